"""paramsync against real Kafka + S3: it verifies candidates before moving the marker, then announces."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.paramsync.service import Paramsync
from services.trainer.learner import Learner
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_CANDIDATE, PolicyMessage
from shared.rl.envs import fragment_spec
from shared.settings import load_settings
from shared.store import S3Store

pytestmark = [pytest.mark.kafka, pytest.mark.s3]


async def test_candidates_are_verified_published_and_announced(
    kafka_bootstrap: str, s3_endpoint: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3_endpoint.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    env = {"FLYWHEEL_RUN": run_name, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_bootstrap,
           **{k: v for k, v in s3_endpoint.env().items() if k.startswith("FLYWHEEL_")}}
    settings = load_settings(None, environ=env)
    svc = Paramsync(settings)
    await svc.start()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    weights = Learner(fragment_spec("CartPole-v1", 1 << 20), settings.trainer).weights()
    key, sha = vs.put_blob(weights)
    bad_key, bad_sha = vs.put_blob(b"not weights at all")
    good0 = VersionRecord(version=0, blob=key, sha256=sha, size=len(weights), trainer_step=0)
    wrong_sha = VersionRecord(version=1, blob=key, sha256="0" * 64, size=len(weights), trainer_step=1)
    not_weights = VersionRecord(version=2, blob=bad_key, sha256=bad_sha, size=18, trainer_step=2)
    good3 = VersionRecord(version=3, blob=key, sha256=sha, size=len(weights), trainer_step=3)
    try:
        for rec in (good0, wrong_sha, not_weights, good3):
            await svc.producer.send_and_wait(svc.topics.policy, PolicyMessage.of("candidate", rec).to_bytes(),
                                             key=KEY_CANDIDATE)
            await asyncio.sleep(0.7)  # one candidate per poll, so none is superseded
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (vs.read_marker() or (None,))[0] != good3:
            await asyncio.sleep(0.2)
        marker = vs.read_marker()
        assert marker is not None and marker[0].version == 3
        assert [r.version for r in vs.records()] == [0, 3]  # 1 (sha mismatch) and 2 (not weights) refused
    finally:
        stop.set()
        await task
        await svc.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(svc.topics.policy, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        msgs = []
        for recs in (await consumer.getmany(timeout_ms=3000)).values():
            msgs.extend(PolicyMessage.model_validate_json(r.value) for r in recs)
    finally:
        await consumer.stop()
    assert [m.version for m in msgs if m.type == "announce"] == [0, 3]
