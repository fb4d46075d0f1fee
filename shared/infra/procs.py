"""Process bookkeeping for the local stack: pid files, liveness, detached start, stop, ports, locks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

Matcher = Callable[[list[str]], bool]
MAX_LOG_BYTES = 50 * 1024 * 1024  # a log this big is rotated to <name>.1 when its process restarts


def read_cmdline(pid: int) -> list[str] | None:
    """The argv of a live process, or None when it is gone or a zombie (empty cmdline)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    return args or None


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (reaping it first if it is our own child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def find_ours(pidfile: Path, matches: Matcher) -> int | None:
    """The pid recorded in `pidfile` if that process is alive and is what we started.

    A pid file pointing at a dead process, or at a recycled pid running something else, is stale
    and removed.
    """
    pid = read_pid(pidfile)
    if pid is not None and is_running(pid):
        args = read_cmdline(pid)
        if args is not None and matches(args):
            return pid
    pidfile.unlink(missing_ok=True)
    return None


def spawn(
    cmd: list[str], *, log_path: Path, pidfile: Path, cwd: Path, env: dict[str, str] | None = None
) -> int:
    """Start `cmd` detached (own session, no stdin), appending its output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    if log_path.exists() and log_path.stat().st_size > MAX_LOG_BYTES:
        log_path.replace(log_path.with_name(log_path.name + ".1"))
    with open(log_path, "ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        log.write(f"\n===== flywheel infra: starting at {stamp}: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # Popen warns at interpreter exit about a child still running; it is meant to outlive us.
    proc.returncode = 0
    pidfile.write_text(f"{proc.pid}\n")
    return proc.pid


def stop(pidfile: Path, matches: Matcher, *, timeout_s: float = 20.0) -> int | None:
    """SIGTERM our process (only if `find_ours` recognises it), SIGKILL after `timeout_s`.

    Returns the pid that was stopped, or None when nothing of ours was running.
    """
    pid = find_ours(pidfile, matches)
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if is_running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while is_running(pid):
            time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    return pid


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def describe_listener(port: int) -> str:
    """Best effort 'pid N (cmd)' of the process listening on `port`, for error messages."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    cmd = " ".join(read_cmdline(int(proc.name)) or ["?"])
                    short = cmd if len(cmd) <= 200 else f"{cmd[:80]} ... {cmd[-110:]}"
                    return f"pid {proc.name} ({short})"
    return "another process (not visible to this user)"


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file (or a note that it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two `up`/`down` calls on one home never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
