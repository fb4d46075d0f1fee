"""``VersionedStore.prune`` keeps pinned versions (shared/marker.py): the rollback guard pins the published
versions it may restore (services/trainer/autorollback.py), and paramsync prunes the policy history behind
it. A pinned version keeps its history record and its payload; unpinned old ones go; a pin expires."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shared.marker import VersionedStore, VersionRecord
from shared.store import LocalDirStore

RUN = "r"


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def vs(tmp_path: Path, clock: FakeClock) -> VersionedStore:
    return VersionedStore(LocalDirStore(tmp_path / "store"), RUN, "policy", clock=clock)


def payload(v: int) -> bytes:
    return f"weights of version {v}".encode()


def publish(vs: VersionedStore, clock: FakeClock, versions: range, same_as: dict[int, int] | None = None) -> None:
    for v in versions:
        data = payload((same_as or {}).get(v, v))
        key, sha = vs.put_blob(data)
        vs.publish_next(VersionRecord(version=v, blob=key, sha256=sha, size=len(data), trainer_step=v))
        clock.now += 1  # each written after the one before


def blob_exists(vs: VersionedStore, v: int) -> bool:
    return vs.store.exists(vs.blob_key(hashlib.sha256(payload(v)).hexdigest()))


def record(vs: VersionedStore, v: int) -> VersionRecord:
    (rec,) = [r for r in vs.records() if r.version == v]
    return rec


def test_pinned_versions_survive_prune_and_unpinned_old_ones_go(vs: VersionedStore, clock: FakeClock) -> None:
    publish(vs, clock, range(1, 8))
    vs.pin(2, "trainer-a", ttl_s=600)  # the guard's best version and another it may restore
    vs.pin(4, "trainer-a", ttl_s=600)
    assert vs.pinned() == {2, 4}
    removed = vs.prune(2)
    assert removed == [1, 3, 5]  # least recently written first; 6 and 7 are the newest two
    assert [r.version for r in vs.records()] == [2, 4, 6, 7]
    for v in (2, 4, 6, 7):
        assert blob_exists(vs, v)
        assert vs.fetch(record(vs, v)) == payload(v)  # a rollback to a pinned version can load its weights
    for v in (1, 3, 5):
        assert not blob_exists(vs, v)
    assert vs.prune(2) == []  # pruning again keeps them still


def test_a_pinned_version_goes_once_unpinned(vs: VersionedStore, clock: FakeClock) -> None:
    publish(vs, clock, range(1, 5))
    vs.pin(1, "trainer-a", ttl_s=600)
    assert vs.prune(1) == [2, 3]
    assert [r.version for r in vs.records()] == [1, 4]
    vs.unpin(1)  # the guard no longer may restore it
    assert vs.prune(1) == [1]
    assert [r.version for r in vs.records()] == [4] and not blob_exists(vs, 1)


def test_a_pinned_version_keeps_a_payload_it_shares_with_a_pruned_one(vs: VersionedStore, clock: FakeClock) -> None:
    # Payloads are content-addressed: version 3 holds the same weights as version 1 (an update that took no
    # step, a republish), so both records name one blob. Pruning 1 must not delete what pinned 3 names.
    publish(vs, clock, range(1, 6), same_as={3: 1})
    assert record(vs, 1).blob == record(vs, 3).blob
    vs.pin(3, "trainer-a", ttl_s=600)
    assert vs.prune(1) == [1, 2, 4]
    assert vs.fetch(record(vs, 3)) == payload(1)


def test_an_expired_pin_keeps_nothing(vs: VersionedStore, clock: FakeClock) -> None:
    # A trainer that died leaves its pins behind: they expire, so nothing stays pinned for good.
    publish(vs, clock, range(1, 5))
    vs.pin(1, "dead-trainer", ttl_s=30)
    vs.pin(2, "live-trainer", ttl_s=600)
    clock.now += 60
    assert vs.pinned() == {2}
    assert vs.prune(1) == [1, 3]
    assert [r.version for r in vs.records()] == [2, 4]


def test_pins_count_only_for_their_own_store(tmp_path: Path, clock: FakeClock) -> None:
    # The guard pins policy versions; checkpoints of the same numbers are pruned by their own rule.
    store = LocalDirStore(tmp_path / "store")
    policies = VersionedStore(store, RUN, "policy", clock=clock)
    ckpts = VersionedStore(store, RUN, "checkpoints", clock=clock)
    publish(policies, clock, range(1, 4))
    publish(ckpts, clock, range(1, 4))
    policies.pin(1, "trainer-a", ttl_s=600)
    assert ckpts.pinned() == set()
    assert ckpts.prune(1) == [1, 2]
    assert policies.prune(1) == [2]
    assert [r.version for r in policies.records()] == [1, 3]
