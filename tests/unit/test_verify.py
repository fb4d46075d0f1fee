"""``flywheel verify``'s checks on crafted ledgers and topic views (pure), and on checkpoints in a local store;
tests/integration/test_verify_topics.py reads a real broker's topics, the fault suite runs it on the real stack."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from services.admin.verify import TopicView, check_ledger, check_run, check_topics, checkpoint_record, verify
from services.trainer.ledger import OffsetLedger
from shared.digest import Digest, mix64
from shared.marker import VersionedStore, VersionRecord
from shared.settings import Settings, StoreSettings
from shared.store import LocalDirStore

TP = TopicPartition("r.samples", 0)


def ledger() -> dict[str, Any]:
    led = OffsetLedger()
    for off in range(40):
        assert led.consumed(TP, off)
        led.finished(TP, off, "dead" if off == 7 else ("dropped" if off in (11, 12) else "trained"))
    return led.state()["r.samples:0"]


def test_an_honest_ledger_checks() -> None:
    rep = check_ledger("r.samples:0", ledger())
    assert rep.ok, rep.problems
    assert rep.counts == {"trained": 37, "dropped": 2, "dead": 1, "gap": 0, "lost": 0}


def test_a_range_that_claims_more_than_its_outcomes_names_the_missing_offsets() -> None:
    part = ledger()
    part["end"] = 45  # the checkpoint claims five offsets it has no outcome for
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert any("missing (no outcome): 40, 41, 42, 43, 44" in p for p in rep.problems), rep.problems


def test_a_doubled_offset_is_named_from_the_digest() -> None:
    part = copy.deepcopy(ledger())
    d = Digest.from_json(part["digests"]["trained"])
    d.add(20)  # one record trained twice, the ranges unchanged
    part["digests"]["trained"] = d.to_json()
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert any("offset 20 doubled" in p for p in rep.problems), rep.problems


def test_a_swapped_offset_is_caught_though_the_count_matches() -> None:
    part = copy.deepcopy(ledger())
    d = Digest.from_json(part["digests"]["trained"])
    d.hash = (d.hash - mix64(30) + mix64(7)) & ((1 << 64) - 1)  # 30 missing, 7 (dead-lettered) trained too
    part["digests"]["trained"] = d.to_json()
    assert not check_ledger("r.samples:0", part).ok


def test_the_topics_must_agree() -> None:
    part = ledger()
    rep = check_ledger("r.samples:0", part)
    check_topics(rep, part, present=set(range(40)), dlq_sources={7}, log_start=0)
    assert rep.ok, rep.problems
    rep = check_ledger("r.samples:0", part)
    check_topics(rep, part, present=set(range(40)) - {5}, dlq_sources=set(), log_start=0)
    assert any("not on the DLQ: 7" in p for p in rep.problems)
    assert any("does not hold: 5" in p for p in rep.problems)


# ---- the whole run: every partition, from the origin, nothing lost (check_run) ------------------------
def view(partitions: int = 1, present: set[int] | None = None, log_start: int = 0, end: int = 40,
         dlq: set[int] | None = None) -> TopicView:
    return TopicView(partitions=set(range(partitions)), log_start={n: log_start for n in range(partitions)},
                     log_end={n: end for n in range(partitions)},
                     present={0: set(range(log_start, 40)) if present is None else present},
                     dlq_sources={0: {7} if dlq is None else dlq})


def test_an_honest_run_checks_against_the_topics() -> None:
    reports = check_run({"r.samples:0": ledger()}, "r.samples", 0, view())
    assert [r.ok for r in reports.values()] == [True], [r.problems for r in reports.values()]


def test_a_partition_the_ledger_does_not_name_fails_when_its_log_has_records() -> None:
    # A lost rank ledger, or a partition added to the topic: the model's outcome for its records is unknown.
    reports = check_run({"r.samples:0": ledger()}, "r.samples", 0, view(partitions=3, end=5))
    assert set(reports) == {"r.samples:0", "r.samples:1", "r.samples:2"}
    assert reports["r.samples:0"].ok
    for key in ("r.samples:1", "r.samples:2"):
        assert not reports[key].ok
        assert "not in the checkpoint's ledger, but the log has offsets [0, 5)" in reports[key].problems[0]


def test_an_empty_partition_the_ledger_does_not_name_has_nothing_to_prove() -> None:
    reports = check_run({"r.samples:0": ledger()}, "r.samples", 0, view(partitions=2, end=0))
    assert set(reports) == {"r.samples:0"}


def test_a_range_that_starts_late_fails_as_offsets_without_an_outcome() -> None:
    # A ledger covering one partition from offset 1000 used to verify as "every offset exactly once".
    led = OffsetLedger()
    for off in range(1000, 1010):
        assert led.consumed(TP, off)
        led.finished(TP, off, "trained")
    part = led.state()["r.samples:0"]
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert rep.problems == ["the ledger starts at offset 1000, not at the run's origin 0: offsets [0, 1000) have "
                            "no outcome in this model"]
    # After a deliberate fresh start the range is proven from where the new model began (origin None).
    assert check_ledger("r.samples:0", part, origin=None).ok


def test_tampered_ranges_with_intact_digests_fail() -> None:
    part = copy.deepcopy(ledger())
    part["ranges"]["trained"] = [[0, 7], [8, 11], [13, 41]]  # claims 40 trained too; digests untouched
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert any(p.startswith("trained: digest (count 37) disagrees with its ranges (count 38)") for p in rep.problems)
    assert any("outcomes outside [0, 40): 40" in p for p in rep.problems)


def test_moved_ranges_with_intact_counts_fail_on_the_hash() -> None:
    part = copy.deepcopy(ledger())
    part["ranges"]["dead"] = [[8, 9]]  # dead-letter 8 instead of 7: counts agree, offsets do not
    part["ranges"]["trained"] = [[0, 8], [9, 11], [13, 40]]
    rep = check_ledger("r.samples:0", part)
    assert any(p.startswith("trained: digest") for p in rep.problems)
    assert any(p.startswith("dead: digest") for p in rep.problems)


def test_a_gap_the_log_holds_fails() -> None:
    led = OffsetLedger()
    led.begin(TP, 0)
    for off in (0, 1, 4):  # 2 and 3 skipped: folded as gaps
        assert led.consumed(TP, off)
        led.finished(TP, off, "trained")
    part = led.state()["r.samples:0"]
    assert part["ranges"]["gap"] == [[2, 4]]
    rep = check_ledger("r.samples:0", part)
    assert rep.ok, rep.problems
    check_topics(rep, part, present={0, 1, 3, 4}, dlq_sources=set(), log_start=0)
    assert rep.problems == ["recorded as gaps but the log holds records there: 3"]


def test_a_doubled_record_in_two_outcomes_is_named() -> None:
    part = copy.deepcopy(ledger())
    part["ranges"]["dropped"] = [[11, 13], [20, 21]]  # 20 is trained as well
    d = Digest.from_json(part["digests"]["dropped"])
    d.add(20)
    part["digests"]["dropped"] = d.to_json()
    rep = check_ledger("r.samples:0", part)
    assert "doubled (two outcomes): 20" in rep.problems
    assert any("41 outcomes for 40 offsets: offset 20 doubled" in p for p in rep.problems), rep.problems


def test_lost_records_fail_naming_the_range_and_the_topics_agree_they_are_gone() -> None:
    led = OffsetLedger()
    led.begin(TP, 0)
    led.lost(TP, 0, 4)
    for off in range(4, 10):
        assert led.consumed(TP, off)
        led.finished(TP, off, "trained")
    parts = {"r.samples:0": led.state()["r.samples:0"]}
    reports = check_run(parts, "r.samples", 0, view(present=set(range(4, 10)), log_start=4, end=10, dlq=set()))
    assert reports["r.samples:0"].problems == ["lost before training (left the log untrained): 4 record(s) at [0, 4)"]


def test_a_ledger_entry_for_another_topic_or_a_partition_the_topic_lacks_fails() -> None:
    parts = {"r.samples:0": ledger(), "other.samples:0": ledger(), "r.samples:5": ledger()}
    reports = check_run(parts, "r.samples", 0, view())
    assert reports["r.samples:0"].ok
    assert any("not a partition of this run's samples topic" in p for p in reports["other.samples:0"].problems)
    assert any("the topic has no partition 5" in p for p in reports["r.samples:5"].problems)


# ---- checkpoint_record and verify() on a store (the ledger alone) --------------------------------------
def _checkpoint(store: VersionedStore, step: int, parts: dict[str, Any], **extra: Any) -> None:
    data = f"weights {step}".encode()
    key, _ = store.put_blob(data, f"{store.prefix}/{step}/x.pt")
    current = store.read_marker()
    store.publish(VersionRecord(version=step, blob=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                                trainer_step=step, extra={"ledger": parts, "policy_version": step, **extra}),
                  None if current is None else current[1])


def test_checkpoint_record_finds_the_newest_or_a_kept_step(tmp_path: Path) -> None:
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    with pytest.raises(LookupError, match="no checkpoint in this run yet"):
        checkpoint_record(store, None)
    _checkpoint(store, 3, {})
    _checkpoint(store, 5, {})
    assert checkpoint_record(store, None).version == 5
    assert checkpoint_record(store, 3).version == 3
    with pytest.raises(LookupError, match=r"checkpoint 4 is not kept \(have \[3, 5\]\)"):
        checkpoint_record(store, 4)


def _settings(tmp_path: Path) -> Settings:
    return Settings(run="r", store=StoreSettings(backend="local", local_root=tmp_path))


def test_verify_exits_0_on_an_honest_checkpoint_and_1_on_each_fault(tmp_path: Path) -> None:
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    _checkpoint(store, 1, {"r.samples:0": ledger()})
    code, lines = verify(_settings(tmp_path), read_log=False)
    assert code == 0, lines
    assert lines[-1].startswith("verify: ok: every offset exactly once (1 partition(s), each from the run's origin")
    late = copy.deepcopy(ledger())
    late["start"] = 5
    _checkpoint(store, 2, {"r.samples:0": late})
    code, lines = verify(_settings(tmp_path), read_log=False)
    assert code == 1 and lines[-1] == "verify: FAILED"
    assert any("r.samples:0 [5, 40): FAILED" in line for line in lines), lines
    assert any("starts at offset 5, not at the run's origin 0" in line for line in lines), lines
    # The older, honest checkpoint still verifies on its own.
    assert verify(_settings(tmp_path), step=1, read_log=False)[0] == 0
    _checkpoint(store, 3, {})
    code, lines = verify(_settings(tmp_path), read_log=False)
    assert code == 1 and "nothing can be proven" in lines[-1]


def test_verify_after_a_fresh_start_accepts_the_new_models_origin_and_says_so(tmp_path: Path) -> None:
    store = VersionedStore(LocalDirStore(tmp_path), "r", "checkpoints")
    late = OffsetLedger()
    for off in range(50, 60):
        assert late.consumed(TP, off)
        late.finished(TP, off, "trained")
    _checkpoint(store, 1, late.state(), fresh_start_at=1234.5)
    code, lines = verify(_settings(tmp_path), read_log=False)
    assert code == 0, lines
    assert any("deliberate fresh start at 1234.5" in line for line in lines)
