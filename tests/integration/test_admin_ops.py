"""Operator actions against the real broker and S3: auth, validation (4xx naming the field), the
commands on the control topic, durable state (pause, config revisions, audit)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.marker import VersionedStore, VersionRecord
from shared.messages import ControlCommand, SamplerBeat
from shared.runtime import read_paused
from shared.store import S3Store
from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3]
AUTH = {"Authorization": f"Bearer {TOKEN}"}

MUTATING = [("POST", "/samplers/pause", {}), ("POST", "/samplers/resume", {}),
            ("POST", "/policy/rollback", {"version": 1}), ("PATCH", "/config", {"trainer.learning_rate": 0.001}),
            ("POST", "/config/revert", {"revision": 1}), ("POST", "/policy/sync", None)]


async def _control(bootstrap: str, topic: str, n: int) -> list[ControlCommand]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        out: list[ControlCommand] = []
        for _ in range(40):
            for recs in (await consumer.getmany(timeout_ms=250)).values():
                out += [ControlCommand.model_validate_json(r.value) for r in recs]
            if len(out) >= n:
                break
        return out
    finally:
        await consumer.stop()


async def _announce_sampler(state: Any, sampler_id: str) -> None:
    """A sampler heartbeat, and wait until admin has seen it (pause/resume of one sampler needs it)."""
    await state.producer.send_and_wait(state.topics.heartbeats, SamplerBeat(id=sampler_id, policy_version=1).to_bytes())
    for _ in range(50):
        if sampler_id in state.view.samplers:
            break
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(("method", "path", "body"), MUTATING)
async def test_every_mutation_needs_the_token(api: Any, method: str, path: str, body: Any) -> None:
    client, _ = api
    r = await client.request(method, path, json=body)
    assert r.status_code == 401, (path, r.text)


async def test_pause_and_resume_are_durable_commands(api: Any, kafka_bootstrap: str) -> None:
    client, state = api
    await _announce_sampler(state, "s-a")
    r = await client.post("/samplers/pause", json={"sampler": "nope"}, headers=AUTH)
    assert r.status_code == 404 and "unknown sampler" in r.json()["detail"]
    assert (await client.post("/samplers/pause", json={"sampler": 3}, headers=AUTH)).status_code == 422
    assert (await client.post("/samplers/pause", json={"extra": 1}, headers=AUTH)).status_code == 422
    r = await client.post("/samplers/pause", json={"sampler": "s-a"}, headers=AUTH)
    assert r.status_code == 202 and r.json()["action"] == "pause" and r.json()["sampler"] == "s-a"
    assert r.json()["status"] == "sent" and r.json()["command_sent"] and r.json()["reason"] is None
    first = r.json()["request_id"]
    assert "s-a" in read_paused(state.store, state.settings.run)["samplers"]
    r = await client.post("/samplers/pause", headers=AUTH)  # no body: every sampler
    assert r.status_code == 202 and r.json()["sampler"] is None
    assert read_paused(state.store, state.settings.run)["all"] is not None
    assert (await client.post("/samplers/resume", json={}, headers=AUTH)).status_code == 202
    paused = read_paused(state.store, state.settings.run)
    assert paused["all"] is None and paused["samplers"] == {} and paused["updated_at"]
    cmds = await _control(kafka_bootstrap, state.topics.control, 3)
    assert [(c.command, c.sampler) for c in cmds] == [("pause", "s-a"), ("pause", None), ("resume", None)]
    audit = (await client.get("/audit")).json()["entries"]
    assert [e["action"] for e in audit] == ["pause", "pause", "resume"]
    assert audit[0]["params"] == {"sampler": "s-a", "request_id": first} and audit[0]["actor"] == "admin"
    assert [c.request_id for c in cmds][0] == first and audit[0]["outcome"] == "sent"


async def test_runtime_config_is_validated_revised_and_reverted(api: Any) -> None:
    client, state = api
    r = await client.get("/config")
    assert r.status_code == 200 and r.json()["revision"] == 0
    base = r.json()["settings"]
    assert set(base) >= {"sampler.max_backlog", "trainer.learning_rate", "trainer.max_staleness",
                         "trainer.target_kl", "trainer.publish_every", "sampler.sync_interval_s"}
    r = await client.patch("/config", json={"trainer.learning_rate": -1}, headers=AUTH)
    assert r.status_code == 422 and "trainer.learning_rate" in r.json()["detail"]
    r = await client.patch("/config", json={"trainer.epochs": 3}, headers=AUTH)
    assert r.status_code == 422 and "trainer.epochs" in r.json()["detail"] and "not a runtime setting" in r.text
    r = await client.patch("/config", json={"sampler.max_backlog": "many"}, headers=AUTH)
    assert r.status_code == 422 and "sampler.max_backlog" in r.json()["detail"]
    r = await client.patch("/config", json={"trainer.learning_rate": 5e-4, "sampler.max_backlog": 12}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["revision"] == 1
    assert body["changes"]["trainer.learning_rate"] == {"old": base["trainer.learning_rate"], "new": 5e-4}
    assert body["changes"]["sampler.max_backlog"] == {"old": base["sampler.max_backlog"], "new": 12}
    r = await client.patch("/config", json={"trainer.target_kl": None}, headers=AUTH)  # optional: may be unset
    assert r.status_code == 200 and r.json()["revision"] == 2
    r = await client.post("/config/revert", json={"revision": 9}, headers=AUTH)
    assert r.status_code == 404
    for wrong in (False, "1", 1.5):  # JSON's false is not revision 0 (schemathesis found it accepted)
        r = await client.post("/config/revert", json={"revision": wrong}, headers=AUTH)
        assert r.status_code == 422, (wrong, r.text)
    # 1.0 is revision 1: JSON Schema's integer (schemathesis sent 71452.0, valid by the schema, and got a 422)
    r = await client.post("/config/revert", json={"revision": 1.0}, headers=AUTH)
    assert r.status_code == 200 and r.json()["revision"] == 3
    assert r.json()["settings"]["trainer.learning_rate"] == 5e-4
    now = (await client.get("/config")).json()
    assert now["revision"] == 3 and now["settings"]["sampler.max_backlog"] == 12
    history = (await client.get("/config/history")).json()["revisions"]
    assert [h["revision"] for h in history] == [1, 2, 3] and history[2]["reverted_from"] == 1
    actions = [e["action"] for e in (await client.get("/audit")).json()["entries"]]
    assert actions == ["config_change", "config_change", "config_revert"]


async def test_versions_and_rollback_validation(api: Any, s3_endpoint: Any, run_name: str) -> None:
    client, _ = api
    r = await client.post("/policy/rollback", json={"version": 1}, headers=AUTH)
    assert r.status_code == 404 and "nothing published" in r.json()["detail"]
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    for v, data in [(1, b"w1"), (2, b"w2")]:
        key, sha = vs.put_blob(data)
        vs.publish_next(VersionRecord(version=v, blob=key, sha256=sha, size=len(data), trainer_step=v * 10))
    r = await client.get("/policy/versions")
    assert r.status_code == 200 and r.json()["current"] == 2
    assert [v["version"] for v in r.json()["versions"]] == [1, 2]
    assert (await client.post("/policy/rollback", json={"version": "x"}, headers=AUTH)).status_code == 422
    assert (await client.post("/policy/rollback", json={"version": 7}, headers=AUTH)).status_code == 404
    r = await client.post("/policy/rollback", json={"version": 2}, headers=AUTH)
    assert r.status_code == 409 and "already" in r.json()["detail"]


async def test_status_history_has_points(api: Any) -> None:
    client, _ = api
    for _ in range(50):
        points = (await client.get("/status/history")).json()["points"]
        if len(points) >= 2:
            break
        await asyncio.sleep(0.2)
    assert len(points) >= 2 and {"t", "backlog", "policy_version", "episode_return"} <= set(points[-1])


async def test_resuming_one_while_all_are_paused_is_refused(api: Any) -> None:
    client, state = api
    await _announce_sampler(state, "s-b")
    assert (await client.post("/samplers/pause", headers=AUTH)).status_code == 202
    r = await client.post("/samplers/resume", json={"sampler": "s-b"}, headers=AUTH)
    assert r.status_code == 409 and "resume all" in r.json()["detail"]
    assert (await client.post("/samplers/resume", headers=AUTH)).status_code == 202
