"""The supervisor: ``restart: unless-stopped`` for a local stack, plus its log cap.

``python -m devstack supervise --home H`` (started by ``up``, stopped first by ``down``) checks
every second each process of H that is wanted (has a launch record, see ``devstack.procs``): one
that is not running, and not held, is started again from its record after a capped exponential
backoff with jitter. A process stopped by ``stop`` / ``down`` is not wanted any more, so it is not
"died"; a held one (``hold NAME``) is left alone until ``release NAME``. Restarts are counted in
``<home>/supervisor.json`` and each is one JSON line in ``<home>/logs/supervisor.log``. Every tick
it also rotates the home's logs past the cap (``devstack.logs``).

:class:`RestartPolicy` is the rule, pure (the clock is passed in); :class:`Supervisor` the shell.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from tenacity import RetryCallState, Retrying, wait_exponential_jitter
from tenacity.wait import wait_base

from devstack.config import REPO_ROOT, StackError
from devstack.logs import LOG_BACKUPS, LOG_MAX_BYTES, rotate_all
from devstack.procs import Proc, table_lock, wanted
from devstack.state import StackState, SupervisorState

NAME = "supervisor"
TICK_S = 1.0
RESET_AFTER_S = 60.0


def command(home: Path) -> list[str]:
    return [sys.executable, "-m", "devstack", "supervise", "--home", str(home)]


def proc(home: Path) -> Proc:
    return Proc(home, NAME)


def start(home: Path) -> tuple[int, bool]:
    """(pid, started): this home's supervisor, started detached unless it already runs."""
    return proc(home).ensure(command(home), cwd=REPO_ROOT)


@dataclass(frozen=True)
class Decision:
    """What to do about one process at one tick: nothing, note that a held one went down, a restart
    scheduled in ``delay_s``, or restart now."""

    action: Literal["none", "held", "scheduled", "restart"]
    attempt: int = 0
    delay_s: float = 0.0


@dataclass
class _Track:
    attempt: int = 0  # restarts since the process last stayed up for reset_after_s
    up_since: float | None = None
    due_at: float | None = None
    delay_s: float = 0.0


class RestartPolicy:
    """When to restart a process that is not running: capped exponential backoff with jitter.

    Invariant: a process is restarted only after it was seen dead and not held, ``wait(attempt)``
    seconds after that (``attempt`` 1, 2, ... counts restarts since it last stayed up
    ``reset_after_s``); a held process is never restarted, and its release starts a new wait.
    ``wait`` is a tenacity wait strategy (default ``wait_exponential_jitter(multiplier=1, max=30)``).
    """

    def __init__(self, wait: wait_base | None = None, reset_after_s: float = RESET_AFTER_S) -> None:
        self.wait = wait or wait_exponential_jitter(multiplier=1, max=30)
        self.reset_after_s = reset_after_s
        self._tracks: dict[str, _Track] = {}

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart number ``attempt`` (1-based)."""
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = attempt
        return float(self.wait(state))

    def observe(self, name: str, *, alive: bool, held: bool, now: float) -> Decision:
        track = self._tracks.setdefault(name, _Track())
        if alive:
            track.due_at = None
            if track.up_since is None:
                track.up_since = now
            elif now - track.up_since >= self.reset_after_s:
                track.attempt = 0
            return Decision("none", track.attempt)
        was_up, track.up_since = track.up_since is not None, None
        if held:
            track.due_at = None
            return Decision("held" if was_up else "none", track.attempt)
        if track.due_at is None:
            track.attempt += 1
            track.delay_s = self.delay(track.attempt)
            track.due_at = now + track.delay_s
            return Decision("scheduled", track.attempt, track.delay_s)
        if now < track.due_at:
            return Decision("none", track.attempt)
        track.due_at, track.up_since = None, now  # a restart is a start: the reset clock runs from here
        return Decision("restart", track.attempt, track.delay_s)

    def keep_only(self, names: set[str]) -> None:
        """Forget processes that are no longer wanted (a later start begins with a fresh backoff)."""
        for name in set(self._tracks) - names:
            del self._tracks[name]


class Supervisor:
    """The loop: every ``tick_s``, :meth:`tick` restarts what :class:`RestartPolicy` says and rotates logs."""

    def __init__(self, home: Path, policy: RestartPolicy | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.home = home
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self.state = SupervisorState(home)
        self.events = home / "logs" / f"{NAME}.log"
        self._exits: dict[int, str] = {}  # pid -> how it ended, for the processes this one started
        self._died: dict[str, str] = {}  # name -> how its last run ended

    def run(self, stop: threading.Event, tick_s: float = TICK_S) -> None:
        self.log("supervisor_started", pid=os.getpid(), tick_s=tick_s)
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # one bad tick (a disk hiccup) must not end supervision
                self.log("tick_failed", error=f"{type(exc).__name__}: {exc}")
            stop.wait(tick_s)
        self.log("supervisor_stopped", pid=os.getpid())

    def tick(self) -> None:
        with table_lock(self.home):
            held = self.state.held()
            procs = [p for p in wanted(self.home) if p.name != NAME]
            for p in procs:
                self._reap()
                pid = p.pid()
                decision = self.policy.observe(p.name, alive=pid is not None, held=p.name in held, now=self.clock())
                if pid is not None:
                    self._died.pop(p.name, None)
                elif decision.action == "held":
                    self._died[p.name] = self._how_it_ended(p.last_pid())
                    self.log("exited", process=p.name, exit=self._died[p.name], held=True)
                elif decision.action == "scheduled":
                    self._died.setdefault(p.name, self._how_it_ended(p.last_pid()))
                    self.log("exited", process=p.name, exit=self._died[p.name], attempt=decision.attempt,
                             restart_in_s=round(decision.delay_s, 3))
                elif decision.action == "restart":
                    self._restart(p, decision)
            self.policy.keep_only({p.name for p in procs})
        cap = StackState(self.home).load()
        for path in rotate_all(self.home / "logs", int(cap.get("log_max_bytes") or LOG_MAX_BYTES),
                               int(cap.get("log_backups", LOG_BACKUPS))):
            self.log("log_rotated", path=str(path))

    def _restart(self, p: Proc, decision: Decision) -> None:
        exit_info = self._died.pop(p.name, "unknown")
        try:
            pid = p.respawn()
        except (OSError, StackError) as exc:
            self.log("restart_failed", process=p.name, attempt=decision.attempt, error=str(exc))
            return
        restarts = self.state.restarts().get(p.name, 0) + 1
        self.state.update(p.name, restarts=restarts, last_restart_at=time.time(), last_exit=exit_info)
        self.log("restarted", process=p.name, pid=pid, attempt=decision.attempt,
                 delay_s=round(decision.delay_s, 3), exit=exit_info, restarts=restarts)
        self._audit(p, {"process": p.name, "attempt": decision.attempt, "exit": exit_info, "restarts": restarts},
                    f"restarted as pid {pid}")

    def _audit(self, p: Proc, params: dict[str, Any], outcome: str) -> None:
        """An automatic action goes to the run's audit trail (``GET /audit``) too, when the process is one
        of the run's services (its launch record has the settings to reach the run's object store).
        Best effort: the restart happened either way, and supervisor.log has it."""
        record = p.record()
        env = (record.env or {}) if record is not None else {}
        if not env.get("FLYWHEEL_CONFIG"):
            return  # Kafka, S3, Prometheus: not a run's service
        try:
            from shared.runtime import AuditLog
            from shared.settings import load_settings
            from shared.store import LocalDirStore, ObjectStore, S3Store

            settings = load_settings(env["FLYWHEEL_CONFIG"], environ=env)
            store: ObjectStore
            if settings.store.backend == "local":
                store = LocalDirStore(settings.store.local_root)
            else:  # the service's credentials, from its launch record (not this process's environment)
                import boto3

                store = S3Store(boto3.client("s3", endpoint_url=settings.s3.endpoint, region_name=settings.s3.region,
                                             aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                                             aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY")),
                                settings.s3.bucket)
            AuditLog(store, settings.run).append("supervisor", "restart", params, outcome)
        except Exception as exc:  # the store may be what is down
            self.log("audit_write_failed", process=p.name, error=f"{type(exc).__name__}: {exc}"[:300])

    def _reap(self) -> None:
        """Collect the exit status of the processes this supervisor started (it is their parent)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            self._exits[pid] = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def _how_it_ended(self, pid: int | None) -> str:
        if pid is None:
            return "never started"
        how = self._exits.pop(pid, None)
        return f"pid {pid} {how}" if how else f"pid {pid} exited (status unknown: started by another process)"

    def log(self, event: str, **fields: Any) -> None:
        line = {"timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
        self.events.parent.mkdir(parents=True, exist_ok=True)
        with open(self.events, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def main(home: Path) -> int:
    """``python -m devstack supervise --home H``: supervise until SIGTERM / SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _s, _f: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        Supervisor(home).run(stop)
    return 0
