"""Policies on Kafka (docs/policies.md): the inline announcement's encoding and sha256 check, paramsync's
choice of what rides inline, the sampler's adoption plan, and both services on the in-memory bus: an inline
version adopted with no store GET of the blob, corrupt inline weights refused and fetched from the store.

Kafka's own semantics (the compacted topic, a sampler that starts late, a real broker's size limit) are in
``tests/integration/test_inline_policy.py``.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from services.paramsync.inline import InlinePayload, inline_capacity
from services.paramsync.service import Paramsync
from services.sampler.adoption import AdoptInline, AdoptionPlan, FetchFromStore
from services.sampler.service import INLINE_REFUSED, POLICY_FETCHES, Sampler
from services.trainer.learner import Learner
from services.trainer.publication import announcement
from shared.bus import MemoryBus, Record
from shared.fragment import H_POLICY_VERSION, header_dict
from shared.kafka import Topics, policy_segments, topic_specs
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_ANNOUNCE, KEY_CANDIDATE, InlineMismatch, PolicyMessage
from shared.rl.envs import fragment_spec
from shared.settings import Settings
from shared.store import ObjectStore, StoredObject
from tests.services import running, until

RUN = "r"
T = Topics.for_run(RUN)
DATA = bytes(range(256)) * 40  # 10 KiB of "weights"


def rec_for(data: bytes, version: int = 1) -> VersionRecord:
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    return VersionRecord(version=version, blob=f"{RUN}/policy/blobs/{sha}.safetensors", sha256=sha, size=len(data),
                         trainer_step=version, created_at=1.0)


# ---- the message ------------------------------------------------------------------------------
def test_without_inline_the_encoding_is_the_one_readers_before_inline_know() -> None:
    msg = PolicyMessage.of("announce", rec_for(DATA))
    assert "inline" not in json.loads(msg.to_bytes())
    assert msg.inline_weights() is None


def test_inline_weights_round_trip_and_older_readers_ignore_them() -> None:
    rec = rec_for(DATA)
    msg = PolicyMessage.of("announce", rec).with_inline(DATA)
    raw = msg.to_bytes()
    assert json.loads(raw)["inline"] == base64.b64encode(DATA).decode()
    back = PolicyMessage.model_validate_json(raw)
    assert back.inline_weights() == DATA and back.record() == rec
    # The trainer's reader of announcements parses it as before (and a reader without the field ignores it).
    parsed = announcement(Record(TopicPartition(T.policy, 0), 0, KEY_ANNOUNCE, raw, []))
    assert parsed is not None and parsed.version == 1 and parsed.sha256 == rec_for(DATA).sha256


def test_inline_weights_that_do_not_match_their_sha256_are_refused() -> None:
    msg = PolicyMessage.of("announce", rec_for(DATA)).with_inline(DATA)
    flipped = bytearray(DATA)
    flipped[7] ^= 1
    corrupt = msg.model_copy(update={"inline": base64.b64encode(bytes(flipped)).decode()})
    with pytest.raises(InlineMismatch, match="corrupt"):
        corrupt.inline_weights()
    truncated = msg.model_copy(update={"inline": base64.b64encode(DATA[:-1]).decode()})
    with pytest.raises(InlineMismatch, match="corrupt"):
        truncated.inline_weights()
    with pytest.raises(InlineMismatch, match="not base64"):
        msg.model_copy(update={"inline": "%%%not base64"}).inline_weights()
    with pytest.raises(ValueError, match="do not match"):
        PolicyMessage.of("announce", rec_for(DATA)).with_inline(bytes(flipped))


# ---- paramsync's side -------------------------------------------------------------------------
def test_weights_ride_inline_up_to_the_limit_and_the_message_size() -> None:
    rec = rec_for(DATA)
    payload = InlinePayload(len(DATA), 4 * 1024 * 1024)
    empty, inline = payload.announcement(rec)  # nothing held yet
    assert not inline and "inline" not in json.loads(empty)
    assert payload.wants(rec) and payload.keep(rec, DATA) and not payload.wants(rec)
    ann, inline = payload.announcement(rec)
    assert inline and PolicyMessage.model_validate_json(ann).inline_weights() == DATA
    other = rec_for(DATA[:-1], version=2)  # another version: never announced with the held weights
    assert payload.announcement(other)[1] is False
    with pytest.raises(ValueError):
        payload.keep(rec, DATA[:-1])

    assert not InlinePayload(len(DATA) - 1, 4 * 1024 * 1024).keep(rec, DATA)  # over inline_max_bytes
    assert not InlinePayload(0, 4 * 1024 * 1024).fits(rec)  # 0: off
    small_topic = InlinePayload(1024 * 1024, 12 * 1024)  # the message limit caps it (base64: 4 bytes per 3)
    assert small_topic.limit == inline_capacity(12 * 1024) < len(DATA) and not small_topic.fits(rec)
    assert len(PolicyMessage.of("announce", rec_for(b"x" * small_topic.limit)).with_inline(
        b"x" * small_topic.limit).to_bytes()) <= 12 * 1024

    payload.refused(len(ann))  # a broker refused it as too large: only smaller weights from now on
    assert payload.limit < len(DATA) and payload.announcement(rec)[1] is False


def test_the_policy_topic_takes_an_inline_announcement_and_rolls_segments_for_compaction() -> None:
    settings = Settings.model_validate({"run": RUN})
    [policy] = [t for t in topic_specs(settings) if t.name == T.policy]
    cfg = dict(policy.topic_configs)
    limit = InlinePayload(settings.paramsync.inline_max_bytes, settings.kafka.max_message_bytes).limit
    assert limit == settings.paramsync.inline_max_bytes  # the default 1 MiB fits the default message size
    biggest = PolicyMessage.of("announce", rec_for(b"\0" * limit)).with_inline(b"\0" * limit).to_bytes()
    assert len(biggest) <= int(cfg["max.message.bytes"])
    assert cfg["cleanup.policy"] == "compact" and int(cfg["segment.bytes"]) >= 4 * int(cfg["max.message.bytes"])
    assert cfg == {**cfg, **policy_segments(int(cfg["max.message.bytes"]))}


# ---- the sampler's plan -------------------------------------------------------------------------
@functools.cache
def ann(version: int, data: bytes | None = DATA) -> PolicyMessage:
    msg = PolicyMessage.of("announce", rec_for(DATA, version))
    return msg if data is None else msg.with_inline(data)


def test_an_inline_announcement_is_adopted_at_once_and_the_newest_version_wins() -> None:
    plan = AdoptionPlan()
    assert plan.next(None, 0.0, 1.0) is None
    assert plan.announced(ann(1), 0.0)
    assert plan.next(None, 0.0, 1.0) == AdoptInline(ann(1))
    assert plan.next(1, 0.0, 1.0) is None  # adopted
    assert plan.announced(ann(2, None), 0.1)  # newer, no weights: the store, at once (no fetch before)
    assert plan.next(1, 0.1, 1.0) == FetchFromStore("announce")
    plan.fetched_from_store(0.1)
    assert plan.announced(ann(3), 0.2) and plan.next(1, 0.2, 1.0) == AdoptInline(ann(3))  # inline: no interval
    assert not plan.announced(ann(2), 0.3)  # older: its weights are never kept
    assert plan.next(1, 0.3, 1.0) == AdoptInline(ann(3))


def test_store_fetches_are_spaced_by_the_interval_and_the_newest_is_fetched() -> None:
    plan = AdoptionPlan()
    plan.announced(ann(1, None), 0.0)
    assert plan.next(None, 0.0, 1.0) == FetchFromStore("announce")
    plan.fetched_from_store(0.0)
    for v, t in ((2, 0.2), (3, 0.4), (4, 0.6)):
        plan.announced(ann(v, None), t)
        assert plan.next(1, t, 1.0) is None  # within the interval: wait
    assert plan.wanted == 4 and plan.next(1, 1.0, 1.0) == FetchFromStore("announce")
    assert plan.next(1, 0.9, 0.0) == FetchFromStore("announce")  # 0: no limit


def test_a_version_seen_only_behind_the_marker_waits_for_its_announcement() -> None:
    plan = AdoptionPlan()
    assert plan.found_behind_marker(5, 10.0)
    assert plan.next(4, 10.5, 1.0) is None  # its announcement (with the weights, likely) is on its way
    plan.announced(ann(5), 10.6)
    assert plan.next(4, 10.6, 1.0) == AdoptInline(ann(5))
    plan.found_behind_marker(6, 20.0)  # announcement lost: the store, once the interval has passed
    assert plan.next(5, 20.5, 1.0) is None and plan.next(5, 21.0, 1.0) == FetchFromStore("poll")
    plan.found_behind_marker(7, 30.0)
    plan.announced(ann(7, None), 30.1)  # announced without weights: nothing more to wait for
    assert plan.next(6, 30.1, 1.0) == FetchFromStore("poll")  # what made it known first


def test_refused_inline_weights_send_that_version_to_the_store_and_refused_versions_are_not_retried() -> None:
    plan = AdoptionPlan()
    plan.announced(ann(1), 0.0)
    plan.inline_refused(1)
    assert plan.next(None, 0.0, 1.0) == FetchFromStore("announce")
    plan.fetched_from_store(0.0)
    plan.announced(ann(2), 0.1)
    plan.weights_refused(2)
    assert plan.next(1, 5.0, 1.0) is None
    plan.announced(ann(2), 5.0)  # re-announced: still refused
    assert plan.next(1, 5.0, 1.0) is None
    plan.announced(ann(3), 6.0)
    assert plan.next(1, 6.0, 1.0) == AdoptInline(ann(3))


# ---- the services on the in-memory bus -------------------------------------------------------------
class CountingStore:
    """The object store, counting GETs of policy payloads (blobs): what inline policies save."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.blob_gets = 0

    def get(self, key: str) -> StoredObject | None:
        if "/policy/blobs/" in key:
            self.blob_gets += 1
        return self.inner.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def sampler_settings(tmp_path: Path, **sampler: Any) -> Settings:
    return Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
        "env": {"num_envs": 2, "fragment_steps": 4},
        "sampler": {"sync_interval_s": 60, "heartbeat_interval_s": 0.1, "credits": False,
                    "max_fragments_per_s": 50, **sampler},
    })


def counted(sampler: Sampler) -> CountingStore:
    store = CountingStore(sampler.policies.store)
    sampler.policies.store = store
    return store


def loadable(settings: Settings, seed: int) -> bytes:
    spec = fragment_spec(settings.env.id, 1 << 20)
    return Learner(spec, settings.trainer.model_copy(update={"seed": seed})).weights()


def store_version(sampler: Sampler, data: bytes, version: int) -> VersionRecord:
    vs = VersionedStore(sampler.store, RUN, "policy")
    key, sha = vs.put_blob(data)
    rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version)
    vs.publish_next(rec)
    return rec






def fetches(sampler_id: str, source: str) -> float:
    return POLICY_FETCHES.labels(sampler=sampler_id, source=source)._value.get()  # type: ignore[no-any-return]


def sent_versions(mem: MemoryBus) -> list[str]:
    return [header_dict(r.headers)[H_POLICY_VERSION] for r in mem.records(T.samples)]


async def test_a_sampler_adopts_inline_versions_without_a_store_get_even_when_it_starts_late(tmp_path: Path) -> None:
    mem = MemoryBus()
    sampler = Sampler(sampler_settings(tmp_path), "s-inline-unit", bus=mem.bus())
    store = counted(sampler)
    # The counters live as long as the test process (another test's sampler may share a label): count the change.
    inline_before, store_before = fetches("s-inline-unit", "inline"), fetches("s-inline-unit", "store")
    v0 = loadable(sampler.settings, 0)
    # Published and announced before the sampler started: found on the (compacted) topic, not in the store.
    mem.append(T.policy, PolicyMessage.of("announce", store_version(sampler, v0, 0)).with_inline(v0).to_bytes(),
               key=KEY_ANNOUNCE)
    mem.append(T.policy, b'{"type": "candidate", "not": "an announcement"}', key=KEY_CANDIDATE)
    async with running(sampler) as task:
        await until(lambda: sampler.worker.policy_version == 0, task)
        v1 = loadable(sampler.settings, 1)
        mem.append(T.policy, PolicyMessage.of("announce", store_version(sampler, v1, 1)).with_inline(v1).to_bytes(),
                   key=KEY_ANNOUNCE)
        await until(lambda: "1" in sent_versions(mem), task)
    assert store.blob_gets == 0
    assert fetches("s-inline-unit", "inline") - inline_before == 2
    assert fetches("s-inline-unit", "store") - store_before == 0
    versions = sent_versions(mem)
    assert versions == sorted(versions) and versions[0] == "0"


async def test_corrupt_inline_weights_are_never_acted_on_the_store_is_asked_instead(tmp_path: Path) -> None:
    mem = MemoryBus()
    sampler = Sampler(sampler_settings(tmp_path), "s-corrupt", bus=mem.bus())
    store = counted(sampler)
    installed: list[tuple[int, bytes]] = []
    set_policy = sampler.worker.set_policy

    def recording(version: int, weights: bytes) -> None:
        installed.append((version, weights))
        set_policy(version, weights)

    sampler.worker.set_policy = recording  # type: ignore[method-assign]
    v0 = loadable(sampler.settings, 0)
    store_version(sampler, v0, 0)
    refused_before = INLINE_REFUSED.labels(sampler="s-corrupt")._value.get()
    async with running(sampler) as task:
        await until(lambda: sampler.worker.policy_version == 0, task)
        v1 = loadable(sampler.settings, 1)
        msg = PolicyMessage.of("announce", store_version(sampler, v1, 1)).with_inline(v1)
        evil = loadable(sampler.settings, 2)  # loadable weights, but not the ones the sha256 names
        mem.append(T.policy, msg.model_copy(update={"inline": base64.b64encode(evil).decode()}).to_bytes(),
                   key=KEY_ANNOUNCE)
        await until(lambda: sampler.worker.policy_version == 1, task)
    assert installed == [(0, v0), (1, v1)]  # never the corrupt weights
    assert INLINE_REFUSED.labels(sampler="s-corrupt")._value.get() == refused_before + 1
    assert store.blob_gets == 2 and fetches("s-corrupt", "inline") == 0  # version 0 at start, then 1


async def test_paramsync_announces_small_policies_inline_and_large_ones_for_the_store(tmp_path: Path) -> None:
    def make(limit: int) -> tuple[Paramsync, MemoryBus, VersionedStore]:
        mem = MemoryBus()
        settings = Settings.model_validate({
            "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
            "paramsync": {"heartbeat_interval_s": 0.1, "reannounce_interval_s": 0.3, "inline_max_bytes": limit},
        })
        svc = Paramsync(settings, bus=mem.bus())
        return svc, mem, VersionedStore(svc.policies.store, RUN, "policy")

    def announcements(mem: MemoryBus) -> list[PolicyMessage]:
        msgs = [PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy)]
        return [m for m in msgs if m.type == "announce"]

    svc, mem, vs = make(1024 * 1024)
    data = loadable(svc.settings, 0)
    key, sha = vs.put_blob(data)
    rec = VersionRecord(version=0, blob=key, sha256=sha, size=len(data), trainer_step=0)
    async with running(svc) as task:
        mem.append(T.policy, PolicyMessage.of("candidate", rec).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: len(announcements(mem)) >= 2, task)  # the announcement and a re-announcement
    assert all(m.inline_weights() == data for m in announcements(mem))
    assert [r.key for r in mem.records(T.policy)][1:3] == [KEY_ANNOUNCE, KEY_ANNOUNCE]
    assert vs.read_marker() is not None and [r.version for r in vs.records()] == [0]  # the store keeps history

    restarted, mem2, _ = make(1024 * 1024)  # a restarted paramsync re-announces the marker's weights inline
    async with running(restarted) as task:
        await until(lambda: len(announcements(mem2)) >= 1, task)
    assert announcements(mem2)[0].inline_weights() == data

    for limit in (len(data) - 1, 0):  # over the limit, or inline off: the store
        big, mem3, _ = make(limit)
        async with running(big) as task:
            await until(lambda: len(announcements(mem3)) >= 1, task)  # noqa: B023
        assert [m.inline for m in announcements(mem3)] == [None] * len(announcements(mem3))
