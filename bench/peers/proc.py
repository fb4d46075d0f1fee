"""Run a peer as a child process in its own session, reading its merged output line by line with the time
each line arrived, until it exits, a line says stop, or a timeout.

Only the child's own process group is signalled (SIGTERM, then SIGKILL after ``grace_s``): the peers fork
workers (Sample Factory's rollout and inference processes), and they go with it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux): a peer's worker orphaned when its parent is
    killed (Sample Factory's rollout and inference processes) is reparented here instead of to init, so reaping
    it (``bench.machine.reap_children``) counts its CPU time as this process's children's. False where the call
    is not available."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: how a peer's child process reports to the bench."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def json_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON object lines of a child's output, in order (other output, a traceback say, is skipped)."""
    out: list[dict[str, Any]] = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def by_event(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``json_events`` by event name, the last of each (objects without a string ``event`` ignored)."""
    return {ev["event"]: ev for ev in events if isinstance(ev.get("event"), str)}


@dataclass
class ProcResult:
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)
    rc: int | None = None  # None: stopped by us (a stop line or the timeout)
    stopped: bool = False  # a line said stop
    timed_out: bool = False
    wall_start: float = 0.0  # time.time() just before the process was started

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def run_lines(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None,
              on_line: Callable[[float, str], bool] | None = None, grace_s: float = 10.0,
              log: Path | None = None) -> ProcResult:
    """Start ``cmd``; feed each line to ``on_line(t, line)`` (True = stop now); stop after ``timeout_s``."""
    res = ProcResult(wall_start=time.time())
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, text=True, errors="replace", bufsize=1, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    sink = log.open("w") if log is not None else None
    try:
        while True:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                res.timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                break
            t = time.monotonic() - t0
            res.lines.append((t, line))
            if sink is not None:
                sink.write(f"{t:9.3f} {line}\n")
            if on_line is not None and on_line(t, line):
                res.stopped = True
                break
    finally:
        if sink is not None:
            sink.close()
        if proc.poll() is None:
            _stop_group(proc, grace_s)
        else:
            res.rc = proc.returncode
            _stop_group(proc, 0.0)  # workers it may have left behind
        reader.join(timeout=5)
    if not (res.stopped or res.timed_out):
        res.rc = proc.returncode
    return res


def _stop_group(proc: subprocess.Popen[str], grace_s: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s if grace_s > 0 else 1.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
