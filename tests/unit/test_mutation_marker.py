"""shared/marker.py at its edges (``make test-mutation``): record round trips and recency, the repair bound, the
payload checks, the newer-than rule, pins at their expiry, pinned copies and prune's ``keep``. The local-directory
store, with a clock the test sets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from shared.marker import (
    REPAIR_ATTEMPTS,
    BadMarker,
    BadPayload,
    MarkerConflict,
    StaleVersion,
    VersionedStore,
    VersionRecord,
)
from shared.store import LocalDirStore, StoredObject

RUN = "r"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> LocalDirStore:
    return LocalDirStore(tmp_path / "store")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def vs(store: LocalDirStore, clock: Clock) -> VersionedStore:
    return VersionedStore(store, RUN, "policy", clock=clock)


def put(vs: VersionedStore, version: int, data: bytes | None = None) -> VersionRecord:
    data = data if data is not None else f"payload {version}".encode()
    key, sha = vs.put_blob(data)
    return VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version * 10)


def publish(vs: VersionedStore, version: int, data: bytes | None = None) -> VersionRecord:
    rec = put(vs, version, data)
    vs.publish_next(rec)
    return rec


def test_keys_under_the_run_and_kind(vs: VersionedStore) -> None:
    assert vs.prefix == "r/policy" and vs.marker_key == "r/policy/LATEST"
    assert vs.blob_key("ab") == "r/policy/blobs/ab.safetensors"
    assert vs.history_key(7) == "r/policy/versions/7.json"
    assert VersionedStore(vs.store, RUN).kind == "policy"


def test_put_blob_is_content_addressed_and_idempotent(vs: VersionedStore, store: LocalDirStore) -> None:
    key, sha = vs.put_blob(b"abc")
    assert sha == hashlib.sha256(b"abc").hexdigest() and key == vs.blob_key(sha)
    assert vs.put_blob(b"abc") == (key, sha)
    assert vs.put_blob(b"xyz", key="r/policy/blobs/mine") == ("r/policy/blobs/mine", hashlib.sha256(b"xyz").hexdigest())
    obj = store.get("r/policy/blobs/mine")
    assert obj is not None and obj.data == b"xyz"
    store.put(key, b"changed")
    vs.put_blob(b"abc")  # present: not written again
    assert store.get(key) == StoredObject(b"changed", LocalDirStore._etag(b"changed"))


def test_record_json_round_trip_keeps_every_field() -> None:
    rec = VersionRecord(version=3, blob="b", sha256="s", size=9, trainer_step=30, created_at=5.5,
                        extra={"lineage": "x"}, written_at=7.25)
    back = VersionRecord.from_json(rec.to_json())
    assert back == rec and back.written_at == 7.25 and back.extra == {"lineage": "x"}
    raw = json.loads(rec.to_json())
    del raw["written_at"], raw["extra"]
    old = VersionRecord.from_json(json.dumps(raw).encode())
    assert old.written_at is None and old.extra == {}


def test_records_with_a_write_time_are_newer_than_those_without_whatever_the_clock() -> None:
    old_format = VersionRecord(version=9, blob="b", sha256="s", size=1, trainer_step=1)
    at_zero = VersionRecord(version=1, blob="b", sha256="s", size=1, trainer_step=1, written_at=0.0)
    before_epoch = VersionRecord(version=2, blob="b", sha256="s", size=1, trainer_step=1, written_at=-1.5)
    ordered = sorted([at_zero, old_format, before_epoch], key=VersionRecord.recency)
    assert [r.version for r in ordered] == [9, 2, 1]
    assert old_format.recency() == (0, 0.0, 9) and at_zero.recency() == (1, 0.0, 1)
    older = VersionRecord(version=3, blob="b", sha256="s", size=1, trainer_step=1)
    assert sorted([old_format, older], key=VersionRecord.recency) == [older, old_format]


def test_publish_stamps_written_at_and_keeps_the_history(vs: VersionedStore, clock: Clock) -> None:
    clock.now = 1234.5
    rec = publish(vs, 1)
    current = vs.read_marker()
    assert current is not None and current[0] == rec and current[0].written_at == 1234.5
    assert [r.version for r in vs.records()] == [1]
    assert vs.records()[0].written_at == 1234.5


def test_publish_next_refuses_the_same_or_an_older_version(vs: VersionedStore) -> None:
    publish(vs, 5)
    for v in (5, 4):
        with pytest.raises(StaleVersion, match=f"version {v} is not newer than published 5"):
            vs.publish_next(put(vs, v))
    publish(vs, 6)
    current = vs.read_marker()
    assert current is not None and current[0].version == 6


def test_publish_with_a_stale_etag_conflicts(vs: VersionedStore) -> None:
    publish(vs, 1)
    current = vs.read_marker()
    assert current is not None
    publish(vs, 2)
    with pytest.raises(MarkerConflict, match="moved before version 3"):
        vs.publish(put(vs, 3), current[1])
    with pytest.raises(MarkerConflict):
        vs.publish(put(vs, 3), None)  # "first" while one exists


def test_fetch_checks_sha_and_size(vs: VersionedStore, store: LocalDirStore) -> None:
    rec = publish(vs, 1, b"0123456789")
    assert vs.fetch(rec) == b"0123456789"
    from dataclasses import replace

    with pytest.raises(BadPayload, match="size 10, want"):
        vs.fetch(replace(rec, size=11))
    with pytest.raises(BadPayload, match="corrupt"):
        vs.fetch(replace(rec, sha256="0" * 64))
    store.delete(rec.blob)
    with pytest.raises(BadPayload, match="is missing"):
        vs.fetch(rec)


def test_load_newer_only_when_strictly_newer(vs: VersionedStore) -> None:
    assert vs.load_newer(None) is None
    publish(vs, 3, b"three")
    got = vs.load_newer(None)
    assert got is not None and got[0].version == 3 and got[1] == b"three"
    assert vs.load_newer(3) is None
    assert vs.load_newer(4) is None
    got = vs.load_newer(2)
    assert got is not None and got[1] == b"three"


def test_load_newer_keeps_what_it_has_on_a_bad_payload(vs: VersionedStore, store: LocalDirStore) -> None:
    rec = publish(vs, 1)
    store.put(rec.blob, b"tampered")
    assert vs.load_newer(None) is None


class CorruptingStore(LocalDirStore):
    """Every marker write lands corrupt: no repair ever sticks."""

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        if key.endswith("/LATEST"):
            data = b"{torn"
        return super().put(key, data, if_none_match=if_none_match, if_match=if_match)


def test_read_marker_gives_up_after_the_repair_bound(tmp_path: Path) -> None:
    store = CorruptingStore(tmp_path / "s")
    vs = VersionedStore(store, RUN, "policy")
    repairs: list[Any] = []
    vs.on_repair = lambda rec, why: repairs.append(rec.version)
    publish_store = VersionedStore(LocalDirStore(tmp_path / "s"), RUN, "policy")
    rec = put(publish_store, 1)
    publish_store.publish(rec, None)
    publish_store.store.put(vs.marker_key, b"{torn")
    assert REPAIR_ATTEMPTS == 5
    with pytest.raises(BadMarker, match="stayed unreadable through 5 repairs"):
        vs.read_marker()
    assert repairs == [1] * 5
    with pytest.raises(BadMarker, match="is unreadable"):
        vs.read_marker(repair=False)


def test_repair_marker_leaves_a_readable_or_absent_marker_alone(vs: VersionedStore) -> None:
    assert vs.repair_marker() is None
    publish(vs, 1)
    before = vs.store.get(vs.marker_key)
    assert vs.repair_marker() is None
    assert vs.store.get(vs.marker_key) == before


def test_a_failing_repair_hook_does_not_undo_the_repair(vs: VersionedStore, store: LocalDirStore) -> None:
    publish(vs, 1)
    publish(vs, 2)
    store.put(vs.marker_key, b"not json")

    def hook(rec: VersionRecord, why: str) -> None:
        raise RuntimeError("audit down")

    vs.on_repair = hook
    rec = vs.repair_marker()
    assert rec is not None and rec.version == 2
    current = vs.read_marker(repair=False)
    assert current is not None and current[0].version == 2


def test_pin_lasts_its_ttl_exclusive(vs: VersionedStore, clock: Clock) -> None:
    vs.pin(4, "t", ttl_s=10.0)
    body = json.loads(vs.store.get("r/policy/pins/4.json").data)  # type: ignore[union-attr]
    assert body == {"version": 4, "holder": "t", "until": 1010.0}
    clock.now = 1009.9
    assert vs.pinned() == {4}
    clock.now = 1010.0
    assert vs.pinned() == set()
    vs.pin(4, "t", ttl_s=10.0)  # renewed
    assert vs.pinned() == {4}
    vs.unpin(4)
    assert vs.pinned() == set()


def test_unreadable_pins_are_ignored(vs: VersionedStore) -> None:
    vs.store.put("r/policy/pins/1.json", b"junk")
    vs.store.put("r/policy/pins/2.json", b'{"version": 2}')
    vs.pin(3, "t", ttl_s=60.0)
    assert vs.pinned() == {3}


def test_pin_copy_names_a_fresh_key_with_the_same_payload(vs: VersionedStore) -> None:
    rec = publish(vs, 1, b"weights")
    copy = vs.pin_copy(rec)
    prefix = f"r/policy/blobs/{rec.sha256}.pin-"
    assert copy.blob.startswith(prefix) and copy.blob.endswith(".safetensors")
    assert len(copy.blob) == len(prefix) + 12 + len(".safetensors")
    assert copy.written_at is None and copy.version == rec.version and copy.sha256 == rec.sha256
    assert vs.fetch(copy) == b"weights"
    assert vs.pin_copy(rec).blob != copy.blob


def test_prune_keeps_the_newest_written(vs: VersionedStore, clock: Clock) -> None:
    for v in range(1, 6):
        clock.now += 1
        publish(vs, v)
    assert vs.prune(keep=2) == [1, 2, 3]
    assert [r.version for r in vs.records()] == [4, 5]
    assert vs.prune(keep=2) == []


def test_prune_to_zero_keeps_only_the_marker_record(vs: VersionedStore, clock: Clock) -> None:
    for v in range(1, 4):
        clock.now += 1
        publish(vs, v)
    assert vs.prune(keep=0) == [1, 2]
    assert [r.version for r in vs.records()] == [3]
    current = vs.read_marker()
    assert current is not None and vs.fetch(current[0])


def test_records_skip_a_damaged_one(vs: VersionedStore) -> None:
    publish(vs, 1)
    publish(vs, 2)
    vs.store.put(vs.history_key(1), b"{")
    assert [r.version for r in vs.records()] == [2]


def test_load_latest_good_with_nothing_usable_names_the_refusals(vs: VersionedStore, store: LocalDirStore) -> None:
    rec = publish(vs, 1)
    store.delete(rec.blob)
    with pytest.raises(BadPayload, match="no usable version under r/policy"):
        vs.load_latest_good()


def test_a_long_unreadable_reason_is_cut_to_300_characters(vs: VersionedStore, store: LocalDirStore) -> None:
    publish(vs, 1)
    store.put(vs.marker_key, json.dumps({"version": 1, "blob": "b", "sha256": "s", "size": 1, "trainer_step": 1,
                                         "created_at": "x" * 1000}).encode())  # float() names the whole value
    reasons: list[str] = []
    vs.on_repair = lambda rec, why: reasons.append(why)
    assert vs.repair_marker() is not None
    assert len(reasons[0]) == 300 and reasons[0].startswith("marker r/policy/LATEST is unreadable: ")


def test_a_corrupt_payload_is_named_by_both_hash_prefixes(vs: VersionedStore, store: LocalDirStore) -> None:
    rec = publish(vs, 1, b"0123456789")
    store.put(rec.blob, b"abc")
    sha = hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(BadPayload) as err:
        vs.fetch(rec)
    assert str(err.value) == (f"payload {rec.blob} of version 1 is corrupt: sha256 {sha[:12]}.. size 3, "
                              f"want {rec.sha256[:12]}.. size 10")


def test_no_history_behind_an_unreadable_marker_is_bad_payload(vs: VersionedStore, store: LocalDirStore) -> None:
    store.put(vs.marker_key, b"{torn")
    with pytest.raises(BadPayload, match=r"^no usable version under r/policy: marker r/policy/LATEST is unreadable"):
        vs.load_latest_good()


def test_refusals_are_cut_in_the_final_error(vs: VersionedStore, clock: Clock) -> None:
    for v in range(1, 8):
        clock.now += 1
        publish(vs, v)

    def refuse(data: bytes) -> None:
        raise ValueError("y" * 500)

    with pytest.raises(BadPayload) as err:
        vs.load_latest_good(refuse)
    msg = str(err.value)
    head = "no usable version under r/policy: "
    assert msg.startswith(head + "version 7 refused: ValueError: yyy") and len(msg) == len(head) + 1000
    first = msg[len(head):].split("; ")[0]
    assert len(first) == 300


def test_a_repair_with_no_intact_history_cuts_the_refusals(vs: VersionedStore, store: LocalDirStore,
                                                           clock: Clock) -> None:
    for v in range(1, 12):
        clock.now += 1
        rec = publish(vs, v, f"payload {v}".encode() * 3)
        store.put(rec.blob, b"gone bad")
    store.put(vs.marker_key, b"{torn")
    with pytest.raises(BadMarker) as err:
        vs.repair_marker()
    msg = str(err.value)
    tail = msg.split("no history record under r/policy/versions/ is readable with an intact payload: ", 1)[1]
    assert len(tail) == 700


def test_prune_to_zero_keeps_a_pinned_version(vs: VersionedStore, clock: Clock) -> None:
    for v in range(1, 4):
        clock.now += 1
        publish(vs, v)
    vs.pin(1, "t", ttl_s=60.0)
    assert vs.prune(keep=0) == [2]
    assert [r.version for r in vs.records()] == [1, 3]


def test_an_unreadable_history_record_is_logged_with_a_cut_reason(vs: VersionedStore, store: LocalDirStore) -> None:
    import io

    from shared.logging import configure_logging

    buf = io.StringIO()
    configure_logging("test", "run", stream=buf)
    vs = VersionedStore(store, RUN, "policy")  # its logger after the logging is set up
    store.put(vs.history_key(3), json.dumps({"version": 3, "blob": "b", "sha256": "s", "size": 1, "trainer_step": 1,
                                             "created_at": "z" * 1000}).encode())
    assert vs.records() == []
    line = next(json.loads(x) for x in buf.getvalue().splitlines() if "history_record_unreadable" in x)
    assert line["key"] == vs.history_key(3) and len(line["reason"]) == 200


def _logs() -> Any:
    import io

    from shared.logging import configure_logging

    buf = io.StringIO()
    configure_logging("test", "run", stream=buf)
    return buf


def _logged(buf: Any, event: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in buf.getvalue().splitlines() if f'"{event}"' in x]


def test_the_options_are_keyword_only(store: LocalDirStore) -> None:
    with pytest.raises(TypeError):
        VersionedStore(store, RUN, "policy", None)  # type: ignore[misc]


def test_a_payload_of_any_size_fetches(vs: VersionedStore) -> None:
    data = bytes(range(256)) * 4
    rec = publish(vs, 1, data)
    assert vs.fetch(rec) == data


def test_read_marker_hands_the_repair_a_cut_reason(vs: VersionedStore, store: LocalDirStore) -> None:
    publish(vs, 1)
    store.put(vs.marker_key, json.dumps({"version": 1, "blob": "b", "sha256": "s", "size": 1, "trainer_step": 1,
                                         "created_at": "x" * 1000}).encode())
    reasons: list[str] = []
    vs.on_repair = lambda rec, why: reasons.append(why)
    current = vs.read_marker()
    assert current is not None and current[0].version == 1
    assert len(reasons) == 1 and len(reasons[0]) == 300


def test_repair_logs_what_it_skipped_and_a_failing_hook(store: LocalDirStore, clock: Clock) -> None:
    buf = _logs()
    vs = VersionedStore(store, RUN, "policy", clock=clock)
    publish(vs, 1)
    clock.now += 1
    bad = publish(vs, 2)
    store.put(bad.blob, b"torn")
    store.put(vs.marker_key, b"{torn")

    def hook(rec: VersionRecord, why: str) -> None:
        raise RuntimeError("e" * 1000)

    vs.on_repair = hook
    rec = vs.repair_marker()
    assert rec is not None and rec.version == 1
    (repaired,) = _logged(buf, "marker_repaired")
    assert repaired["version"] == 1 and len(repaired["skipped"]) == 1 and "version 2" in repaired["skipped"][0]
    (failed,) = _logged(buf, "marker_repair_report_failed")
    assert len(failed["error"]) == 300 and failed["error"].startswith("RuntimeError: eee")


def test_a_fallback_is_logged_with_the_refusals(store: LocalDirStore, clock: Clock) -> None:
    buf = _logs()
    vs = VersionedStore(store, RUN, "policy", clock=clock)
    publish(vs, 1)
    clock.now += 1
    bad = publish(vs, 2)
    store.put(bad.blob, b"torn")
    got = vs.load_latest_good()
    assert got is not None and got[0].version == 1 and len(got[2]) == 1
    (line,) = _logged(buf, "fell_back_to_older_version")
    assert line["version"] == 1 and len(line["refused"]) == 1
    buf2 = _logs()
    vs2 = VersionedStore(store, "other", "policy", clock=clock)
    publish(vs2, 1)
    assert vs2.load_latest_good() is not None
    assert _logged(buf2, "fell_back_to_older_version") == []


class PhantomList(LocalDirStore):
    """Lists a history record (and a pin) that is gone by the time it is read (deleted in between)."""

    def list(self, prefix: str) -> list[str]:
        return sorted(super().list(prefix) + [f"{prefix}0.json"])


def test_records_skip_one_deleted_since_the_listing(tmp_path: Path) -> None:
    vs = VersionedStore(PhantomList(tmp_path / "s"), RUN, "policy")
    publish(vs, 1)
    publish(vs, 2)
    assert [r.version for r in vs.records()] == [1, 2]


def _five(vs: VersionedStore, clock: Clock) -> list[VersionRecord]:
    out = []
    for v in range(1, 6):
        clock.now += 1
        out.append(publish(vs, v))
    return out


def test_prune_goes_on_past_the_marker_record(vs: VersionedStore, store: LocalDirStore, clock: Clock) -> None:
    recs = _five(vs, clock)
    store.put(vs.marker_key, recs[0].to_json())  # the marker names version 1 (its record is the oldest)
    assert vs.prune(keep=1) == [2, 3, 4]
    assert [r.version for r in vs.records()] == [1, 5]
    assert not store.exists(recs[1].blob) and store.exists(recs[0].blob)


def test_prune_goes_on_past_a_blob_the_marker_names(vs: VersionedStore, store: LocalDirStore, clock: Clock) -> None:
    from dataclasses import replace

    recs = _five(vs, clock)
    store.put(vs.marker_key, replace(recs[0], version=9).to_json())  # a rollback republished version 1's payload
    assert vs.prune(keep=1) == [1, 2, 3, 4]
    assert store.exists(recs[0].blob)
    assert not any(store.exists(r.blob) for r in recs[1:4])


def test_a_negative_keep_keeps_nothing_but_the_marker_record(vs: VersionedStore, clock: Clock) -> None:
    _five(vs, clock)
    assert vs.prune(keep=-1) == [1, 2, 3, 4]
    assert [r.version for r in vs.records()] == [5]


def test_pins_skip_one_deleted_since_the_listing(tmp_path: Path) -> None:
    vs = VersionedStore(PhantomList(tmp_path / "s"), RUN, "policy")
    vs.pin(3, "t", ttl_s=60.0)
    assert vs.pinned() == {3}


def test_records_are_values_that_cannot_be_altered() -> None:
    import dataclasses

    a = VersionRecord(version=1, blob="b", sha256="s", size=1, trainer_step=1, created_at=1.0)
    b = VersionRecord(version=1, blob="b", sha256="s", size=1, trainer_step=1, created_at=1.0, written_at=5.0)
    assert a == b  # written_at is not part of the value
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.version = 2  # type: ignore[misc]


def test_fetch_refuses_any_other_hash_or_size(vs: VersionedStore) -> None:
    from dataclasses import replace

    rec = publish(vs, 1, b"0123456789")
    for bad in (replace(rec, sha256="f" * 64), replace(rec, sha256="0" * 64), replace(rec, size=9),
                replace(rec, size=11)):
        with pytest.raises(BadPayload, match="corrupt"):
            vs.fetch(bad)


def test_prune_to_zero_keeps_a_pinned_version_that_is_not_the_oldest(vs: VersionedStore, clock: Clock) -> None:
    for v in range(1, 4):
        clock.now += 1
        publish(vs, v)
    vs.pin(2, "t", ttl_s=60.0)
    assert vs.prune(keep=0) == [1]
    assert [r.version for r in vs.records()] == [2, 3]


def test_prune_knows_the_marker_record_by_value_at_large_versions(vs: VersionedStore, store: LocalDirStore,
                                                                  clock: Clock) -> None:
    recs = []
    for v in range(1000, 1004):
        clock.now += 1
        recs.append(publish(vs, v))
    store.put(vs.marker_key, recs[0].to_json())  # the marker names version 1000, the oldest record
    assert vs.prune(keep=1) == [1001, 1002]
    assert [r.version for r in vs.records()] == [1000, 1003]
