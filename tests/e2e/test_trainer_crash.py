"""Kill -9 the trainer mid-run; the supervisor restarts it: nothing is lost; only the uncommitted tail is
seen twice."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest

from shared.kafka import Topics, consumer_lag, trainer_group
from shared.settings import KafkaSettings, Settings
from tests.e2e.conftest import log_events, status
from tests.faults.accounting import committed, read_topic

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(600)]
OUTCOMES = ("fragment_trained", "fragment_dropped_stale", "fragment_dead_lettered")


def test_trainer_killed_and_restarted_loses_nothing(make_stack: Any, run_name: str, kafka_bootstrap: str) -> None:
    # Publish and checkpoint often so the restart really resumes from a checkpoint mid-run.
    stack = make_stack(18600, env={"FLYWHEEL_TRAINER_CHECKPOINT_EVERY": "10"})
    stack.up(samplers=2, prometheus=False)
    log = stack.log_path("trainer")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and status(stack)["trainer"]["updates"] < 25:
        time.sleep(1)
    assert status(stack)["trainer"]["updates"] >= 25

    stack.hold("trainer")  # the supervisor leaves it down until release: samplers produce meanwhile
    stack.kill("trainer")  # SIGKILL: no commit, no checkpoint, no goodbye
    committed_at_kill = asyncio.run(committed(kafka_bootstrap, trainer_group(run_name)))
    assert committed_at_kill, "the trainer committed nothing before the kill"
    run1 = log_events(log)
    run1_len = len(run1)
    time.sleep(3)  # samplers keep producing while the trainer is down

    stack.release("trainer")  # the supervisor restarts it (restart: unless-stopped)
    stack.wait_healthy("trainer", timeout_s=90)
    assert stack.restarts()["trainer"] == 1
    restored = [e for e in log_events(log)[run1_len:] if e["event"] == "checkpoint_restored"]
    assert restored, "the restarted trainer did not restore its checkpoint"
    time.sleep(8)

    # Stop producing, then let the trainer drain the backlog completely.
    for replica in range(2):
        stack.stop("sampler", replica)
    settings = Settings(run=run_name, kafka=KafkaSettings(bootstrap=kafka_bootstrap))
    topic = Topics.for_run(run_name).samples
    deadline = time.monotonic() + 180
    lag: dict[int, int] = {}
    while time.monotonic() < deadline:
        lag = asyncio.run(consumer_lag(settings, trainer_group(run_name), topic))
        if sum(lag.values()) == 0:
            break
        time.sleep(1)
    assert sum(lag.values()) == 0, f"trainer did not drain the backlog: {lag}"
    before_stop = len(log_events(log))
    stack.stop("trainer")  # SIGTERM: finish the step, commit, checkpoint, exit
    tail = [e["event"] for e in log_events(log)[before_stop:]]
    assert "stopping" in tail and "stopped" in tail, tail
    between = tail[tail.index("stopping"):tail.index("stopped")]
    assert {"checkpoint_written", "checkpoint_up_to_date"} & set(between), tail  # saved (or already) on the way out

    produced = {k: h.get("sample-id", "") for k, h in asyncio.run(read_topic(kafka_bootstrap, topic)).items()}
    events = log_events(log)
    first = [e for e in events[:run1_len] if e["event"] in OUTCOMES]
    second = [e for e in events[run1_len:] if e["event"] in OUTCOMES]
    accounted = {(e["partition"], e["offset"]): e.get("sample_id") for e in first + second}

    # Every record produced (before the kill and after) reached an outcome, with its sample id.
    missing = {k: v for k, v in produced.items() if k not in accounted}
    assert not missing, f"{len(missing)} records never reached an outcome, e.g. {list(missing.items())[:3]}"
    for key, sid in produced.items():
        assert accounted[key] == sid

    # Within one trainer run, each record has exactly one outcome.
    for run in (first, second):
        dup = [k for k, n in Counter((e["partition"], e["offset"]) for e in run).items() if n > 1]
        assert not dup, dup

    # Seen twice: only records at or after where run 2 resumed: the offsets of the checkpoint it restored
    # (records after them are in no checkpointed model, so they are trained again), else the committed ones.
    resumed = {e["partition"]: e["offset"] for e in events[run1_len:] if e["event"] == "resumed_from_ledger_offset"}
    twice = {(e["partition"], e["offset"]) for e in first} & {(e["partition"], e["offset"]) for e in second}
    for p, off in twice:
        assert off >= min(resumed.get(p, committed_at_kill.get(p, 0)), committed_at_kill.get(p, 0)), \
            (p, off, resumed, committed_at_kill)
    # ...and the consumed-but-uncommitted tail of run 1 was indeed re-delivered.
    uncommitted_run1 = {(e["partition"], e["offset"]) for e in first
                        if e["offset"] >= committed_at_kill.get(e["partition"], 0)}
    assert uncommitted_run1 <= twice
    print(f"\nproduced {len(produced)} records; committed at kill {committed_at_kill}; "
          f"seen twice {len(twice)}; outcomes run1 {Counter(e['event'] for e in first)}, "
          f"run2 {Counter(e['event'] for e in second)}")
