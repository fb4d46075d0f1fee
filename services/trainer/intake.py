"""Which fragments train, and when: the trainer's rules as pure classes (no I/O; the clock is passed in).

:class:`Intake` (DESIGN.md, the loop, 3):

- **admit** a decoded fragment: a policy version newer than any that exists is poison
  (``future_version``); a sample id already admitted in this trainer run is a ``duplicate`` (so no
  record is trained twice within a run, whatever Kafka re-delivers); otherwise it waits.
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
- **revoke**: fragments of revoked partitions leave the buffer and their sample ids are forgotten
  (the new owner, or this member after a re-assignment, gets them again).

:class:`StallWatch`: training has stalled when records keep arriving but no update happened for
``after_s`` seconds; it says why (all dropped as stale, all dead-lettered, waiting for a batch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from aiokafka import TopicPartition

from shared.fragment import Fragment

DEDUP_WINDOW = 200_000
"""Sample ids remembered for de-duplication (a few MB); far more than one run's re-delivery window."""


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
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._window = dedup_window

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
        if frag.sample_id in self._seen:
            return Rejected("duplicate", f"sample id {frag.sample_id} was already admitted in this trainer run")
        self._seen[frag.sample_id] = None
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)
        self.buffer.append(item)
        return None

    # ---- batches ----------------------------------------------------------------------------
    def form_batch(self, now: float, live_samplers: set[str] | None = None) -> Batch:
        """Drop what is now too stale, then take a batch if the strategy says one is due (``train``
        empty otherwise). ``live_samplers``: for a strategy that waits for every live sampler."""
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
        timed_out = now - self.buffer[0].at > self.batch_timeout_s
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

    # ---- rebalances -------------------------------------------------------------------------
    def forget_ids(self, sample_ids: Iterable[str]) -> None:
        """These fragments were not trained after all (their partition left): they may come again."""
        for sid in sample_ids:
            self._seen.pop(sid, None)

    def revoke(self, partitions: Iterable[TopicPartition]) -> list[Pending]:
        """Remove the buffered fragments of ``partitions``; they will be delivered again."""
        gone = set(partitions)
        removed = [p for p in self.buffer if p.tp in gone]
        self.buffer = [p for p in self.buffer if p.tp not in gone]
        for p in removed:
            self._seen.pop(p.frag.sample_id, None)
        return removed


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
