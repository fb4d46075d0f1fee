"""Flywheel's Kafka clients over SASL_PLAINTEXT + SCRAM-SHA-512, against a real broker.

The module starts its own broker (devstack, KRaft, a SASL_PLAINTEXT listener beside the PLAINTEXT one, the
SCRAM user created when the storage is formatted) in a fresh home on its own ports, so it never touches the
shared test stack, and stops it at the end. Settings come from the environment, as in production
(FLYWHEEL_KAFKA_SECURITY_PROTOCOL, ..._SASL_USERNAME, ..._SASL_PASSWORD).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed

import devstack
from devstack import InfraEndpoints, StackError
from shared.kafka import (
    LagProbe,
    check_credentials,
    ensure_topics,
    make_consumer,
    make_producer,
    trainer_group,
)
from shared.settings import Settings, load_settings

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(shutil.which("java") is None, reason="the local SASL broker needs Java (none on PATH)"),
]

T = TypeVar("T")
KAFKA_PORT, CONTROLLER_PORT, S3_PORT, SASL_PORT = 19492, 19493, 19400, 19494
STEP_TIMEOUT_S = 30.0
"""Bound on every broker call: a misconfigured client must fail the test, not hang it."""


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfraEndpoints]:
    home = tmp_path_factory.mktemp("kafka-sasl")
    try:
        started = time.monotonic()
        ep = devstack.ensure_up(home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT, s3_port=S3_PORT,
                                kafka_sasl_port=SASL_PORT, timeout_s=150, progress=lambda _msg: None)
        print(f"SASL broker up in {time.monotonic() - started:.1f} s at {ep.kafka_sasl_bootstrap}")
    except StackError as exc:
        devstack.down(home, progress=lambda _msg: None)
        pytest.fail(f"the SASL broker did not come up:\n{exc}", pytrace=False)
    try:
        yield ep
    finally:
        devstack.down(home, progress=lambda _msg: None)


def sasl_settings(ep: InfraEndpoints, run: str, **env: str) -> Settings:
    return load_settings(environ={**ep.kafka_sasl_env(), "FLYWHEEL_RUN": run,
                                  "FLYWHEEL_KAFKA_SAMPLES_PARTITIONS": "2", **env})


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, STEP_TIMEOUT_S)


async def test_topics_produce_consume_commit_and_lag_over_scram(sasl_broker: InfraEndpoints, run_name: str) -> None:
    settings = sasl_settings(sasl_broker, run_name)
    assert settings.kafka.security_protocol == "SASL_PLAINTEXT" and settings.kafka.sasl_mechanism == "SCRAM-SHA-512"
    await bounded(check_credentials(settings))

    topics = await bounded(ensure_topics(settings))
    assert topics.samples == f"{run_name}.samples"

    producer = make_producer(settings)
    await bounded(producer.start())
    try:
        meta = await bounded(producer.send_and_wait(topics.samples, b"fragment-over-scram", key=b"sampler-0"))
    finally:
        await producer.stop()

    group = trainer_group(run_name)
    probe = LagProbe(settings)
    await bounded(probe.start())
    try:
        lag = await bounded(probe.lag(group, topics.samples))
        assert lag == {0: 0, 1: 0} | {meta.partition: 1}, lag  # nothing committed yet: the record counts

        consumer = make_consumer(settings, topics.samples, group_id=group)
        await bounded(consumer.start())
        try:
            record = await bounded(consumer.getone())
            assert (record.value, record.key, record.offset) == (b"fragment-over-scram", b"sampler-0", meta.offset)
            tp = TopicPartition(topics.samples, record.partition)
            await bounded(consumer.commit({tp: record.offset + 1}))
            assert await bounded(consumer.committed(tp)) == record.offset + 1
        finally:
            await consumer.stop()

        assert await bounded(probe.lag(group, topics.samples)) == {0: 0, 1: 0}
    finally:
        await probe.stop()


async def test_wrong_password_is_an_authentication_error(
    sasl_broker: InfraEndpoints, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = sasl_settings(sasl_broker, run_name, FLYWHEEL_KAFKA_SASL_PASSWORD="not-the-password")

    # The start-up check reports the broker's own answer, at once.
    started = time.monotonic()
    with pytest.raises(SaslAuthenticationFailed, match="invalid credentials"):
        await bounded(check_credentials(settings))
    assert time.monotonic() - started < 10.0

    # A client fails its start too (aiokafka wraps the refusal in "Unable to bootstrap" and logs the reason).
    producer = make_producer(settings)
    with caplog.at_level(logging.ERROR, logger="aiokafka"):
        try:
            for start in (lambda: ensure_topics(settings), producer.start):
                started = time.monotonic()
                with pytest.raises(KafkaConnectionError, match="Unable to bootstrap"):
                    await bounded(start())
                assert time.monotonic() - started < 10.0
        finally:
            await producer.stop()
    assert any("SaslAuthenticationFailed" in r.getMessage() for r in caplog.records), caplog.text
    assert "not-the-password" not in caplog.text


async def test_an_unknown_user_is_refused(sasl_broker: InfraEndpoints, run_name: str) -> None:
    settings = sasl_settings(sasl_broker, run_name, FLYWHEEL_KAFKA_SASL_USERNAME="mallory")
    with pytest.raises(SaslAuthenticationFailed):
        await bounded(check_credentials(settings))
