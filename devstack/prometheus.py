"""Optional Prometheus for the local stack (Debian's ``prometheus`` package), evaluating deploy/'s alerts.

The scrape configuration is ``deploy/prometheus/prometheus.local.yml`` with two changes written
to ``<home>/prometheus.yml``: the ``flywheel-*`` targets are the ports this stack really uses
(so a third sampler is scraped, and a sampler that is not running is not a false "down"), and
``rule_files`` are absolute paths into ``deploy/prometheus/``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from devstack.config import REPO_ROOT
from devstack.procs import Proc, is_running, port_is_free, require_free
from devstack.readiness import http_ok, wait_until

NAME = "prometheus"
LOCAL_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.local.yml"
NOT_INSTALLED = (
    "prometheus is not on PATH, so alert rules are not evaluated locally "
    "(install it with `sudo apt-get install prometheus`, Debian/Ubuntu)"
)


def binary() -> str | None:
    """Path of the ``prometheus`` executable, or None when it is not installed."""
    return shutil.which("prometheus")


def proc(home: Path) -> Proc:
    return Proc(home, NAME)


def command(exe: str, home: Path, port: int) -> list[str]:
    return [exe, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'prometheus'}",
            f"--web.listen-address=127.0.0.1:{port}"]


def write_config(home: Path, targets: Mapping[str, Sequence[int | str]], port: int) -> Path:
    """Write ``<home>/prometheus.yml``: ``targets`` maps job suffix (``trainer``, ``sampler``) to ports on
    127.0.0.1, or ``host:port`` strings (the multi-host stack's parts, each at its own address).

    Returns the path; the file is replaced atomically, so a SIGHUP reload never sees half of it.
    """
    base = LOCAL_CONFIG.parent
    cfg: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    cfg["rule_files"] = [str((base / rule).resolve()) for rule in cfg.get("rule_files") or []]
    for job in cfg.get("scrape_configs") or []:
        name = str(job.get("job_name", ""))
        ports: Sequence[int | str]
        if name == "prometheus":
            ports = [port]
        elif name.startswith("flywheel-") and name.removeprefix("flywheel-") in targets:
            ports = targets[name.removeprefix("flywheel-")]
        else:
            continue
        job["static_configs"] = [{"targets": [f"127.0.0.1:{p}" if isinstance(p, int) else p for p in ports]}]
    path = home / "prometheus.yml"
    tmp = path.with_suffix(".tmp")
    header = f"# Written by devstack from {LOCAL_CONFIG}; edit that file, not this one.\n"
    tmp.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    tmp.replace(path)
    return path


def ensure_running(
    home: Path, port: int, targets: Mapping[str, Sequence[int | str]], *, deadline: float,
    progress: Callable[[str], None]
) -> int | None:
    """Write the configuration, then reload the running Prometheus or start one and wait until ready.

    Returns its pid, or None (after one line saying so) when Prometheus is not installed.
    """
    exe = binary()
    if exe is None:
        progress(NOT_INSTALLED)
        return None
    write_config(home, targets, port)
    prom = proc(home)
    if (pid := prom.pid()) is not None:
        os.kill(pid, signal.SIGHUP)  # re-read the targets: samplers may have been scaled
        progress(f"prometheus already running (pid {pid}), configuration reloaded")
        return pid
    if not port_is_free(port):
        require_free("prometheus; or run without it: --no-prometheus", port, home)
    pid, _ = prom.ensure(command(exe, home, port), cwd=home)
    started = pid
    took = wait_until(f"prometheus (pid {pid})", lambda left: http_ok(f"http://127.0.0.1:{port}/-/ready"),
                      deadline=max(deadline, time.monotonic() + 30.0), alive=lambda: is_running(started),
                      log_path=prom.log)
    progress(f"prometheus ready (pid {pid}) after {took:.1f} s on http://127.0.0.1:{port}, log {prom.log}")
    return pid
