"""Data-parallel trainer ranks under a fault: ``kill -9`` of one rank of two.

The group re-forms unaided: the survivor's next collective fails, it stops, the supervisor restarts both,
and they resume from rank 0's checkpoint (which holds both ranks' ledgers). What the model holds is proved
by ``flywheel verify``; the trainer-log accounting of the other rows reads one process's log and is not
used here. Runs in ``make test-faults`` (after the single-trainer rows: this file re-forms the stack's
trainer as two ranks, then back to one).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.faults.conftest import FaultEnv, Row

RECOVERY_BOUND_S = 90.0


def _equal_digests(env: FaultEnv) -> list[dict[str, Any]] | None:
    ranks = env.status()["trainer"]["ranks"]
    if len(ranks) == 2 and all(r["alive"] for r in ranks) and ranks[0]["digest_update"] is not None \
            and ranks[0]["digest_update"] == ranks[1]["digest_update"]:
        return list(ranks)
    return None


@pytest.mark.faults_full
@pytest.mark.timeout(600)
def test_trainer_rank_kill9_group_recovers(fault_env: FaultEnv) -> None:
    env = fault_env
    env.stack.up(samplers=2, trainers=2, prometheus=False, timeout_s=180)
    try:
        deadline = time.monotonic() + 120
        while (ranks := _equal_digests(env)) is None and time.monotonic() < deadline:
            time.sleep(1)
        assert ranks is not None, f"two ranks with equal digests never showed: {env.status()['trainer']['ranks']}"
        assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
        before = env.stack.restarts()
        version = env.published()
        pid = env.stack.pid("trainer", 1)
        assert pid is not None
        env.stack.kill("trainer", 1)
        t0 = time.monotonic()
        env.say(f"trainer-1 (pid {pid}) killed with SIGKILL at published version {version}")
        # A version can still appear in the first seconds (an update rank 0 finished before its collective
        # failed, published late): recovery is the group re-formed (both ranks restarted) and then a version
        # newer than any published before the restarts.
        after = env.wait_restarted({name: before.get(name, 0) for name in ("trainer", "trainer-1")},
                                   timeout_s=RECOVERY_BOUND_S)
        watch = env.watch_samplers()  # the heal: both ranks restarted, re-forming the group
        assert after.get("trainer-1", 0) > before.get("trainer-1", 0), "the killed rank was not restarted"
        # The survivor's collective failed: rank 0 stopped too and came back from the checkpoint.
        assert after.get("trainer", 0) > before.get("trainer", 0), "rank 0 went on alone after losing rank 1"
        reformed_at = max(version, env.published())
        env.wait_version_advances(reformed_at, timeout_s=max(1.0, t0 + RECOVERY_BOUND_S - time.monotonic()))
        recover_s = time.monotonic() - t0
        assert env.stack.pid("trainer", 1) not in (None, pid)
        env.samplers_back(watch)
        code, out = env.verify()
        env.say(f"[rank kill] flywheel verify exit {code}:\n{out}")
        verified, cell = env.verify_cell(code, out)
        env.rows.append(Row("trainer rank kill -9 (2 ranks)", "ok" if verified else "FAILED",
                            round(recover_s, 1), None, None,
                            env.restarts(), "both ranks restarted from rank 0's checkpoint; lost / twice proved by "
                            "flywheel verify (not log-accounted)", cell, env.samplers_cell(None)))
        assert verified, f"unexpected: {env.verify_problems(out)}\n{out}"
        assert recover_s <= RECOVERY_BOUND_S
    finally:
        env.stack.up(samplers=2, trainers=1, prometheus=False, timeout_s=180)
