"""The admin API against the real broker and S3: contract, auth, errors are 4xx."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.admin.cli import render_status
from shared.marker import VersionedStore, VersionRecord
from shared.messages import SamplerBeat, TrainerBeat
from shared.store import S3Store
from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3]


async def test_status_before_anything_runs(api: Any, run_name: str) -> None:
    client, _ = api
    r = await client.get("/status")
    assert r.status_code == 200
    s = r.json()
    assert s["run"] == run_name
    assert s["policy"] == {"version": None, "sha256": None, "published_at": None, "signed": False, "signed_by": None}
    assert s["trainer"]["alive"] is False and s["samplers"] == []
    assert set(s) >= {"run", "policy", "trainer", "samplers", "backlog", "sync", "staleness", "episode_return"}
    assert s["services"]["trainer"]["state"] == "down"  # no heartbeat yet
    assert run_name in render_status(s).splitlines()[0]


async def test_sync_needs_a_token_and_a_published_policy(api: Any, s3_endpoint: Any, run_name: str) -> None:
    client, _ = api
    assert (await client.post("/policy/sync")).status_code == 401
    assert (await client.post("/policy/sync", headers={"Authorization": "Bearer nope"})).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = await client.post("/policy/sync", headers=auth)
    assert r.status_code == 409 and "no policy" in r.json()["detail"]
    assert (await client.post("/policy/sync", params={"wait_s": "abc"}, headers=auth)).status_code == 422
    assert (await client.post("/policy/sync", params={"wait_s": 99}, headers=auth)).status_code == 422
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    key, sha = vs.put_blob(b"weights")
    vs.publish_next(VersionRecord(version=3, blob=key, sha256=sha, size=7, trainer_step=30))
    r = await client.post("/policy/sync", headers=auth)
    assert r.status_code == 202 and r.json()["policy_version"] == 3 and r.json()["synced"] is None


async def test_status_reflects_heartbeats_and_backlog(api: Any, run_name: str) -> None:
    client, state = api
    await state.producer.send_and_wait(state.topics.heartbeats, SamplerBeat(id="s-a", policy_version=2,
                                                                              steps_per_s=123.0).to_bytes())
    await state.producer.send_and_wait(state.topics.heartbeats, TrainerBeat(
        id="tr", policy_version=4, updates=9, env_steps_trained=4608, fragments_trained=18, samples_per_s=99.0,
        last_update_at=time.time(), staleness_mean=1.5, staleness_max=3, return_mean=42.0, return_count=7,
        fragments_dropped_stale=0, fragments_dead_lettered=0).to_bytes())
    for _ in range(3):
        await state.producer.send_and_wait(state.topics.samples, b"x")
    deadline = time.monotonic() + 20
    s: dict[str, Any] = {}
    while time.monotonic() < deadline:
        s = (await client.get("/status")).json()
        if s["samplers"] and s["trainer"]["alive"] and s["backlog"]["records"] == 3:
            break
        await asyncio.sleep(0.2)
    assert s["samplers"][0]["id"] == "s-a" and s["samplers"][0]["alive"] and s["samplers"][0]["policy_version"] == 2
    assert s["trainer"]["updates"] == 9 and s["trainer"]["samples_trained"] == 4608
    assert s["staleness"]["mean"] == 1.5 and s["staleness"]["max"] == 3
    assert s["episode_return"] == {"mean": 42.0, "count": 7}
    assert s["backlog"]["records"] == 3
    metrics = (await client.get("/metrics")).text
    assert "flywheel_backlog_records 3.0" in metrics


async def test_openapi_documents_the_contract(api: Any) -> None:
    client, _ = api
    spec = (await client.get("/openapi.json")).json()
    assert "/status" in spec["paths"] and "/policy/sync" in spec["paths"]
    assert "401" in spec["paths"]["/policy/sync"]["post"]["responses"]
    assert (await client.get("/healthz")).status_code == 200
