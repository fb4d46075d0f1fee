"""Which fragments train, and when: the trainer's rules as pure classes (no I/O; the clock is passed in).

:class:`Intake` (docs/architecture.md, "What trains, and when"):

- **admit** a decoded fragment: a policy version newer than any that exists is poison
  (``future_version``); a ``duplicate`` is a record at an offset of its partition already admitted in
  this trainer run (Kafka re-delivering it after a lost commit: remembered for the whole run, as offset
  ranges, a few bytes each) or a sample id among the last ``dedup_window`` admitted (a sampler sending
  the same fragment twice: two records, two offsets); otherwise it waits. Memory is bounded either way
  (:class:`OffsetSet`, :class:`RecentIds`).
- **staleness is checked when the batch is formed**, not when the fragment arrived: against the
  *reference* version, the older of the trainer's own version and the newest *published* one
  (samplers can only act on published versions: measured against the trainer's counter alone, an
  unpublished run of updates would make every fragment stale and stall training for good).
- **batches** come from a *strategy*, chosen when the trainer (or the benchmark's in-memory pipeline)
  is wired: :class:`AsyncBatches` (``batch_fragments`` at a time, the bound ``max_staleness``) or
  :class:`SyncBatches` (the synchronous baseline: one fragment of the current version from every live
  sampler, bound 0, reference the trainer's own version). Nothing else differs between the modes here.
- **publication lead** (async): no batch while the trainer is ``max_staleness`` versions ahead of the
  newest published version (a slow publish); else, when it lands, the reference jumps and everything
  samplers made meanwhile is dropped at once.
- **revoke**: fragments of revoked partitions leave the buffer and their offsets and sample ids are
  forgotten (the new owner, or this member after a re-assignment, gets them again); what was trained
  stays remembered, so its re-delivery after a re-assignment is refused.
- **seeked**: a restore moved the consumer back; the offsets from there on are forgotten, because the
  checkpointed model does not hold them and they are to be trained again.

:class:`StallWatch`: training has stalled when records keep arriving but no update happened for
``after_s`` seconds; it says why (all dropped as stale, all dead-lettered, waiting for a batch).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from aiokafka import TopicPartition

from shared.fragment import Fragment

DEDUP_WINDOW = 100_000
"""Sample ids remembered for de-duplication (~9 MB when full, :class:`RecentIds`). A sampler re-sending a
fragment does so within seconds, thousands of fragments at most; Kafka's re-deliveries are caught by
offset, for the whole run, whatever this window holds."""
MAX_OFFSET_RANGES = 4096
"""Ranges of admitted offsets kept per partition (:class:`OffsetSet`): each gap (a dead-lettered record,
a released one) starts a new range; past this many the oldest are forgotten."""


@dataclass
class Pending:
    tp: TopicPartition
    offset: int
    frag: Fragment
    at: float  # clock time it was admitted


@dataclass(frozen=True)
class Rejected:
    reason: Literal["future_version", "duplicate"]
    message: str


@dataclass
class Batch:
    train: list[Pending] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per trained fragment, at formation
    stale: list[tuple[Pending, int]] = field(default_factory=list)  # dropped at formation, with their staleness
    waiting_publication: bool = False  # a batch could form, but the trainer is too far ahead of publication



class OffsetSet:
    """A set of offsets as sorted, disjoint, half-open ranges ``[start, end)``: consecutive offsets cost
    one range (tens of bytes), not one entry each.

    Invariants: ``starts`` is strictly increasing, ``starts[i] < ends[i] < starts[i + 1]`` (ranges never
    touch: adjacent ones are merged); at most ``max_ranges`` ranges, the lowest dropped first (dropping
    only ever forgets, it never adds an offset).
    """

    def __init__(self, max_ranges: int = MAX_OFFSET_RANGES) -> None:
        if max_ranges < 1:
            raise ValueError(f"max_ranges must be >= 1, got {max_ranges}")
        self.max_ranges = max_ranges
        self.starts: list[int] = []
        self.ends: list[int] = []

    def __contains__(self, offset: object) -> bool:
        if not isinstance(offset, int):
            return False
        i = bisect_right(self.starts, offset) - 1
        return i >= 0 and offset < self.ends[i]

    def __len__(self) -> int:
        """How many ranges (not offsets)."""
        return len(self.starts)

    def add(self, offset: int) -> None:
        i = bisect_right(self.starts, offset) - 1  # the range starting at or before offset, if any
        if i >= 0 and offset < self.ends[i]:
            return
        joins_left = i >= 0 and self.ends[i] == offset
        joins_right = i + 1 < len(self.starts) and self.starts[i + 1] == offset + 1
        if joins_left and joins_right:
            self.ends[i] = self.ends[i + 1]
            del self.starts[i + 1], self.ends[i + 1]
        elif joins_left:
            self.ends[i] = offset + 1
        elif joins_right:
            self.starts[i + 1] = offset
        else:
            self.starts.insert(i + 1, offset)
            self.ends.insert(i + 1, offset + 1)
            if len(self.starts) > self.max_ranges:
                del self.starts[0], self.ends[0]

    def discard(self, offset: int) -> None:
        i = bisect_right(self.starts, offset) - 1
        if i < 0 or offset >= self.ends[i]:
            return
        start, end = self.starts[i], self.ends[i]
        if start == offset and end == offset + 1:
            del self.starts[i], self.ends[i]
        elif start == offset:
            self.starts[i] = offset + 1
        elif end == offset + 1:
            self.ends[i] = offset
        else:
            self.ends[i] = offset
            self.starts.insert(i + 1, offset + 1)
            self.ends.insert(i + 1, end)
            if len(self.starts) > self.max_ranges:
                del self.starts[0], self.ends[0]

    def discard_from(self, offset: int) -> None:
        """Forget ``offset`` and every later one."""
        i = bisect_left(self.starts, offset)
        del self.starts[i:], self.ends[i:]
        if i and self.ends[i - 1] > offset:
            self.ends[i - 1] = offset


_DIGEST_MASK = (1 << 60) - 1  # Python ints below 2**60 take 32 bytes; above, 36


class RecentIds:
    """The last ``capacity`` sample ids admitted, oldest evicted first, each with the record it came in.

    Ids are kept as 60-bit digests (the process's string hash, SipHash with a per-process key: a chance
    collision among 100k ids is ~4e-9, and nobody outside can aim for one), in a set for lookups and a
    ring of numpy arrays (digest, partition, offset) for the order; ~90 bytes an id instead of ~170 for
    the strings in an ordered dict. Invariants: ``len(self) <= capacity``; a digest is in the set iff
    exactly one live ring slot holds it (a slot is live while ``_part >= 0``).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"dedup_window must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: set[int] = set()
        self._digest = np.zeros(capacity, np.int64)
        self._part = np.full(capacity, -1, np.int32)  # index into _tps; -1: empty or released
        self._offset = np.zeros(capacity, np.int64)
        self._next = 0  # the ring slot written next (the oldest, once the ring is full)
        self._tps: list[TopicPartition] = []
        self._tp_index: dict[TopicPartition, int] = {}

    @staticmethod
    def digest(sample_id: str) -> int:
        return hash(sample_id) & _DIGEST_MASK

    def __contains__(self, sample_id: object) -> bool:
        return isinstance(sample_id, str) and self.digest(sample_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, sample_id: str, tp: TopicPartition, offset: int) -> None:
        """Remember ``sample_id`` (not already held) as read at ``tp``/``offset``; evicts the oldest."""
        d = self.digest(sample_id)
        slot = self._next
        if self._part[slot] >= 0:
            self._ids.discard(int(self._digest[slot]))
        if tp not in self._tp_index:
            self._tp_index[tp] = len(self._tps)
            self._tps.append(tp)
        self._digest[slot], self._part[slot], self._offset[slot] = d, self._tp_index[tp], offset
        self._ids.add(d)
        self._next = (slot + 1) % self.capacity

    def pop(self, sample_ids: Iterable[str]) -> list[tuple[TopicPartition, int]]:
        """Forget ``sample_ids``; where each of those still held was read."""
        wanted = {self.digest(sid) for sid in sample_ids} & self._ids
        if not wanted:
            return []
        hit = np.flatnonzero((self._part >= 0) & np.isin(self._digest, np.fromiter(wanted, np.int64)))
        return self._release(hit)

    def pop_from(self, tp: TopicPartition, offset: int) -> None:
        """Forget the ids read at ``tp`` at ``offset`` or later."""
        if tp in self._tp_index:
            self._release(np.flatnonzero((self._part == self._tp_index[tp]) & (self._offset >= offset)))

    def _release(self, slots: np.ndarray) -> list[tuple[TopicPartition, int]]:
        out = []
        for slot in slots.tolist():
            self._ids.discard(int(self._digest[slot]))
            out.append((self._tps[int(self._part[slot])], int(self._offset[slot])))
            self._part[slot] = -1
        return out


class AsyncBatches:
    """Asynchronous: ``batch_fragments`` at a time (fewer once the oldest waited the timeout); the bound
    is ``max_staleness`` against the older of the trainer's and the published version."""

    name = "async"
    needs_live_samplers = False
    poll_timeout_ms = 200

    def __init__(self, batch_fragments: int, poll_max_records: int) -> None:
        self.batch_fragments = batch_fragments
        self.poll_max_records = poll_max_records

    def bound(self, max_staleness: int) -> int:
        return max_staleness

    def reference(self, model_version: int, published: int | None) -> int:
        return model_version if published is None else min(model_version, published)

    def may_train(self, model_version: int, published: int | None, bound: int) -> bool:
        """Not while the trainer is ``max(1, bound)`` versions ahead of the published one: when a slow
        publication catches up, the reference jumps by that much at most, so what samplers made on the
        old published version is not dropped in bulk (it stays within the bound)."""
        return published is None or model_version - published < max(1, bound)

    def take(self, buffer: list[Pending], timed_out: bool, live_samplers: set[str] | None) -> int:
        if len(buffer) < self.batch_fragments and not timed_out:
            return 0
        return min(len(buffer), self.batch_fragments)

    def ahead(self, buffered: int) -> int:
        """Records to take while an update runs: what the next batch still needs, none once it is complete."""
        return min(self.poll_max_records, max(0, self.batch_fragments - buffered))

    def wants(self, buffered: int, may_train: bool = True) -> int:
        # At least one while it may train (the poll also serves the consumer's liveness); none once a batch
        # is held while it may not: records polled then would only wait, and each would free a credit.
        need = self.batch_fragments - buffered
        return min(self.poll_max_records, max(1, need) if may_train else max(0, need))


class SyncBatches:
    """The synchronous baseline: everything buffered once every live sampler contributed a fragment of
    the current version (or on the timeout); bound 0 against the trainer's own version."""

    name = "sync"
    needs_live_samplers = True
    poll_timeout_ms = 20

    def __init__(self, poll_max_records: int) -> None:
        self.poll_max_records = poll_max_records

    def bound(self, max_staleness: int) -> int:
        return 0

    def reference(self, model_version: int, published: int | None) -> int:
        return model_version

    def may_train(self, model_version: int, published: int | None, bound: int) -> bool:
        return True  # samplers wait for each new version themselves

    def take(self, buffer: list[Pending], timed_out: bool, live_samplers: set[str] | None) -> int:
        have = {p.frag.sampler_id for p in buffer}
        if not timed_out and (not live_samplers or not live_samplers <= have):
            return 0
        return len(buffer)

    def wants(self, buffered: int, may_train: bool = True) -> int:
        return self.poll_max_records

    def ahead(self, buffered: int) -> int:
        """Nothing while an update runs: samplers wait for the version that update makes."""
        return 0


BatchStrategy = AsyncBatches | SyncBatches


def strategy_for(mode: str, batch_fragments: int, poll_max_records: int) -> BatchStrategy:
    """The strategy of ``settings.mode``."""
    if mode == "sync":
        return SyncBatches(poll_max_records)
    return AsyncBatches(batch_fragments, poll_max_records)


class Intake:
    def __init__(self, *, max_staleness: int, batch_timeout_s: float, strategy: BatchStrategy,
                 dedup_window: int = DEDUP_WINDOW) -> None:
        self.max_staleness = max_staleness  # as configured; the strategy says what bound applies
        self.batch_timeout_s = batch_timeout_s
        self.strategy = strategy
        self.buffer: list[Pending] = []
        self.model_version = 0  # the version of the trainer's current weights
        self.published: int | None = None  # newest version behind the marker, as last seen
        self.abandoned: list[tuple[int, int]] = []  # version ranges a rollback abandoned: never trained
        self._recent = RecentIds(dedup_window)  # sample ids: a fragment sent twice
        self._offsets: dict[TopicPartition, OffsetSet] = {}  # admitted offsets: a record delivered twice

    # ---- versions ---------------------------------------------------------------------------
    def saw_published(self, version: int) -> None:
        self.published = version if self.published is None else max(self.published, version)

    @property
    def newest(self) -> int:
        """The newest version that exists: nothing can have been produced by a later one."""
        return max(self.model_version, self.published or 0)

    @property
    def reference(self) -> int:
        return self.strategy.reference(self.model_version, self.published)

    @property
    def bound(self) -> int:
        return self.strategy.bound(self.max_staleness)

    def staleness(self, frag: Fragment) -> int:
        return max(0, self.reference - frag.policy_version)

    def abandon(self, first: int, last: int) -> None:
        """A rollback abandoned versions ``first``..``last``: fragments they made are dropped as stale."""
        if first <= last:
            self.abandoned.append((first, last))

    def is_abandoned(self, version: int) -> bool:
        return any(lo <= version <= hi for lo, hi in self.abandoned)

    # ---- admission --------------------------------------------------------------------------
    def admit(self, item: Pending) -> Rejected | None:
        """Buffer ``item`` (None) or say why it is poison."""
        frag = item.frag
        if frag.policy_version > self.newest:
            return Rejected("future_version", f"policy version {frag.policy_version} is newer than any that exists "
                                              f"(newest {self.newest})")
        offsets = self._offsets.get(item.tp)
        if offsets is None:
            offsets = self._offsets[item.tp] = OffsetSet()
        if item.offset in offsets:
            return Rejected("duplicate", f"offset {item.offset} of partition {item.tp.partition} was already "
                                         f"admitted in this trainer run (a re-delivery)")
        if frag.sample_id in self._recent:
            return Rejected("duplicate", f"sample id {frag.sample_id} was already admitted in this trainer run")
        self._recent.add(frag.sample_id, item.tp, item.offset)
        offsets.add(item.offset)
        self.buffer.append(item)
        return None

    # ---- batches ----------------------------------------------------------------------------
    def form_batch(self, now: float, live_samplers: set[str] | None = None, force: bool = False) -> Batch:
        """Drop what is now too stale, then take a batch if the strategy says one is due (``train``
        empty otherwise). ``live_samplers``: for a strategy that waits for every live sampler. ``force``:
        as if the oldest fragment had waited ``batch_timeout_s`` (a data-parallel rank joining an update
        another rank's batch made due)."""
        out = Batch()
        keep = []
        bound = self.bound
        for p in self.buffer:
            s = self.staleness(p.frag)
            if s > bound or self.is_abandoned(p.frag.policy_version):
                out.stale.append((p, s))
            else:
                keep.append(p)
        self.buffer = keep
        if not self.buffer:
            return out
        if not self.strategy.may_train(self.model_version, self.published, bound):
            out.waiting_publication = True
            return out
        timed_out = force or now - self.buffer[0].at > self.batch_timeout_s
        n = self.strategy.take(self.buffer, timed_out, live_samplers)
        if n == 0:
            return out
        out.train, self.buffer = self.buffer[:n], self.buffer[n:]
        out.staleness = [self.staleness(p.frag) for p in out.train]
        return out

    def wants(self) -> int:
        """How many records to poll next: what the next batch still needs (async), so nothing waits in
        the buffer growing stale while a batch trains; 0 while the trainer waits for a publication with a
        batch already held (consuming more would only grant samplers credit for data that waits)."""
        may_train = self.strategy.may_train(self.model_version, self.published, self.bound)
        return self.strategy.wants(len(self.buffer), may_train)

    def wants_ahead(self) -> int:
        """How many records to poll while an update runs: what the next batch still needs (async), so it is
        decoded and waiting when the update ends, and no more (more would only wait, and free credits early);
        none while the trainer may not train (it waits for a publication)."""
        if not self.strategy.may_train(self.model_version, self.published, self.bound):
            return 0
        return self.strategy.ahead(len(self.buffer))

    # ---- rebalances -------------------------------------------------------------------------
    def forget_ids(self, sample_ids: Iterable[str]) -> None:
        """These fragments were not trained after all (their partition left): they may come again. Their
        offsets are found through the id window; :meth:`release` needs no lookup."""
        for tp, offset in self._recent.pop(sample_ids):
            self._forget_offset(tp, offset)

    def put_back(self, items: Iterable[Pending]) -> None:
        """A batch formed and not trained (a rollback or a stop was decided first): back at the front of the
        buffer in its order, still pending in the ledger; the next :meth:`form_batch` checks its staleness again
        (after a rollback, what belongs to abandoned versions is dropped with an outcome, not lost)."""
        self.buffer[:0] = list(items)

    def release(self, items: Iterable[Pending]) -> None:
        """These admitted fragments were not trained after all: their records may come again."""
        items = list(items)
        self._recent.pop(p.frag.sample_id for p in items)
        for p in items:
            self._forget_offset(p.tp, p.offset)

    def revoke(self, partitions: Iterable[TopicPartition]) -> list[Pending]:
        """Remove the buffered fragments of ``partitions``; they will be delivered again. What was
        trained stays remembered: re-delivered to this member after a re-assignment, it is a duplicate."""
        gone = set(partitions)
        removed = [p for p in self.buffer if p.tp in gone]
        self.buffer = [p for p in self.buffer if p.tp not in gone]
        self.release(removed)
        return removed

    def seeked(self, tp: TopicPartition, offset: int) -> None:
        """The consumer was moved back to ``offset`` of ``tp`` (a restore): the records from there on are
        read again and trained again, not duplicates."""
        if tp in self._offsets:
            self._offsets[tp].discard_from(offset)
        self._recent.pop_from(tp, offset)

    def _forget_offset(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._offsets:
            self._offsets[tp].discard(offset)


@dataclass
class Stall:
    since: float
    reason: str


class StallWatch:
    """Records arrive but no update for ``after_s``: stalled, with the reason from what happened since."""

    def __init__(self, after_s: float, now: float) -> None:
        self.after_s = after_s
        self._last_update = now
        self._first_arrival: float | None = None  # first record since the last update
        self._last_arrival = now
        self._counts = {"consumed": 0, "dropped_stale": 0, "dead_lettered": 0}

    def note(self, what: Literal["consumed", "dropped_stale", "dead_lettered"], now: float, n: int = 1) -> None:
        if what == "consumed":
            if self._first_arrival is None:
                self._first_arrival = now
            self._last_arrival = now
        self._counts[what] += n

    def trained(self, now: float) -> None:
        self._last_update = now
        self._first_arrival = None
        self._counts = dict.fromkeys(self._counts, 0)

    def check(self, now: float, reference: int | None = None) -> Stall | None:
        if self._first_arrival is None or now - max(self._last_update, self._first_arrival) < self.after_s:
            return None
        if now - self._last_arrival >= self.after_s:
            return None  # nothing arrives any more (samplers paused, a stray poison record): idle, not stalled
        c = self._counts
        n = c["consumed"]
        if c["dropped_stale"] >= n:
            why = f"all {n} fragments since the last update were dropped as stale (reference version {reference})"
        elif c["dead_lettered"] >= n:
            why = f"all {n} records since the last update were dead-lettered"
        elif c["dropped_stale"] + c["dead_lettered"] >= n:
            why = f"all {n} records since the last update were dropped as stale or dead-lettered"
        else:
            why = f"{n} records arrived but no update for {now - self._last_update:.0f} s"
        return Stall(since=max(self._last_update, self._first_arrival), reason=why)
