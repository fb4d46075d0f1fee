"""The trainer's admission, batching and stall rules (services/trainer/intake.py), without a broker."""

from __future__ import annotations

import dataclasses
import itertools
import random
import tracemalloc
import uuid
from typing import cast

from aiokafka import TopicPartition

from services.trainer.intake import (
    DEDUP_WINDOW,
    AsyncBatches,
    Intake,
    OffsetSet,
    Pending,
    RecentIds,
    StallWatch,
    SyncBatches,
    strategy_for,
)
from shared.fragment import Fragment
from tests.fragments import blank_fragment

TP0 = TopicPartition("run.samples", 0)
TP1 = TopicPartition("run.samples", 1)


def frag(version: int, sample_id: str, sampler: str = "s0") -> Fragment:
    return blank_fragment(version, steps=2, envs=1, sampler_id=sampler, sample_id=sample_id)


_OFFSETS = itertools.count(10_000)


def pending(version: int, sid: str, offset: int | None = None, tp: TopicPartition = TP0, at: float = 0.0,
            sampler: str = "s0") -> Pending:
    """A consumed record: a fresh offset unless one is given (one offset is one record)."""
    return Pending(tp, next(_OFFSETS) if offset is None else offset, frag(version, sid, sampler), at)


def make(max_staleness: int = 2, batch_fragments: int = 2, batch_timeout_s: float = 5.0, sync: bool = False,
         **kw: object) -> Intake:
    """An Intake wired as the trainer wires it: the strategy of the mode (async or sync)."""
    strategy = strategy_for("sync" if sync else "async", batch_fragments, poll_max_records=64)
    return Intake(max_staleness=max_staleness, batch_timeout_s=batch_timeout_s, strategy=strategy,
                  **kw)  # type: ignore[arg-type]


def test_staleness_is_checked_when_the_batch_is_formed_not_on_arrival() -> None:
    intake = make(batch_fragments=3)
    intake.model_version = intake.published = 5
    assert intake.admit(pending(4, "a", 0)) is None  # staleness 1 on arrival
    assert intake.admit(pending(5, "b", 1)) is None
    intake.model_version = intake.published = 8  # three updates published meanwhile
    assert intake.admit(pending(8, "c", 2)) is None
    batch = intake.form_batch(now=0.0)
    assert [(p.frag.sample_id, s) for p, s in batch.stale] == [("a", 4), ("b", 3)]
    assert batch.train == []  # only one fragment left: not a batch yet
    assert [p.frag.sample_id for p in intake.buffer] == ["c"]


def test_reference_is_the_older_of_own_and_published_version() -> None:
    intake = make(max_staleness=4)
    intake.model_version = 13  # updates that paramsync has not published yet
    intake.saw_published(10)
    assert intake.reference == 10
    assert intake.admit(pending(10, "a")) is None
    assert intake.admit(pending(9, "b")) is None
    batch = intake.form_batch(now=0.0)
    # Against the trainer's own counter they would count 3 and 4 versions old: every unpublished update
    # would age all data, and a long enough publication outage would stall training for good.
    assert [p.frag.sample_id for p in batch.train] == ["a", "b"] and batch.staleness == [0, 1]


def test_sync_mode_uses_own_version_and_zero_bound() -> None:
    intake = make(sync=True, max_staleness=8)
    intake.model_version, intake.published = 4, 3
    intake.admit(pending(3, "old", sampler="s0"))
    intake.admit(pending(4, "new", sampler="s1"))
    batch = intake.form_batch(now=0.0, live_samplers={"s1"})
    assert [p.frag.sample_id for p, _ in batch.stale] == ["old"]
    assert [p.frag.sample_id for p in batch.train] == ["new"]


def test_future_versions_are_refused() -> None:
    intake = make()
    intake.model_version, intake.published = 7, 6
    rejected = intake.admit(pending(999_999_999, "x"))
    assert rejected is not None and rejected.reason == "future_version" and "newest 7" in rejected.message
    assert intake.admit(pending(7, "y")) is None  # the trainer's own newest version exists


def test_duplicate_sample_ids_are_refused_within_a_run() -> None:
    intake = make(batch_fragments=1)
    assert intake.admit(pending(0, "same", 0)) is None
    assert intake.form_batch(now=0.0).train  # trained
    rejected = intake.admit(pending(0, "same", 1))
    assert rejected is not None and rejected.reason == "duplicate"


def test_dedup_window_is_bounded() -> None:
    intake = make(batch_fragments=1, dedup_window=3)
    for i in range(5):
        assert intake.admit(pending(0, f"id{i}", i)) is None
        intake.form_batch(now=0.0)
    assert intake.admit(pending(0, "id0", 9)) is None  # forgotten: the window holds 3 ids
    assert intake.admit(pending(0, "id4", 10)) is not None


def test_revoke_removes_buffered_fragments_and_forgets_their_ids() -> None:
    intake = make(batch_fragments=10)
    intake.admit(pending(0, "p0", 0, TP0))
    intake.admit(pending(0, "p1", 0, TP1))
    removed = intake.revoke({TP1})
    assert [p.frag.sample_id for p in removed] == ["p1"]
    assert [p.frag.sample_id for p in intake.buffer] == ["p0"]
    # Re-delivered after a re-assignment: not a duplicate, it was never trained here.
    assert intake.admit(pending(0, "p1", 0, TP1)) is None


def train_all(intake: Intake) -> list[Pending]:
    """Form a batch of everything buffered (the trainer trains it)."""
    batch = intake.form_batch(now=1e9)  # long past every batch timeout
    assert not intake.buffer
    return batch.train


def test_a_redelivered_record_is_refused_by_offset_long_after_its_id_left_the_window() -> None:
    intake = make(batch_fragments=1, dedup_window=2)
    for i in range(50):
        assert intake.admit(pending(0, f"id{i}", i)) is None
        train_all(intake)
    # Kafka hands offset 3 out again (a commit lost in a rebalance): same record, same id, long evicted.
    rejected = intake.admit(pending(0, "id3", 3))
    assert rejected is not None and rejected.reason == "duplicate"
    assert "offset 3 of partition 0" in rejected.message and "re-delivery" in rejected.message
    # Offsets are per partition: offset 3 of partition 1 is another record.
    assert intake.admit(pending(0, "other", 3, TP1)) is None
    # A sampler re-sending a recent fragment: a new record (offset), a known sample id.
    rejected = intake.admit(pending(0, "id49", 50))
    assert rejected is not None and rejected.reason == "duplicate" and "sample id id49" in rejected.message


def test_revoke_keeps_trained_offsets_and_releases_buffered_ones() -> None:
    intake = make(batch_fragments=100, dedup_window=1)
    for i in range(3):
        intake.admit(pending(0, f"t{i}", i))
    train_all(intake)  # offsets 0-2 trained
    intake.admit(pending(0, "b3", 3))
    intake.admit(pending(0, "b4", 4))  # buffered, not trained
    assert [p.offset for p in intake.revoke({TP0})] == [3, 4]
    # Re-assigned with every commit lost: Kafka re-delivers from offset 0.
    assert [intake.admit(pending(0, f"t{i}", i)) is None for i in range(3)] == [False] * 3
    assert intake.admit(pending(0, "b3", 3)) is None and intake.admit(pending(0, "b4", 4)) is None


def test_forget_ids_and_release_let_a_revoked_batch_come_again() -> None:
    intake = make(batch_fragments=100)
    for i in range(4):
        intake.admit(pending(0, f"f{i}", i))
    batch = train_all(intake)
    intake.forget_ids(p.frag.sample_id for p in batch[:2])  # the trainer's call for a batch formed before a revoke
    intake.release(batch[2:3])
    for i in range(3):
        assert intake.admit(pending(0, f"f{i}", i)) is None, f"f{i} is not a duplicate: it was never trained"
    rejected = intake.admit(pending(0, "f3", 3))
    assert rejected is not None and rejected.reason == "duplicate"


def test_a_seek_back_to_a_checkpoint_lets_the_records_after_it_train_again() -> None:
    intake = make(batch_fragments=100)
    for i in range(10):
        intake.admit(pending(0, f"s{i}", i))
        intake.admit(pending(0, f"q{i}", i, TP1))
    train_all(intake)
    intake.seeked(TP0, 6)  # the restored model holds offsets 0-5 of partition 0
    assert [intake.admit(pending(0, f"s{i}", i)) is None for i in range(10)] == [False] * 6 + [True] * 4
    assert intake.admit(pending(0, "q7", 7, TP1)) is not None  # partition 1 did not move


def test_offset_set_matches_a_plain_set() -> None:
    rng = random.Random(7)
    for trial in range(200):
        ours, plain = OffsetSet(max_ranges=10_000), set()
        for _ in range(200):
            x, op = rng.randrange(60), rng.random()
            if op < 0.6:
                ours.add(x)
                plain.add(x)
            elif op < 0.95:
                ours.discard(x)
                plain.discard(x)
            else:
                ours.discard_from(x)
                plain = {y for y in plain if y < x}
            assert {y for y in range(62) if y in ours} == plain, f"trial {trial}"
            assert all(a < b for a, b in zip(ours.ends, ours.starts[1:], strict=False)), "ranges touch or overlap"
            assert all(a < b for a, b in zip(ours.starts, ours.ends, strict=True)), "an empty range"


def test_offset_set_stays_compact_and_bounded() -> None:
    offsets = OffsetSet(max_ranges=3)
    for i in range(100_000):
        offsets.add(i)
    assert len(offsets) == 1  # consecutive offsets: one range
    for gap in (10, 20, 30, 40):  # dead-lettered records leave gaps
        offsets.discard(gap)
    assert len(offsets) == 3 and 5 not in offsets and 15 not in offsets  # the lowest ranges were forgotten
    assert 25 in offsets and 35 in offsets and 99_999 in offsets and 40 not in offsets


def test_recent_ids_evict_the_oldest_first() -> None:
    ids = RecentIds(3)
    for i in range(5):
        ids.add(f"x{i}", TP0, i)
    assert len(ids) == 3 and "x1" not in ids and all(f"x{i}" in ids for i in (2, 3, 4))
    assert ids.pop(["x3", "x1", "nope"]) == [(TP0, 3)]
    ids.add("x5", TP1, 5)  # overwrites x2's slot
    assert "x2" not in ids and "x5" in ids and len(ids) == 2  # x4, x5 (x3 was popped)


def test_dedupe_memory_is_bounded_for_200k_ids() -> None:
    # 200k ids through the default window (100k): ~9 MiB stay, ~94 bytes an id held. The ordered dict of
    # id strings this replaced kept all 200k, ~33 MiB.
    items = [Pending(TP0 if i % 2 else TP1, i // 2, cast(Fragment, _Ident(0, uuid.UUID(int=i).hex)), 0.0)
             for i in range(200_000)]  # only what admit keeps is measured: the records are the caller's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        intake = make(batch_fragments=1)
        for p in items:
            assert intake.admit(p) is None
            intake.buffer.clear()  # trained
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(intake._recent) == DEDUP_WINDOW == 100_000
    assert sum(len(o) for o in intake._offsets.values()) == 2  # one range of offsets per partition
    assert used < 11 * 1024 * 1024, f"{used / 2**20:.1f} MiB for 200k sample ids"


@dataclasses.dataclass
class _Ident:
    """What admission reads of a fragment."""

    policy_version: int
    sample_id: str


def test_partial_batch_after_timeout_and_poll_bound() -> None:
    intake = make(batch_fragments=4, batch_timeout_s=1.0)
    intake.admit(pending(0, "a", at=10.0))
    assert intake.wants() == 3
    assert intake.form_batch(now=10.5).train == []
    assert [p.frag.sample_id for p in intake.form_batch(now=11.5).train] == ["a"]


def test_stall_watch_reasons() -> None:
    w = StallWatch(after_s=30, now=0.0)
    assert w.check(100.0) is None  # nothing arrives: idle, not stalled
    w.note("consumed", 100.0, 5)
    w.note("dropped_stale", 100.0, 5)
    assert w.check(120.0) is None
    w.note("consumed", 125.0)  # records keep arriving...
    w.note("dropped_stale", 125.0)
    stall = w.check(131.0, reference=7)
    assert stall is not None and "dropped as stale" in stall.reason and "reference version 7" in stall.reason
    w.trained(132.0)
    assert w.check(200.0) is None
    w.note("consumed", 200.0, 2)
    w.note("dead_lettered", 200.0, 2)
    w.note("consumed", 235.0)
    w.note("dead_lettered", 235.0)
    stall = w.check(240.0)
    assert stall is not None and "dead-lettered" in stall.reason
    assert w.check(270.0) is None  # nothing arrived for 30 s: idle (e.g. samplers paused), not stalled


def test_the_strategy_is_chosen_at_wiring_and_decides_bound_reference_and_poll_size() -> None:
    a = make(max_staleness=8, batch_fragments=4)
    s = make(max_staleness=8, sync=True)
    assert isinstance(a.strategy, AsyncBatches) and isinstance(s.strategy, SyncBatches)
    for intake in (a, s):
        intake.model_version, intake.published = 6, 4
    assert (a.bound, a.reference) == (8, 4)  # async: the configured bound, against the published version
    assert (s.bound, s.reference) == (0, 6)  # sync: zero staleness against the trainer's own version
    assert a.wants() == 4 and s.wants() == 64  # async polls only what the next batch needs
    a.admit(pending(4, "x"))
    assert a.wants() == 3
    a.max_staleness = 1  # a runtime change of the bound applies to the next batch
    assert a.bound == 1 and s.bound == 0


def test_async_trainer_waits_when_it_is_the_bound_ahead_of_publication() -> None:
    intake = make(max_staleness=3, batch_fragments=1)
    intake.model_version, intake.published = 13, 10  # a publication is slow: 3 versions unpublished
    intake.admit(pending(10, "a"))
    batch = intake.form_batch(now=0.0)
    assert batch.train == [] and batch.waiting_publication and batch.stale == []
    intake.saw_published(13)  # it lands: the fragment made on 10 is 3 behind, within the bound, trained
    batch = intake.form_batch(now=0.0)
    assert [p.frag.sample_id for p in batch.train] == ["a"] and batch.staleness == [3]
    sync = make(max_staleness=3, sync=True)
    sync.model_version, sync.published = 13, 10
    sync.admit(pending(13, "b"))
    assert not sync.form_batch(now=0.0, live_samplers={"s0"}).waiting_publication


def test_no_polling_past_a_held_batch_while_waiting_for_publication() -> None:
    intake = make(max_staleness=3, batch_fragments=2)
    intake.model_version, intake.published = 13, 10  # the publication lead is reached: no batch may train
    assert intake.wants() == 2  # an empty buffer still fills one batch, ready for when publication lands
    intake.admit(pending(10, "a"))
    assert intake.wants() == 1
    intake.admit(pending(10, "b"))
    # A batch is held: polling more would consume (and free the samplers' credits for) fragments that wait.
    assert intake.wants() == 0
    intake.saw_published(13)
    assert intake.wants() == 1  # may train again: the usual at-least-one poll
    sync = make(max_staleness=3, sync=True)
    sync.model_version, sync.published = 13, 10
    assert sync.wants() == 64
