"""Consumers bound how long a fetch waits at the broker (kafka.fetch_max_wait_ms)."""

from __future__ import annotations

from shared.kafka import make_consumer
from shared.settings import KafkaSettings, Settings, load_settings


async def test_consumers_use_the_configured_fetch_wait() -> None:
    assert load_settings(None, {}).kafka.fetch_max_wait_ms == 50  # not aiokafka's 500 ms
    consumer = make_consumer(Settings(kafka=KafkaSettings(fetch_max_wait_ms=20)), group_id=None)
    # aiokafka keeps one fetch in flight per broker; this bounds how long a partition whose records
    # arrive meanwhile waits for the next one.
    assert consumer._fetch_max_wait_ms == 20  # noqa: SLF001
