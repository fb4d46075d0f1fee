"""The sampler service on the in-memory bus: it produces fragments, honours credit grants, pause and resume
commands, adopts announced policies, and serves /metrics in the format its header declares; admin's state,
on the same bus, sees its heartbeats and its fragments as the trainer group's backlog, and sends commands.

Kafka's own semantics are not what is tested here (``tests/integration``, ``tests/e2e`` do that): only
what the sampler does with what it reads and what it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from aiokafka import TopicPartition

from services.admin.state import AdminState
from services.sampler.service import Sampler
from services.trainer.learner import Learner
from shared.bus import MemoryBus
from shared.credits import H_SAMPLER_SEQ, parse_seq
from shared.fragment import H_POLICY_VERSION, H_SAMPLER_ID, header_dict
from shared.kafka import Topics
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_ANNOUNCE, ControlCommand, CreditGrant, PolicyMessage, SamplerBeat, parse_heartbeat
from shared.rl.envs import fragment_spec
from shared.service import http_app
from shared.settings import Settings
from tests.services import running
from tests.services import until as _until

RUN = "r"
T = Topics.for_run(RUN)


def settings(tmp_path: Path, **sampler: Any) -> Settings:
    return Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
        "env": {"num_envs": 2, "fragment_steps": 4},
        "sampler": {"sync_interval_s": 0.2, "heartbeat_interval_s": 0.1, **sampler},
    })


def publish(sampler: Sampler, version: int) -> VersionRecord:
    """A loadable policy behind the marker, as paramsync leaves it."""
    weights = Learner(fragment_spec(sampler.settings.env.id, 1 << 20), sampler.settings.trainer).weights()
    vs = VersionedStore(sampler.store, RUN, "policy")
    key, sha = vs.put_blob(weights)
    rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(weights), trainer_step=version)
    vs.publish_next(rec)
    return rec






def fragments(mem: MemoryBus) -> list[dict[str, str]]:
    return [header_dict(r.headers) for r in mem.records(T.samples)]


def beats(mem: MemoryBus, sampler_id: str) -> list[SamplerBeat]:
    out = [parse_heartbeat(r.value or b"") for r in mem.records(T.heartbeats)]
    return [b for b in out if isinstance(b, SamplerBeat) and b.id == sampler_id]


async def test_it_produces_fragments_within_the_credits_the_trainer_grants(tmp_path: Path) -> None:
    mem = MemoryBus()
    mem.create(T.samples, 2)
    sampler = Sampler(settings(tmp_path), "s-1", bus=mem.bus())
    publish(sampler, 0)
    async with running(sampler) as task:
        await until(lambda: len(mem.records(T.samples)) >= 1, task)
        await asyncio.sleep(0.5)
        assert len(mem.records(T.samples)) == 1  # the first window is one fragment: it waits for a grant
        [h] = fragments(mem)
        assert h[H_SAMPLER_ID] == "s-1" and h[H_POLICY_VERSION] == "0"
        seq = parse_seq(h[H_SAMPLER_SEQ])
        assert seq is not None and seq[1] == 1
        grant = CreditGrant(trainer="t", window=3, consumed={f"s-1/{seq[0]}": 1})
        mem.append(T.credits, grant.to_bytes(), key=b"credits")
        await until(lambda: len(mem.records(T.samples)) >= 4, task)
        await asyncio.sleep(0.5)
        assert len(mem.records(T.samples)) == 4  # 1 consumed + a window of 3 in flight, not one more
        await until(lambda: any(b.credits_in_flight == 3 for b in beats(mem, "s-1")), task)
    assert {r.tp.partition for r in mem.records(T.samples)} == {0, 1}  # no key: spread over partitions
    assert sampler.fragments == 4 and sampler.health()["state"] == "ok"


async def test_a_pause_command_stops_production_until_resume(tmp_path: Path) -> None:
    mem = MemoryBus()
    sampler = Sampler(settings(tmp_path, credits=False, max_fragments_per_s=50), "s-1", bus=mem.bus())
    publish(sampler, 0)
    async with running(sampler) as task:
        await until(lambda: len(mem.records(T.samples)) >= 3, task)
        mem.append(T.control, ControlCommand(command="pause", request_id="p1").to_bytes(), key=b"pause")
        await until(lambda: any(b.paused_since is not None for b in beats(mem, "s-1")), task)
        await asyncio.sleep(0.1)  # a fragment being collected when the command came is held, not sent
        held = len(mem.records(T.samples))
        await asyncio.sleep(0.6)
        assert len(mem.records(T.samples)) == held  # paused: nothing produced, still beating
        assert beats(mem, "s-1")[-1].paused_since is not None
        mem.append(T.control, ControlCommand(command="resume", request_id="r1").to_bytes(), key=b"resume")
        await until(lambda: len(mem.records(T.samples)) >= held + 3, task)
        await until(lambda: beats(mem, "s-1")[-1].paused_since is None, task)


async def test_an_announced_version_is_adopted_between_fragments(tmp_path: Path) -> None:
    mem = MemoryBus()
    sampler = Sampler(settings(tmp_path, credits=False, max_fragments_per_s=50, sync_interval_s=60),
                      "s-1", bus=mem.bus())
    publish(sampler, 0)
    async with running(sampler) as task:
        await until(lambda: len(mem.records(T.samples)) >= 1, task)
        rec = publish(sampler, 1)
        mem.append(T.policy, PolicyMessage.of("announce", rec).to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: fragments(mem)[-1][H_POLICY_VERSION] == "1", task, timeout_s=5)  # not the 60 s poll
        assert any(b.policy_version == 1 for b in beats(mem, "s-1"))  # paramsync measures sync latency from it
        versions = [h[H_POLICY_VERSION] for h in fragments(mem)]
        assert versions == sorted(versions)  # never back


async def test_metrics_declare_the_text_format_they_are_in(tmp_path: Path) -> None:
    sampler = Sampler(settings(tmp_path), "s-1", bus=MemoryBus().bus())
    try:
        transport = httpx.ASGITransport(app=http_app(sampler))
        async with httpx.AsyncClient(transport=transport, base_url="http://sampler") as client:
            resp = await client.get("/metrics")
    finally:
        sampler.worker.close()
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE flywheel_sampler_fragments_produced_total counter" in resp.text


async def test_admin_state_sees_the_samplers_heartbeats_and_backlog_and_its_commands_reach_it(
        tmp_path: Path) -> None:
    mem = MemoryBus()
    mem.create(T.samples, 2)
    cfg = settings(tmp_path, credits=False, max_fragments_per_s=50)
    sampler = Sampler(cfg, "s-1", bus=mem.bus())
    publish(sampler, 0)
    admin = AdminState(cfg.model_copy(update={"admin": cfg.admin.model_copy(update={"refresh_interval_s": 0.1})}),
                       bus=mem.bus())
    await admin.start()
    admin_stop = asyncio.Event()
    admin_task = asyncio.create_task(admin.run(admin_stop))
    try:
        async with running(sampler) as task:
            await until(lambda: "s-1" in admin.view.samplers and len(mem.records(T.samples)) >= 4, task)
            mem.committed[TopicPartition(T.samples, 0)] = 1  # the trainer group committed one record
            await admin.command(ControlCommand(command="pause", request_id="p1"))
            await until(lambda: admin.view.samplers["s-1"].beat.paused_since is not None, task)
            produced = len(mem.records(T.samples))

            def backlog_is_what_is_not_committed() -> bool:
                return admin.view.lag is not None and sum(admin.view.lag.values()) == produced - 1

            await until(backlog_is_what_is_not_committed, task)
            assert admin.history and admin.history[-1]["backlog"] == produced - 1
    finally:
        admin_stop.set()
        await asyncio.wait_for(admin_task, 10)  # stops although its heartbeat reader never returns by itself
        await admin.stop()
    assert admin.health()["state"] == "ok"


async def test_a_credit_wait_longer_than_a_kafka_request_reports_degraded_until_a_grant(tmp_path: Path) -> None:
    mem = MemoryBus()
    mem.create(T.samples, 2)
    base = settings(tmp_path)  # the trainer (or Kafka) away for more than a request's timeout (1 s here)
    cfg = base.model_copy(update={"kafka": base.kafka.model_copy(update={"request_timeout_ms": 1000})})
    sampler = Sampler(cfg, "s-1", bus=mem.bus())
    publish(sampler, 0)
    async with running(sampler) as task:
        await until(lambda: len(mem.records(T.samples)) >= 1, task)
        assert sampler.health()["state"] == "ok"  # waiting for a grant is flow control at first
        await until(lambda: sampler.health()["state"] == "degraded", task)
        assert "no credit grant" in sampler.health()["reasons"]["credits"]
        seq = parse_seq(fragments(mem)[0][H_SAMPLER_SEQ])
        assert seq is not None
        mem.append(T.credits, CreditGrant(trainer="t", window=3, consumed={f"s-1/{seq[0]}": 1}).to_bytes(),
                   key=b"credits")
        await until(lambda: sampler.health()["state"] == "ok", task)


async def until(cond: Callable[[], bool], tasks: Any, timeout_s: float = 20) -> None:
    await _until(cond, tasks, timeout_s)
