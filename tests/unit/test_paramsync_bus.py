"""paramsync on the in-memory bus: it verifies a candidate before moving the marker and announces it,
commits what it handled, measures sync latency from heartbeats, re-announces on a sync command, and
applies pending rollback requests (at start, and at once on a command).

Kafka's own semantics are proven against the broker in ``tests/integration/test_paramsync.py`` and
``test_rollback_durable.py``; here only what paramsync does with what it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from aiokafka import TopicPartition

import services.paramsync.service as paramsync_service
from services.admin.rollbacks import RollbackRequests, new_request_id
from services.paramsync.service import Paramsync
from services.trainer.learner import Learner
from shared.bus import MemoryBus
from shared.kafka import Topics
from shared.marker import VersionedStore, VersionRecord
from shared.messages import (
    KEY_CANDIDATE,
    ControlCommand,
    ParamsyncBeat,
    PolicyMessage,
    SamplerBeat,
    parse_heartbeat,
)
from shared.rl.envs import fragment_spec
from shared.settings import Settings
from tests.services import running, until

RUN = "r"
T = Topics.for_run(RUN)


def make(tmp_path: Path, reannounce_interval_s: float = 60) -> tuple[Paramsync, MemoryBus, VersionedStore]:
    mem = MemoryBus()
    settings = Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
        "paramsync": {"heartbeat_interval_s": 0.1, "reannounce_interval_s": reannounce_interval_s},
    })
    svc = Paramsync(settings, bus=mem.bus())
    return svc, mem, VersionedStore(svc.policies.store, RUN, "policy")


def weights(svc: Paramsync) -> bytes:
    return Learner(fragment_spec(svc.settings.env.id, 1 << 20), svc.settings.trainer).weights()


def record(vs: VersionedStore, data: bytes, version: int) -> VersionRecord:
    key, sha = vs.put_blob(data)
    return VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version)


def announced(mem: MemoryBus) -> list[int]:
    msgs = [PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy)]
    return [m.version for m in msgs if m.type == "announce"]






async def test_a_candidate_is_verified_published_announced_and_committed(tmp_path: Path) -> None:
    svc, mem, vs = make(tmp_path)
    data = weights(svc)
    wrong_sha = VersionRecord(version=1, blob=record(vs, data, 1).blob, sha256="0" * 64, size=len(data),
                              trainer_step=1)
    not_weights = record(vs, b"not weights at all", 2)
    async with running(svc) as task:
        mem.append(T.policy, PolicyMessage.of("candidate", record(vs, data, 0)).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: announced(mem) == [0], task)
        for bad in (wrong_sha, not_weights):
            mem.append(T.policy, PolicyMessage.of("candidate", bad).to_bytes(), key=KEY_CANDIDATE)
            end = len(mem.records(T.policy))
            # Handled (refused) and committed, each in its own poll (so none is superseded by the next).
            await until(lambda: mem.committed.get(TopicPartition(T.policy, 0), 0) >= end, task)  # noqa: B023
        mem.append(T.policy, PolicyMessage.of("candidate", record(vs, data, 3)).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: announced(mem) == [0, 3], task)
    marker = vs.read_marker()
    assert marker is not None and marker[0].version == 3
    assert [r.version for r in vs.records()] == [0, 3]  # 1 (sha256 mismatch), 2 (not weights): never published
    assert svc.published_version == 3


async def test_heartbeats_give_sync_latency_and_a_sync_command_re_announces(tmp_path: Path) -> None:
    svc, mem, vs = make(tmp_path)
    async with running(svc) as task:
        mem.append(T.policy, PolicyMessage.of("candidate", record(vs, weights(svc), 0)).to_bytes(),
                   key=KEY_CANDIDATE)
        await until(lambda: announced(mem) == [0], task)

        def own_beats() -> list[ParamsyncBeat]:
            beats = [parse_heartbeat(r.value or b"") for r in mem.records(T.heartbeats)]
            return [b for b in beats if isinstance(b, ParamsyncBeat)]

        # The sampler beats until paramsync counts it, as a real one does every second: paramsync reads heartbeats
        # from the end, and on a loaded machine its reader may take its position after a single early beat
        # (seen once in CI: no latency within 10 s).
        for _ in range(100):
            mem.append(T.heartbeats, SamplerBeat(id="s-1", policy_version=0).to_bytes(), key=b"s-1")
            with contextlib.suppress(TimeoutError):
                await until(lambda: any(b.live_samplers == 1 and b.sync_latency_p50_s is not None
                                        for b in own_beats()), task, timeout_s=0.3)
                break
        else:
            raise AssertionError(f"no sync latency from 100 sampler beats over 30 s: {own_beats()[-3:]}")
        mem.append(T.control, ControlCommand(command="sync", request_id="q").to_bytes(), key=b"sync")
        await until(lambda: announced(mem) == [0, 0], task)


async def test_the_published_version_is_re_announced_an_interval_after_start(tmp_path: Path) -> None:
    svc, mem, vs = make(tmp_path, reannounce_interval_s=0.5)
    vs.publish_next(record(vs, weights(svc), 0))  # published (and announced) before this paramsync started
    async with running(svc) as task:
        await asyncio.sleep(0.3)
        assert announced(mem) == []  # not at start
        await until(lambda: announced(mem) == [0, 0], task, timeout_s=3)


@pytest.mark.parametrize("when", ["at start", "on command"])
async def test_a_pending_rollback_request_is_applied_and_recorded(tmp_path: Path, when: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    svc, mem, vs = make(tmp_path)
    data = weights(svc)
    other = bytearray(data)
    other[-1] ^= 1  # another loadable payload (a different float in the last tensor)
    v1 = record(vs, data, 1)
    vs.publish_next(v1)
    vs.publish_next(record(vs, bytes(other), 2))
    requests = RollbackRequests(vs.store, RUN)
    request_id = new_request_id()
    if when == "at start":  # requested while paramsync was down
        requests.create(request_id, 1, "op")
    else:
        monkeypatch.setattr(paramsync_service, "ROLLBACK_POLL_S", 60.0)  # only the command can wake it in time

    def status() -> str:
        obj = vs.store.get(f"{RUN}/ops/rollback/{request_id}.json")
        return "" if obj is None else str(json.loads(obj.data)["status"])

    async with running(svc) as task:
        if when == "on command":
            await asyncio.sleep(0.3)  # the first pass found nothing pending
            assert status() == ""
            requests.create(request_id, 1, "op")
            mem.append(T.control, ControlCommand(command="rollback", request_id=request_id, version=1).to_bytes(),
                       key=b"rollback")
        await until(lambda: announced(mem) == [3], task, timeout_s=5)
        await until(lambda: status() == "applied", task, timeout_s=5)
    marker = vs.read_marker()
    assert marker is not None
    rec = marker[0]
    assert rec.version == 3 and rec.extra["rollback_of"] == 1 and rec.extra["lineage"] == 3
    assert rec.sha256 == v1.sha256 and rec.blob != v1.blob  # a pinned copy
    stored = json.loads(vs.store.get(f"{RUN}/ops/rollback/{request_id}.json").data)  # type: ignore[union-attr]
    assert stored["new_version"] == 3 and svc.lineage_required == 3


async def test_after_a_rollback_candidates_of_the_abandoned_lineage_are_refused(tmp_path: Path) -> None:
    # Versions 1 and 2 are published; an operator rolls back to 1 (published as 3, lineage 3). A candidate
    # trained from the abandoned weights (lineage 0) must never be published, one that followed the rollback
    # (lineage 3) is.
    svc, mem, vs = make(tmp_path)
    spec = fragment_spec(svc.settings.env.id, 1 << 20)

    def seeded(seed: int) -> bytes:  # distinct, loadable weights per version
        return Learner(spec, svc.settings.trainer.model_copy(update={"seed": seed})).weights()

    for v in (0, 1, 2):
        vs.publish_next(record(vs, seeded(v), v))
    RollbackRequests(vs.store, RUN).create(new_request_id(), 1, "operator")
    async with running(svc) as task:
        await until(lambda: (m := vs.read_marker()) is not None and m[0].version == 3, task)
        stale = record(vs, seeded(4), 4)  # lineage 0: trained on from version 2's weights
        mem.append(T.policy, PolicyMessage.of("candidate", stale).to_bytes(), key=KEY_CANDIDATE)
        end = len(mem.records(T.policy))
        await until(lambda: mem.committed.get(TopicPartition(T.policy, 0), 0) >= end, task)
        marker = vs.read_marker()
        assert marker is not None and marker[0].version == 3, "a candidate of the abandoned lineage was published"
        fresh = record(vs, seeded(5), 5)
        fresh = VersionRecord(**{**fresh.__dict__, "extra": {"lineage": 3}})
        mem.append(T.policy, PolicyMessage.of("candidate", fresh).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: (m := vs.read_marker()) is not None and m[0].version == 5, task)
    assert 4 not in [r.version for r in vs.records()]
