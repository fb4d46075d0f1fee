"""Every consumed record gets exactly one outcome: admitted to wait for a batch (then trained), dropped
as stale, or dead-lettered — each counted, logged once with the fragment's identity, and folded into the
ledger (``ConsumerGroup``). The rules of what is admitted are pure (``intake.py``); this part moves a
record between them and the group. Explicit inputs only; it never calls back into the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import TopicPartition

from services.trainer import telemetry as m
from services.trainer.group import ConsumerGroup
from services.trainer.intake import Batch, Intake, Pending, StallWatch
from services.trainer.learner import Learner
from shared.bus import Record
from shared.credits import H_SAMPLER_SEQ, Consumption
from shared.fragment import H_SAMPLER_ID, FragmentError, FragmentSpec, decode_fragment, header_dict
from shared.identity import IdentityCheck, fragment_message, record_time
from shared.logging import fragment_fields


class RecordOutcomes:
    def __init__(self, *, group: ConsumerGroup, intake: Intake, stall: StallWatch, consumption: Consumption,
                 stats: m.TrainerStats, spec: FragmentSpec, log: Any, consumed: asyncio.Event,
                 refresh_published: Callable[[], Awaitable[bool]], identity: IdentityCheck,
                 audit: Callable[[str, dict[str, Any], str], Awaitable[None]]) -> None:
        self.group = group
        self.intake = intake
        self.stall = stall
        self.consumption = consumption
        self.stats = stats
        self.spec = spec
        self.log = log
        self.consumed = consumed  # wakes the credit-grant task
        self.refresh_published = refresh_published
        self.identity = identity  # sampler ids bound to their keys (shared.identity)
        self.audit = audit

    async def take(self, tp: TopicPartition, rec: Record, learner: Learner) -> None:
        """One polled record: skipped (a re-delivery that already has an outcome), dead-lettered, or admitted."""
        if not await self.group.consumed(tp, rec.offset):
            self.log.info("redelivered_record_skipped", partition=tp.partition, offset=rec.offset)
            return
        m.CONSUMED.inc()
        now = time.monotonic()
        self.stall.note("consumed", now)
        try:
            frag = decode_fragment(rec.headers, rec.value, self.spec)
        except FragmentError as err:
            await self.dead_letter(tp, rec, err.reason, str(err))
            return
        # A fragment under an id bound to another key is refused before it counts for anything: another process
        # cannot take a sampler's credits or pass its data off as that sampler's.
        if not await self._identity_holds(tp, rec, frag.sampler_id):
            return
        # Credits count valid fragments only: poison never takes a sampler's window.
        h = header_dict(rec.headers)
        self.consumption.saw(h.get(H_SAMPLER_ID) or "?", h.get(H_SAMPLER_SEQ), now)
        self.consumed.set()
        rejected = self.intake.admit(Pending(tp, rec.offset, frag, now))
        if rejected is not None and rejected.reason == "future_version" and await self.refresh_published():
            rejected = self.intake.admit(Pending(tp, rec.offset, frag, now))  # a version we had not heard of yet
        if rejected is not None:
            await self.dead_letter(tp, rec, rejected.reason, rejected.message)
            return
        learner.record_returns(frag)
        self.log.info("fragment_consumed", **fragment_fields(frag.sample_id, frag.sampler_id, frag.policy_version,
                                                              tp.partition, rec.offset))

    async def _identity_holds(self, tp: TopicPartition, rec: Record, sampler_id: str) -> bool:
        refused = self.identity.refusal("fragment", sampler_id, rec.headers, fragment_message(rec.headers, rec.value),
                                        record_time(rec), partition=tp.partition, offset=rec.offset)
        if refused is None:
            return True
        if refused.news:
            await self.audit("sampler_identity_refused", refused.audit, "dead-lettered")
        await self.dead_letter(tp, rec, "sampler_identity", str(refused.error))
        return False

    def drop_stale(self, batch: Batch) -> None:
        now = time.monotonic()
        for p, staleness in batch.stale:
            self.group.finished(p.tp, p.offset, "dropped")
            m.DROPPED.inc()
            self.stats.dropped += 1
            self.stats.lags.dropped(p.frag.sampler_id, now)
            self.stall.note("dropped_stale", now)
            f = p.frag
            self.log.info("fragment_dropped_stale", outcome="dropped_stale", staleness=staleness,
                          max_staleness=self.intake.bound, reference_version=self.intake.reference,
                          **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))

    async def dead_letter(self, tp: TopicPartition, rec: Record, reason: str, error: str) -> None:
        if not await self.group.dead_letter(tp, rec, reason, error):
            return  # revoked meanwhile: the new owner handles it (again)
        m.DEAD.labels(reason=reason).inc()
        self.stats.dead_lettered += 1
        self.stall.note("dead_lettered", time.monotonic())
        h = header_dict(rec.headers)
        self.log.warning("fragment_dead_lettered", outcome="dead_lettered", reason=reason, error=error[:500],
                         sample_id=h.get("sample-id"), sampler_id=h.get("sampler-id"),
                         policy_version=h.get("policy-version"), partition=tp.partition, offset=rec.offset)
