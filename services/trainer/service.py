"""The trainer service: pull fragments, validate, batch, update, *then* commit offsets.

Every consumed record ends in exactly one typed outcome — trained, dropped as stale, or
dead-lettered (poison, future version, duplicate) — each counted and logged once with the
fragment's identity. The rules of what trains when are pure (``intake.py``); offsets are committed
only up to the first record without an outcome (``ledger.py``) and only for owned partitions.

Faults are normal: Kafka and S3 operations are retried with backoff (``shared.retry``) while the
trainer reports itself degraded; a failed publish or checkpoint is deferred to the next update.
Exactly-once model state: a checkpoint stores the offsets its model reflects and a restarted
trainer resumes from them, re-training whatever came after (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError, RebalanceInProgressError
from prometheus_client import Counter, Gauge, Histogram

from services.trainer.intake import Batch, BatchStrategy, Intake, Pending, StallWatch, strategy_for
from services.trainer.learner import Learner
from services.trainer.ledger import OffsetLedger
from shared.bus import Bus, Record, kafka_bus
from shared.credits import H_SAMPLER_SEQ, Consumption, auto_window
from shared.fragment import H_SAMPLER_ID, FragmentError, decode_fragment, header_dict
from shared.kafka import Topics, ensure_topics, trainer_group
from shared.logging import fragment_fields, get_logger
from shared.marker import BadPayload, MarkerConflict, VersionedStore, VersionRecord
from shared.messages import KEY_CANDIDATE, PolicyMessage, SamplerBeat, TrainerBeat, parse_heartbeat
from shared.retry import Health, describe, is_transient, poll_or_pause, retry_transient, stop_clients
from shared.rl.envs import fragment_spec
from shared.runtime import AuditLog, RuntimeConfig, RuntimeWatcher, apply_runtime, runtime_values
from shared.service import RateMeter, percentile
from shared.settings import ConfigError, Settings
from shared.store import open_store

T = TypeVar("T")

CONSUMED = Counter("flywheel_trainer_fragments_consumed_total", "Records pulled from the samples topic")
TRAINED = Counter("flywheel_trainer_fragments_trained_total", "Fragments used in an update")
STEPS_TRAINED = Counter("flywheel_trainer_env_steps_trained_total", "Env steps used in updates")
DROPPED = Counter("flywheel_trainer_fragments_dropped_stale_total", "Fragments older than max_staleness")
DEAD = Counter("flywheel_trainer_fragments_dead_lettered_total", "Invalid records sent to the DLQ", ["reason"])
UPDATES = Counter("flywheel_trainer_updates_total", "Optimizer updates")
SAMPLE_PASSES = Counter("flywheel_trainer_sample_passes_total",
                        "Samples through a gradient step (sgd steps x minibatch size): the update work done")
BUSY = Counter("flywheel_trainer_busy_seconds_total", "Seconds spent in updates")
UPDATE_SECONDS = Histogram("flywheel_trainer_update_seconds", "Duration of one update",
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
STALENESS = Histogram("flywheel_trainer_fragment_staleness_versions", "Policy lag of trained fragments, at batch time",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
VERSION = Gauge("flywheel_trainer_policy_version", "Latest policy version the trainer sent")
RETURN_MEAN = Gauge("flywheel_trainer_episode_return_mean", "Mean return of the recent episodes")
COMMIT_FAILURES = Counter("flywheel_trainer_commit_failures_total",
                          "Offset commits that failed retriably (retried with the next commit)")
CHECKPOINTS = Counter("flywheel_trainer_checkpoints_total", "Checkpoints written")
NONFINITE = Counter("flywheel_trainer_nonfinite_steps_skipped_total",
                    "Gradient steps refused because the loss or gradient was not finite")
STALLED = Gauge("flywheel_trainer_stalled", "1 while records arrive but no update happens (see /status for why)")
RECOVERIES = Counter("flywheel_trainer_recovery_actions_total", "Automatic recovery actions", ["action"])
PUBLISH_RETRY_MIN_S, PUBLISH_RETRY_MAX_S = 1.0, 10.0  # back-off of a deferred candidate's retries
DEFERRED = Counter("flywheel_trainer_deferred_total", "Publishes or checkpoints deferred by a transient fault",
                   ["what"])

POLICY_REFRESH_S = 5.0
"""Re-read the marker this often (announcements are the fast path; this covers lost ones)."""
RUNTIME_POLL_S = 2.0
"""Runtime settings (PATCH /config) are applied within this long."""
LEARNING_RATE = Gauge("flywheel_trainer_learning_rate",
                      "Learning rate of the last update (schedule and runtime settings)")


SAMPLER_LAG_FORGET_S = 600.0
PUBLICATION_WAITS = Counter("flywheel_trainer_publication_waits_total",
                            "Loop passes that held a batch because the trainer was max_staleness versions ahead "
                            "of the published policy")
SAMPLER_LAG = Gauge("flywheel_trainer_sampler_staleness_versions",
                    "Per sampler: lag at training time of its last 200 trained fragments", ["sampler", "stat"])
SAMPLER_DROPPED = Gauge("flywheel_trainer_sampler_dropped_fraction",
                        "Per sampler: its fragments dropped as stale / (trained + dropped)", ["sampler"])
GRANT_REFRESH_S = 1.0
"""Send a credit grant at least this often, even when nothing was consumed."""
GRANTS = Counter("flywheel_trainer_credit_grants_total", "Flow-control grants sent to the samplers")
CREDIT_WINDOW = Gauge("flywheel_trainer_credit_window", "Fragments each live sampler may have in flight")


@dataclasses.dataclass
class SamplerLag:
    trained: deque[int] = dataclasses.field(default_factory=lambda: deque(maxlen=200))
    trained_count: int = 0
    dropped: int = 0
    seen: float = 0.0


class Trainer:
    name = "trainer"

    def __init__(self, settings: Settings, trainer_id: str | None = None, bus: Bus | None = None,
                 strategy: BatchStrategy | None = None) -> None:
        self.settings = settings
        self.cfg = settings.trainer
        self.id = trainer_id or f"trainer-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger()
        self.spec = dataclasses.replace(fragment_spec(settings.env.id, settings.kafka.max_message_bytes),
                                        max_abs_value=self.cfg.max_abs_value)
        self.learner = Learner(self.spec, self.cfg)
        store = open_store(settings)
        self.base_settings = settings
        self.runtime = RuntimeWatcher(RuntimeConfig(store, settings.run))
        self.audit = AuditLog(store, settings.run)
        self.lineage = 0  # the newest rollback the model descends from
        self._pending_rollback: PolicyMessage | None = None
        self._last_runtime_poll = 0.0
        self.config_revision = 0
        self.policies = VersionedStore(store, settings.run, "policy")
        self.checkpoints = VersionedStore(store, settings.run, "checkpoints")
        self._on_kafka = bus is None  # else an in-memory bus (unit tests): no topics to create
        bus = bus or kafka_bus(settings, trainer_group(settings.run), self.cfg.group_instance_id)
        self.producer = bus.publisher
        self.source = bus.source
        self.announcements = bus.tail(self.topics.policy)
        # How batches form (async, or the synchronous baseline) is the one thing settings.mode changes here.
        strategy = strategy or strategy_for(settings.mode, self.cfg.batch_fragments, self.cfg.poll_max_records)
        self.intake = Intake(max_staleness=self.cfg.max_staleness, batch_timeout_s=self.cfg.batch_timeout_s,
                             strategy=strategy)
        self.stall = StallWatch(self.cfg.stall_after_s, time.monotonic())
        self.consumption = Consumption(auto_window(settings), live_after_s=settings.paramsync.sampler_timeout_s)
        self._last_grant = 0.0
        self._publication_wait_since: float | None = None
        self.health_state = Health("trainer")
        self.ledger = OffsetLedger()
        self.staleness: deque[int] = deque(maxlen=1000)
        self.per_sampler: dict[str, SamplerLag] = {}  # staleness as trained and drops, per sampler (expires)
        self.rate = RateMeter()
        self.dropped = 0
        self.trained_run = 0  # fragments trained by this process (the dropped fraction's denominator)
        self.dead_lettered = 0
        self.nonfinite_skipped = 0
        self.candidates_resent = 0
        self.last_update_at: float | None = None
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._last_beat = 0.0
        self._last_marker_read = 0.0
        self._started = False
        self._resume: dict[str, int] | None = None  # checkpoint offsets to seek to on the first assignment
        self._checkpoint_due = False
        self._last_checkpoint: int | None = None
        self._candidate: tuple[PolicyMessage, float] | None = None  # the newest sent, and when
        # The newest candidate whose publish a transient fault deferred (version, weights, update), when to
        # try it again, and the current back-off: retried from the loop, because an async trainer that is
        # max_staleness versions ahead of publication trains no further update that would send a newer one.
        self._deferred: tuple[int, bytes, int] | None = None
        self._deferred_retry_at = 0.0
        self._deferred_backoff_s = PUBLISH_RETRY_MIN_S
        self._stalled_logged = False
        # A strategy that waits for every live sampler (sync) learns who is live from their heartbeats.
        self._beats = bus.tail(self.topics.heartbeats) if strategy.needs_live_samplers else None
        self._sampler_seen: dict[str, float] = {}
        self._after_update: asyncio.Task[None] | None = None  # the last update's commit + publish
        self._commit_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()  # a revoke waits for the update in progress
        # Partitions being revoked: aiokafka's assignment() still lists them until the rejoin completes,
        # so this set (filled first thing in the revoke callback) is what says "no longer ours".
        self._revoking: set[TopicPartition] = set()
        self._fatal: BaseException | None = None  # a fatal error met inside a rebalance callback
        self._update_failed = False
        self._tasks: list[asyncio.Task[None]] = []

    # ---- retries -----------------------------------------------------------------------------
    async def _retry(self, op: Callable[[], Awaitable[T]], what: str, component: str,
                     timeout_s: float | None = None) -> T:
        return await retry_transient(op, what=what, component=component, health=self.health_state,
                                     log=self.log, stop_event=self._stop, timeout_s=timeout_s)

    def _kafka_timeout(self) -> float:
        return self.settings.kafka.request_timeout_ms / 1000

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._on_kafka:
            await self._retry(lambda: ensure_topics(self.settings), "create topics", "kafka")
        await self._restore()
        await self._retry(self.producer.start, "start producer", "kafka")
        marker = await self._retry(lambda: asyncio.to_thread(self.policies.read_marker), "read policy marker", "store")
        if marker is None:
            c = self.learner.counters
            await self._publish(c.policy_version, self.learner.weights(), c.updates, required=True)  # version 0
        else:
            self.intake.saw_published(marker[0].version)
        await self._retry(self.source.start, "start consumer", "kafka")
        self.source.subscribe(self.topics.samples, self._on_revoke, self._on_assign)
        await self._retry(self.announcements.start, "start announcement reader", "kafka")
        if self._beats is not None:
            await self._retry(self._beats.start, "start heartbeat reader", "kafka")
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        self._stop = stop_event
        self._tasks.append(asyncio.create_task(self._watch_announcements(), name="trainer-announcements"))
        while not stop_event.is_set():
            if self._fatal is not None:
                raise self._fatal
            for task in self._tasks:
                if task.done():
                    raise RuntimeError(f"background task {task.get_name()} ended") from task.exception()
            await self._poll_once()
            await self._maybe_grant()
            if self._pending_rollback is not None:
                await self._follow_rollback(self._pending_rollback)
            if self._beats is not None:
                await self._poll_live_samplers()
            while not stop_event.is_set():
                batch = self.intake.form_batch(time.monotonic(),
                                               self._live_samplers() if self._beats is not None else None)
                self._drop_stale(batch)
                if batch.waiting_publication:
                    self._note_publication_wait()
                if not batch.train:
                    break
                await self._train(batch)
            if self._after_update is not None and self._after_update.done():
                await self._settle()  # a fatal error in the background commit or publish stops the trainer here
            if self._after_update is None:  # else that task commits; this one would only run first
                await self._commit()  # dropped / dead-lettered progress, when nothing is pending before it
            await self._liveness()
            await self._maybe_heartbeat()

    async def _poll_once(self) -> None:
        want, timeout_ms = self.intake.wants(), self.intake.strategy.poll_timeout_ms
        if want == 0:  # waiting for a publication with a batch held: consume (and grant) nothing more
            await asyncio.sleep(timeout_ms / 1000)
            return
        polled = await poll_or_pause(lambda: self.source.poll(max_records=want, timeout_ms=timeout_ms),
                                     what="poll", health=self.health_state, log=self.log)
        if polled is None:
            return
        for tp, records in polled.items():
            for rec in records:
                if not self._owned(tp):  # revoked while an earlier record was handled
                    self.log.info("revoked_records_skipped", partition=tp.partition, from_offset=rec.offset)
                    break
                await self._intake(tp, rec)

    def _owned(self, tp: TopicPartition) -> bool:
        return tp not in self._revoking and tp in self.source.assignment()

    def _live_samplers(self) -> set[str]:
        now = time.monotonic()
        timeout = self.settings.paramsync.sampler_timeout_s
        return {sid for sid, seen in self._sampler_seen.items() if now - seen <= timeout}

    async def _poll_live_samplers(self) -> None:
        assert self._beats is not None
        for rec in await self._beats.poll(timeout_ms=0):
            try:
                beat = parse_heartbeat(rec.value or b"")
            except ValueError:
                continue
            if isinstance(beat, SamplerBeat):
                self._sampler_seen[beat.id] = time.monotonic()
        timeout = self.settings.paramsync.sampler_timeout_s
        now = time.monotonic()
        for sid in [s for s, seen in self._sampler_seen.items() if now - seen > 10 * timeout]:
            del self._sampler_seen[sid]  # per-sampler state expires

    async def stop(self) -> None:
        try:
            if self._started:
                try:
                    await self._settle()
                except Exception as exc:  # already the reason run() ended, or it will be logged with it
                    self.log.error("background_commit_publish_failed", error=describe(exc))
                await self._commit()
                if self._update_failed:
                    self.log.error("final_checkpoint_skipped", reason="an update failed part-way; the previous "
                                   "checkpoint stays the resume point")
                elif self.learner.counters.updates and self._last_checkpoint == self.learner.counters.updates:
                    self.log.info("checkpoint_up_to_date", update=self._last_checkpoint)
                elif self.learner.counters.updates:
                    try:
                        await asyncio.wait_for(self._checkpoint(), 30)
                    except Exception as exc:  # the store is down: the next start resumes from the previous one
                        self.log.error("final_checkpoint_failed", error=describe(exc))
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            clients: list[Any] = [self.source, self.announcements, self.producer]
            if self._beats is not None:
                clients.append(self._beats)
            await stop_clients(clients, self.log)

    def health(self) -> dict[str, Any]:
        c = self.learner.counters
        stall = self.stall.check(time.monotonic(), self.intake.reference)
        return {"ok": self._started, "updates": c.updates, "policy_version": c.policy_version,
                **self.health_state.as_dict(), "stalled": None if stall is None else stall.reason}

    # ---- intake: every record gets exactly one outcome ------------------------------------
    async def _intake(self, tp: TopicPartition, rec: Record) -> None:
        CONSUMED.inc()
        now = time.monotonic()
        h = header_dict(rec.headers)
        self.consumption.saw(h.get(H_SAMPLER_ID) or "?", h.get(H_SAMPLER_SEQ), now)
        self.stall.note("consumed", now)
        try:
            frag = decode_fragment(rec.headers, rec.value, self.spec)
        except FragmentError as err:
            await self._dead_letter(tp, rec, err.reason, str(err))
            return
        rejected = self.intake.admit(Pending(tp, rec.offset, frag, now))
        if rejected is not None and rejected.reason == "future_version" and await self._refresh_published():
            rejected = self.intake.admit(Pending(tp, rec.offset, frag, now))  # a version we had not heard of yet
        if rejected is not None:
            await self._dead_letter(tp, rec, rejected.reason, rejected.message)
            return
        self.ledger.consumed(tp, rec.offset, pending=True)
        self.learner.record_returns(frag)
        self.log.info("fragment_consumed", **fragment_fields(frag.sample_id, frag.sampler_id, frag.policy_version,
                                                              tp.partition, rec.offset))

    def _note_publication_wait(self) -> None:
        now = time.monotonic()
        if self._publication_wait_since is None or now - self._publication_wait_since > 5.0:
            self.log.info("waiting_for_publication", policy_version=self.learner.counters.policy_version,
                          published_version=self.intake.published, lead=max(1, self.intake.bound))
            self._publication_wait_since = now
        PUBLICATION_WAITS.inc()

    def _drop_stale(self, batch: Batch) -> None:
        for p, staleness in batch.stale:
            self.ledger.finished(p.tp, p.offset)
            DROPPED.inc()
            self.dropped += 1
            self._lag_of(p.frag.sampler_id).dropped += 1
            self.stall.note("dropped_stale", time.monotonic())
            f = p.frag
            self.log.info("fragment_dropped_stale", outcome="dropped_stale", staleness=staleness,
                          max_staleness=self.intake.bound, reference_version=self.intake.reference,
                          **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))

    async def _dead_letter(self, tp: TopicPartition, rec: Record, reason: str, error: str) -> None:
        h = header_dict(rec.headers)
        headers = list(rec.headers or []) + [
            ("dlq-reason", reason.encode()),
            ("dlq-error", error[:1000].encode()),
            ("dlq-source", f"{tp.topic}:{tp.partition}:{rec.offset}".encode()),
            ("dlq-at", repr(time.time()).encode()),
        ]
        value = rec.value
        if value is not None and len(value) > self.settings.kafka.max_message_bytes:
            # Too big to copy (the producer would refuse it and the record would come back after every
            # restart): dead-letter its headers; the payload stays on the samples topic (dlq-source).
            headers.append(("dlq-truncated", f"payload of {len(value)} bytes not copied".encode()))
            value = b""  # not None: a record needs a key or a value
        # Only once the dead-letter topic has it is the record done: until then it is not committed.
        await self._retry(lambda: self.producer.send_and_wait(self.topics.dlq, value, key=rec.key, headers=headers),
                          "dead-letter send", "kafka", timeout_s=self._kafka_timeout())
        if not self._owned(tp):  # revoked meanwhile: the new owner handles it (again)
            return
        self.ledger.consumed(tp, rec.offset, pending=False)
        DEAD.labels(reason=reason).inc()
        self.dead_lettered += 1
        self.stall.note("dead_lettered", time.monotonic())
        self.log.warning("fragment_dead_lettered", outcome="dead_lettered", reason=reason, error=error[:500],
                         sample_id=h.get("sample-id"), sampler_id=h.get("sampler-id"),
                         policy_version=h.get("policy-version"), partition=tp.partition, offset=rec.offset)

    # ---- update, then commit ---------------------------------------------------------------
    async def _train(self, batch: Batch) -> None:
        async with self._update_lock:
            await self._train_locked(batch)

    async def _train_locked(self, batch: Batch) -> None:
        gone = [p for p in batch.train if not self._owned(p.tp)]
        if gone:  # formed before a revoke that ran while this waited for the lock: not ours to train
            self.intake.forget_ids(p.frag.sample_id for p in gone)
            keep = [(p, st) for p, st in zip(batch.train, batch.staleness, strict=True) if self._owned(p.tp)]
            batch = Batch(train=[p for p, _ in keep], staleness=[st for _, st in keep])
            self.log.info("revoked_batch_items_released", count=len(gone))
            if not batch.train:
                return
        items = batch.train
        t0 = time.perf_counter()
        try:
            stats = await asyncio.to_thread(self.learner.update, [p.frag for p in items])
        except BaseException:
            self._update_failed = True  # the weights may hold part of this update: no final checkpoint
            raise
        elapsed = time.perf_counter() - t0
        c = self.learner.counters
        self.last_update_at = time.time()
        self.stall.trained(time.monotonic())
        UPDATES.inc()
        BUSY.inc(elapsed)
        UPDATE_SECONDS.observe(elapsed)
        TRAINED.inc(len(items))
        self.trained_run += len(items)
        STEPS_TRAINED.inc(stats.env_steps)
        SAMPLE_PASSES.inc(stats.sample_passes)
        if stats.skipped_steps:
            NONFINITE.inc(stats.skipped_steps)
            self.nonfinite_skipped += stats.skipped_steps
            self.log.warning("nonfinite_steps_skipped", update=c.updates, skipped=stats.skipped_steps,
                             taken=stats.sgd_steps)
        self.rate.add(stats.env_steps)
        for p, staleness in zip(items, batch.staleness, strict=True):
            self.ledger.finished(p.tp, p.offset)
            self.staleness.append(staleness)
            lag = self._lag_of(p.frag.sampler_id)
            lag.trained.append(staleness)
            lag.trained_count += 1
            STALENESS.observe(staleness)
            f = p.frag
            self.log.info("fragment_trained", outcome="trained", update=c.updates, staleness=staleness,
                          **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))
        LEARNING_RATE.set(float(self.learner.optimizer.param_groups[0]["lr"]))
        if c.recent_returns:
            RETURN_MEAN.set(sum(c.recent_returns) / len(c.recent_returns))
        self.log.info("update_done", update=c.updates, fragments=len(items), env_steps=stats.env_steps,
                      seconds=round(elapsed, 4), policy_loss=round(stats.policy_loss, 5),
                      value_loss=round(stats.value_loss, 5), entropy=round(stats.entropy, 4),
                      approx_kl=round(stats.approx_kl, 5), clip_fraction=round(stats.clip_fraction, 4),
                      behaviour_weight_mean=round(stats.behaviour_weight_mean, 4), sgd_steps=stats.sgd_steps,
                      learning_rate=float(self.learner.optimizer.param_groups[0]["lr"]),
                      clip_coef=round(self.learner.update_cfg.clip_coef, 5), stopped_early=stats.stopped_early,
                      masked_fraction=round(stats.masked_fraction, 4))
        # Commit (only now, after the optimizer step) and publish in the background: the next update
        # runs meanwhile instead of waiting for two Kafka round trips and a store write. One such task
        # at a time, so commits and candidates stay in order.
        await self._settle()
        candidate = None
        if c.updates % self.cfg.publish_every == 0:
            candidate = (c.policy_version + 1, self.learner.weights(), c.updates)  # as of this update
            c.policy_version += 1  # the model is at that version now
            self.intake.model_version = c.policy_version
        # A fresh run checkpoints its first update before committing anything, so no record ever counts as
        # consumed while its gradient is in no checkpoint; then every checkpoint_every updates.
        first = self._last_checkpoint is None
        if first:
            await self._try_checkpoint()
        self._after_update = asyncio.create_task(self._commit_and_publish(candidate), name="trainer-commit-publish")
        if not first and (self._checkpoint_due or c.updates % self.cfg.checkpoint_every == 0):
            await self._settle()
            await self._try_checkpoint()

    async def _try_checkpoint(self) -> None:
        """A checkpoint now; a transient store fault defers it to the next update (the previous one stays
        valid, and restarts resume from its offsets)."""
        try:
            await self._checkpoint()
            self._checkpoint_due = False
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._checkpoint_due = True
            DEFERRED.labels(what="checkpoint").inc()
            self.health_state.degraded("store", f"checkpoint failed: {describe(exc)}")
            self.log.warning("checkpoint_deferred", update=self.learner.counters.updates, error=describe(exc))

    async def _commit_and_publish(self, candidate: tuple[int, bytes, int] | None) -> None:
        await self._commit()
        if candidate is not None:
            await self._publish(*candidate)

    async def _settle(self) -> None:
        """Wait for the previous update's commit and publish; their errors surface here."""
        task, self._after_update = self._after_update, None
        if task is not None:
            await task

    async def _commit(self, include: set[TopicPartition] | None = None) -> None:
        """Commit what has an outcome, on partitions this member owns. A retriable failure (coordinator
        moved, timeout, connection) or a rebalance in progress is logged and left for the next commit,
        which carries the same offsets (commits are cumulative): not committing only means re-delivery
        after a crash, never loss. Restarts resume from the checkpoint's offsets anyway."""
        if self._last_checkpoint is None and self.learner.counters.updates:
            return  # a fresh run commits nothing until its first checkpoint holds what it trained
        async with self._commit_lock:  # in order: a later commit never lands before an earlier one
            # Owned: assigned and not being revoked, except the partitions a revoke commits on their way out.
            owned = {tp for tp in self.source.assignment() if tp not in self._revoking} | (include or set())
            offsets = {tp: off for tp, off in self.ledger.committable().items() if tp in owned}
            if not offsets:
                return
            try:
                # aiokafka retries retriable errors itself, without end: bound the wait, so an unreachable
                # coordinator delays commits (logged, counted) instead of stalling updates and stop.
                await asyncio.wait_for(self.source.commit(offsets), self._kafka_timeout())
            except (KafkaError, TimeoutError) as exc:
                # IllegalStateError: the assignment changed between the snapshot above and the commit.
                retriable = isinstance(exc, (TimeoutError, CommitFailedError, RebalanceInProgressError,
                                             IllegalStateError)) or bool(getattr(exc, "retriable", False))
                if not retriable:
                    raise
                COMMIT_FAILURES.inc()
                self.health_state.degraded("kafka", f"commit failed: {describe(exc)}")
                self.log.warning("commit_failed", error=describe(exc),
                                 offsets={f"{tp.partition}": o for tp, o in offsets.items()})
                return
            self.ledger.mark_committed(offsets)
            self.health_state.recovered("kafka")
        self.log.debug("offsets_committed", offsets={f"{tp.partition}": o for tp, o in offsets.items()})

    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        """Before partitions leave: let the update in progress finish and commit it (its records are
        trained by this member and must not be re-delivered), commit, then drop the rest of theirs."""
        self._revoking |= revoked
        try:
            async with self._update_lock:
                try:
                    await self._settle()
                except Exception as exc:
                    if not is_transient(exc):
                        self._fatal = exc  # raised by the loop: a rebalance callback must not hide it
                    raise
                finally:
                    await self._commit(include=revoked)
        except Exception as exc:  # the rebalance goes on; the new owner gets the uncommitted tail
            self.log.warning("revoke_commit_failed", error=describe(exc))
        finally:
            removed = self.intake.revoke(revoked)
            self.ledger.forget(revoked)
            if removed:
                self.log.info("revoked_fragments_released", count=len(removed),
                              partitions=sorted({p.tp.partition for p in removed}))

    async def _on_assign(self, assigned: set[TopicPartition]) -> None:
        """On the first assignment after a restore, seek to the offsets the checkpoint reflects: the
        records after them are in no checkpointed model, so they are trained again (exactly once)."""
        self._revoking -= assigned
        if self._resume is None:
            return
        for tp in assigned:
            off = self._resume.pop(f"{tp.topic}:{tp.partition}", None)
            if off is not None:
                self.source.seek(tp, off)
                # The next commit moves the group back here too: a rebalance before this partition's
                # first record must not hand the new owner the (later) offsets the crashed run committed.
                self.ledger.seeked(tp, off)
                self.log.info("resumed_from_checkpoint_offset", partition=tp.partition, offset=off)
        if not self._resume:
            self._resume = None

    # ---- liveness ----------------------------------------------------------------------------
    async def _watch_announcements(self) -> None:
        """Background: the newest published version, from paramsync's announcements."""
        while True:
            try:
                records = await self.announcements.poll(timeout_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("announcement_read_failed", error=describe(exc))
                await asyncio.sleep(1.0)
                continue
            for rec in records:
                try:
                    msg = PolicyMessage.model_validate_json(rec.value or b"")
                except ValueError:
                    continue
                if msg.type == "announce":
                    self.intake.saw_published(msg.version)
                    if msg.rollback_of is not None and msg.lineage > self.lineage:
                        self._pending_rollback = msg

    async def _liveness(self) -> None:
        """Re-read the marker now and then; re-send a candidate paramsync has not published; report a stall."""
        now = time.monotonic()
        if now - self._last_runtime_poll > RUNTIME_POLL_S:
            self._last_runtime_poll = now
            try:
                rev = await asyncio.wait_for(asyncio.to_thread(self.runtime.poll), 10)
                if rev is not None:
                    try:
                        self._apply_runtime(apply_runtime(self.base_settings, rev.settings), rev.revision)
                    except ConfigError as exc:  # does not validate against this trainer's settings: skip it
                        self.log.error("runtime_config_refused", revision=rev.revision, error=str(exc)[:300])
                    self.runtime.ack(rev)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.log.warning("runtime_config_unreadable", error=describe(exc))
        if now - self._last_marker_read > POLICY_REFRESH_S:
            self._last_marker_read = now
            await self._refresh_published()
        if self._candidate is not None:
            msg, sent_at = self._candidate
            if (self.intake.published or -1) < msg.version and now - sent_at > self.cfg.candidate_resend_s:
                await self._resend_candidate(msg, "not published in time")
        if self._deferred is not None and now >= self._deferred_retry_at and (
                self._after_update is None or self._after_update.done()):
            await self._settle()  # the last update's commit and publish first (it may have sent a newer one)
            if self._deferred is not None:
                # In the background slot of an update's commit + publish: the loop is not held by a slow
                # store, and the next update's publish waits for this one, so candidates stay in order.
                self.log.info("publish_retry", policy_version=self._deferred[0], automatic_action=True)
                self._after_update = asyncio.create_task(self._publish(*self._deferred), name="trainer-publish-retry")
        stall = self.stall.check(now, self.intake.reference)
        STALLED.set(0 if stall is None else 1)
        if stall is None:
            self._stalled_logged = False
        elif not self._stalled_logged:
            self._stalled_logged = True
            self.log.error("training_stalled", reason=stall.reason, published_version=self.intake.published,
                           policy_version=self.learner.counters.policy_version)
            await self._audit("training_stalled", {"reason": stall.reason}, "detected; re-sending the candidate")
            if self._candidate is not None:
                await self._resend_candidate(self._candidate[0], "training stalled")

    async def _follow_rollback(self, msg: PolicyMessage) -> None:
        """An operator rolled the policy back: continue from the republished weights with a fresh
        optimizer; fragments of the abandoned versions are dropped as stale (never trained)."""
        async with self._update_lock:
            self._pending_rollback = None
            if msg.lineage <= self.lineage:  # a re-announcement of a rollback already followed
                return
            await self._settle()
            data = await self._retry(lambda: asyncio.to_thread(self.policies.fetch, msg.record()), "fetch rollback",
                                     "store")
            c = self.learner.counters
            abandoned = (int(msg.rollback_of or 0) + 1, msg.version - 1)
            self.learner.load_policy_weights(data)
            self.learner.reset_optimizer()
            c.policy_version = max(c.policy_version, msg.version)
            self.intake.model_version = c.policy_version
            self.intake.saw_published(msg.version)
            self.intake.abandon(*abandoned)  # versions above N were never published: nothing made by them
            self.lineage = msg.lineage
            self._candidate = None
            self._deferred = None  # weights of an abandoned trajectory
            VERSION.set(c.policy_version)
            # Checkpoint now, before training on: a restart must not re-train the records already in these
            # weights' history on top of them, nor forget which versions were abandoned.
            self._checkpoint_due = True
            await self._try_checkpoint()
        RECOVERIES.labels(action="follow_rollback").inc()
        self.log.warning("rollback_followed", rollback_of=msg.rollback_of, policy_version=msg.version,
                         abandoned=list(abandoned), optimizer="reset")
        await self._audit("trainer_followed_rollback", {"rollback_of": msg.rollback_of, "version": msg.version},
                          "weights loaded, optimizer reset, abandoned versions dropped")

    def _lag_of(self, sampler_id: str) -> SamplerLag:
        lag = self.per_sampler.get(sampler_id)
        if lag is None:
            lag = self.per_sampler[sampler_id] = SamplerLag()
        lag.seen = time.monotonic()
        return lag

    def _lag_report(self) -> dict[str, dict[str, Any]]:
        """Per sampler: staleness of its last trained fragments (mean, p95, max) and the fraction of its
        fragments dropped as stale. Samplers silent for 10 minutes are forgotten (restarts add ids)."""
        now = time.monotonic()
        for sid in [sid for sid, lag in self.per_sampler.items() if now - lag.seen > SAMPLER_LAG_FORGET_S]:
            del self.per_sampler[sid]
            for labels in [(sid, stat) for stat in ("mean", "p95", "max")]:
                with contextlib.suppress(KeyError):
                    SAMPLER_LAG.remove(*labels)
            with contextlib.suppress(KeyError):
                SAMPLER_DROPPED.remove(sid)
        out = {}
        for sid, lag in sorted(self.per_sampler.items()):
            st = list(lag.trained)
            total = lag.dropped + lag.trained_count
            out[sid] = {"mean": round(sum(st) / len(st), 3) if st else None,
                        "p95": percentile(st, 0.95) if st else None, "max": max(st) if st else None,
                        "dropped": lag.dropped,
                        "dropped_fraction": round(lag.dropped / total, 4) if total else None}
            if st:
                SAMPLER_LAG.labels(sid, "mean").set(sum(st) / len(st))
                SAMPLER_LAG.labels(sid, "p95").set(percentile(st, 0.95) or 0.0)
                SAMPLER_LAG.labels(sid, "max").set(max(st))
            if total:
                SAMPLER_DROPPED.labels(sid).set(lag.dropped / total)
        return out

    async def _audit(self, action: str, params: dict[str, Any], outcome: str) -> None:
        """Record an automatic action in the run's audit trail (best effort: it never stops training)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.audit.append, "trainer", action, params, outcome), 10)
        except Exception as exc:
            self.log.warning("audit_write_failed", action=action, error=describe(exc))

    def _apply_runtime(self, settings: Settings, revision: int) -> None:
        old = runtime_values(self.settings)
        self.settings = settings
        self.cfg = settings.trainer
        self.learner.set_runtime(settings.trainer)
        self.intake.max_staleness = settings.trainer.max_staleness
        self.consumption.total_window = auto_window(settings)
        new = runtime_values(settings)
        changes = {k: {"old": old[k], "new": new[k]} for k in new if k.startswith("trainer.") and old[k] != new[k]}
        self.config_revision = revision
        LEARNING_RATE.set(self.learner.learning_rate())
        self.log.info("runtime_config_applied", revision=revision, changes=changes or None)

    async def _refresh_published(self) -> bool:
        """Re-read the marker (an announcement may not have reached us yet); True if it moved. A store
        that cannot be read marks the trainer degraded and leaves the reference as it was."""
        before = self.intake.published
        try:
            marker = await asyncio.wait_for(asyncio.to_thread(self.policies.read_marker), 10)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.health_state.degraded("store", f"marker read failed: {describe(exc)}")
            return False
        self.health_state.recovered("store")
        if marker is not None:
            self.intake.saw_published(marker[0].version)
        return self.intake.published != before

    async def _resend_candidate(self, msg: PolicyMessage, why: str) -> None:
        try:
            await asyncio.wait_for(self.producer.send_and_wait(self.topics.policy, msg.to_bytes(), key=KEY_CANDIDATE),
                                   self._kafka_timeout())
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.warning("candidate_resend_failed", policy_version=msg.version, error=describe(exc))
        else:
            self.candidates_resent += 1
            RECOVERIES.labels(action="resend_candidate").inc()
            if why == "training stalled" or self.candidates_resent % 10 == 1:
                await self._audit("candidate_resent", {"version": msg.version, "why": why}, "sent")
            self.log.warning("candidate_resent", policy_version=msg.version, reason=why,
                             published_version=self.intake.published, automatic_action=True)
        self._candidate = (msg, time.monotonic())

    # ---- publishing and checkpoints --------------------------------------------------------
    async def _publish(self, version: int, data: bytes, update: int, required: bool = False) -> None:
        """Write the weights blob and send a candidate; paramsync verifies and publishes it.

        A transient failure defers it (the next update sends a newer candidate) unless ``required``."""
        async def write_and_send() -> PolicyMessage:
            key, sha = await asyncio.to_thread(self.policies.put_blob, data)
            rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=update,
                                extra={"lineage": self.lineage} if self.lineage else {})
            msg = PolicyMessage.of("candidate", rec)
            await asyncio.wait_for(self.producer.send_and_wait(self.topics.policy, msg.to_bytes(), key=KEY_CANDIDATE),
                                   self._kafka_timeout())
            return msg

        try:
            if required:
                msg = await self._retry(write_and_send, "publish candidate", "publish")
            else:
                msg = await write_and_send()
        except Exception as exc:
            if required or not is_transient(exc):
                raise
            DEFERRED.labels(what="publish").inc()
            self.health_state.degraded("publish", f"candidate {version} not sent: {describe(exc)}")
            self.log.warning("publish_deferred", policy_version=version, update=update, error=describe(exc))
            if self._deferred is None or version > self._deferred[0]:
                self._deferred_backoff_s = PUBLISH_RETRY_MIN_S
            else:
                self._deferred_backoff_s = min(PUBLISH_RETRY_MAX_S, self._deferred_backoff_s * 2)
            self._deferred = (version, data, update)
            self._deferred_retry_at = time.monotonic() + self._deferred_backoff_s
            return
        self.health_state.recovered("publish")
        if self._deferred is not None and self._deferred[0] <= version:
            self._deferred = None
        self._candidate = (msg, time.monotonic())
        VERSION.set(version)
        self.log.info("candidate_sent", policy_version=version, sha256=msg.sha256[:12], update=update)

    async def _checkpoint(self) -> None:
        c = self.learner.counters
        step = c.updates
        offsets = await self._checkpoint_offsets()
        data = self.learner.state_bytes(offsets)

        def write() -> str:
            current = self.checkpoints.read_marker()
            # Content-addressed under the step: a key never holds two different contents, so a blob
            # left by a crash before its marker write can never be mistaken for a later checkpoint.
            sha = hashlib.sha256(data).hexdigest()
            key, _ = self.checkpoints.put_blob(data, f"{self.checkpoints.prefix}/{step}/{sha}.pt")
            rec = VersionRecord(version=step, blob=key, sha256=sha, size=len(data), trainer_step=step,
                                extra={"policy_version": c.policy_version, "offsets": offsets,
                                       "lineage": self.lineage, "abandoned": self.intake.abandoned})
            try:
                self.checkpoints.publish(rec, None if current is None else current[1])
            except MarkerConflict:
                # A retried conditional PUT that had in fact succeeded answers 412: the marker is ours then.
                now = self.checkpoints.read_marker()
                if now is None or now[0].sha256 != sha:
                    raise
            return key

        key = await asyncio.to_thread(write)
        self._last_checkpoint = step
        CHECKPOINTS.inc()
        try:
            pruned = await asyncio.to_thread(self.checkpoints.prune, self.cfg.keep_checkpoints)
        except Exception as exc:  # pruning is housekeeping: retried with the next checkpoint
            pruned = []
            self.log.warning("checkpoint_prune_failed", error=describe(exc))
        self.health_state.recovered("store")
        self.log.info("checkpoint_written", update=step, policy_version=c.policy_version, key=key,
                      offsets=offsets, pruned=pruned or None)

    async def _checkpoint_offsets(self) -> dict[str, int]:
        """What the model reflects, per partition: the ledger's position where it consumed, else the
        consumer's position (nothing consumed there since the assignment)."""
        offsets = self.ledger.snapshot()
        for tp in self.source.assignment():
            key = f"{tp.topic}:{tp.partition}"
            if key not in offsets:
                # Unknown position: no checkpoint now (TimeoutError defers it) rather than one that
                # forgets a partition.
                offsets[key] = await asyncio.wait_for(self.source.position(tp), 5)
        if self._resume:  # partitions not assigned yet since the restore keep the restored offsets
            for key, off in self._resume.items():
                offsets.setdefault(key, off)
        return offsets

    async def _restore(self) -> None:
        """Resume from the newest usable checkpoint (falling back to older ones); never from scratch
        while a checkpoint exists, unless ``trainer.fresh_start``; an unreachable store is retried."""
        try:
            found = await self._retry(
                lambda: asyncio.to_thread(self.checkpoints.load_latest_good, self.learner.restore),
                "read checkpoint", "store")
        except BadPayload as exc:
            if not self.cfg.fresh_start:
                raise RuntimeError(f"no usable checkpoint ({exc}); refusing to start from scratch over an existing "
                                   "run: set trainer.fresh_start=true to do so deliberately") from None
            self.log.error("checkpoints_unusable_fresh_start", reason=str(exc)[:500])
            self.learner = Learner(self.spec, self.cfg)  # the failed restores may have touched it
            found = None
        if found is not None and self.cfg.fresh_start:
            self.log.warning("fresh_start_ignoring_checkpoint", update=found[0].version)
            self.learner = Learner(self.spec, self.cfg)
            found = None
        if found is not None:
            record, _data, refused = found
            offsets = {str(k): int(v) for k, v in dict(record.extra.get("offsets") or {}).items()}
            self._resume = offsets or None
            self._last_checkpoint = record.version
            self.lineage = int(record.extra.get("lineage") or 0)
            for lo, hi in record.extra.get("abandoned") or []:
                self.intake.abandon(int(lo), int(hi))
            if refused:
                await self._audit("checkpoint_fallback", {"restored": record.version, "refused": refused[:3]},
                                  "restored an older checkpoint")
            self.log.info("checkpoint_restored", update=record.version, fell_back=bool(refused),
                          policy_version=self.learner.counters.policy_version, checkpoint_offsets=offsets)
        marker = await self._retry(lambda: asyncio.to_thread(self.policies.read_marker), "read policy marker", "store")
        c = self.learner.counters
        marker_lineage = int(marker[0].extra.get("lineage") or 0) if marker is not None else 0
        if marker is not None and marker_lineage > self.lineage:
            # A rollback was published after this checkpoint: continue from the published weights.
            data = await self._retry(lambda: asyncio.to_thread(self.policies.fetch, marker[0]), "fetch policy", "store")
            self.learner.load_policy_weights(data)
            self.learner.reset_optimizer()
            self.lineage = marker_lineage
            self.log.warning("rollback_followed_at_start", policy_version=marker[0].version, lineage=marker_lineage)
        if marker is not None and marker[0].version > c.policy_version:
            # Samplers act on a version newer than the checkpoint (a crash after publishing). The model
            # stays the checkpoint's (its weights reflect exactly the checkpoint's offsets); only the
            # numbering moves on, so the next candidate is newer than what is published.
            self.log.info("version_numbering_advanced", checkpoint_version=c.policy_version,
                          published_version=marker[0].version)
            c.policy_version = marker[0].version
        self.intake.model_version = c.policy_version
        VERSION.set(c.policy_version)

    # ---- flow control ----------------------------------------------------------------------
    async def _maybe_grant(self) -> None:
        """Tell the samplers how far their fragments are consumed (shared.credits): at once when that
        moved, else every second (a lost grant heals). Never waits for the acknowledgement."""
        now = time.monotonic()
        if not self.consumption.changed and now - self._last_grant < GRANT_REFRESH_S:
            return
        grant = self.consumption.grant(self.id, now)
        self._last_grant = now
        try:
            await self.producer.send(self.topics.credits, grant.to_bytes(), key=b"credits")
        except Exception as exc:  # the next grant carries the same counts
            if not is_transient(exc):
                raise
            self.log.debug("credit_grant_failed", error=describe(exc))
            return
        GRANTS.inc()
        CREDIT_WINDOW.set(grant.window)

    # ---- heartbeats ------------------------------------------------------------------------
    async def _maybe_heartbeat(self) -> None:
        if time.monotonic() - self._last_beat < self.cfg.heartbeat_interval_s:
            return
        self._last_beat = time.monotonic()
        c = self.learner.counters
        st = list(self.staleness)
        stall = self.stall.check(time.monotonic(), self.intake.reference)
        beat = TrainerBeat(
            id=self.id, policy_version=c.policy_version, updates=c.updates, env_steps_trained=c.env_steps_trained,
            fragments_trained=c.fragments_trained, samples_per_s=self.rate.rate(), last_update_at=self.last_update_at,
            staleness_mean=sum(st) / len(st) if st else None, staleness_max=max(st) if st else None,
            staleness_p95=percentile(st, 0.95) if st else None,
            return_mean=sum(c.recent_returns) / len(c.recent_returns) if c.recent_returns else None,
            return_count=len(c.recent_returns), fragments_dropped_stale=self.dropped,
            fragments_dead_lettered=self.dead_lettered, published_version=self.intake.published,
            stalled_since=None if stall is None else time.time() - (time.monotonic() - stall.since),
            stalled_reason=None if stall is None else stall.reason, nonfinite_steps_skipped=self.nonfinite_skipped,
            candidates_resent=self.candidates_resent, health=self.health_state.as_dict(), started_at=self.started_at,
            staleness_per_sampler=self._lag_report(),
            dropped_fraction=round(self.dropped / (self.dropped + self.trained_run), 4)
            if self.dropped + self.trained_run else None,
            learning_rate=self.learner.learning_rate(), config_revision=self.config_revision,
        )
        try:
            await self.producer.send(self.topics.heartbeats, beat.to_bytes(), key=self.id.encode())
        except Exception as exc:  # a heartbeat is not worth stopping for; the next one retries
            if not is_transient(exc):
                raise
            self.log.debug("heartbeat_failed", error=describe(exc))
