"""services/trainer/ledger.py at its edges (``make test-mutation``): run-length ranges, re-deliveries at each bound,
lost ranges next to other outcomes, commits, seeks and revokes, and the JSON form a checkpoint stores."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from services.trainer.ledger import (
    Digest,
    OffsetLedger,
    PartitionLedger,
    _extend,
    mix64,
    parse_tp,
    range_digest,
    tp_key,
)

TP = TopicPartition("run.samples", 3)
TP2 = TopicPartition("run.samples", 4)


def part(ledger: OffsetLedger, tp: TopicPartition = TP) -> PartitionLedger:
    return ledger._parts[tp]


def test_extend_merges_only_adjacent_ranges() -> None:
    r: list[list[int]] = []
    _extend(r, 5)
    assert r == [[5, 6]]
    _extend(r, 6)
    assert r == [[5, 7]]
    _extend(r, 8)
    assert r == [[5, 7], [8, 9]]
    _extend(r, 9, 20)
    assert r == [[5, 7], [8, 20]]
    _extend(r, 21, 22)
    assert r == [[5, 7], [8, 20], [21, 22]]


def test_tp_keys_round_trip_with_colons_in_the_topic() -> None:
    assert tp_key(TP) == "run.samples:3"
    assert parse_tp("a:b:12") == TopicPartition("a:b", 12)
    assert parse_tp(tp_key(TP2)) == TP2


def test_a_redelivery_at_each_bound_is_refused() -> None:
    led = OffsetLedger()
    assert led.consumed(TP, 10) and led.consumed(TP, 11) and led.consumed(TP, 12)
    led.finished(TP, 10, "trained")  # frontier 11
    led.finished(TP, 12, "dropped")  # done above the frontier
    assert not led.consumed(TP, 9) and not led.consumed(TP, 10)  # below the frontier (11)
    assert not led.consumed(TP, 11)  # pending
    assert not led.consumed(TP, 12)  # done
    assert led.consumed(TP, 13)
    assert led.expected(TP) == 14


def test_next_is_one_past_the_highest_consumed_whatever_the_order() -> None:
    led = OffsetLedger()
    led.consumed(TP, 0)
    led.consumed(TP, 5)
    led.consumed(TP, 3)
    assert led.expected(TP) == 6
    assert led.expected(TP2) is None and led.resume_offset(TP2) is None


def test_finished_for_an_unknown_or_unpending_offset_is_ignored() -> None:
    led = OffsetLedger()
    led.finished(TP, 0, "trained")  # never seen
    led.consumed(TP, 0)
    led.finished(TP, 1, "trained")  # not pending
    assert part(led).frontier == 0
    led.finished(TP, 0, "dead")
    led.finished(TP, 0, "trained")  # already finished
    assert part(led).frontier == 1 and part(led).digests["dead"] == Digest(1, mix64(0))
    assert part(led).digests["trained"] == Digest()


def test_an_empty_lost_range_is_nothing() -> None:
    led = OffsetLedger()
    led.begin(TP, 0)
    led.lost(TP, 0, 0)
    led.lost(TP, 5, 3)
    led.lost(TP2, 0, 4)  # a partition never seen
    assert part(led).to_json()["ranges"]["lost"] == [] and part(led).frontier == 0
    assert TP2 not in led.partitions()
    with pytest.raises(ValueError, match=r"lost range \[2, 4\) of run.samples:3 does not start at the next expected "
                                         r"offset 0"):
        led.lost(TP, 2, 4)


def test_lost_ranges_fold_whole_between_other_outcomes() -> None:
    led = OffsetLedger()
    led.begin(TP, 0)
    led.consumed(TP, 0)
    led.lost(TP, 1, 4)
    led.consumed(TP, 4)
    led.lost(TP, 5, 7)
    led.consumed(TP, 7)
    assert part(led).frontier == 0
    for o in (7, 4, 0):
        led.finished(TP, o, "trained")
    p = part(led)
    assert p.frontier == 8 and p.lost == []
    assert p.ranges["lost"] == [[1, 4], [5, 7]] and p.ranges["trained"] == [[0, 1], [4, 5], [7, 8]]
    assert p.digests["lost"] == range_digest(1, 4) + range_digest(5, 7)
    assert sum((d for d in p.digests.values()), Digest()) == range_digest(0, 8)


def test_committable_and_mark_committed() -> None:
    led = OffsetLedger()
    led.consumed(TP, 5)
    assert led.committable() == {}  # nothing moved past the first offset
    led.finished(TP, 5, "trained")
    assert led.committable() == {TP: 6}
    led.mark_committed({TP: 6})
    assert led.committable() == {}
    led.mark_committed({TP: 2})  # an older commit never lowers it
    assert led.committable() == {}


def test_a_restored_partition_at_offset_zero_is_committable() -> None:
    led = OffsetLedger()
    led.restore({}, {"run.samples:3": 0})
    assert led.committable() == {TP: 0}
    assert led.resume_offset(TP) == 0


def test_seek_ahead_records_a_gap_and_forgets_the_commit() -> None:
    led = OffsetLedger()
    led.consumed(TP, 0)
    led.finished(TP, 0, "trained")
    led.mark_committed({TP: 1})
    led.consumed(TP, 1)  # pending: forgotten by the seek
    led.seeked(TP, 4)
    p = part(led)
    assert p.frontier == 4 and p.next == 4 and p.pending == set()
    assert p.ranges["gap"] == [[1, 4]]
    assert led.committable() == {TP: 4}
    led.seeked(TP, 2)  # behind the frontier: nothing moves back
    assert part(led).frontier == 4 and part(led).next == 4


def test_forget_keeps_the_frontier_and_drops_the_rest() -> None:
    led = OffsetLedger()
    for o in range(3):
        led.consumed(TP, o)
    led.finished(TP, 0, "trained")
    led.finished(TP, 2, "trained")
    led.lost(TP, 3, 5)
    led.mark_committed({TP: 1})
    led.forget([TP, TP2])
    p = part(led)
    assert (p.frontier, p.next, p.pending, p.done, p.lost) == (1, 1, set(), {}, [])
    assert led.committable() == {TP: 1}  # the commit was forgotten with the partition
    assert TP2 not in led.partitions()


def test_json_round_trip_and_older_forms() -> None:
    led = OffsetLedger()
    led.begin(TP, 2)
    for o in range(2, 6):
        led.consumed(TP, o)
        led.finished(TP, o, "trained" if o % 2 else "dead")
    state = led.state()
    assert state["run.samples:3"]["start"] == 2 and state["run.samples:3"]["end"] == 6
    back = PartitionLedger.from_json(state["run.samples:3"])
    assert back.to_json() == state["run.samples:3"] and back.next == 6 and back.frontier == 6
    bare = PartitionLedger.from_json({"start": 1, "end": 3})
    assert bare.digests == {k: Digest() for k in bare.digests} and all(v == [] for v in bare.ranges.values())
    assert led.snapshot() == {"run.samples:3": 6}


def test_restore_replaces_everything_and_export_adopt() -> None:
    led = OffsetLedger()
    led.consumed(TP2, 0)
    led.restore({"run.samples:3": {"start": 0, "end": 2, "ranges": {"trained": [[0, 2]]},
                                   "digests": {"trained": range_digest(0, 2).to_json()}}},
                {"run.samples:3": 9, "run.samples:5": 7})
    assert led.partitions() == {TP, TopicPartition("run.samples", 5)}
    assert led.resume_offset(TP) == 2 and led.resume_offset(TopicPartition("run.samples", 5)) == 7
    assert set(led.export([TP, TP2])) == {"run.samples:3"}
    other = OffsetLedger()
    other.consumed(TP, 0)
    other.adopt(led.export([TP]), owned={TP})
    assert other.resume_offset(TP) == 0
    other.adopt(led.export([TP]), owned=set())
    assert other.resume_offset(TP) == 2


def test_an_empty_lost_range_leaves_no_trace_once_the_frontier_passes() -> None:
    led = OffsetLedger()
    led.begin(TP, 0)
    led.lost(TP, 0, 0)
    assert part(led).lost == []
    led.consumed(TP, 0)
    led.finished(TP, 0, "trained")
    assert part(led).ranges["lost"] == [] and part(led).digests["lost"] == Digest()


def test_a_lost_range_below_the_expected_offset_is_refused() -> None:
    led = OffsetLedger()
    for o in range(5):
        led.consumed(TP, o)
    with pytest.raises(ValueError, match=r"lost range \[3, 6\) of run.samples:3 does not start at the next expected "
                                         r"offset 5"):
        led.lost(TP, 3, 6)


def test_the_first_commit_of_a_restored_partition_counts_from_zero() -> None:
    led = OffsetLedger()
    led.restore({}, {"run.samples:3": 0})
    led.mark_committed({TP: 0})
    assert led.committable() == {}
    led.consumed(TP, 0)
    led.finished(TP, 0, "trained")
    assert led.committable() == {TP: 1}


def test_large_offsets_merge_fold_and_lose_by_value() -> None:
    led = OffsetLedger()
    led.begin(TP, 100_000)
    for o in range(100_000, 100_003):
        led.consumed(TP, o)
        led.finished(TP, o, "trained")
    led.lost(TP, 100_003, 100_005)
    p = part(led)
    assert p.ranges["trained"] == [[100_000, 100_003]] and p.ranges["lost"] == [[100_003, 100_005]]
    assert p.frontier == 100_005 and p.lost == []


def test_a_commit_beyond_the_frontier_is_not_undone() -> None:
    led = OffsetLedger()
    led.consumed(TP, 0)
    led.finished(TP, 0, "trained")
    led.mark_committed({TP: 10})  # the group committed further (another member)
    assert led.committable() == {}
