"""What the model reflects, per partition, and which offsets may be committed.

Every consumed record ends in exactly one outcome: ``trained`` (after the optimizer step), ``dropped``
(stale) or ``dead`` (dead-lettered, after the dead-letter send was acknowledged). Per partition the
ledger keeps a *frontier*: every offset in ``[start, frontier)`` has an outcome, and those outcomes
are folded into order-independent digests (a count and a 64-bit multiset hash of the offsets, one per
outcome) and into run-length ranges (which name offsets when a check fails). Offsets the trainer read
past without a record come in two kinds: ``lost`` when the log start had moved past them (retention or
``deleteRecords`` removed them before they were trained: :meth:`OffsetLedger.lost`, which the trainer
reports loudly), ``gap`` otherwise (the log held no record there).

Invariants:
- ``start`` is the partition's *origin*, where the run began on it: offset 0 (the run's samples topic is
  the run's own; ``ConsumerGroup.assigned`` starts every partition this model never saw there), or, after
  a deliberate fresh start, the first offset the new model read. It never moves, and the digests cover
  everything since, so pruning old checkpoints cannot break the chain: the newest checkpoint alone proves
  the run.
- The frontier is the commit position and the checkpoint's resume offset: committing it never skips a
  record without an outcome, so a crash re-delivers exactly the unfinished tail.
- ``trained + dropped + dead + gap + lost`` digests equal :func:`range_digest` of ``[start, frontier)``:
  every offset exactly once. ``flywheel verify`` (``services.admin.verify``) checks this from a checkpoint
  alone, and checks the outcomes against the topics; a ``lost`` outcome fails it.
- The ledger is saved in the same checkpoint blob as the weights (``Learner.state_bytes``), taken while
  no update runs, so the ``trained`` digest covers exactly the records whose gradients are in them.
- A revoked partition keeps its frontier and digests (the model still reflects them); its unfinished
  records are forgotten (the next owner, or this member after a re-assignment, reads them again from the
  frontier: :meth:`OffsetLedger.resume_offset`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition

from shared.digest import ORIGIN, OUTCOMES, Digest, Outcome, mix64, range_digest

__all__ = ["ORIGIN", "OUTCOMES", "Digest", "OffsetLedger", "Outcome", "PartitionLedger", "mix64", "range_digest"]

def _extend(ranges: list[list[int]], lo: int, hi: int | None = None) -> None:
    """Append ``[lo, hi)`` (one offset when ``hi`` is None) to sorted run-length ranges, merging when adjacent."""
    hi = lo + 1 if hi is None else hi
    if ranges and ranges[-1][1] == lo:
        ranges[-1][1] = hi
    else:
        ranges.append([lo, hi])


@dataclasses.dataclass
class PartitionLedger:
    start: int
    frontier: int
    next: int  # one past the highest consumed offset (== frontier when nothing is in flight)
    digests: dict[str, Digest] = dataclasses.field(default_factory=lambda: {k: Digest() for k in OUTCOMES})
    ranges: dict[str, list[list[int]]] = dataclasses.field(default_factory=lambda: {k: [] for k in OUTCOMES})
    pending: set[int] = dataclasses.field(default_factory=set)
    done: dict[int, Outcome] = dataclasses.field(default_factory=dict)  # finished, above the frontier
    lost: list[list[int]] = dataclasses.field(default_factory=list)  # lost ranges above the frontier, in order

    def fold(self, offset: int, outcome: Outcome) -> None:
        self.digests[outcome].add(offset)
        _extend(self.ranges[outcome], offset)

    def advance(self) -> None:
        while self.frontier < self.next and self.frontier not in self.pending:
            if self.lost and self.lost[0][0] == self.frontier:  # a lost range folds whole (it may be millions)
                lo, hi = self.lost.pop(0)
                self.digests["lost"] = self.digests["lost"] + range_digest(lo, hi)
                _extend(self.ranges["lost"], lo, hi)
                self.frontier = hi
                continue
            outcome = self.done.pop(self.frontier, "gap")
            self.fold(self.frontier, outcome)
            self.frontier += 1

    def clear_unfinished(self) -> None:
        self.pending.clear()
        self.done.clear()
        self.lost.clear()

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.frontier,
                "digests": {k: d.to_json() for k, d in self.digests.items()},
                "ranges": {k: [list(r) for r in v] for k, v in self.ranges.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionLedger:
        end = int(d["end"])
        p = cls(start=int(d["start"]), frontier=end, next=end)
        for k in OUTCOMES:
            if k in (d.get("digests") or {}):
                p.digests[k] = Digest.from_json(d["digests"][k])
            p.ranges[k] = [[int(a), int(b)] for a, b in (d.get("ranges") or {}).get(k, [])]
        return p


def tp_key(tp: TopicPartition) -> str:
    return f"{tp.topic}:{tp.partition}"


def parse_tp(key: str) -> TopicPartition:
    topic, _, part = key.rpartition(":")
    return TopicPartition(topic, int(part))


class OffsetLedger:
    def __init__(self) -> None:
        self._parts: dict[TopicPartition, PartitionLedger] = {}
        self._committed: dict[TopicPartition, int] = {}

    def _part(self, tp: TopicPartition, offset: int) -> PartitionLedger:
        p = self._parts.get(tp)
        if p is None:  # first record of a partition this model never saw: its ledger starts here
            p = self._parts[tp] = PartitionLedger(start=offset, frontier=offset, next=offset)
            self._committed.setdefault(tp, offset)  # nothing to commit until the frontier moves
        return p

    def consumed(self, tp: TopicPartition, offset: int) -> bool:
        """Note a consumed record; it is pending until :meth:`finished` gives it an outcome. False (and
        nothing noted) for an offset that already has an outcome or is pending: a re-delivery to skip."""
        p = self._part(tp, offset)
        if offset < p.frontier or offset in p.pending or offset in p.done:
            return False
        p.pending.add(offset)
        p.next = max(p.next, offset + 1)
        return True

    def begin(self, tp: TopicPartition, origin: int) -> None:
        """Start the ledger of a partition this model never saw at ``origin`` (nothing to commit until it moves)."""
        self._part(tp, origin)

    def expected(self, tp: TopicPartition) -> int | None:
        """The next offset this ledger expects on ``tp`` (one past the highest consumed or seeked), None for a
        partition it never saw. A consumed offset beyond it means the consumer skipped offsets."""
        p = self._parts.get(tp)
        return None if p is None else p.next

    def lost(self, tp: TopicPartition, lo: int, hi: int) -> None:
        """Offsets ``[lo, hi)`` left the log before this model read them (the log start moved past them):
        they get the outcome ``lost``. Only offsets not yet consumed: ``lo`` is :meth:`expected`."""
        p = self._parts.get(tp)
        if p is None or hi <= lo:
            return
        if lo != p.next:
            raise ValueError(f"lost range [{lo}, {hi}) of {tp_key(tp)} does not start at the next expected "
                             f"offset {p.next}")
        p.lost.append([lo, hi])
        p.next = hi
        p.advance()

    def finished(self, tp: TopicPartition, offset: int, outcome: Outcome) -> None:
        """A pending record was trained, dropped as stale or dead-lettered."""
        p = self._parts.get(tp)
        if p is None or offset not in p.pending:
            return  # forgotten by a revoke meanwhile: the next reader gives it its outcome
        p.pending.discard(offset)
        p.done[offset] = outcome
        p.advance()

    def committable(self) -> dict[TopicPartition, int]:
        """Offsets to commit now: only partitions that moved past their last commit."""
        return {tp: p.frontier for tp, p in self._parts.items() if p.frontier > self._committed.get(tp, -1)}

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            self._committed[tp] = max(self._committed.get(tp, -1), off)

    def resume_offset(self, tp: TopicPartition) -> int | None:
        """Where this model reads ``tp`` from when it is assigned: its frontier (None: never seen)."""
        p = self._parts.get(tp)
        return None if p is None else p.frontier

    def seeked(self, tp: TopicPartition, offset: int) -> None:
        """The consumer was moved to ``offset``: the next commit names it even when the group's committed
        offset is further on. Seeking ahead of the frontier records the skipped offsets as a gap."""
        p = self._part(tp, offset)
        p.clear_unfinished()
        p.next = max(p.frontier, offset)
        p.advance()
        self._committed.pop(tp, None)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions were revoked: their unfinished records go to the next reader; what the model reflects
        (frontier and digests) stays, for checkpoints and for a later re-assignment."""
        for tp in partitions:
            p = self._parts.get(tp)
            if p is not None:
                p.clear_unfinished()
                p.next = p.frontier
            self._committed.pop(tp, None)

    def lost_counts(self) -> dict[TopicPartition, int]:
        """Per partition with any, the records that left the log before this model read them (folded or not):
        this run's, carried across restarts by the checkpoints."""
        out: dict[TopicPartition, int] = {}
        for tp, p in self._parts.items():
            n = sum(hi - lo for lo, hi in p.ranges["lost"]) + sum(hi - lo for lo, hi in p.lost)
            if n:
                out[tp] = n
        return out

    def snapshot(self) -> dict[str, int]:
        """Frontiers as ``"topic:partition" -> offset`` (checkpoint offsets, logs)."""
        return {tp_key(tp): p.frontier for tp, p in self._parts.items()}

    def state(self) -> dict[str, dict[str, Any]]:
        """The per-partition ledger a checkpoint stores beside the weights."""
        return {tp_key(tp): p.to_json() for tp, p in self._parts.items()}

    def restore(self, state: dict[str, dict[str, Any]], offsets: dict[str, int]) -> None:
        """Load a checkpoint's ledger; partitions it names only by offset (older checkpoints) start there."""
        self._parts.clear()
        self._committed.clear()
        for key, d in state.items():
            self._parts[parse_tp(key)] = PartitionLedger.from_json(d)
        for key, off in offsets.items():
            tp = parse_tp(key)
            if tp not in self._parts:
                self._parts[tp] = PartitionLedger(start=int(off), frontier=int(off), next=int(off))

    def export(self, partitions: Iterable[TopicPartition]) -> dict[str, dict[str, Any]]:
        """The entries of ``partitions`` (the ones this rank owns) for the other ranks (:meth:`adopt`)."""
        return {tp_key(tp): self._parts[tp].to_json() for tp in partitions if tp in self._parts}

    def adopt(self, entries: dict[str, dict[str, Any]], owned: set[TopicPartition]) -> None:
        """Take another rank's entries for partitions this rank does not own (data-parallel ranks exchange
        them after every update): this rank's checkpoint then holds what every rank trained, and a partition
        assigned to it later is read from where the model ends. The owner's entry is the truth, even one
        behind this rank's own older entry (records this rank dropped after the last exchange and before a
        revoke are read again by the new owner and get their outcome there)."""
        for key, d in entries.items():
            tp = parse_tp(key)
            if tp in owned:
                continue
            self._parts[tp] = PartitionLedger.from_json(d)
            self._committed.pop(tp, None)

    def partitions(self) -> set[TopicPartition]:
        return set(self._parts)
