"""Concurrent pauses of different samplers all stick: the pause state is a conditional
read-modify-write (``shared.runtime.update_paused``), not last-writer-wins. Real Kafka and S3."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from shared.messages import SamplerBeat
from shared.runtime import read_paused
from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_concurrent_pauses_of_different_samplers_all_stick(api: Any) -> None:
    client, state = api
    ids = [f"s-{i}" for i in range(6)]
    for sid in ids:
        await state.producer.send_and_wait(state.topics.heartbeats, SamplerBeat(id=sid, policy_version=0,
                                                                                  steps_per_s=1.0).to_bytes())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(ids) <= set(state.view.samplers):
        await asyncio.sleep(0.1)
    assert set(ids) <= set(state.view.samplers)
    replies = await asyncio.gather(*[client.post("/samplers/pause", json={"sampler": sid}, headers=AUTH)
                                     for sid in ids])
    assert [r.status_code for r in replies] == [202] * len(ids), [r.text for r in replies]
    paused = await asyncio.to_thread(read_paused, state.store, state.settings.run)
    assert sorted(paused["samplers"]) == ids and paused["all"] is None
    # and concurrent resumes of some of them keep the others paused
    replies = await asyncio.gather(*[client.post("/samplers/resume", json={"sampler": sid}, headers=AUTH)
                                     for sid in ids[:3]])
    assert [r.status_code for r in replies] == [202] * 3
    paused = await asyncio.to_thread(read_paused, state.store, state.settings.run)
    assert sorted(paused["samplers"]) == ids[3:]
