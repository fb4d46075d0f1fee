"""Kafka semantics against the real broker: topics, manual commits, a killed consumer, lag."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from shared.kafka import Topics, consumer_lag, ensure_topics, make_consumer, make_producer
from shared.settings import KafkaSettings, Settings

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]


def settings_for(bootstrap: str, run: str, partitions: int = 1) -> Settings:
    return Settings(run=run, kafka=KafkaSettings(bootstrap=bootstrap, samples_partitions=partitions))


async def produce(settings: Settings, topic: str, n: int) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for i in range(n):
            await producer.send(topic, f"record-{i}".encode(), key=b"k")
        await producer.flush()
    finally:
        await producer.stop()


async def test_run_topics_are_created_with_their_configs(kafka_bootstrap: str, run_name: str) -> None:
    s = settings_for(kafka_bootstrap, run_name, partitions=3)
    topics = await ensure_topics(s)
    await ensure_topics(s)  # idempotent
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        described = {t["topic"]: t for t in await admin.describe_topics([topics.samples, topics.policy])}
        assert len(described[topics.samples]["partitions"]) == 3
        assert set(await admin.list_topics()) >= {topics.samples, topics.dlq, topics.policy, topics.control,
                                                   topics.heartbeats}
        resp = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topics.policy)])
        entries = {e[0]: e[1] for e in resp[0].resources[0][4]}
        assert entries["cleanup.policy"] == "compact"
    finally:
        await admin.close()
    assert topics == Topics.for_run(run_name)


def _run_child_until_done(bootstrap: str, topic: str, group: str, total: int, commit_upto: int,
                          *extra: str) -> list[dict[str, int]]:
    """Start consumer_child.py, wait until it consumed ``total`` records, SIGKILL it; its stdout lines."""
    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": bootstrap, "PYTHONPATH": str(REPO)}
    env.pop("FLYWHEEL_CONFIG", None)
    child = subprocess.Popen([sys.executable, str(REPO / "tests/integration/consumer_child.py"), topic, group,
                              str(total), str(commit_upto), *extra], stdout=subprocess.PIPE, text=True, env=env,
                             cwd=REPO)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = child.stdout.readline() if child.stdout else ""
            if not line:
                break
            lines.append(json.loads(line))
            if "done" in lines[-1]:
                break
        assert lines and "done" in lines[-1], f"child did not consume everything: {lines[-3:]}"
    finally:
        child.send_signal(signal.SIGKILL)  # consumed everything, committed commit_upto: dies without the rest
        child.wait(timeout=10)
    assert [d["offset"] for d in lines if "offset" in d] == list(range(total))
    assert {"committed": commit_upto} in lines
    return lines


async def _drain(consumer: AIOKafkaConsumer, want: int, timeout_s: float) -> tuple[list[int], float]:
    """Offsets ``consumer`` receives until it has ``want`` (or the guard expires), then anything more
    within a second; and the seconds until the first record arrived."""
    got: list[int] = []
    t0 = time.monotonic()
    first_at = float("inf")
    while time.monotonic() - t0 < timeout_s and len(got) < want:
        for records in (await consumer.getmany(timeout_ms=500)).values():
            got.extend(r.offset for r in records)
            first_at = min(first_at, time.monotonic() - t0)
    await asyncio.sleep(1.0)  # nothing more arrives
    for records in (await consumer.getmany(timeout_ms=500)).values():
        got.extend(r.offset for r in records)
    return got, first_at


async def test_killed_consumer_is_replaced_and_gets_exactly_the_uncommitted_records(
    kafka_bootstrap: str, run_name: str
) -> None:
    s = settings_for(kafka_bootstrap, run_name)
    topic = (await ensure_topics(s)).samples
    group = f"{run_name}.g"
    total, commit_upto = 40, 15
    await produce(s, topic, total)
    _run_child_until_done(kafka_bootstrap, topic, group, total, commit_upto)

    replacement = make_consumer(s, topic, group_id=group)
    await replacement.start()
    try:
        # The dead member's session (6 s) must expire first.
        got, _ = await _drain(replacement, total - commit_upto, timeout_s=60)
    finally:
        await replacement.stop()
    assert got == list(range(commit_upto, total)), "replacement must get exactly the uncommitted records"


async def test_static_member_replacement_does_not_wait_for_the_dead_session(
    kafka_bootstrap: str, run_name: str
) -> None:
    """With a group instance id (the trainer's default), a killed member's replacement takes its
    partitions over at once: here the session is 60 s, and the replacement has the uncommitted
    records long before it could have expired. Dynamic membership would wait out those 60 s."""
    s = settings_for(kafka_bootstrap, run_name)
    topic = (await ensure_topics(s)).samples
    group = f"{run_name}.static"
    total, commit_upto, session_ms = 30, 10, 60_000
    await produce(s, topic, total)
    _run_child_until_done(kafka_bootstrap, topic, group, total, commit_upto, "member-a", str(session_ms))

    replacement = make_consumer(s, topic, group_id=group, group_instance_id="member-a", session_timeout_ms=session_ms)
    await replacement.start()
    try:
        # The guard (45 s) is shorter than the session (60 s): only a takeover without waiting passes.
        got, first_at = await _drain(replacement, total - commit_upto, timeout_s=45)
    finally:
        await replacement.stop()
    assert got == list(range(commit_upto, total)), "replacement must get exactly the uncommitted records"
    print(f"static-member replacement: first record after {first_at:.1f} s")


async def test_consumer_lag_counts_uncommitted_records(kafka_bootstrap: str, run_name: str) -> None:
    s = settings_for(kafka_bootstrap, run_name, partitions=2)
    topic = (await ensure_topics(s)).samples
    group = f"{run_name}.lag"
    producer = make_producer(s)
    await producer.start()
    for i in range(10):
        await producer.send(topic, b"x", partition=i % 2)
    await producer.flush()
    await producer.stop()
    assert await consumer_lag(s, group, topic) == {0: 5, 1: 5}  # never committed: counts from the start

    consumer = make_consumer(s, topic, group_id=group)
    await consumer.start()
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200, max_records=1)
        await consumer.commit({TopicPartition(topic, 0): 3, TopicPartition(topic, 1): 5})
    finally:
        await consumer.stop()
    assert await consumer_lag(s, group, topic) == {0: 2, 1: 0}


async def test_a_one_partition_tail_gets_a_record_long_before_its_fetch_wait(kafka_bootstrap: str,
                                                                             run_name: str) -> None:
    """kafka.tail_fetch_max_wait_ms only bounds an idle fetch: the broker answers a one-partition reader the moment
    a record comes. With the wait at 8 s, each of 5 records sent to an idle reader arrives in under 2 s (were the
    broker to hold the fetch for its wait, each would take up to 8 s)."""
    from shared.bus import kafka_bus

    s = Settings(run=run_name, kafka=KafkaSettings(bootstrap=kafka_bootstrap, tail_fetch_max_wait_ms=8_000))
    topic = (await ensure_topics(s)).policy
    bus = kafka_bus(s)
    tail = bus.tail(topic)
    assert tail.consumer._fetch_max_wait_ms == 8_000  # type: ignore[attr-defined]  # noqa: SLF001
    several = bus.tail(topic, partitions={topic: (0, 1)})  # two partitions: the short wait stays
    assert several.consumer._fetch_max_wait_ms == s.kafka.fetch_max_wait_ms  # type: ignore[attr-defined]  # noqa: SLF001
    await several.stop()
    producer = make_producer(s)
    await producer.start()
    await tail.start()
    took = []
    try:
        for i in range(5):
            await asyncio.sleep(1.0)  # the reader is idle: its fetch waits at the broker
            sent = time.monotonic()
            await producer.send_and_wait(topic, f"announce-{i}".encode(), key=b"announce")  # compacted: keyed
            got: list[bytes | None] = []
            while not got and time.monotonic() - sent < 30:
                got = [r.value for r in await tail.poll(timeout_ms=10_000)]
            took.append(time.monotonic() - sent)
            assert got == [f"announce-{i}".encode()]
    finally:
        await tail.stop()
        await producer.stop()
    assert max(took) < 2.0, took
