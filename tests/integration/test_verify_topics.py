"""``flywheel verify``'s reading of the topics against a real broker: every partition of the samples topic
with its log start and end (moved by a real ``deleteRecords``), the offsets present within each ledger
range, the dead-letter copies' sources; and the checks on top of them (check_run)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from services.admin.verify import check_run, read_topics
from services.trainer.ledger import OffsetLedger
from shared.kafka import Topics, ensure_topics, make_producer
from shared.settings import KafkaSettings, Settings

pytestmark = pytest.mark.kafka


async def _fill(settings: Settings, per_partition: dict[int, int], dlq_sources: list[tuple[int, int]]) -> None:
    topics = Topics.for_run(settings.run)
    await ensure_topics(settings)
    producer = make_producer(settings)
    await producer.start()
    try:
        for p, n in per_partition.items():
            for i in range(n):
                await producer.send_and_wait(topics.samples, f"r{p}-{i}".encode(), key=b"k", partition=p)
        for p, off in dlq_sources:
            await producer.send_and_wait(topics.dlq, b"copy", key=b"k", partition=0,
                                         headers=[("dlq-source", f"{topics.samples}:{p}:{off}".encode())])
    finally:
        await producer.stop()


async def _delete(bootstrap: str, tp: TopicPartition, before: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(before_offset=before)})
    finally:
        await admin.close()


def _ledger(tp: TopicPartition, outcomes: dict[int, str], lost: tuple[int, int] | None = None) -> dict[str, object]:
    led = OffsetLedger()
    led.begin(tp, 0)
    if lost is not None:
        led.lost(tp, *lost)
    for off, outcome in sorted(outcomes.items()):
        assert led.consumed(tp, off)
        led.finished(tp, off, outcome)  # type: ignore[arg-type]
    return led.state()[f"{tp.topic}:{tp.partition}"]


def test_read_topics_sees_every_partition_the_log_start_and_the_dlq(kafka_bootstrap: str, run_name: str) -> None:
    settings = Settings(run=run_name, kafka=KafkaSettings(bootstrap=kafka_bootstrap, samples_partitions=3))
    topics = Topics.for_run(run_name)
    tp0, tp1 = TopicPartition(topics.samples, 0), TopicPartition(topics.samples, 1)
    asyncio.run(_fill(settings, {0: 6, 1: 5, 2: 0}, [(0, 2)]))
    asyncio.run(_delete(kafka_bootstrap, tp1, 3))  # 1:0-2 leave the log

    parts = {f"{topics.samples}:0": _ledger(tp0, {0: "trained", 1: "trained", 2: "dead", 3: "dropped"})}
    view = asyncio.run(read_topics(settings, parts))
    assert view.partitions == {0, 1, 2}
    assert view.log_start == {0: 0, 1: 3, 2: 0} and view.log_end == {0: 6, 1: 5, 2: 0}
    assert view.present[0] == {0, 1, 2, 3}  # within the ledger's range [0, 4) only
    assert view.dlq_sources == {0: {2}}

    # Partition 1 is not in the ledger and its log held records: the run is not proven. Partition 2 is empty.
    reports = check_run(parts, topics.samples, 0, view)
    assert reports[f"{topics.samples}:0"].ok, reports[f"{topics.samples}:0"].problems
    assert set(reports) == {f"{topics.samples}:0", f"{topics.samples}:1"}
    assert reports[f"{topics.samples}:1"].problems == [
        "not in the checkpoint's ledger, but the log has offsets [0, 5) (log start 3): their outcome in this "
        "model is unknown"]

    # A ledger that found 1:0-2 gone before training them: named as lost; the rest checks against the log.
    parts[f"{topics.samples}:1"] = _ledger(tp1, {3: "trained", 4: "trained"}, lost=(0, 3))
    view = asyncio.run(read_topics(settings, parts))
    assert view.present[1] == {3, 4}
    reports = check_run(parts, topics.samples, 0, view)
    assert reports[f"{topics.samples}:1"].problems == [
        "lost before training (left the log untrained): 3 record(s) at [0, 3)"]

    # A ledger claiming it trained 1:0-2 (which the log no longer holds) checks: retention may expire
    # trained records. The digests prove them; the count says so.
    parts[f"{topics.samples}:1"] = _ledger(tp1, {o: "trained" for o in range(5)})
    reports = check_run(parts, topics.samples, 0, asyncio.run(read_topics(settings, parts)))
    assert reports[f"{topics.samples}:1"].ok
    assert reports[f"{topics.samples}:1"].counts["below_log_start"] == 3

    # A dead-lettered offset without its DLQ copy, and a trained offset the log never held, fail.
    parts[f"{topics.samples}:0"] = _ledger(tp0, {o: "dead" if o in (2, 5) else "trained" for o in range(7)})
    reports = check_run(parts, topics.samples, 0, asyncio.run(read_topics(settings, parts)))
    problems = reports[f"{topics.samples}:0"].problems
    assert "dead-lettered per the ledger but not on the DLQ: 5" in problems
    assert "outcome recorded for offsets the log does not hold: 6" in problems
