"""The intake's de-duplication (services/trainer/intake.py: OffsetSet, RecentIds, admit's duplicate rule) at its
edges (``make test-mutation``): the bounds of the constructors, which range is dropped on overflow, and the id
window's invariant (a digest is held iff exactly one live ring slot holds it) checked with deterministic digests,
so that released and overwritten slots can be told apart."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from services.trainer.intake import Intake, OffsetSet, Pending, RecentIds, strategy_for
from tests.fragments import blank_fragment

TP0 = TopicPartition("run.samples", 0)
TP1 = TopicPartition("run.samples", 1)


def ranges(s: OffsetSet) -> list[tuple[int, int]]:
    return list(zip(s.starts, s.ends, strict=True))


def test_offset_set_needs_at_least_one_range() -> None:
    with pytest.raises(ValueError, match="max_ranges must be >= 1, got 0"):
        OffsetSet(max_ranges=0)
    one = OffsetSet(max_ranges=1)
    one.add(5)
    one.add(7)  # a second range: the lower one goes
    assert ranges(one) == [(7, 8)]


def test_offset_set_holds_only_ints() -> None:
    s = OffsetSet()
    s.add(3)
    assert 3 in s and "3" not in s and None not in s and 3.0 not in s


def test_offset_set_membership_at_range_edges() -> None:
    s = OffsetSet()
    for o in (0, 1, 2, 10):
        s.add(o)
    assert ranges(s) == [(0, 3), (10, 11)]
    assert [o in s for o in (-1, 0, 2, 3, 9, 10, 11)] == [False, True, True, False, False, True, False]


def test_add_extends_joins_and_inserts() -> None:
    s = OffsetSet()
    s.add(5)
    s.add(6)  # joins left
    assert ranges(s) == [(5, 7)]
    s.add(4)  # joins right
    assert ranges(s) == [(4, 7)]
    s.add(9)
    assert ranges(s) == [(4, 7), (9, 10)]
    s.add(7)  # left only: 8 is still missing
    assert ranges(s) == [(4, 8), (9, 10)]
    s.add(8)  # closes the gap: both join
    assert ranges(s) == [(4, 10)]
    s.add(6)  # already in
    s.add(0)
    assert ranges(s) == [(0, 1), (4, 10)]


def test_add_past_the_bound_forgets_the_lowest_range() -> None:
    s = OffsetSet(max_ranges=2)
    for o in (0, 2, 4):
        s.add(o)
    assert ranges(s) == [(2, 3), (4, 5)]
    assert 0 not in s and 2 in s and 4 in s
    s.add(3)  # joining does not add a range
    assert ranges(s) == [(2, 5)]


def test_discard_trims_splits_and_removes() -> None:
    s = OffsetSet()
    for o in range(10, 20):
        s.add(o)
    s.discard(10)  # the start
    assert ranges(s) == [(11, 20)]
    s.discard(19)  # the end
    assert ranges(s) == [(11, 19)]
    s.discard(15)  # the middle: split
    assert ranges(s) == [(11, 15), (16, 19)]
    s.discard(15)  # not held
    s.discard(19)
    s.discard(5)
    assert ranges(s) == [(11, 15), (16, 19)]
    s.add(30)
    s.discard(30)  # a range of one
    assert ranges(s) == [(11, 15), (16, 19)]


def test_a_split_past_the_bound_forgets_the_lowest_range() -> None:
    s = OffsetSet(max_ranges=2)
    for o in (0, 10, 11, 12):
        s.add(o)
    s.discard(11)
    assert ranges(s) == [(10, 11), (12, 13)]


def test_discard_from_cuts_inside_a_range_and_drops_the_rest() -> None:
    s = OffsetSet()
    for o in (1, 2, 3, 4, 8, 9, 20):
        s.add(o)
    s.discard_from(3)
    assert ranges(s) == [(1, 3)]
    s.discard_from(3)  # at the end of a range: nothing more to cut
    assert ranges(s) == [(1, 3)]
    s.discard_from(0)
    assert ranges(s) == []
    s.discard_from(0)  # empty
    assert ranges(s) == []
    s.add(5)
    s.add(6)
    s.discard_from(6)
    assert ranges(s) == [(5, 6)]


def test_recent_ids_need_a_capacity_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="dedup_window must be >= 1, got 0"):
        RecentIds(0)
    one = RecentIds(1)
    one.add("a", TP0, 1)
    one.add("b", TP0, 2)
    assert "a" not in one and "b" in one and len(one) == 1


def test_recent_ids_hold_only_strings() -> None:
    ids = RecentIds(4)
    ids.add("7", TP0, 1)
    assert "7" in ids and 7 not in ids and None not in ids and "8" not in ids


@pytest.fixture
def plain_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests are the ids' numbers: no chance collisions, and 0 is a digest like any other."""
    monkeypatch.setattr(RecentIds, "digest", staticmethod(lambda sample_id: int(sample_id)))


@pytest.mark.usefixtures("plain_digests")
def test_an_empty_slot_holds_no_digest() -> None:
    ids = RecentIds(3)
    ids.add("0", TP0, 10)
    ids.add("7", TP0, 11)  # writing a never-used slot must not drop digest 0
    ids.add("8", TP1, 12)
    assert "0" in ids and len(ids) == 3
    ids.pop_from(TP1, 0)  # only TP1's record goes
    assert "0" in ids and "7" in ids and "8" not in ids


@pytest.mark.usefixtures("plain_digests")
def test_a_released_slot_is_not_live_when_the_ring_comes_round() -> None:
    ids = RecentIds(4)
    ids.add("1", TP0, 1)
    ids.add("2", TP0, 2)
    assert ids.pop(["1"]) == [(TP0, 1)]  # slot 0 released
    ids.add("1", TP0, 5)  # the same id again, slot 2
    ids.add("3", TP0, 6)
    ids.add("4", TP0, 7)  # overwrites the released slot 0: "1" lives on in slot 2
    assert "1" in ids and len(ids) == 4
    assert ids.pop(["1"]) == [(TP0, 5)]
    assert ids.pop(["1"]) == []


@pytest.mark.usefixtures("plain_digests")
def test_pop_from_forgets_from_the_offset_on_in_one_partition() -> None:
    ids = RecentIds(8)
    for i in range(4):
        ids.add(str(i), TP0, 100 + i)
        ids.add(str(10 + i), TP1, 100 + i)
    ids.pop_from(TP0, 102)
    assert [str(i) in ids for i in range(4)] == [True, True, False, False]
    assert all(str(10 + i) in ids for i in range(4))
    ids.pop_from(TopicPartition("run.samples", 9), 0)  # never seen: nothing
    assert len(ids) == 6
    assert ids.pop(["0", "11", "99"]) == [(TP0, 100), (TP1, 101)]


def test_pop_of_nothing_held_is_empty() -> None:
    ids = RecentIds(2)
    assert ids.pop([]) == [] and ids.pop(["x"]) == []
    ids.add("x", TP0, 0)
    assert ids.pop(["y"]) == [] and "x" in ids


def test_the_ring_evicts_in_order_across_many_rounds() -> None:
    ids = RecentIds(3)
    for i in range(10):
        ids.add(f"id{i}", TP0, i)
        assert len(ids) == min(i + 1, 3)
        assert [f"id{j}" in ids for j in range(i + 1)] == [j > i - 3 for j in range(i + 1)]


def _intake() -> Intake:
    return Intake(max_staleness=2, batch_timeout_s=5.0, strategy=strategy_for("async", 100, poll_max_records=64))


def _p(sid: str, offset: int, tp: TopicPartition = TP0) -> Pending:
    return Pending(tp, offset, blank_fragment(0, steps=2, envs=1, sampler_id="s0", sample_id=sid), 0.0)


def test_admit_refuses_an_offset_again_per_partition_and_keeps_the_first() -> None:
    intake = _intake()
    assert intake.admit(_p("a", 0)) is None
    rejected = intake.admit(_p("a2", 0))
    assert rejected is not None and rejected.reason == "duplicate" and "offset 0 of partition 0" in rejected.message
    assert intake.admit(_p("b", 0, TP1)) is None
    assert [p.frag.sample_id for p in intake.buffer] == ["a", "b"]


def test_admit_refuses_a_sample_id_again_and_does_not_remember_the_refused_offset() -> None:
    intake = _intake()
    assert intake.admit(_p("a", 0)) is None
    rejected = intake.admit(_p("a", 1))
    assert rejected is not None and rejected.reason == "duplicate"
    assert rejected.message == "sample id a was already admitted in this trainer run"
    assert 1 not in intake._offsets[TP0]
    assert intake.admit(_p("c", 1)) is None  # offset 1 was refused, not admitted: another record may be there
    assert len(intake.buffer) == 2


@pytest.mark.usefixtures("plain_digests")
def test_a_released_slot_is_never_popped_again() -> None:
    ids = RecentIds(4)
    ids.add("1", TP0, 1)
    assert ids.pop(["1"]) == [(TP0, 1)]  # slot 0 released, its digest left behind
    ids.add("1", TP1, 7)  # the same id again, slot 1
    assert ids.pop(["1"]) == [(TP1, 7)]
    assert len(ids) == 0


def test_large_offsets_join_by_value() -> None:
    s = OffsetSet()
    s.add(100_001)
    s.add(100_000)  # joins the range to its right
    s.add(100_003)
    s.add(100_002)  # closes the gap: one range
    assert ranges(s) == [(100_000, 100_004)]


def _big(n: int) -> int:
    """``n`` as a fresh int object (not a shared constant): comparisons must be by value."""
    return int(str(n))


def test_large_offsets_discard_by_value() -> None:
    s = OffsetSet()
    s.add(_big(100_000))
    s.discard(_big(100_000))  # a range of one
    assert ranges(s) == []
    for o in range(100_000, 100_005):
        s.add(_big(o))
    s.discard(_big(100_000))  # the start
    s.discard(_big(100_004))  # the end
    assert ranges(s) == [(100_001, 100_004)]


def test_adding_past_the_last_of_many_ranges() -> None:
    s = OffsetSet()
    for o in range(0, 600, 2):
        s.add(o)
    assert len(s) == 300
    s.add(1000)
    s.add(599)  # joins the last range on its left only
    assert len(s) == 301 and ranges(s)[-2:] == [(598, 600), (1000, 1001)]
