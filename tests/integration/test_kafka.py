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
from aiokafka import TopicPartition
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


async def test_killed_consumer_is_replaced_and_gets_exactly_the_uncommitted_records(
    kafka_bootstrap: str, run_name: str
) -> None:
    s = settings_for(kafka_bootstrap, run_name)
    topic = (await ensure_topics(s)).samples
    group = f"{run_name}.g"
    total, commit_upto = 40, 15
    await produce(s, topic, total)

    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_bootstrap, "PYTHONPATH": str(REPO)}
    env.pop("FLYWHEEL_CONFIG", None)
    child = subprocess.Popen([sys.executable, str(REPO / "tests/integration/consumer_child.py"), topic, group,
                              str(total), str(commit_upto)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
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
        child.send_signal(signal.SIGKILL)  # consumed 40, committed 15: dies without committing the rest
        child.wait(timeout=10)
    first_run = [d["offset"] for d in lines if "offset" in d]
    assert first_run == list(range(total))
    assert {"committed": commit_upto} in lines

    replacement = make_consumer(s, topic, group_id=group)
    await replacement.start()
    got: list[int] = []
    try:
        deadline = time.monotonic() + 60  # the dead member's session (6 s) must expire first
        while time.monotonic() < deadline and len(got) < total - commit_upto:
            polled = await replacement.getmany(timeout_ms=500)
            for records in polled.values():
                got.extend(r.offset for r in records)
        await asyncio.sleep(1.0)  # nothing more arrives
        for records in (await replacement.getmany(timeout_ms=500)).values():
            got.extend(r.offset for r in records)
    finally:
        await replacement.stop()
    assert got == list(range(commit_upto, total)), "replacement must get exactly the uncommitted records"


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
