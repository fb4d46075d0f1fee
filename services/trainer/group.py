"""The trainer's side of the consumer group: which partitions it owns, what each record's outcome is
(the :class:`~services.trainer.ledger.OffsetLedger`), committing, dead-lettering, and where a partition
is read from when it is assigned.

Explicit inputs only (a record source, a publisher, settings, a health object): it never calls back
into the trainer. The trainer serialises it with the update: its revoke callback
(:meth:`Trainer._on_revoke <services.trainer.service.Trainer._on_revoke>`) marks the partitions
:attr:`~ConsumerGroup.revoking`, then calls :meth:`ConsumerGroup.commit` under the trainer's update lock
and :meth:`ConsumerGroup.forget` after it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError, RebalanceInProgressError

from services.trainer.ledger import ORIGIN, OffsetLedger, Outcome, tp_key
from services.trainer.telemetry import COMMIT_FAILURES, RECORDS_LOST
from shared.bus import Publisher, Record, RecordSource
from shared.fragment import header_dict
from shared.retry import Health, Retrier, describe
from shared.runtime import Auditor

POSITION_WAIT_S = 1.0
"""Longest :meth:`ConsumerGroup.find_lost` waits for a partition's position (it has none while resetting)."""
DLQ_HEADER_BUDGET = 16_384
"""Bytes of the original record's headers a dead-letter copy keeps (the rest are summarised), so the copy
always fits the topic's message limit."""


class ConsumerGroup:
    def __init__(self, source: RecordSource, producer: Publisher, *, samples_topic: str, dlq_topic: str,
                 max_message_bytes: int, kafka_timeout_s: float, health: Health, retry: Retrier, audit: Auditor,
                 log: Any) -> None:
        self.source = source
        self.producer = producer
        self.samples_topic = samples_topic
        self.dlq_topic = dlq_topic
        self.max_message_bytes = max_message_bytes
        self.kafka_timeout_s = kafka_timeout_s
        self.health = health
        self.retry = retry
        self.audit = audit
        self.log = log
        self.ledger = OffsetLedger()
        # Where a partition this model never saw is read from: the run's origin (offset 0), so records that
        # left the log before the trainer read them are found and named (``lost``). False only for the first
        # process of a deliberate fresh start, whose new model begins at the group's offsets.
        self.unseen_from_origin = True
        # Partitions being revoked: aiokafka's assignment() still lists them until the rejoin completes,
        # so this set (filled first thing in the revoke callback) is what says "no longer ours".
        self.revoking: set[TopicPartition] = set()
        self.hold_commits = False  # a fresh run commits nothing until its first checkpoint holds what it trained
        self._commit_lock = asyncio.Lock()
        self.in_hand: dict[TopicPartition, int] = {}  # the lowest offset polled and not yet taken, per partition
        self._ahead: dict[TopicPartition, tuple[int, int]] = {}  # (expected, position) at the last look
        self._looked: dict[TopicPartition, tuple[int, int]] = {}  # pairs already given to _skipped

    # ---- ownership ------------------------------------------------------------------------
    def owned(self, tp: TopicPartition) -> bool:
        return tp not in self.revoking and tp in self.source.assignment()

    def assigned(self, partitions: set[TopicPartition]) -> None:
        """Read every assigned partition from where this model's ledger ends (the checkpoint's offsets
        after a restore, the frontier after a revoke): records after it are in no model of this run, so
        they are trained (again) exactly once. Partitions the model never saw start at the run's origin
        (offset 0; after a deliberate fresh start, at the group's offset)."""
        self.revoking -= partitions
        for tp in sorted(partitions, key=lambda t: (t.topic, t.partition)):
            off = self.ledger.resume_offset(tp)
            if off is not None:
                self.source.seek(tp, off)
                # The next commit moves the group here too: a rebalance before this partition's first record
                # must not hand the next owner the (later) offsets a crashed run committed.
                self.ledger.seeked(tp, off)
                self.log.info("resumed_from_ledger_offset", partition=tp.partition, offset=off)
            elif self.unseen_from_origin:
                self.source.seek(tp, ORIGIN)
                self.ledger.begin(tp, ORIGIN)  # its range starts here: records already gone are found as lost
                self.log.info("started_at_origin", partition=tp.partition, offset=ORIGIN)

    def forget(self, partitions: set[TopicPartition]) -> None:
        self.ledger.forget(partitions)

    # ---- outcomes -------------------------------------------------------------------------
    async def consumed(self, tp: TopicPartition, offset: int) -> bool:
        """False for a re-delivered record that already has an outcome in this model (skip it), or for one of
        a partition revoked meanwhile. A record beyond the next expected offset means the consumer skipped
        offsets: those the log start has passed were lost before training (:meth:`_skipped`)."""
        expected = self.ledger.expected(tp)
        if expected is not None and offset > expected:
            await self._skipped(tp, expected, offset)
            if not self.owned(tp):
                return False
        return self.ledger.consumed(tp, offset)

    async def _skipped(self, tp: TopicPartition, expected: int, offset: int) -> None:
        """The consumer jumped from ``expected`` to ``offset``. Where the log start is past ``expected``, the
        records in between left the log (retention, ``deleteRecords``, a reset to the log start) before this
        model read them: recorded as ``lost`` in the ledger (``flywheel verify`` then fails, naming them),
        counted, logged as an error and audited. The rest of the jump holds no record (a ``gap``)."""
        log_start = await self.retry(lambda: self.source.log_start(tp), "read log start", "kafka",
                                     timeout_s=self.kafka_timeout_s)
        hi = min(log_start, offset)
        if hi <= expected or not self.owned(tp) or self.ledger.expected(tp) != expected:
            return
        self.ledger.lost(tp, expected, hi)
        n = hi - expected
        RECORDS_LOST.inc(n)
        self.log.error("records_lost_before_training", partition=tp.partition, from_offset=expected, to_offset=hi,
                       count=n, log_start=log_start,
                       hint="retention or deleteRecords removed them before the trainer read them")
        await self.audit("records_lost_before_training",
                         {"topic": tp.topic, "partition": tp.partition, "from_offset": expected, "to_offset": hi,
                          "count": n, "log_start": log_start},
                         f"{n} record(s) left the log untrained; flywheel verify names them until the run ends")

    async def find_lost(self) -> None:
        """Records that left the log while no later record came to show it (every untrained record of a
        partition deleted, and the samplers waiting for credits those records held): where the consumer's
        position, capped at the lowest record polled and not yet taken (``in_hand``), is past the ledger's next
        expected offset at two looks in a row, :meth:`_skipped` decides from the log start whether they were lost.
        Each jump is looked into once."""
        ahead: dict[TopicPartition, tuple[int, int]] = {}
        for tp in sorted(self.source.assignment(), key=lambda t: t.partition):
            expected = self.ledger.expected(tp)
            if tp.topic != self.samples_topic or expected is None or not self.owned(tp):
                continue
            try:
                position = await asyncio.wait_for(self.source.position(tp), POSITION_WAIT_S)
            except (TimeoutError, KafkaError):  # resetting, or the assignment changed meanwhile: the next look
                continue
            # Records polled and not yet taken are past the position already: they are not lost.
            position = min(position, self.in_hand.get(tp, position))
            if position <= expected:
                continue
            pair = (expected, position)
            if self._ahead.get(tp) == pair and self._looked.get(tp) != pair:
                self._looked[tp] = pair
                await self._skipped(tp, expected, position)
            ahead[tp] = pair
        self._ahead = ahead

    def lost(self) -> tuple[int, list[int]]:
        """Records of this run that left the log before the model read them, and their partitions (the
        heartbeat, ``/status``); from the ledger, so a restarted trainer still reports them."""
        counts = self.ledger.lost_counts()
        return sum(counts.values()), sorted(tp.partition for tp in counts)

    def seen(self) -> dict[int, int]:
        """Per owned partition of the samples topic, the offset below which every record reached this trainer
        or left the log first (the ledger's next expected offset). Credit grants carry it (``CreditGrant.seen``),
        so a sampler stops counting a fragment that will never be consumed."""
        out: dict[int, int] = {}
        for tp in self.source.assignment():
            expected = self.ledger.expected(tp)
            if tp.topic == self.samples_topic and expected is not None and self.owned(tp):
                out[tp.partition] = expected
        return out

    def finished(self, tp: TopicPartition, offset: int, outcome: Outcome) -> None:
        self.ledger.finished(tp, offset, outcome)

    async def dead_letter(self, tp: TopicPartition, rec: Record, reason: str, error: str) -> bool:
        """Copy ``rec`` to the dead-letter topic with the reason, then mark it finished. Only once the topic
        has it is the record done (until then it is not committed). False if the partition was revoked
        meanwhile (the next owner handles it again)."""
        headers, value = dead_letter_copy(tp, rec, reason, error, self.max_message_bytes)
        await self.retry(lambda: self.producer.send_and_wait(self.dlq_topic, value, key=rec.key, headers=headers),
                         "dead-letter send", "kafka", timeout_s=self.kafka_timeout_s)
        if not self.owned(tp):
            return False
        self.ledger.finished(tp, rec.offset, "dead")
        return True

    # ---- commits --------------------------------------------------------------------------
    async def commit(self, include: set[TopicPartition] | None = None) -> None:
        """Commit every frontier that moved, on partitions this member owns. A retriable failure (coordinator
        moved, timeout, connection) or a rebalance in progress is logged and left for the next commit, which
        carries the same offsets (commits are cumulative): not committing only means re-delivery after a
        crash, never loss. Restarts resume from the checkpoint's offsets anyway."""
        if self.hold_commits:
            return
        async with self._commit_lock:  # in order: a later commit never lands before an earlier one
            owned = {tp for tp in self.source.assignment() if tp not in self.revoking} | (include or set())
            offsets = {tp: off for tp, off in self.ledger.committable().items() if tp in owned}
            if not offsets:
                return
            try:
                # aiokafka retries retriable errors itself, without end: bound the wait, so an unreachable
                # coordinator delays commits (logged, counted) instead of stalling updates and stop.
                await asyncio.wait_for(self.source.commit(offsets), self.kafka_timeout_s)
            except (KafkaError, TimeoutError) as exc:
                # IllegalStateError: the assignment changed between the snapshot above and the commit.
                retriable = isinstance(exc, (TimeoutError, CommitFailedError, RebalanceInProgressError,
                                             IllegalStateError)) or bool(getattr(exc, "retriable", False))
                if not retriable:
                    raise
                COMMIT_FAILURES.inc()
                self.health.degraded("kafka", f"commit failed: {describe(exc)}")
                self.log.warning("commit_failed", error=describe(exc),
                                 offsets={f"{tp.partition}": o for tp, o in offsets.items()})
                return
            self.ledger.mark_committed(offsets)
            self.health.recovered("kafka")
        self.log.debug("offsets_committed", offsets={f"{tp.partition}": o for tp, o in offsets.items()})

    # ---- checkpoints ----------------------------------------------------------------------
    async def checkpoint_state(self) -> tuple[dict[str, int], dict[str, Any]]:
        """What the model reflects: every partition it ever read (revoked ones included: the model still
        holds their records) at its frontier, plus assigned partitions it has not read yet at the consumer's
        position. Raises TimeoutError (the checkpoint is deferred) rather than forget a partition."""
        offsets = self.ledger.snapshot()
        for tp in self.source.assignment():
            if tp_key(tp) not in offsets:
                offsets[tp_key(tp)] = await asyncio.wait_for(self.source.position(tp), 5)
        return offsets, self.ledger.state()

    def restore(self, ledger_state: dict[str, Any], offsets: dict[str, int]) -> None:
        self.ledger.restore(ledger_state, offsets)


def dead_letter_copy(tp: TopicPartition, rec: Record, reason: str, error: str,
                     max_message_bytes: int) -> tuple[list[tuple[str, bytes]], bytes]:
    """The dead-letter record for ``rec``: its headers (cut to a budget) plus ``dlq-*`` ones, and its value
    unless the copy would exceed the topic's message limit (then the payload stays on the samples topic,
    named by ``dlq-source``): a dead-letter send must never fail for size, or the record comes back after
    every restart."""
    original = list(rec.headers or [])
    kept: list[tuple[str, bytes]] = []
    used = 0
    for k, v in original:
        size = len(k) + len(v) + 16
        if used + size > DLQ_HEADER_BUDGET:
            break
        kept.append((k, v))
        used += size
    headers = kept + [
        ("dlq-reason", reason.encode()),
        ("dlq-error", error[:1000].encode("utf-8", "replace")),
        ("dlq-source", f"{tp.topic}:{tp.partition}:{rec.offset}".encode()),
        ("dlq-at", repr(time.time()).encode()),
    ]
    if len(kept) < len(original):
        dropped = len(original) - len(kept)
        headers.append(("dlq-headers-truncated", f"{dropped} of {len(original)} headers not copied".encode()))
    value = rec.value
    overhead = sum(len(k) + len(v) + 16 for k, v in headers) + len(rec.key or b"") + 512
    if value is not None and len(value) + overhead > max_message_bytes:
        headers.append(("dlq-truncated", f"payload of {len(value)} bytes not copied".encode()))
        value = b""  # not None: a record needs a key or a value
    return headers, value if value is not None else b""


def source_of(rec: Record) -> tuple[str, int, int] | None:
    """``(topic, partition, offset)`` a dead-letter copy names, or None."""
    raw = header_dict(rec.headers).get("dlq-source")
    if not raw:
        return None
    topic, _, rest = raw.rpartition(":")
    topic, _, part = topic.rpartition(":")
    try:
        return topic, int(part), int(rest)
    except ValueError:
        return None
