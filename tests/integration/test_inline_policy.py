"""Policies on Kafka against the real broker and S3 (docs/policies.md): a sampler that starts after a version
was announced finds it, weights inline, on the compacted policy topic, and adopts it and the next one with no
store GET of a blob; a policy over ``paramsync.inline_max_bytes`` is fetched from the store; a policy topic
whose ``max.message.bytes`` is too small for the inline announcement (created before inline policies) gets
the announcement without the weights instead of stopping paramsync.

Store GETs are counted by a wrapper around the sampler's store client (S3 is not what is tested here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from services.paramsync.service import Paramsync
from services.sampler.service import Sampler
from services.trainer.learner import Learner
from shared.kafka import Topics
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_CANDIDATE, PolicyMessage
from shared.rl.envs import fragment_spec
from shared.settings import Settings, load_settings
from shared.store import S3Store, StoredObject
from tests.services import running
from tests.services import until as _until

pytestmark = [pytest.mark.kafka, pytest.mark.s3]


class CountingStore:
    """The sampler's object store, counting GETs of policy payloads (blobs)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.blob_gets = 0

    def get(self, key: str) -> StoredObject | None:
        if "/policy/blobs/" in key:
            self.blob_gets += 1
        return self.inner.get(key)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_settings(kafka_bootstrap: str, s3_endpoint: Any, run_name: str, monkeypatch: pytest.MonkeyPatch,
                  **paramsync: Any) -> Settings:
    for k, v in s3_endpoint.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    env = {"FLYWHEEL_RUN": run_name, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_bootstrap,
           **{k: v for k, v in s3_endpoint.env().items() if k.startswith("FLYWHEEL_")}}
    base = load_settings(None, environ=env)
    return base.model_copy(update={
        "paramsync": base.paramsync.model_copy(update={"reannounce_interval_s": 60.0, **paramsync}),
        "sampler": base.sampler.model_copy(update={"credits": False, "max_fragments_per_s": 5.0,
                                                   "sync_interval_s": 60.0}),
        "env": base.env.model_copy(update={"num_envs": 2, "fragment_steps": 4}),
    })






def weights(settings: Settings, seed: int) -> bytes:
    spec = fragment_spec(settings.env.id, 1 << 20)
    return Learner(spec, settings.trainer.model_copy(update={"seed": seed})).weights()


async def send_candidate(svc: Paramsync, vs: VersionedStore, data: bytes, version: int) -> VersionRecord:
    key, sha = await asyncio.to_thread(vs.put_blob, data)
    rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version)
    await svc.producer.send_and_wait(svc.topics.policy, PolicyMessage.of("candidate", rec).to_bytes(),
                                     key=KEY_CANDIDATE)
    return rec


async def announcements(kafka_bootstrap: str, topic: str) -> list[PolicyMessage]:
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        msgs: list[PolicyMessage] = []
        while await consumer.position(tp) < end:
            for recs in (await consumer.getmany(timeout_ms=1000)).values():
                msgs.extend(PolicyMessage.model_validate_json(r.value) for r in recs)
    finally:
        await consumer.stop()
    return [m for m in msgs if m.type == "announce"]


async def test_inline_versions_cost_no_store_get_and_a_large_one_comes_from_the_store(
    kafka_bootstrap: str, s3_endpoint: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(kafka_bootstrap, s3_endpoint, run_name, monkeypatch)
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    w0, w1, w2 = (weights(settings, seed) for seed in (0, 1, 2))
    sampler = Sampler(settings, "s-inline")
    store = CountingStore(sampler.policies.store)
    sampler.policies.store = store
    async with AsyncExitStack() as services:
        paramsync = Paramsync(settings.model_copy(update={
            "paramsync": settings.paramsync.model_copy(update={"inline_max_bytes": len(w0)})}))
        first = AsyncExitStack()
        ps = await first.enter_async_context(running(paramsync))
        try:
            await send_candidate(paramsync, vs, w0, 0)
            await until(lambda: paramsync.published_version == 0, [ps])
            # The sampler starts after version 0 was announced: it finds it on the topic, weights inline.
            sm = await services.enter_async_context(running(sampler))
            await until(lambda: sampler.worker.policy_version == 0, [ps, sm])
            await send_candidate(paramsync, vs, w1, 1)
            await until(lambda: sampler.worker.policy_version == 1, [ps, sm])
            assert store.blob_gets == 0, "an inline version was fetched from the store"
        finally:
            await first.aclose()
        # paramsync again, with an inline limit below the policy's size: version 2 goes through the store.
        paramsync2 = Paramsync(settings.model_copy(update={
            "paramsync": settings.paramsync.model_copy(update={"inline_max_bytes": len(w2) - 1})}))
        ps2 = await services.enter_async_context(running(paramsync2))
        late = Sampler(settings, "s-inline-late")
        late_store = CountingStore(late.policies.store)
        late.policies.store = late_store
        sm2 = await services.enter_async_context(running(late))
        await until(lambda: late.worker.policy_version == 1, [ps2, sm, sm2])
        assert late_store.blob_gets == 0  # version 1 from the topic, inline
        await send_candidate(paramsync2, vs, w2, 2)
        await until(lambda: sampler.worker.policy_version == 2 and late.worker.policy_version == 2, [ps2, sm, sm2])
        assert store.blob_gets == 1 and late_store.blob_gets == 1  # over the limit: one GET each
    anns = await announcements(kafka_bootstrap, Topics.for_run(run_name).policy)
    inline = {m.version: m.inline_weights() for m in anns}
    assert inline[0] == w0 and inline[1] == w1 and inline[2] is None
    assert [r.version for r in vs.records()] == [0, 1, 2]  # the store keeps every version


async def test_a_policy_topic_too_small_for_the_weights_gets_the_announcement_without_them(
    kafka_bootstrap: str, s3_endpoint: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(kafka_bootstrap, s3_endpoint, run_name, monkeypatch)
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    w0 = weights(settings, 0)
    topic = Topics.for_run(run_name).policy
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:  # as created before inline policies, with a message limit below the inline announcement's size
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={
            "cleanup.policy": "compact", "max.message.bytes": str(len(w0))})])
    finally:
        await admin.close()
    paramsync = Paramsync(settings)
    async with running(paramsync) as ps:
        assert paramsync.inline.limit < len(w0)  # read from the topic at start
        rec = await send_candidate(paramsync, vs, w0, 0)
        await until(lambda: paramsync.published_version == 0, [ps])
        await asyncio.sleep(0.5)
        assert not ps.done()  # no refused record, no producer out of sequence
    anns = await announcements(kafka_bootstrap, topic)
    assert [(m.version, m.sha256, m.inline) for m in anns] == [(0, rec.sha256, None)]


async def until(cond: Callable[[], bool], tasks: Any, timeout_s: float = 30) -> None:
    await _until(cond, tasks, timeout_s)
