"""Checkpoints: the model, its optimizer and the ledger of what it reflects, behind ``checkpoints/LATEST``.

A checkpoint is one content-addressed blob (weights, optimizer, counters, offsets and the per-partition
ledger, written by ``Learner.state_bytes``) and a marker record naming it, whose ``extra`` repeats the
offsets and ledger for readers without torch (``flywheel verify``) plus the lineage, abandoned versions
and the fresh-start stamp. The marker moves by a conditional write; a retried PUT that had in fact
succeeded is recognised by its sha256.

Restore: the newest usable checkpoint, falling back to older ones (each refusal audited); never from
scratch while checkpoints exist, unless ``trainer.fresh_start``, which is honoured once: the checkpoints
it writes carry its stamp, so a setting left on does not wipe the run again at every restart.

Explicit inputs only; it never calls back into the trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.trainer.group import ConsumerGroup
from services.trainer.intake import Intake
from services.trainer.learner import Learner
from services.trainer.telemetry import CHECKPOINTS, DEFERRED
from shared.marker import BadPayload, MarkerConflict, VersionedStore, VersionRecord
from shared.retry import Health, Retrier, describe, is_transient
from shared.runtime import Auditor
from shared.signing import SignatureRefused


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restore found: the checkpoint's record and what the model reflects."""

    step: int
    offsets: dict[str, int]
    ledger: dict[str, Any]
    lineage: int
    abandoned: list[tuple[int, int]]
    fresh_start_at: float | None


class Checkpoints:
    def __init__(self, store: VersionedStore, *, keep: int, health: Health, retry: Retrier, audit: Auditor,
                 log: Any, run: str | None = None, sign: Callable[[VersionRecord], VersionRecord] | None = None,
                 check: Callable[[VersionRecord], None] | None = None) -> None:
        """``run``: written into every checkpoint record (``extra["run"]``); ``sign``: the trainer's signature on it
        (``Signer.sign_checkpoint``, which writes the run too); ``check``: raises to refuse a record at restore
        (``PolicyVerifier.check_checkpoint``: another run's, or unsigned or badly signed where signing is on)."""
        self.store = store
        self.run = run
        self.sign = sign
        self.check = check
        self.refused_records: list[str] = []  # what ``check`` refused at the last restore
        self.keep = keep
        self.health = health
        self.retry = retry
        self.audit = audit
        self.log = log
        self.last: int | None = None  # the step of the newest checkpoint written or restored
        self.last_offsets: dict[str, int] = {}  # the offsets it holds
        self.fresh_start_at: float | None = None  # carried by every checkpoint after a deliberate fresh start

    async def write(self, step: int, data: bytes, extra: dict[str, Any]) -> str:
        """Store ``data`` (``Learner.state_bytes``) as the checkpoint of ``step`` and move the marker."""
        extra = dict(extra)
        if self.fresh_start_at is not None:
            extra["fresh_start_at"] = self.fresh_start_at

        def write() -> str:
            current = self.store.read_marker()
            # Content-addressed under the step: a key never holds two different contents, so a blob left by a
            # crash before its marker write can never be mistaken for a later checkpoint.
            sha = hashlib.sha256(data).hexdigest()
            key, _ = self.store.put_blob(data, f"{self.store.prefix}/{step}/{sha}.pt")
            rec = VersionRecord(version=step, blob=key, sha256=sha, size=len(data), trainer_step=step, extra=extra)
            if self.sign is not None:
                rec = self.sign(rec)
            elif self.run is not None:
                rec = dataclasses.replace(rec, extra={**extra, "run": self.run})
            try:
                self.store.publish(rec, None if current is None else current[1])
            except MarkerConflict:
                # A retried conditional PUT that had in fact succeeded answers 412: the marker is ours then.
                now = self.store.read_marker()
                if now is None or now[0].sha256 != sha:
                    raise
            return key

        key = await asyncio.to_thread(write)
        self.last = step
        CHECKPOINTS.inc()
        try:
            pruned = await asyncio.to_thread(self.store.prune, self.keep)
        except Exception as exc:  # pruning is housekeeping: retried with the next checkpoint
            pruned = []
            self.log.warning("checkpoint_prune_failed", error=describe(exc))
        self.health.recovered("store")
        self.log.info("checkpoint_written", update=step, policy_version=extra.get("policy_version"), key=key,
                      offsets=extra.get("offsets"), pruned=pruned or None)
        return key

    async def save(self, learner: Learner, group: ConsumerGroup, extra: dict[str, Any]) -> None:
        """Checkpoint ``learner`` with what ``group``'s ledger says it reflects (taken together, with no
        await between them and no update running: the caller holds the update lock or is stopping)."""
        c = learner.counters
        offsets, ledger = await group.checkpoint_state()
        data = learner.state_bytes(offsets, ledger)
        await self.write(c.updates, data, {"policy_version": c.policy_version, "offsets": offsets, "ledger": ledger,
                                           **extra})
        self.last_offsets = dict(offsets)

    def holds(self, updates: int, frontiers: dict[str, int]) -> bool:
        """Whether the newest checkpoint holds the model at ``updates`` and every ledger frontier as it is now:
        records dropped as stale or dead-lettered after the last update move a frontier without an update, and a
        checkpoint without them would read them again (and report them lost if the log start passed them)."""
        return self.last == updates and all(self.last_offsets.get(k) == v for k, v in frontiers.items())

    async def try_save(self, learner: Learner, group: ConsumerGroup, extra: dict[str, Any],
                       fence: Callable[[], Awaitable[None]]) -> bool:
        """:meth:`save` after ``fence`` (the lease check); False when a transient store fault deferred it to the
        next update (the previous checkpoint stays valid, and restarts resume from its offsets)."""
        try:
            await fence()
            await self.save(learner, group, extra)
            return True
        except Exception as exc:
            if not is_transient(exc):
                raise
            DEFERRED.labels(what="checkpoint").inc()
            self.health.degraded("store", f"checkpoint failed: {describe(exc)}")
            self.log.warning("checkpoint_deferred", update=learner.counters.updates, error=describe(exc))
            return False

    async def resume(self, learner: Learner, fresh: Callable[[], Learner], group: ConsumerGroup, intake: Intake,
                     fresh_start: bool) -> tuple[Learner, Restored | None]:
        """Restore ``learner`` from the newest usable checkpoint and hand its ledger to ``group`` and its
        abandoned versions to ``intake``; after a deliberate fresh start, a ``fresh()`` learner instead."""
        restored = await self.restore(learner.restore, fresh_start)
        if restored is None:
            return (fresh() if self.fresh_start_at is not None else learner), None
        group.restore(learner.restored_ledger or restored.ledger, restored.offsets)
        for lo, hi in restored.abandoned:
            intake.abandon(lo, hi)
        return learner, restored

    async def restore(self, load: Any, fresh_start: bool) -> Restored | None:
        """Load the newest usable checkpoint with ``load`` (``Learner.restore``, which raises to refuse one).

        None: start from scratch (nothing was ever checkpointed here, or a deliberate fresh start)."""
        self.refused_records = []
        try:
            found = await self.retry(lambda: asyncio.to_thread(self.store.load_latest_good, load, self._check),
                                     "read checkpoint", "store")
        except BadPayload as exc:
            await self._audit_refused()
            if not fresh_start:
                raise RuntimeError(f"no usable checkpoint ({exc}); refusing to start from scratch over an existing "
                                   "run: set trainer.fresh_start=true to do so deliberately") from None
            self.log.error("checkpoints_unusable_fresh_start", reason=str(exc)[:500])
            self._fresh()
            return None
        if found is None:
            if fresh_start:
                self._fresh()
            return None
        await self._audit_refused()
        record, _data, refused = found
        stamp = record.extra.get("fresh_start_at")
        if fresh_start and stamp is None:
            self.log.warning("fresh_start_ignoring_checkpoint", update=record.version)
            self._fresh()
            return None
        if fresh_start:
            self.log.warning("fresh_start_already_done", update=record.version, fresh_start_at=stamp,
                             hint="this run started fresh once; it resumes now. Unset trainer.fresh_start")
        self.fresh_start_at = None if stamp is None else float(stamp)
        self.last = record.version
        offsets = {str(k): int(v) for k, v in dict(record.extra.get("offsets") or {}).items()}
        self.last_offsets = dict(offsets)
        if refused:
            await self.audit("checkpoint_fallback", {"restored": record.version, "refused": refused[:3]},
                             "restored an older checkpoint")
        self.log.info("checkpoint_restored", update=record.version, fell_back=bool(refused), checkpoint_offsets=offsets)
        return Restored(step=record.version, offsets=offsets, ledger=dict(record.extra.get("ledger") or {}),
                        lineage=record.lineage,
                        abandoned=[(int(lo), int(hi)) for lo, hi in record.extra.get("abandoned") or []],
                        fresh_start_at=self.fresh_start_at)

    def _check(self, rec: VersionRecord) -> None:
        """``check`` on a record found at restore, each refusal remembered for its audit entry."""
        if self.check is None:
            return
        try:
            self.check(rec)
        except SignatureRefused as exc:
            self.refused_records.append(f"checkpoint {rec.version}: {exc}")
            self.log.error("checkpoint_refused", update=rec.version, reason=exc.reason, detail=exc.detail,
                           checkpoint_run=rec.extra.get("run"))
            raise

    async def _audit_refused(self) -> None:
        for what in self.refused_records[:5]:
            await self.audit("checkpoint_refused", {"run": self.run, "refused": what[:300]}, "not restored")

    def _fresh(self) -> None:
        self.fresh_start_at = time.time()
        self.log.warning("fresh_start", fresh_start_at=self.fresh_start_at)
