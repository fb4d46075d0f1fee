"""One service process of the local stack: its name, its files, whether it is ours, its /healthz.

Process bookkeeping itself (detached spawn, pid files, recycled-pid checks, log tails) is
``shared.infra.procs``; this module only adds what is specific to Flywheel's four services.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from shared.infra.procs import Matcher, describe_listener, find_ours, is_running, port_is_free, tail

SERVICES = ("trainer", "paramsync", "admin", "sampler")
START_ORDER = ("trainer", "paramsync", "admin", "sampler")
STOP_ORDER = ("sampler", "admin", "paramsync", "trainer")  # trainer last: it commits what it trained
LOG_TAIL_LINES = 30
POLL_S = 0.5


class LocalStackError(RuntimeError):
    """The local stack could not start, check or stop a process (the message says why)."""


def proc_key(service: str, replica: int = 0) -> str:
    """``trainer``, ``paramsync``, ``admin``, or ``sampler-<i>``: the name of pid file, log and pids() key."""
    if service not in SERVICES:
        raise LocalStackError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    if replica < 0 or (service != "sampler" and replica != 0):
        raise LocalStackError(f"{service} has no replica {replica} (only samplers are replicated)")
    return f"sampler-{replica}" if service == "sampler" else service


def parse_key(key: str) -> tuple[str, int]:
    """The inverse of :func:`proc_key`: ``sampler-1`` -> (``sampler``, 1); ``sampler`` -> (``sampler``, 0)."""
    service, _, index = key.partition("-")
    if service == "sampler" and index:
        if not index.isdigit():
            raise LocalStackError(f"bad sampler name {key!r}; expected sampler-<index>, e.g. sampler-1")
        return service, int(index)
    proc_key(service)  # validates the name
    return service, 0


def require_free(what: str, port: int, home: Path) -> None:
    """Raise, naming the port and the process that holds it, unless 127.0.0.1:``port`` is free."""
    if not port_is_free(port):
        raise LocalStackError(
            f"port {port} ({what}) on 127.0.0.1 is already in use by {describe_listener(port)}, which is "
            f"not a process of the local stack in {home}; stop it or choose another port"
        )


def cmdline_matcher(service: str) -> Matcher:
    """Recognises ``<python> -m services.<service> ...`` (the pid-file check against recycled pids)."""
    module = f"services.{service}"
    return lambda args: args[1:3] == ["-m", module]


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment a live process started with, or None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def find_service(pidfile: Path, service: str, home: Path) -> int | None:
    """The pid in ``pidfile`` if it runs ``services.<service>`` started for this ``home``.

    ``shared.infra.procs.find_ours`` checks the pid is alive and its command line; the services
    also carry ``FLYWHEEL_HOME=<home>`` so a pid recycled into another stack's service is not ours.
    """
    pid = find_ours(pidfile, cmdline_matcher(service))
    if pid is None:
        return None
    environ = read_environ(pid)
    if environ is not None and environ.get("FLYWHEEL_HOME") != str(home):
        pidfile.unlink(missing_ok=True)
        return None
    return pid


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited (reaping it if it is our child); False if it still runs."""
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def http_status(url: str, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """(HTTP status, short description) of a GET; status None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (our own 127.0.0.1 URL)
            return int(resp.status), f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code}: {exc.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{type(reason).__name__}: {reason}"


def wait_http_ok(
    what: str,
    url: str,
    *,
    deadline: float,
    alive: Callable[[], bool],
    log_path: Path,
) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.

    Raises LocalStackError with the last 30 lines of ``log_path`` when the process exits first,
    or with the last answer when ``deadline`` (time.monotonic()) passes.
    """
    started = time.monotonic()
    last = "not polled yet"
    while True:
        code, last = http_status(url)
        if code == 200:
            return time.monotonic() - started
        if not alive():
            raise LocalStackError(
                f"{what} exited during start-up (last answer from {url}: {last}).\n"
                f"last {LOG_TAIL_LINES} lines of {log_path}:\n{tail(log_path, LOG_TAIL_LINES)}"
            )
        if time.monotonic() >= deadline:
            raise LocalStackError(
                f"{what} did not become healthy within {time.monotonic() - started:.0f} s "
                f"(last answer from {url}: {last}).\n"
                f"last {LOG_TAIL_LINES} lines of {log_path}:\n{tail(log_path, LOG_TAIL_LINES)}"
            )
        time.sleep(POLL_S)
