"""Which offsets may be committed: everything consumed up to the first record not yet finished.

A record is *finished* once it was trained (after the optimizer step), dropped as stale, or
dead-lettered (after the dead-letter send was acknowledged). Committing ``min(pending)`` per
partition — or one past the last consumed offset when nothing is pending — never skips a record
that was not finished, so a crash re-delivers exactly the unfinished tail.
"""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetLedger:
    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}  # one past the highest consumed offset
        self._pending: dict[TopicPartition, set[int]] = {}
        self._committed: dict[TopicPartition, int] = {}

    def consumed(self, tp: TopicPartition, offset: int, pending: bool) -> None:
        """Note a consumed record; ``pending`` if it still has to be trained."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        if pending:
            self._pending.setdefault(tp, set()).add(offset)

    def finished(self, tp: TopicPartition, offset: int) -> None:
        """A pending record was trained (or otherwise disposed of)."""
        self._pending.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Offsets to commit now: only partitions that moved past their last commit."""
        out = {}
        for tp, nxt in self._next.items():
            pending = self._pending.get(tp)
            pos = min(pending) if pending else nxt
            if pos > self._committed.get(tp, -1):
                out[tp] = pos
        return out

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            self._committed[tp] = max(self._committed.get(tp, -1), off)

    def seeked(self, tp: TopicPartition, offset: int) -> None:
        """The consumer was moved to ``offset`` (a restore): nothing before it is pending, and the next
        commit names ``offset`` even when the group's committed offset is further on."""
        self._next[tp] = offset
        self._pending.pop(tp, None)
        self._committed.pop(tp, None)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Partitions were revoked: their unfinished records will go to the new owner."""
        for tp in partitions:
            self._next.pop(tp, None)
            self._pending.pop(tp, None)
            self._committed.pop(tp, None)

    def snapshot(self) -> dict[str, int]:
        """Committable positions as ``"topic:partition" -> offset`` (for checkpoints and logs)."""
        out = {}
        for tp, nxt in self._next.items():
            pending = self._pending.get(tp)
            out[f"{tp.topic}:{tp.partition}"] = min(pending) if pending else nxt
        return out
