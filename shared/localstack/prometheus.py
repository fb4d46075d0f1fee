"""Optional Prometheus for the local stack (Debian's ``prometheus`` package), evaluating deploy/'s alerts.

The scrape configuration is ``deploy/prometheus/prometheus.local.yml`` with two changes written
to ``<home>/prometheus.yml``: the ``flywheel-*`` targets are the ports this stack really uses
(so a third sampler is scraped, and a sampler that is not running is not a false "down"), and
``rule_files`` are absolute paths into ``deploy/prometheus/``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from shared.infra.config import REPO_ROOT
from shared.infra.procs import Matcher

LOCAL_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.local.yml"
NOT_INSTALLED = (
    "prometheus is not on PATH, so alert rules are not evaluated locally "
    "(install it with `sudo apt-get install prometheus`, Debian/Ubuntu)"
)


def binary() -> str | None:
    """Path of the ``prometheus`` executable, or None when it is not installed."""
    return shutil.which("prometheus")


def tsdb_path(home: Path) -> Path:
    return home / "prometheus"


def config_path(home: Path) -> Path:
    return home / "prometheus.yml"


def matcher(home: Path) -> Matcher:
    """Recognises the Prometheus we start for ``home`` (by its storage path)."""
    flag = f"--storage.tsdb.path={tsdb_path(home)}"
    return lambda args: Path(args[0]).name == "prometheus" and flag in args


def command(exe: str, home: Path, port: int) -> list[str]:
    return [
        exe,
        f"--config.file={config_path(home)}",
        f"--storage.tsdb.path={tsdb_path(home)}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]


def write_config(home: Path, targets: dict[str, list[int]], port: int) -> Path:
    """Write ``<home>/prometheus.yml``: ``targets`` maps job suffix (``trainer``, ``sampler``) to ports.

    Returns the path; the file is replaced atomically, so a SIGHUP reload never sees half of it.
    """
    base = LOCAL_CONFIG.parent
    cfg: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    cfg["rule_files"] = [str((base / rule).resolve()) for rule in cfg.get("rule_files") or []]
    for job in cfg.get("scrape_configs") or []:
        name = str(job.get("job_name", ""))
        if name == "prometheus":
            ports = [port]
        elif name.startswith("flywheel-") and name.removeprefix("flywheel-") in targets:
            ports = targets[name.removeprefix("flywheel-")]
        else:
            continue
        job["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in ports]}]
    path = config_path(home)
    tmp = path.with_suffix(".tmp")
    header = f"# Written by shared.localstack from {LOCAL_CONFIG}; edit that file, not this one.\n"
    tmp.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    tmp.replace(path)
    return path
