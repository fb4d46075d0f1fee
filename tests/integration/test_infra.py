"""The test fixtures give a working Kafka and S3, and `python -m devstack infra-up` is idempotent."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devstack import REPO_ROOT, TEST_CONTROLLER_PORT, TEST_HOME, TEST_KAFKA_PORT, TEST_S3_PORT

pytestmark = [pytest.mark.kafka, pytest.mark.s3]


async def test_kafka_round_trip_with_committed_offset(kafka_bootstrap: str, run_name: str) -> None:
    topic = f"{run_name}.infra"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
        assert all(code == 0 for _name, code, *_ in response.topic_errors), response.topic_errors
    finally:
        await admin.close()

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"hello", key=b"k", partition=1)
    finally:
        await producer.stop()

    tp = TopicPartition(topic, 1)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=f"{run_name}.g",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        record = await consumer.getone()
        assert (record.value, record.key, record.offset) == (b"hello", b"k", meta.offset)
        await consumer.commit({tp: record.offset + 1})
        assert await consumer.committed(tp) == record.offset + 1
    finally:
        await consumer.stop()


def test_s3_put_get(s3_endpoint: Any, s3_client: Any, run_name: str) -> None:
    key = f"{run_name}/hello.txt"
    s3_client.put_object(Bucket=s3_endpoint.bucket, Key=key, Body=b"hello")
    assert s3_client.get_object(Bucket=s3_endpoint.bucket, Key=key)["Body"].read() == b"hello"
    listed = s3_client.list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=f"{run_name}/")
    assert [o["Key"] for o in listed.get("Contents", [])] == [key]


def _up() -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [
        sys.executable,
        "-m",
        "devstack",
        "infra-up",
        "--home",
        str(TEST_HOME),
        "--kafka-port",
        str(TEST_KAFKA_PORT),
        "--controller-port",
        str(TEST_CONTROLLER_PORT),
        "--s3-port",
        str(TEST_S3_PORT),
    ]
    started = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out, time.monotonic() - started


def _pids(home: Path) -> dict[str, str]:
    return {name: (home / "pids" / f"{name}.pid").read_text().strip() for name in ("kafka", "s3")}


@pytest.mark.skipif(shutil.which("java") is None, reason="the local stack needs Java (none on PATH)")
def test_local_up_is_idempotent() -> None:
    _up()  # brings the test stack up if the fixtures came from elsewhere; reuses it otherwise
    before = _pids(TEST_HOME)
    out, took = _up()
    assert _pids(TEST_HOME) == before
    assert f"Kafka already running (pid {before['kafka']})" in out.stdout
    assert f"S3 server already running (pid {before['s3']})" in out.stdout
    assert took < 20.0, f"a warm `up` took {took:.1f} s"
    env = (TEST_HOME / "infra.env").read_text()
    assert f"FLYWHEEL_KAFKA_BOOTSTRAP=127.0.0.1:{TEST_KAFKA_PORT}" in env
    assert f"FLYWHEEL_S3_ENDPOINT=http://127.0.0.1:{TEST_S3_PORT}" in env
