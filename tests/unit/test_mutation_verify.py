"""services/admin/verify.py's checks at their edges (``make test-mutation``): how many offsets a problem names, the
single-offset explanation, where the retained part of a range begins, partition order, an unnamed partition that
never held a record, and the lines ``flywheel verify`` prints."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from services.admin.verify import (
    MAX_NAMED,
    PartitionReport,
    TopicView,
    _explain,
    _name,
    _offsets,
    _spans,
    check_ledger,
    check_run,
    check_topics,
    verify,
)
from services.trainer.ledger import OffsetLedger
from shared.digest import Digest, mix64
from shared.marker import VersionedStore, VersionRecord
from shared.settings import Settings, StoreSettings
from shared.store import LocalDirStore

MASK = (1 << 64) - 1


def ledger(n: int = 10, start: int = 0, partition: int = 0, dead: tuple[int, ...] = ()) -> dict[str, Any]:
    tp = TopicPartition("r.samples", partition)
    led = OffsetLedger()
    led.begin(tp, start)
    for off in range(start, start + n):
        assert led.consumed(tp, off)
        led.finished(tp, off, "dead" if off in dead else "trained")
    return led.state()[f"r.samples:{partition}"]


def test_offsets_and_names_are_bounded() -> None:
    assert _offsets([[2, 5], (7, 8)]) == [2, 3, 4, 7]
    assert MAX_NAMED == 20
    assert _name(list(range(20))) == ", ".join(str(o) for o in range(20))
    assert _name(list(range(21))) == ", ".join(str(o) for o in range(20)) + " (+1 more)"
    assert _spans([[0, 1]] * 20) == ", ".join(["[0, 1)"] * 20)
    assert _spans([[0, 1]] * 22) == ", ".join(["[0, 1)"] * 20) + " (+2 more)"


def test_explain_names_one_doubled_or_missing_offset() -> None:
    assert _explain(Digest(1, mix64(7)), 0, 10) == ": offset 7 doubled"
    assert _explain(Digest(-1, (-mix64(3)) & MASK), 0, 10) == ": offset 3 missing"
    assert _explain(Digest(1, mix64(12)), 0, 10) == ""  # outside the range
    assert _explain(Digest(2, 2 * mix64(1)), 0, 10) == ""
    assert _explain(Digest(0, 5), 0, 10) == ""
    assert _explain(Digest(1, mix64(9)), 0, 10) == ": offset 9 doubled"  # the last offset of [0, 10)
    assert _explain(Digest(1, mix64(0)), 0, 10) == ": offset 0 doubled"


def test_a_late_start_names_the_offsets_without_an_outcome() -> None:
    rep = check_ledger("r.samples:0", ledger(start=4), origin=0)
    assert rep.problems == ["the ledger starts at offset 4, not at the run's origin 0: offsets [0, 4) have no "
                            "outcome in this model"]
    rep = check_ledger("r.samples:0", ledger(start=0), origin=3)
    assert "offsets [0, 3) have no outcome" in rep.problems[0]
    assert check_ledger("r.samples:0", ledger(start=4), origin=None).ok
    assert check_ledger("r.samples:0", ledger(start=4), origin=4).ok


def test_counts_and_outcomes_outside_the_range() -> None:
    part = ledger(n=10, dead=(3,))
    rep = check_ledger("r.samples:0", part)
    assert rep.ok and rep.counts == {"trained": 9, "dropped": 0, "dead": 1, "gap": 0, "lost": 0}
    assert (rep.start, rep.end) == (0, 10)
    bad = copy.deepcopy(part)
    bad["end"] = 9  # offset 9 has an outcome beyond the end
    rep = check_ledger("r.samples:0", bad)
    assert "outcomes outside [0, 9): 9" in rep.problems
    assert rep.problems == ["outcomes outside [0, 9): 9",
                            "outcome digest != closed form of [0, 9): 10 outcomes for 9 offsets"]


def test_a_lost_range_is_counted_in_records() -> None:
    part = ledger(n=4)
    part["ranges"]["lost"] = [[4, 6], [8, 9]]
    rep = check_ledger("r.samples:0", part)
    assert "lost before training (left the log untrained): 3 record(s) at [4, 6), [8, 9)" in rep.problems


def test_a_digest_that_disagrees_with_its_ranges_says_both_counts() -> None:
    part = ledger(n=5)
    part["digests"]["trained"] = Digest(4, 0).to_json()
    rep = check_ledger("r.samples:0", part)
    assert "trained: digest (count 4) disagrees with its ranges (count 5)" in rep.problems


def view(present: set[int], log_start: int = 0, end: int = 10, dlq: set[int] | None = None,
         partitions: int = 1) -> TopicView:
    return TopicView(partitions=set(range(partitions)), log_start={n: log_start for n in range(partitions)},
                     log_end={n: end for n in range(partitions)}, present={0: present},
                     dlq_sources={0: dlq or set()})


def test_only_offsets_from_the_log_start_on_must_be_on_the_log() -> None:
    part = ledger(n=10, dead=(2,))
    rep = PartitionReport("r.samples:0", 0, 10)
    check_topics(rep, part, present=set(range(3, 10)), dlq_sources={2}, log_start=3)
    assert rep.ok and rep.counts == {"below_log_start": 3}
    rep = PartitionReport("r.samples:0", 0, 10)
    check_topics(rep, part, present=set(range(4, 10)), dlq_sources={2}, log_start=3)
    assert rep.problems == ["outcome recorded for offsets the log does not hold: 3"]
    rep = PartitionReport("r.samples:0", 0, 10)
    check_topics(rep, part, present=set(range(10)), dlq_sources=set(), log_start=0)
    assert rep.problems == ["dead-lettered per the ledger but not on the DLQ: 2"]
    assert "below_log_start" not in rep.counts


def test_a_log_start_past_the_end_counts_only_the_range() -> None:
    rep = PartitionReport("r.samples:0", 2, 10)
    check_topics(rep, ledger(n=8, start=2), present=set(), dlq_sources=set(), log_start=50)
    assert rep.ok and rep.counts == {"below_log_start": 8}
    rep = PartitionReport("r.samples:0", 2, 10)
    check_topics(rep, ledger(n=8, start=2), present=set(range(2, 10)), dlq_sources=set(), log_start=2)
    assert rep.ok and rep.counts == {}


def test_a_gap_below_the_log_start_is_not_checked_and_one_at_it_is() -> None:
    led = OffsetLedger()
    tp = TopicPartition("r.samples", 0)
    led.begin(tp, 0)
    led.seeked(tp, 3)  # gap [0, 3)
    part = led.state()["r.samples:0"]
    rep = PartitionReport("r.samples:0", 0, 3)
    check_topics(rep, part, present={0, 1, 2}, dlq_sources=set(), log_start=2)
    assert rep.problems == ["recorded as gaps but the log holds records there: 2"]


def test_reports_come_in_partition_order() -> None:
    parts = {f"r.samples:{n}": ledger(partition=n) for n in (10, 9, 2)}
    assert list(check_run(parts, "r.samples", 0, None)) == ["r.samples:2", "r.samples:9", "r.samples:10"]


def test_an_unnamed_partition_that_never_held_a_record_needs_no_report() -> None:
    parts = {"r.samples:0": ledger()}
    v = view(set(range(10)), partitions=3)
    v.log_end = {0: 10, 1: 0, 2: 1}
    v.log_start = {0: 0, 1: 0, 2: 1}
    reports = check_run(parts, "r.samples", 0, v)
    assert set(reports) == {"r.samples:0", "r.samples:2"}
    assert reports["r.samples:2"].problems == [
        "not in the checkpoint's ledger, but the log has offsets [0, 1) (log start 1): their outcome in this model "
        "is unknown"]


def test_a_partition_the_topic_lacks() -> None:
    reports = check_run({"r.samples:1": ledger(partition=1)}, "r.samples", 0, view(set(range(10))))
    assert "the topic has no partition 1" in reports["r.samples:1"].problems


def _checkpoint(store: VersionedStore, step: int, parts: dict[str, Any], **extra: Any) -> None:
    data = f"weights {step}".encode()
    key, _ = store.put_blob(data, f"{store.prefix}/{step}/x.pt")
    current = store.read_marker()
    store.publish(VersionRecord(version=step, blob=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                                trainer_step=step, extra={"ledger": parts, "policy_version": step + 100, **extra}),
                  None if current is None else current[1])


def test_the_lines_verify_prints(tmp_path: Path) -> None:
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    empty = ledger(n=0, partition=1)
    _checkpoint(store, 1, {"r.samples:0": ledger(n=10, dead=(4,)), "r.samples:1": empty})
    code, lines = verify(Settings(run="r", store=StoreSettings(backend="local", local_root=tmp_path)), read_log=False)
    assert code == 0
    assert lines == [
        "checkpoint 1 (policy version 101, 2 partition(s) in its ledger)",
        f"  checkpoint record and blob: ok (run r, signing is off: not signed, sha256 "
        f"{hashlib.sha256(b'weights 1').hexdigest()[:12]}..)",
        "  (--no-log: the ledger alone; the topic's partitions and records are not read)",
        "  r.samples:0 [0, 10): ok (trained 9, dead 1)",
        "  r.samples:1 [0, 0): ok (empty)",
        "verify: ok: every offset exactly once (2 partition(s), each from the run's origin to the checkpoint's "
        "frontier; none lost before training)",
    ]
    bad = ledger(n=10)
    bad["ranges"]["trained"] = [[0, 9]]
    _checkpoint(store, 2, {"r.samples:0": bad})
    code, lines = verify(Settings(run="r", store=StoreSettings(backend="local", local_root=tmp_path)), read_log=False)
    assert code == 1 and lines[-1] == "verify: FAILED"
    assert "    - missing (no outcome): 9" in lines


def test_verify_checks_the_checkpoint_itself_its_run_signature_and_blob(tmp_path: Path) -> None:
    """Issue 43: a checkpoint of another run, one whose signed ledger was edited after signing, and one whose
    blob is gone each fail verify, whatever their ledgers say; a signed one of this run passes."""
    from shared.keyfile import read_private_key, read_public_keys
    from shared.settings import SigningSettings
    from shared.signing import KeyRing, Signer, generate_keys

    paths = generate_keys(tmp_path / "keys")
    signing = SigningSettings(enabled=True, keys_file=paths["public"])
    settings = Settings(run="r", store=StoreSettings(backend="local", local_root=tmp_path), signing=signing)
    signer = Signer("r", KeyRing(read_public_keys(paths["public"]), read_private_key(paths["trainer"])))
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    parts = {"r.samples:0": ledger(n=10)}

    def write(step: int, sign: bool = True, **extra: Any) -> VersionRecord:
        data = f"weights {step}".encode()
        key, _ = store.put_blob(data, f"{store.prefix}/{step}/x.pt")
        rec = VersionRecord(version=step, blob=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                            trainer_step=step, extra={"ledger": parts, "policy_version": step, **extra})
        rec = signer.sign_checkpoint(rec) if sign else rec
        current = store.read_marker()
        store.publish(rec, None if current is None else current[1])
        return rec

    rec = write(1)
    code, lines = verify(settings, read_log=False)
    assert code == 0 and f"signed by trainer key {rec.extra['signature']['key_id']}" in lines[1], lines
    write(2, sign=False, run="other")
    code, lines = verify(settings, read_log=False)
    assert code == 1 and "belongs to run 'other', not to this run 'r'" in lines[1], lines
    assert lines[-1] == "verify: FAILED (the checkpoint itself is not trusted)"
    tampered = write(3)
    forged = {**tampered.extra, "ledger": {"r.samples:0": ledger(n=11)}}
    store.publish(dataclasses.replace(tampered, version=4, extra=forged), store.read_marker()[1])  # type: ignore[index]
    code, lines = verify(settings, read_log=False)
    assert code == 1 and "REFUSED (bad_signature" in lines[1], lines
    gone = write(5)
    LocalDirStore(tmp_path).delete(gone.blob)
    code, lines = verify(settings, read_log=False)
    assert code == 1 and "checkpoint blob: FAILED" in lines[1], lines


def test_explain_says_nothing_when_the_counts_agree() -> None:
    """A swap (same count, other offsets) is not one doubled or missing offset, even when the hash difference
    happens to be one offset's hash."""
    assert _explain(Digest(0, (-mix64(4)) & MASK), 0, 10) == ""
    assert _explain(Digest(0, mix64(4)), 0, 10) == ""


def test_how_many_more_are_not_named() -> None:
    assert _name(list(range(45))).endswith(" (+25 more)")
    assert _spans([[0, 1]] * 45).endswith(" (+25 more)")


def test_explain_names_a_missing_offset_whose_hash_has_the_top_bit() -> None:
    o = next(o for o in range(100) if mix64(o) >= 1 << 63)
    assert _explain(Digest(-1, (-mix64(o)) & MASK), 0, 100) == f": offset {o} missing"


def test_a_log_start_below_the_range_counts_nothing_below_it() -> None:
    rep = PartitionReport("r.samples:0", 5, 10)
    check_topics(rep, ledger(n=5, start=5), present=set(range(5, 10)), dlq_sources=set(), log_start=0)
    assert rep.ok and rep.counts == {}


def test_reports_are_ordered_by_topic_then_partition() -> None:
    parts = {"z.other:0": ledger(), "a.other:1": ledger(partition=1)}
    assert list(check_run(parts, "r.samples", 0, None)) == ["a.other:1", "z.other:0"]


def test_a_ledger_entry_of_another_topic_does_not_stand_for_a_samples_partition() -> None:
    parts = {"r.samples:0": ledger(), "zz.other:1": ledger(partition=1)}
    v = view(set(range(10)), partitions=2)
    reports = check_run(parts, "r.samples", 0, v)
    assert "r.samples:1" in reports and "not in the checkpoint's ledger" in reports["r.samples:1"].problems[0]
    assert (reports["r.samples:1"].start, reports["r.samples:1"].end) == (0, 0)


def test_checkpoint_record_finds_large_steps(tmp_path: Path) -> None:
    from services.admin.verify import checkpoint_record

    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    _checkpoint(store, 1000, {})
    _checkpoint(store, 1001, {})
    assert checkpoint_record(store, 1000).version == 1000


def test_verify_reads_the_topics_unless_told_not_to(tmp_path: Path, monkeypatch: Any) -> None:
    import services.admin.verify as mod

    calls: list[Any] = []

    async def fake_read_topics(settings: Settings, parts: dict[str, Any]) -> TopicView:
        calls.append(sorted(parts))
        return view(set(range(10)))

    monkeypatch.setattr(mod, "read_topics", fake_read_topics)
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    _checkpoint(store, 1, {"r.samples:0": ledger()})
    code, lines = verify(Settings(run="r", store=StoreSettings(backend="local", local_root=tmp_path)))
    assert code == 0 and calls == [["r.samples:0"]]
    assert not any("--no-log" in line for line in lines)


def test_explain_says_nothing_for_two_surplus_entries() -> None:
    assert _explain(Digest(2, (-mix64(4)) & MASK), 0, 10) == ""
    assert _explain(Digest(-2, mix64(4)), 0, 10) == ""


def test_a_start_at_a_large_origin_is_the_origin() -> None:
    assert check_ledger("r.samples:0", ledger(n=5, start=_big(100_000)), origin=_big(100_000)).ok


def _big(n: int) -> int:
    return int(str(n))


def test_lost_records_are_counted_per_range() -> None:
    part = ledger(n=4)
    part["ranges"]["lost"] = [[5, 8]]
    rep = check_ledger("r.samples:0", part)
    assert "lost before training (left the log untrained): 3 record(s) at [5, 8)" in rep.problems


def test_every_outcome_past_the_end_is_named() -> None:
    part = ledger(n=10)
    part["end"] = 8
    rep = check_ledger("r.samples:0", part)
    assert "outcomes outside [0, 8): 8, 9" in rep.problems


def test_the_count_below_the_log_start_is_a_difference() -> None:
    rep = PartitionReport("r.samples:0", 3, 10)
    check_topics(rep, ledger(n=7, start=3), present=set(range(6, 10)), dlq_sources=set(), log_start=6)
    assert rep.ok and rep.counts == {"below_log_start": 3}


def test_entries_of_any_other_topic_are_flagged_and_never_stand_for_samples_partitions() -> None:
    for other in ("a.other", "zz.other"):
        parts = {"r.samples:0": ledger(), f"{other}:1": ledger(partition=1)}
        v = view(set(range(10)), partitions=2)
        reports = check_run(parts, "r.samples", 0, v)
        assert reports[f"{other}:1"].problems == ["not a partition of this run's samples topic r.samples"], other
        assert "r.samples:1" in reports, other


def test_a_partition_the_topic_lacks_has_no_count_below_a_log_start() -> None:
    reports = check_run({"r.samples:1": ledger(partition=1)}, "r.samples", 0, view(set(range(10))))
    assert reports["r.samples:1"].counts.get("below_log_start") is None
