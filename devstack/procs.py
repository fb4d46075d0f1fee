"""The processes of one stack home: launch records, pid files, liveness, detached start, stop, ports.

Every process a stack runs (Kafka, the S3 server, the services, Prometheus) is a :class:`Proc`,
a name with three files in ``<home>``:

- ``procs/<name>.json``: its launch record (command, working directory, environment, log), present
  while the process is *wanted*. :meth:`Proc.spawn` writes it, :meth:`Proc.stop` removes it before
  signalling, and the supervisor restarts a wanted process that is not running from it.
- ``pids/<name>.pid``: the pid it was last started with (kept after it exits, for ``status``).
- ``logs/<name>.log``: its stdout + stderr, opened with O_APPEND (see ``devstack.logs``).

A pid is the process only while it runs with the recorded command line (and, when the record sets
``FLYWHEEL_HOME``, that environment), so a recycled pid is never taken for ours. Whoever checks
and then starts or un-wants a process does it under :func:`table_lock`, which the supervisor holds
while it checks and restarts: ``stop`` and a restart never race.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from devstack.config import StackError
from devstack.logs import LOG_MAX_BYTES, rotate
from devstack.state import StackState

BANNER = "===== devstack: starting"
SPAWN_SETTLE_S = 5.0  # how long spawn waits for the kernel to show the new command line


@dataclass(frozen=True)
class ProcStatus:
    """One process of a stack: ``pid`` is the live one, or the last one started when it is dead."""

    name: str
    pid: int | None
    alive: bool
    endpoint: str
    log: Path
    restarts: int = 0
    held: bool = False


@dataclass(frozen=True)
class LaunchRecord:
    """How a process was started, so that it can be recognised and started again the same way."""

    cmd: list[str]
    cwd: str
    env: dict[str, str] | None
    log: str
    netns: str | None = None
    """The network namespace it runs in (``ip netns exec``; the multi-host stack, ``devstack.hosts``), or None:
    the caller's. Left out of the JSON when None."""


class Proc:
    """One named process of the stack in ``home`` (see the module docstring for its files)."""

    def __init__(self, home: Path, name: str) -> None:
        self.home, self.name = home, name
        self.pidfile = home / "pids" / f"{name}.pid"
        self.record_path = home / "procs" / f"{name}.json"

    @property
    def log(self) -> Path:
        return self.home / "logs" / f"{self.name}.log"

    @property
    def out(self) -> Path:
        """Standard output and error of a process that writes its own log file (the services, with
        ``FLYWHEEL_LOG_FILE`` = :attr:`log`): start-up lines and a crash's traceback."""
        return self.home / "logs" / f"{self.name}.out"

    def crash_log(self) -> Path:
        """Where a crash's last words are: :attr:`out` when the process logs to its own file."""
        return self.out if self.out.exists() else self.log

    def record(self) -> LaunchRecord | None:
        """The launch record while the process is wanted, else None."""
        try:
            data = json.loads(self.record_path.read_text())
            netns = data.get("netns")
            return LaunchRecord(list(data["cmd"]), str(data["cwd"]), data.get("env"), str(data["log"]),
                                None if netns is None else str(netns))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def last_pid(self) -> int | None:
        try:
            text = self.pidfile.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def pid(self) -> int | None:
        """The pid of the running process if it is wanted, alive and what was recorded, else None."""
        record, pid = self.record(), self.last_pid()
        if record is None or pid is None or not is_running(pid) or read_cmdline(pid) != record.cmd:
            return None
        home = (record.env or {}).get("FLYWHEEL_HOME")
        if home is not None and (read_environ(pid) or {}).get("FLYWHEEL_HOME") != home:
            return None
        return pid

    def spawn(self, cmd: list[str], *, cwd: Path, env: Mapping[str, str] | None = None,
              netns: str | None = None) -> int:
        """Start ``cmd`` detached (own session, no stdin, output appended to the log) and record it; with
        ``netns``, inside that network namespace (``ip netns exec`` execs ``cmd``, so the process's command line
        is ``cmd`` all the same).

        No check that it already runs: callers do that under :func:`table_lock` (see :meth:`ensure`).
        """
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.pidfile.parent.mkdir(parents=True, exist_ok=True)
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        # A process that writes (and rotates) its own log file gets a separate file for stdout + stderr.
        stdout = self.out if env is not None and env.get("FLYWHEEL_LOG_FILE") == str(self.log) else self.log
        rotate(stdout, int(StackState(self.home).load().get("log_max_bytes") or LOG_MAX_BYTES))  # unsupervised too
        with open(stdout, "ab") as log:  # "a": O_APPEND, so a copy-truncate never leaves a hole
            where = f" in netns {netns}" if netns is not None else ""
            log.write(f"\n{BANNER} {self.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')}{where}: {' '.join(cmd)}\n"
                      .encode())
            log.flush()
            argv = cmd
            if netns is not None:
                from devstack.hosts import netns_exec, tool

                argv = netns_exec(netns, cmd)
                argv[0] = tool("ip") or argv[0]
            proc = subprocess.Popen(argv, cwd=cwd, env=None if env is None else dict(env), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.returncode = 0  # it is meant to outlive us: no "still running" warning at exit
        # Popen returns once exec has begun, but the kernel fills /proc/<pid>/cmdline a moment later: until
        # then pid() would call the new process not ours (and a supervisor's tick would start a second one).
        deadline = time.monotonic() + SPAWN_SETTLE_S
        while read_cmdline(proc.pid) != list(cmd) and proc_state(proc.pid) not in (None, "Z", "X"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        record = LaunchRecord(list(cmd), str(cwd), None if env is None else dict(env), str(stdout), netns)
        data = asdict(record)
        if netns is None:
            del data["netns"]
        fd = os.open(self.record_path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:  # 0600: the environment may hold the admin token
            json.dump(data, fh, indent=1)
        self.record_path.with_suffix(".tmp").replace(self.record_path)
        self.pidfile.write_text(f"{proc.pid}\n")
        return proc.pid

    def respawn(self) -> int:
        """Start the process again exactly as recorded (the supervisor's restart)."""
        record = self.record()
        if record is None:
            raise StackError(f"{self.name} has no launch record in {self.record_path}")
        return self.spawn(record.cmd, cwd=Path(record.cwd), env=record.env, netns=record.netns)

    def ensure(self, cmd: list[str], *, cwd: Path, env: Mapping[str, str] | None = None,
               netns: str | None = None) -> tuple[int, bool]:
        """(pid, started): the running process, or ``cmd`` started now (in ``netns`` if given); atomic against
        the supervisor."""
        with table_lock(self.home):
            pid = self.pid()
            return (pid, False) if pid is not None else (self.spawn(cmd, cwd=cwd, env=env, netns=netns), True)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """Un-want the process, then SIGTERM it, SIGKILL after ``timeout_s``; the pid stopped, or None."""
        with table_lock(self.home):
            pid = self.pid()
            self.record_path.unlink(missing_ok=True)
        if pid is not None:
            terminate(pid, timeout_s)
        return pid

    def status(self, endpoint: str) -> ProcStatus:
        pid = self.pid()
        return ProcStatus(self.name, pid or self.last_pid(), pid is not None, endpoint, self.log)


def wanted(home: Path) -> list[Proc]:
    """Every process of ``home`` that has a launch record (what the supervisor keeps running)."""
    return [Proc(home, p.stem) for p in sorted((home / "procs").glob("*.json"))]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (not re-entrant: never nest two on one file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def table_lock(home: Path) -> contextlib.AbstractContextManager[None]:
    """The lock around every check-then-act on which processes of ``home`` are wanted or running."""
    return file_lock(home / ".procs.lock")


def read_cmdline(pid: int) -> list[str] | None:
    """The argv of a live process, or None when it is gone or a zombie (empty cmdline)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment a live process started with, or None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def marked(key: str, value: str, *, exclude: Iterable[int] = ()) -> list[int]:
    """Live processes (zombies left out) started with ``key=value`` in their environment, apart from ``exclude``.

    An environment is inherited, so a variable set in a parent marks every process it starts, theirs too,
    including those that detached into a session of their own and were re-parented to init."""
    skip = set(exclude)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        pid = int(entry.name)
        if (read_environ(pid) or {}).get(key) == value and is_running(pid):
            found.append(pid)
    return sorted(found)


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc/<pid>/stat`` ("Z" for a zombie), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reaping it first if it is our own child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    return proc_state(pid) not in (None, "Z", "X")


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited; False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def terminate(pid: int, timeout_s: float = 20.0) -> None:
    """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL and wait until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pid, 30.0)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def require_free(what: str, port: int, home: Path) -> None:
    """Raise, naming the port and the process that holds it, unless 127.0.0.1:``port`` is free."""
    if not port_is_free(port):
        raise StackError(
            f"port {port} ({what}) on 127.0.0.1 is already in use by {describe_listener(port)}, which is "
            f"not a process of the stack in {home}; stop it or choose another port"
        )


def describe_listener(port: int) -> str:
    """Best effort 'pid N (cmd)' of the process listening on ``port``, for error messages."""
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
    """The last ``lines`` lines of a log file (or a note that it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    return "\n".join(text.splitlines()[-lines:])
