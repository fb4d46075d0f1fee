"""Reading and writing ``<run>.policy`` from a test, as an attacker with a Kafka client would (the e2e signature
test and the red-team suite): every announcement as it was written, and records produced with their headers."""
from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from shared.messages import KEY_ANNOUNCE

Produced = tuple[bytes, bytes, list[tuple[str, bytes]]]
"""(key, value, headers) of one record to produce."""


async def announcements(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[ConsumerRecord[bytes, bytes]]:
    """Every ``announce`` record on ``topic``, oldest first, read from its start to where it ended when asked
    (bounded by ``timeout_s``). Raises AssertionError when there is none."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                fetch_max_bytes=64 << 20, max_partition_fetch_bytes=64 << 20)
    await consumer.start()
    found: list[ConsumerRecord[bytes, bytes]] = []
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or {0})]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and [tp for tp in parts if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                found += [rec for rec in records if rec.key == KEY_ANNOUNCE and rec.value is not None]
    finally:
        await consumer.stop()
    assert found, f"no announcement on {topic}"
    return sorted(found, key=lambda rec: (rec.partition, rec.offset))


async def produce(bootstrap: str, topic: str, records: list[Produced]) -> None:
    """Send ``records`` to ``topic`` in order, each acknowledged before the next."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=64 << 20)
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, value, key=key, headers=headers or None)
    finally:
        await producer.stop()
