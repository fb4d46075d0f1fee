"""Records removed from a samples partition before the trainer read them (Kafka's ``deleteRecords``, as
retention would) on the real stack: the trainer trains on, says so loudly (an error log line, an audit
entry, ``flywheel_trainer_records_lost_total``), and ``flywheel verify`` exits 1 naming the partition and
the range. Before the deletion the same run verifies (exit 0)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from devstack import LocalStack
from shared.kafka import Topics, trainer_group
from tests.e2e.conftest import log_events, status, wait_until
from tests.faults.accounting import committed, read_topic

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _verify(stack: LocalStack) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "services.admin.cli", "verify"], env=stack.service_env("admin"),
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    return proc.returncode, proc.stdout + proc.stderr


async def _delete_records(bootstrap: str, tp: TopicPartition, before: int) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        low = await admin.delete_records({tp: RecordsToDelete(before_offset=before)})
        return int(low[tp])
    finally:
        await admin.close()


def test_records_deleted_before_training_are_reported_and_fail_verify(make_stack: Any, run_name: str,
                                                                       kafka_bootstrap: str) -> None:
    # A window of 16 fragments in flight: with CartPole's default of 4 over 4 partitions the samplers may well
    # have at most one untrained record on every partition when the trainer stops, and the test needs two on one.
    stack = make_stack(18300, env={"FLYWHEEL_TRAINER_CHECKPOINT_EVERY": "5", "FLYWHEEL_TRAINER_FLOW_WINDOW": "16"})
    stack.up(samplers=2, prometheus=False)
    wait_until(lambda: status(stack)["trainer"]["updates"] >= 10, 120, "10 updates")
    code, out = _verify(stack)
    assert code == 0, f"an untouched run must verify:\n{out}"

    stack.stop("trainer")  # SIGTERM: commits and checkpoints what it trained (no longer wanted: not restarted)
    frontier = asyncio.run(committed(kafka_bootstrap, trainer_group(run_name)))
    topic = Topics.for_run(run_name).samples

    def untrained() -> tuple[int, int, int] | None:
        ends: dict[int, int] = {}
        for p, off in asyncio.run(read_topic(kafka_bootstrap, topic)):
            ends[p] = max(ends.get(p, 0), off + 1)
        # Flow control lets the samplers run only a window ahead of the trainer: 16 fragments over 4 partitions.
        ready = [(p, frontier.get(p, 0), end) for p, end in sorted(ends.items()) if end - frontier.get(p, 0) >= 2]
        return ready[0] if ready else None

    part, lo, end = wait_until(untrained, 90, "2 untrained records on a partition")
    hi = lo + 2  # the oldest two untrained records of that partition leave the log
    assert asyncio.run(_delete_records(kafka_bootstrap, TopicPartition(topic, part), hi)) == hi

    log = stack.log_path("trainer")
    before = len(log_events(log))
    stack.start("trainer")
    stack.wait_healthy("trainer", timeout_s=90)
    lost = wait_until(lambda: [e for e in log_events(log)[before:] if e["event"] == "records_lost_before_training"],
                      90, "records_lost_before_training in the trainer's log")
    assert len(lost) == 1, lost
    assert (lost[0]["partition"], lost[0]["from_offset"], lost[0]["to_offset"], lost[0]["count"]) == (part, lo, hi, 2)
    assert lost[0]["level"] == "error"
    # It trains on, and the next checkpoint carries the loss.
    at = status(stack)["trainer"]["updates"]
    wait_until(lambda: status(stack)["trainer"]["updates"] >= at + 5, 120, "5 more updates")
    wait_until(lambda: [e for e in log_events(log)[before:] if e["event"] == "checkpoint_written"
                        and e["offsets"].get(f"{topic}:{part}", 0) > hi], 120, "a checkpoint after the loss")

    metrics = httpx.get(f"http://127.0.0.1:{stack.port('trainer')}/metrics", timeout=10).text
    assert "flywheel_trainer_records_lost_total 2.0" in metrics, \
        [line for line in metrics.splitlines() if "records_lost" in line]
    audit = httpx.get(f"{stack.admin_url}/audit", headers={"Authorization": f"Bearer {stack.admin_token}"},
                      timeout=10).json()
    entries = [e for e in audit["entries"] if e["action"] == "records_lost_before_training"]
    assert len(entries) == 1, audit
    assert entries[0]["params"]["partition"] == part and entries[0]["params"]["count"] == 2

    code, out = _verify(stack)
    print(f"\npartition {part}: deleted [{lo}, {hi}) of {end}; flywheel verify exit {code}:\n{out}")
    assert code == 1, out
    assert f"{topic}:{part} [0, " in out and "FAILED" in out, out
    assert f"lost before training (left the log untrained): 2 record(s) at [{lo}, {hi})" in out, out
    others = [line for line in out.splitlines() if line.startswith(f"  {topic}:") and f"{topic}:{part} " not in line]
    assert others and all(line.endswith(")") and ": ok (" in line for line in others), out


def _sampler_health(stack: LocalStack, i: int) -> dict[str, Any]:
    r = httpx.get(f"http://127.0.0.1:{stack.port('sampler', i)}/healthz", timeout=10)
    body: dict[str, Any] = r.json()
    return body


def test_every_untrained_record_deleted_no_sampler_is_left_behind(make_stack: Any, run_name: str,
                                                                   kafka_bootstrap: str) -> None:
    # The samplers' newest fragments are exactly the untrained records: deleting every one of them while the
    # trainer is down used to leave every sampler waiting for credits those records held, and training stopped.
    # A window of 24 over 4 partitions: every partition holds untrained records when the samplers stop.
    stack = make_stack(18400, env={"FLYWHEEL_TRAINER_CHECKPOINT_EVERY": "5", "FLYWHEEL_TRAINER_FLOW_WINDOW": "24"})
    stack.up(samplers=2, prometheus=False)
    wait_until(lambda: status(stack)["trainer"]["updates"] >= 10, 120, "10 updates")
    stack.stop("trainer")  # SIGTERM: commits and checkpoints what it trained (not restarted by the supervisor)
    frontier = asyncio.run(committed(kafka_bootstrap, trainer_group(run_name)))
    topic = Topics.for_run(run_name).samples

    def untrained_everywhere() -> dict[int, int] | None:
        ends: dict[int, int] = {}
        for p, off in asyncio.run(read_topic(kafka_bootstrap, topic)):
            ends[p] = max(ends.get(p, 0), off + 1)
        waiting = all(_sampler_health(stack, i)["reasons"].get("credits") for i in range(2))
        ready = len(ends) == 4 and all(end > frontier.get(p, 0) for p, end in ends.items())
        return ends if ready and waiting else None

    # Both samplers used their windows and wait (degraded after a Kafka request's timeout, 30 s, naming no grant).
    ends = wait_until(untrained_everywhere, 120, "untrained records on every partition, both samplers waiting")
    for i in range(2):
        assert "no credit grant for" in _sampler_health(stack, i)["reasons"]["credits"]
    for p, end in ends.items():
        assert asyncio.run(_delete_records(kafka_bootstrap, TopicPartition(topic, p), end)) == end
    produced = {i: _sampler_health(stack, i)["fragments"] for i in range(2)}

    log = stack.log_path("trainer")
    before = len(log_events(log))
    stack.start("trainer")
    stack.wait_healthy("trainer", timeout_s=90)
    started = time.monotonic()
    back: dict[int, float] = {}

    def every_sampler_back() -> bool:
        for i in range(2):
            if i not in back and _sampler_health(stack, i)["fragments"] > produced[i]:
                back[i] = time.monotonic() - started
        return len(back) == 2

    wait_until(every_sampler_back, 60, "every sampler producing again within 60 s of the trainer's start",
               interval=0.5)
    lost = [e for e in log_events(log)[before:] if e["event"] == "records_lost_before_training"]
    assert sorted(e["partition"] for e in lost) == [0, 1, 2, 3], lost
    assert all(e["to_offset"] == ends[e["partition"]] and e["from_offset"] == frontier.get(e["partition"], 0)
               for e in lost), (lost, ends, frontier)
    samplers = [e for i in range(2) for e in log_events(stack.log_path("sampler", i))
                if e["event"] == "fragments_settled_unconsumed"]
    # Settled: the deleted fragments the samplers still counted in flight (records the trainer had consumed but
    # not trained when it stopped were counted consumed already, so they are not among them).
    assert 0 < sum(e["count"] for e in samplers) <= sum(end - frontier.get(p, 0) for p, end in ends.items()), samplers

    # /status: the loss, and no sampler reason left over from the wait (they produce again).
    def loss_shown() -> dict[str, Any] | None:
        st = status(stack)
        reasons = {k: v["reasons"] for k, v in st["services"].items() if k.startswith("sampler:")}
        ok = st["trainer"]["records_lost_partitions"] == [0, 1, 2, 3] and all(not r for r in reasons.values())
        return st if ok and len(reasons) == 2 else None

    st = wait_until(loss_shown, 60, "/status naming the loss, with no sampler degraded")
    assert st["trainer"]["records_lost"] == sum(end - frontier.get(p, 0) for p, end in ends.items())
    at = st["trainer"]["updates"]
    wait_until(lambda: status(stack)["trainer"]["updates"] >= at + 5, 120, "5 more updates")
    wait_until(lambda: [e for e in log_events(log)[before:] if e["event"] == "checkpoint_written"
                        and all(e["offsets"].get(f"{topic}:{p}", 0) >= end for p, end in ends.items())],
               120, "a checkpoint past every loss")
    code, out = _verify(stack)
    print(f"\ndeleted {ends} (frontier {frontier}); samplers back after {back} s; flywheel verify exit {code}:\n{out}")
    assert code == 1, out
    for p, end in ends.items():
        assert f"{topic}:{p} [0, " in out and (f"record(s) at [{frontier.get(p, 0)}, {end})" in out), out
