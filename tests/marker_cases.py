"""Marker-protocol cases run against every ObjectStore: the local twin (unit) and real S3 (integration)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest

from shared.marker import MarkerConflict, StaleVersion, VersionedStore, VersionRecord
from shared.store import ObjectStore, PreconditionFailed


def record_for(vs: VersionedStore, version: int, data: bytes) -> VersionRecord:
    key, sha = vs.put_blob(data)
    return VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version * 10)


def publish_version(vs: VersionedStore, version: int, lineage: int = 0) -> VersionRecord:
    """Publish ``version`` as paramsync does a candidate (payload, history record, marker), in ``lineage``."""
    rec = record_for(vs, version, f"weights of version {version}".encode())
    if lineage:
        rec = replace(rec, extra={"lineage": lineage})
    vs.publish_next(rec)
    return rec


def conditional_writes(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/k"
    etag = store.put(key, b"one", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put(key, b"two", if_none_match=True)
    etag2 = store.put(key, b"three", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.put(key, b"four", if_match=etag)
    got = store.get(key)
    assert got is not None and got.data == b"three" and got.etag == etag2
    assert store.get(f"{prefix}/absent") is None


def publish_and_read(store: ObjectStore, run: str) -> None:
    vs = VersionedStore(store, run)
    assert vs.read_marker() is None
    assert vs.load_newer(None) is None
    vs.publish_next(record_for(vs, 0, b"weights-0"))
    vs.publish_next(record_for(vs, 1, b"weights-1"))
    rec, data = vs.load_newer(None) or (None, None)
    assert rec is not None and rec.version == 1 and data == b"weights-1"
    assert vs.load_newer(1) is None
    with pytest.raises(StaleVersion):
        vs.publish_next(record_for(vs, 1, b"weights-1b"))
    assert [r.version for r in vs.records()] == [0, 1]


def racing_writers_one_wins(store: ObjectStore, run: str) -> None:
    vs = VersionedStore(store, run)
    vs.publish_next(record_for(vs, 0, b"w0"))
    _, etag = vs.read_marker() or (None, "")
    records = [record_for(vs, 1, b"writer-a"), record_for(vs, 1, b"writer-b")]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def write(rec: VersionRecord) -> None:
        barrier.wait()
        try:
            vs.publish(rec, etag)
            outcomes.append("won")
        except MarkerConflict as exc:
            assert "moved before version 1" in str(exc)
            outcomes.append("conflict")

    threads = [threading.Thread(target=write, args=(r,)) for r in records]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict", "won"]
    rec, data = vs.load_newer(0) or (None, b"")
    assert rec is not None and rec.version == 1 and data in (b"writer-a", b"writer-b")
    assert rec.sha256 == next(r.sha256 for r in records if r.blob == rec.blob)


def corrupt_or_missing_payload_keeps_previous(store: ObjectStore, run: str, caplog_text: Callable[[], str]) -> None:
    vs = VersionedStore(store, run)
    vs.publish_next(record_for(vs, 0, b"good-0"))
    rec0, data0 = vs.load_newer(None) or (None, b"")
    assert rec0 is not None and data0 == b"good-0"
    # Version 1: its payload is overwritten with other bytes after publishing (corrupt).
    rec1 = record_for(vs, 1, b"good-1")
    vs.publish_next(rec1)
    store.put(rec1.blob, b"tampered!")
    assert vs.load_newer(0) is None
    # Version 2: its payload is deleted (missing).
    rec2 = record_for(vs, 2, b"good-2")
    vs.publish_next(rec2)
    store.delete(rec2.blob)
    assert vs.load_newer(0) is None
    text = caplog_text()
    assert "is corrupt" in text and "is missing" in text and "keeping_version" in text


def prune_keeps_newest(store: ObjectStore, run: str) -> None:
    vs = VersionedStore(store, run)
    for v in range(5):
        vs.publish_next(record_for(vs, v, f"w{v}".encode()))
    assert vs.prune(2) == [0, 1, 2]
    assert [r.version for r in vs.records()] == [3, 4]
    assert not store.exists(vs.blob_key(hashlib.sha256(b"w0").hexdigest()))
    assert store.exists(vs.blob_key(hashlib.sha256(b"w3").hexdigest()))
    rec, data = vs.load_newer(None) or (None, b"")
    assert rec is not None and rec.version == 4 and data == b"w4"
