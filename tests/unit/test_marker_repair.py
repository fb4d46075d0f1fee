"""Markers that cannot be lost or wedged: repair from the history, pruning by write time, and pruning
that never deletes what the marker names (local-directory store; interleavings forced by a store
wrapper, not by timing)."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from shared.logging import configure_logging
from shared.marker import BadMarker, BadPayload, MarkerConflict, VersionedStore, VersionRecord
from shared.store import LocalDirStore, StoredObject


class Clock:
    """A clock the test moves: one tick per call."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class HookedStore(LocalDirStore):
    """The local store, with a hook that runs once before a chosen operation on a chosen key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.before_put: dict[str, Callable[[], None]] = {}
        self.before_delete: dict[str, Callable[[], None]] = {}

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        hook = self.before_put.pop(key, None)
        if hook is not None:
            hook()
        return super().put(key, data, if_none_match=if_none_match, if_match=if_match)

    def delete(self, key: str) -> None:
        hook = self.before_delete.pop(key, None)
        if hook is not None:
            hook()
        super().delete(key)


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    configure_logging("test", "run", stream=buf)
    yield buf


def publish(vs: VersionedStore, version: int, data: bytes) -> VersionRecord:
    key, sha = vs.put_blob(data)
    rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version)
    current = vs.read_marker()
    vs.publish(rec, None if current is None else current[1])
    return rec


def flip_a_byte(store: LocalDirStore, key: str) -> StoredObject:
    obj = store.get(key)
    assert obj is not None
    store.put(key, b"\x00" + obj.data[1:])
    bad = store.get(key)
    assert bad is not None
    return bad


# ---- repair -------------------------------------------------------------------------------------
def test_one_byte_over_the_checkpoint_marker_is_repaired_and_reported(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    reports: list[tuple[VersionRecord, str]] = []
    vs = VersionedStore(store, "run", "checkpoints", on_repair=lambda rec, why: reports.append((rec, why)))
    publish(vs, 1, b"state-1")
    newest = publish(vs, 2, b"state-2")
    flip_a_byte(store, vs.marker_key)
    with pytest.raises(BadMarker):
        vs.read_marker(repair=False)

    got = vs.read_marker()  # repairs instead of raising

    assert got is not None and got[0] == newest
    assert [r.version for r, _ in reports] == [2] and "unreadable" in reports[0][1]
    line = next(json.loads(x) for x in logs.getvalue().splitlines() if "marker_repaired" in x)
    assert line["version"] == 2 and line["kind"] == "checkpoints"
    assert vs.read_marker(repair=False) == got  # the stored marker is readable again
    assert vs.repair_marker() is None  # nothing left to repair


def test_repair_skips_history_whose_payload_is_bad(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "policy")
    good = publish(vs, 1, b"w1")
    bad = publish(vs, 2, b"w2")
    store.put(bad.blob, b"torn")
    flip_a_byte(store, vs.marker_key)

    assert vs.repair_marker() == good
    rec, data = vs.load_newer(None) or (None, b"")
    assert rec == good and data == b"w1"


def test_nothing_readable_is_bad_marker_and_absent_is_none(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "config")
    assert vs.repair_marker() is None and vs.read_marker() is None
    rec = publish(vs, 1, b"rev-1")
    store.delete(rec.blob)
    flip_a_byte(store, vs.marker_key)
    with pytest.raises(BadMarker) as err:
        vs.repair_marker()
    assert isinstance(err.value, BadPayload) and "no history record" in str(err.value)
    with pytest.raises(BadMarker):
        vs.read_marker()
    assert vs.load_newer(None) is None  # readers keep what they have


def test_a_writer_holding_the_corrupt_etag_conflicts_after_a_repair(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "policy")
    publish(vs, 1, b"w1")
    corrupt = flip_a_byte(store, vs.marker_key)
    assert vs.repair_marker() is not None
    key, sha = vs.put_blob(b"w2")
    late = VersionRecord(version=2, blob=key, sha256=sha, size=2, trainer_step=2)
    with pytest.raises(MarkerConflict):
        vs.publish(late, corrupt.etag)
    vs.publish_next(late)  # the read-check-write path works on the repaired marker
    assert (vs.read_marker() or (None,))[0] == late


def test_two_repairers_one_writes_the_other_rereads(tmp_path: Path, logs: io.StringIO) -> None:
    store = HookedStore(tmp_path)
    reports: list[int] = []
    first = VersionedStore(store, "run", "checkpoints", on_repair=lambda rec, _: reports.append(rec.version))
    second = VersionedStore(store, "run", "checkpoints", on_repair=lambda rec, _: reports.append(rec.version))
    rec = publish(first, 7, b"s7")
    flip_a_byte(store, first.marker_key)
    # The second repairer writes between the first one's read of the corrupt marker and its write.
    store.before_put[first.marker_key] = lambda: second.repair_marker() and None

    assert first.repair_marker() is None  # lost the race: someone else restored it
    assert reports == [7]  # exactly one repair, reported once
    got = first.read_marker(repair=False)
    assert got is not None and got[0] == rec


def test_load_latest_good_repairs_a_corrupt_marker(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "checkpoints")
    publish(vs, 1, b"s1")
    publish(vs, 2, b"s2")
    store.put(vs.marker_key, b"{not json")
    rec, data, refused = vs.load_latest_good() or (None, b"", [])
    assert rec is not None and rec.version == 2 and data == b"s2" and refused == []
    assert vs.read_marker(repair=False) is not None


# ---- pruning ------------------------------------------------------------------------------------
def test_prune_keeps_a_fresh_start_whose_versions_are_lower(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "policy", clock=Clock())
    for v in range(1, 21):
        publish(vs, v, f"old-{v}".encode())
    store.delete(vs.marker_key)  # a deliberate fresh start: versions count from 1 again
    fresh = [publish(vs, v, f"new-{v}".encode()) for v in (1, 2, 3)]

    removed = vs.prune(5)

    assert sorted(r.version for r in vs.records()) == [1, 2, 3, 19, 20]
    assert sorted(removed) == list(range(4, 19))
    for rec in fresh:
        assert vs.fetch(rec) == f"new-{rec.version}".encode()


def test_records_without_written_at_count_as_older(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "policy", clock=Clock())
    for v in (5, 6):  # written by older code: no written_at
        key, sha = vs.put_blob(f"legacy-{v}".encode())
        rec = VersionRecord(version=v, blob=key, sha256=sha, size=8, trainer_step=v)
        raw = json.loads(rec.to_json())
        raw.pop("written_at")
        store.put(vs.history_key(v), json.dumps(raw).encode())
    publish(vs, 1, b"new-1")
    assert vs.prune(2) == [5]
    assert sorted(r.version for r in vs.records()) == [1, 6]


def test_prune_never_deletes_the_marker_record_even_when_old(tmp_path: Path, logs: io.StringIO) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "policy", clock=Clock())
    good = publish(vs, 1, b"w1")
    for v in (2, 3):
        store.put(publish(vs, v, f"w{v}".encode()).blob, b"torn")
    flip_a_byte(store, vs.marker_key)
    assert vs.repair_marker() == good  # the marker names the least recently written record now
    vs.prune(1)
    assert 1 in [r.version for r in vs.records()] and vs.fetch(good) == b"w1"


def test_prune_rereads_the_marker_before_deleting_a_blob(tmp_path: Path) -> None:
    store = HookedStore(tmp_path)
    vs = VersionedStore(store, "run", "policy", clock=Clock())
    old = publish(vs, 1, b"w1")
    for v in range(2, 6):
        publish(vs, v, f"w{v}".encode())

    def rollback_to_1() -> None:  # a rollback republishes version 1's blob while prune runs
        current = vs.read_marker()
        assert current is not None
        vs.publish(replace(old, version=6, extra={"rollback_of": 1}), current[1])

    store.before_delete[vs.history_key(1)] = rollback_to_1
    vs.prune(2)

    rec, data = vs.load_newer(None) or (None, b"")
    assert rec is not None and rec.version == 6 and data == b"w1"


def test_a_pinned_copy_survives_prune_of_the_old_blob(tmp_path: Path) -> None:
    store = HookedStore(tmp_path)
    vs = VersionedStore(store, "run", "policy", clock=Clock())
    old = publish(vs, 1, b"w1")
    for v in range(2, 6):
        publish(vs, v, f"w{v}".encode())
    pinned = vs.pin_copy(old)
    assert pinned.blob != old.blob and pinned.sha256 == old.sha256
    published: list[VersionRecord] = []

    def rollback_after_the_check() -> None:  # prune re-read the marker; the rollback lands right after
        current = vs.read_marker()
        assert current is not None
        rec = replace(pinned, version=6, extra={"rollback_of": 1})
        vs.publish(rec, current[1])
        published.append(rec)

    store.before_delete[old.blob] = rollback_after_the_check
    vs.prune(2)

    assert not store.exists(old.blob)  # the old key went, as prune decided before the rollback
    assert vs.fetch(published[0]) == b"w1"  # the republished version names its own copy
    with pytest.raises(BadPayload):
        vs.pin_copy(old)  # nothing left to copy: a clear error, not a dangling marker
    assert hashlib.sha256(b"w1").hexdigest() in pinned.blob
