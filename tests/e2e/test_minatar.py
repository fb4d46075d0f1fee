"""MinAtar Breakout (uint8 frames, the MinAtar CNN, zstd payloads) end to end on the local stack, real Kafka
and real S3, with configs/minatar-breakout.yaml (docs/pixels.md).

``test_minatar_pixels_flow_end_to_end`` (about a minute; in ``make test`` where the ``minatar`` extra is
installed): fragments flow, updates happen, versions are adopted, nothing is dead-lettered, and every record
on the samples topic is a compressed schema-3 fragment under the topic's size limit.

``test_minatar_learns_on_the_stack`` (``learning_full``: over 11 minutes, selected only by
``-m learning_full``): the issue's must-show, the last-100 return 10 minutes after the first minute at least
double the first minute's and at least 1 higher."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.fragment import H_ENCODING, H_SCHEMA, SCHEMA_VERSION, decode_fragment
from shared.kafka import Topics
from shared.rl.envs import fragment_spec
from shared.settings import load_settings
from tests.e2e.conftest import log_events, status

pytest.importorskip("minatar")
pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "minatar-breakout.yaml"
MIN_VERSIONS = 3


async def topic_records(bootstrap: str, topic: str) -> list[Any]:
    """Every record on ``topic`` up to its end offsets now."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=1 << 24)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: list[Any] = []
        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in tps])

        while await behind():
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                out.extend(r for r in records if r.offset < ends[TopicPartition(r.topic, r.partition)])
        return out
    finally:
        await consumer.stop()


def start(make_stack: Any, port: int) -> Any:
    stack = make_stack(port)
    stack.config = CONFIG  # make_stack's stacks default to configs/cartpole.yaml
    stack.up(samplers=2, prometheus=False)
    return stack


@pytest.mark.timeout(360)
def test_minatar_pixels_flow_end_to_end(make_stack: Any, kafka_bootstrap: str, run_name: str) -> None:
    stack = start(make_stack, 18950)
    deadline = time.monotonic() + 240
    s = status(stack)
    while time.monotonic() < deadline:
        s = status(stack)
        versions = [x["policy_version"] or 0 for x in s["samplers"] if x["alive"]]
        if ((s["policy"]["version"] or 0) >= MIN_VERSIONS and versions and max(versions) >= MIN_VERSIONS
                and s["trainer"]["updates"] >= MIN_VERSIONS):
            break
        time.sleep(1)
    trainer_log = stack.log_path("trainer")
    assert s["trainer"]["updates"] >= MIN_VERSIONS, s["trainer"]
    assert {e["sampler_id"] for e in log_events(trainer_log, "fragment_trained")} == {"sampler-0", "sampler-1"}
    assert not log_events(trainer_log, "fragment_dead_lettered")
    settings = load_settings(CONFIG, environ={})
    spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes, settings.env.frame_stack)
    records = asyncio.run(topic_records(kafka_bootstrap, Topics.for_run(run_name).samples))
    assert records
    for r in records:
        headers = dict(r.headers)
        assert headers[H_SCHEMA] == SCHEMA_VERSION.encode() and headers[H_ENCODING] == b"zstd"
        assert len(r.value) <= settings.kafka.max_message_bytes
        assert decode_fragment(list(r.headers), r.value, spec).obs.dtype == "uint8"
    sizes = sorted(len(r.value) for r in records)
    print(f"\nMINATAR: {s['trainer']['updates']} updates, {len(records)} records, payload bytes median "
          f"{sizes[len(sizes) // 2]} max {sizes[-1]}, return {s['episode_return']}")


@pytest.mark.learning_full
@pytest.mark.timeout(1200)
def test_minatar_learns_on_the_stack(request: pytest.FixtureRequest, make_stack: Any, kafka_bootstrap: str,
                                     run_name: str) -> None:
    if "learning_full" not in (request.config.option.markexpr or ""):
        pytest.skip("an 11-minute learning run: select it with -m learning_full")
    stack = start(make_stack, 18970)
    while status(stack)["trainer"]["updates"] < 1:
        time.sleep(1)
    t0 = time.monotonic()
    time.sleep(60)
    first = status(stack)["episode_return"]["mean"]
    time.sleep(600)
    s = status(stack)
    last = s["episode_return"]["mean"]
    print(f"\nMINATAR LEARNING: first minute {first}, 10 minutes later {last}, {s['trainer']['updates']} updates, "
          f"{s['trainer']['samples_trained']} env steps trained in {time.monotonic() - t0:.0f} s")
    settings = load_settings(CONFIG, environ={})
    records = asyncio.run(topic_records(kafka_bootstrap, Topics.for_run(run_name).samples))
    assert max(len(r.value) for r in records) <= settings.kafka.max_message_bytes
    assert not log_events(stack.log_path("trainer"), "fragment_dead_lettered")
    assert last >= 2 * first and last >= first + 1, (first, last)
