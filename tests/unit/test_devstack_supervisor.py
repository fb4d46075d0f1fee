"""The supervisor's rule (RestartPolicy: backoff, reset, hold; clock passed in) and one real tick over
short-lived local processes: a killed process is restarted and counted, a stopped or held one is not."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenacity import wait_exponential, wait_fixed

from devstack import procs
from devstack.procs import Proc, is_running, proc_state, table_lock
from devstack.state import StackState, SupervisorState
from devstack.supervisor import RestartPolicy, Supervisor


def _policy(reset_after_s: float = 60.0) -> RestartPolicy:
    return RestartPolicy(wait=wait_exponential(multiplier=1, max=30), reset_after_s=reset_after_s)


def _crash(policy: RestartPolicy, name: str, now: float) -> tuple[float, float]:
    """A death seen at ``now``; returns (delay, when the restart happened)."""
    scheduled = policy.observe(name, alive=False, held=False, now=now)
    assert scheduled.action == "scheduled"
    assert policy.observe(name, alive=False, held=False, now=now + scheduled.delay_s - 0.01).action == "none"
    restart = policy.observe(name, alive=False, held=False, now=now + scheduled.delay_s)
    assert (restart.action, restart.attempt) == ("restart", scheduled.attempt)
    return scheduled.delay_s, now + scheduled.delay_s


def test_a_running_process_is_left_alone() -> None:
    policy = _policy()
    for t in range(100):
        assert policy.observe("trainer", alive=True, held=False, now=float(t)).action == "none"


def test_a_crash_loop_backs_off_exponentially_up_to_the_cap() -> None:
    policy, now, delays = _policy(), 0.0, []
    policy.observe("trainer", alive=True, held=False, now=now)
    for _ in range(8):
        delay, now = _crash(policy, "trainer", now + 1.0)
        delays.append(delay)
        policy.observe("trainer", alive=True, held=False, now=now + 0.5)  # up briefly, then dies again
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


def test_the_backoff_resets_once_the_process_stayed_up() -> None:
    policy = _policy(reset_after_s=60.0)
    _, now = _crash(policy, "kafka", 0.0)
    delay, now = _crash(policy, "kafka", now + 5.0)
    assert delay == 2
    policy.observe("kafka", alive=True, held=False, now=now + 1.0)
    policy.observe("kafka", alive=True, held=False, now=now + 59.0)  # up 59 s: not yet
    delay, now = _crash(policy, "kafka", now + 59.5)
    assert delay == 4
    policy.observe("kafka", alive=True, held=False, now=now + 1.0)
    policy.observe("kafka", alive=True, held=False, now=now + 60.0)  # up 60 s since its restart
    delay, _ = _crash(policy, "kafka", now + 61.0)
    assert delay == 1


def test_a_held_process_is_never_restarted_and_release_starts_a_fresh_wait() -> None:
    policy = _policy()
    assert policy.observe("kafka", alive=True, held=True, now=0.0).action == "none"
    assert policy.observe("kafka", alive=False, held=True, now=1.0).action == "held"  # noted once
    for t in range(2, 120):
        assert policy.observe("kafka", alive=False, held=True, now=float(t)).action == "none"
    released = policy.observe("kafka", alive=False, held=False, now=120.0)
    assert (released.action, released.attempt, released.delay_s) == ("scheduled", 1, 1)
    assert policy.observe("kafka", alive=False, held=False, now=121.0).action == "restart"


def test_a_hold_during_the_wait_cancels_the_pending_restart() -> None:
    policy = _policy()
    assert policy.observe("admin", alive=False, held=False, now=0.0).action == "scheduled"
    assert policy.observe("admin", alive=False, held=True, now=5.0).action == "none"
    assert policy.observe("admin", alive=False, held=False, now=6.0).action == "scheduled"


def test_processes_are_tracked_separately_and_forgotten_when_unwanted() -> None:
    policy = _policy()
    _crash(policy, "sampler-0", 0.0)
    _crash(policy, "sampler-0", 10.0)
    assert policy.observe("sampler-1", alive=False, held=False, now=20.0).delay_s == 1
    policy.keep_only({"sampler-1"})
    assert policy.observe("sampler-0", alive=False, held=False, now=30.0).delay_s == 1


def test_the_default_wait_is_exponential_with_up_to_one_second_of_jitter_capped_at_30() -> None:
    policy = RestartPolicy()
    for attempt in range(1, 12):
        base = min(2.0 ** (attempt - 1), 30.0)
        for _ in range(20):
            assert base <= policy.delay(attempt) <= min(base + 1.0, 30.0)


# ---- one real tick -----------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for pidfile in (tmp_path / "pids").glob("*.pid"):
        pid = int(pidfile.read_text())
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)


def _sleeper(home: Path, name: str) -> Proc:
    proc = Proc(home, name)
    proc.spawn([sys.executable, "-c", "import time; time.sleep(120)"], cwd=home)
    assert proc.pid() is not None
    return proc


def _events(home: Path) -> list[dict[str, object]]:
    path = home / "logs" / "supervisor.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _kill(proc: Proc) -> None:
    """SIGKILL and wait until it is a zombie, without reaping it (the supervisor's tick collects its status)."""
    pid = proc.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc_state(pid) != "Z":
        assert time.monotonic() < deadline, f"pid {pid} did not die"
        time.sleep(0.01)


def test_spawn_returns_once_the_kernel_shows_the_new_command_line(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after exec begins, /proc/<pid>/cmdline is briefly empty (seen under load in CI): a tick in that
    window would take the new process for a dead one. The window is stood in for by the first reads failing."""
    real, reads = procs.read_cmdline, []

    def late_cmdline(pid: int) -> list[str] | None:
        reads.append(pid)
        return None if len(reads) <= 3 else real(pid)

    monkeypatch.setattr(procs, "read_cmdline", late_cmdline)
    proc = Proc(home, "sampler-0")
    pid = proc.spawn([sys.executable, "-c", "import time; time.sleep(120)"], cwd=home)
    try:
        assert proc.pid() == pid and len(reads) > 4
    finally:
        os.kill(pid, signal.SIGKILL)


def test_tick_restarts_a_killed_process_counts_it_and_logs_it(home: Path) -> None:
    clock = Clock()
    sup = Supervisor(home, RestartPolicy(wait=wait_fixed(2)), clock=clock)
    proc = _sleeper(home, "trainer")
    first = proc.pid()
    sup.tick()
    _kill(proc)
    sup.tick()  # seen dead: restart scheduled in 2 s
    assert proc.pid() is None
    clock.now += 2.0
    sup.tick()
    assert proc.pid() not in (None, first)
    assert SupervisorState(home).restarts() == {"trainer": 1}
    record = SupervisorState(home).load()["trainer"]
    assert record["last_exit"] == f"pid {first} killed by SIGKILL" and record["last_restart_at"] > 0
    exited, restarted = _events(home)
    assert exited["event"] == "exited" and exited["restart_in_s"] == 2
    assert restarted == {**restarted, "event": "restarted", "process": "trainer", "attempt": 1, "delay_s": 2,
                         "exit": f"pid {first} killed by SIGKILL", "restarts": 1, "pid": proc.pid()}


def test_tick_leaves_a_stopped_or_held_process_alone(home: Path) -> None:
    clock = Clock()
    sup = Supervisor(home, RestartPolicy(wait=wait_fixed(0)), clock=clock)
    stopped, held = _sleeper(home, "paramsync"), _sleeper(home, "kafka")
    with table_lock(home):
        SupervisorState(home).update("kafka", held=True)
    sup.tick()
    stopped.stop(timeout_s=5)
    _kill(held)
    for _ in range(3):
        clock.now += 60.0
        sup.tick()
    assert stopped.pid() is None and held.pid() is None
    assert SupervisorState(home).restarts() == {"kafka": 0}
    assert [e["process"] for e in _events(home) if e.get("held")] == ["kafka"]
    with table_lock(home):
        SupervisorState(home).update("kafka", held=False)
    sup.tick()
    sup.tick()
    assert held.pid() is not None and stopped.pid() is None
    assert SupervisorState(home).restarts()["kafka"] == 1
    [restarted] = [e for e in _events(home) if e["event"] == "restarted"]
    assert restarted["exit"].endswith("killed by SIGKILL")  # how it died while held, not forgotten


def test_tick_rotates_logs_past_the_cap_from_the_stack_state(home: Path) -> None:
    StackState(home).save(log_max_bytes=1000)
    (home / "logs").mkdir()
    (home / "logs" / "sampler-0.log").write_bytes(b"x" * 1001)
    (home / "logs" / "admin.log").write_bytes(b"x" * 1000)
    Supervisor(home).tick()
    assert (home / "logs" / "sampler-0.log").stat().st_size == 0
    assert (home / "logs" / "sampler-0.log.1").stat().st_size == 1001
    assert (home / "logs" / "admin.log").stat().st_size == 1000
    assert [e["path"] for e in _events(home) if e["event"] == "log_rotated"] == [str(home / "logs" / "sampler-0.log")]
