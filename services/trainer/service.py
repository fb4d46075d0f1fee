"""The trainer service: pull fragments, validate, drop stale, update, *then* commit offsets.

Every consumed record ends in exactly one typed outcome — trained, dropped as stale, or
dead-lettered — each counted and logged once with the fragment's identity. Offsets are
committed only up to the first record that has not reached its outcome (see ``ledger.py``), so a
crash loses nothing and re-delivers only what was consumed after the last commit.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter, Gauge, Histogram

from services.trainer.learner import Learner
from services.trainer.ledger import OffsetLedger
from shared.fragment import Fragment, FragmentError, decode_fragment, header_dict
from shared.kafka import CommitOnRevoke, Topics, ensure_topics, make_consumer, make_producer, trainer_group
from shared.logging import fragment_fields, get_logger
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_CANDIDATE, PolicyMessage, SamplerBeat, TrainerBeat, parse_heartbeat
from shared.rl.envs import fragment_spec
from shared.service import RateMeter
from shared.settings import Settings
from shared.store import open_store

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
STALENESS = Histogram("flywheel_trainer_fragment_staleness_versions", "Policy lag of trained fragments",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
VERSION = Gauge("flywheel_trainer_policy_version", "Latest policy version the trainer sent")
RETURN_MEAN = Gauge("flywheel_trainer_episode_return_mean", "Mean return of the recent episodes")
COMMIT_FAILURES = Counter("flywheel_trainer_commit_failures_total",
                          "Offset commits that failed retriably (retried with the next commit)")
CHECKPOINTS = Counter("flywheel_trainer_checkpoints_total", "Checkpoints written")


@dataclass
class Pending:
    tp: TopicPartition
    offset: int
    frag: Fragment
    staleness: int
    at: float  # monotonic time it was consumed


class Trainer:
    name = "trainer"

    def __init__(self, settings: Settings, trainer_id: str | None = None) -> None:
        self.settings = settings
        self.cfg = settings.trainer
        self.id = trainer_id or f"trainer-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger()
        self.spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes)
        self.learner = Learner(self.spec, self.cfg)
        store = open_store(settings)
        self.policies = VersionedStore(store, settings.run, "policy")
        self.checkpoints = VersionedStore(store, settings.run, "checkpoints")
        self.producer = make_producer(settings)
        self.consumer = make_consumer(settings, group_id=trainer_group(settings.run),
                                      group_instance_id=self.cfg.group_instance_id)
        self.ledger = OffsetLedger()
        self.buffer: list[Pending] = []
        self.staleness: deque[int] = deque(maxlen=1000)
        self.rate = RateMeter()
        self.dropped = 0
        self.dead_lettered = 0
        self.last_update_at: float | None = None
        self._last_beat = 0.0
        self._started = False
        # Synchronous baseline (mode: sync): train only on the current version, from every live sampler.
        self.sync = settings.mode == "sync"
        self.max_staleness = 0 if self.sync else self.cfg.max_staleness
        self._beats = make_consumer(settings, group_id=None) if self.sync else None
        self._sampler_seen: dict[str, float] = {}
        self._after_update: asyncio.Task[None] | None = None  # the last update's commit + publish
        self._commit_lock = asyncio.Lock()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await ensure_topics(self.settings)
        await self._restore()
        await self.producer.start()
        if await asyncio.to_thread(self.policies.read_marker) is None:
            c = self.learner.counters
            await self._publish(c.policy_version, self.learner.weights(), c.updates)  # a fresh run: version 0
        await self.consumer.start()
        self.consumer.subscribe([self.topics.samples], listener=CommitOnRevoke(self._on_revoke))
        if self._beats is not None:
            await self._beats.start()
            tp = TopicPartition(self.topics.heartbeats, 0)
            self._beats.assign([tp])
            await self._beats.seek_to_end(tp)
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            polled = await self.consumer.getmany(timeout_ms=20 if self.sync else 200,
                                                 max_records=self.cfg.poll_max_records)
            for tp, records in polled.items():
                for rec in records:
                    await self._intake(tp, rec)
            if self.sync:
                await self._poll_live_samplers()
            while not stop_event.is_set() and (items := self._next_batch()):
                await self._train(items)
            if self._after_update is not None and self._after_update.done():
                await self._settle()  # a failed background commit or publish stops the trainer here
            if self._after_update is None:  # else that task commits; this one would only run first
                await self._commit()  # dropped / dead-lettered progress, when nothing is pending before it
            await self._maybe_heartbeat()

    def _next_batch(self) -> list[Pending]:
        """The fragments to train on now, or [] to keep collecting."""
        if not self.buffer:
            return []
        timed_out = time.monotonic() - self.buffer[0].at > self.cfg.batch_timeout_s
        if self.sync:
            # Synchronous baseline: one fragment of the current version from every live sampler.
            have = {p.frag.sampler_id for p in self.buffer}
            live = self._live_samplers()
            if not timed_out and (not live or not live <= have):
                return []
            items, self.buffer = self.buffer, []
            return items
        batch = self.cfg.batch_fragments
        if len(self.buffer) < batch and not timed_out:
            return []
        items, self.buffer = self.buffer[:batch], self.buffer[batch:]
        return items

    def _live_samplers(self) -> set[str]:
        now = time.monotonic()
        timeout = self.settings.paramsync.sampler_timeout_s
        return {sid for sid, seen in self._sampler_seen.items() if now - seen <= timeout}

    async def _poll_live_samplers(self) -> None:
        assert self._beats is not None
        for records in (await self._beats.getmany(timeout_ms=0)).values():
            for rec in records:
                try:
                    beat = parse_heartbeat(rec.value or b"")
                except ValueError:
                    continue
                if isinstance(beat, SamplerBeat):
                    self._sampler_seen[beat.id] = time.monotonic()

    async def stop(self) -> None:
        try:
            if self._started:
                try:
                    await self._settle()
                except Exception as exc:  # already the reason run() ended, or it will be logged with it
                    self.log.error("background_commit_publish_failed", error=f"{type(exc).__name__}: {exc}"[:300])
                await self._commit()
                if self.learner.counters.updates:
                    await self._checkpoint()
        finally:
            if self._started:
                await self.consumer.stop()
                if self._beats is not None:
                    await self._beats.stop()
            await self.producer.stop()

    def health(self) -> dict[str, Any]:
        c = self.learner.counters
        return {"ok": self._started, "updates": c.updates, "policy_version": c.policy_version}

    # ---- intake: every record gets exactly one outcome ------------------------------------
    async def _intake(self, tp: TopicPartition, rec: ConsumerRecord[Any, Any]) -> None:
        CONSUMED.inc()
        try:
            frag = decode_fragment(rec.headers, rec.value, self.spec)
        except FragmentError as err:
            await self._dead_letter(tp, rec, err)
            self.ledger.consumed(tp, rec.offset, pending=False)
            return
        ids = fragment_fields(frag.sample_id, frag.sampler_id, frag.policy_version, tp.partition, rec.offset)
        self.learner.record_returns(frag)
        staleness = max(0, self.learner.counters.policy_version - frag.policy_version)
        if staleness > self.max_staleness:
            self.ledger.consumed(tp, rec.offset, pending=False)
            DROPPED.inc()
            self.dropped += 1
            self.log.info("fragment_dropped_stale", outcome="dropped_stale", staleness=staleness,
                          max_staleness=self.max_staleness, **ids)
            return
        self.ledger.consumed(tp, rec.offset, pending=True)
        self.buffer.append(Pending(tp, rec.offset, frag, staleness, time.monotonic()))
        self.log.info("fragment_consumed", staleness=staleness, **ids)

    async def _dead_letter(self, tp: TopicPartition, rec: ConsumerRecord[Any, Any], err: FragmentError) -> None:
        h = header_dict(rec.headers)
        headers = list(rec.headers or []) + [
            ("dlq-reason", err.reason.encode()),
            ("dlq-error", str(err)[:1000].encode()),
            ("dlq-source", f"{tp.topic}:{tp.partition}:{rec.offset}".encode()),
            ("dlq-at", repr(time.time()).encode()),
        ]
        await self.producer.send_and_wait(self.topics.dlq, rec.value, key=rec.key, headers=headers)
        DEAD.labels(reason=err.reason).inc()
        self.dead_lettered += 1
        self.log.warning("fragment_dead_lettered", outcome="dead_lettered", reason=err.reason, error=str(err),
                         sample_id=h.get("sample-id"), sampler_id=h.get("sampler-id"),
                         partition=tp.partition, offset=rec.offset)

    # ---- update, then commit ---------------------------------------------------------------
    async def _train(self, items: list[Pending]) -> None:
        t0 = time.perf_counter()
        stats = await asyncio.to_thread(self.learner.update, [p.frag for p in items])
        elapsed = time.perf_counter() - t0
        c = self.learner.counters
        self.last_update_at = time.time()
        UPDATES.inc()
        BUSY.inc(elapsed)
        UPDATE_SECONDS.observe(elapsed)
        TRAINED.inc(len(items))
        STEPS_TRAINED.inc(stats.env_steps)
        SAMPLE_PASSES.inc(stats.sample_passes)
        self.rate.add(stats.env_steps)
        for p in items:
            self.ledger.finished(p.tp, p.offset)
            self.staleness.append(p.staleness)
            STALENESS.observe(p.staleness)
            f = p.frag
            self.log.info("fragment_trained", outcome="trained", update=c.updates, staleness=p.staleness,
                          **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))
        if c.recent_returns:
            RETURN_MEAN.set(sum(c.recent_returns) / len(c.recent_returns))
        self.log.info("update_done", update=c.updates, fragments=len(items), env_steps=stats.env_steps,
                      seconds=round(elapsed, 4), policy_loss=round(stats.policy_loss, 5),
                      value_loss=round(stats.value_loss, 5), entropy=round(stats.entropy, 4),
                      approx_kl=round(stats.approx_kl, 5), clip_fraction=round(stats.clip_fraction, 4),
                      behaviour_weight_mean=round(stats.behaviour_weight_mean, 4), sgd_steps=stats.sgd_steps,
                      learning_rate=float(self.learner.optimizer.param_groups[0]["lr"]),
                      stopped_early=stats.stopped_early)
        # Commit (only now, after the optimizer step) and publish in the background: the next update
        # runs meanwhile instead of waiting for two Kafka round trips and a store write. One such task
        # at a time, so commits and candidates stay in order.
        await self._settle()
        candidate = None
        if c.updates % self.cfg.publish_every == 0:
            candidate = (c.policy_version + 1, self.learner.weights(), c.updates)  # as of this update
            c.policy_version += 1  # the model is at that version now; staleness counts from it
        self._after_update = asyncio.create_task(self._commit_and_publish(candidate), name="trainer-commit-publish")
        if c.updates % self.cfg.checkpoint_every == 0:
            await self._settle()
            await self._checkpoint()

    async def _commit_and_publish(self, candidate: tuple[int, bytes, int] | None) -> None:
        await self._commit()
        if candidate is not None:
            await self._publish(*candidate)

    async def _settle(self) -> None:
        """Wait for the previous update's commit and publish; their errors surface here."""
        task, self._after_update = self._after_update, None
        if task is not None:
            await task

    async def _commit(self) -> None:
        """Commit what has an outcome. A retriable failure (coordinator moved, timeout, connection) or a
        rebalance in progress is logged and left for the next commit, which carries the same offsets
        (commits are cumulative): not committing only means re-delivery after a crash, never loss."""
        async with self._commit_lock:  # in order: a later commit never lands before an earlier one
            offsets = self.ledger.committable()
            if not offsets:
                return
            try:
                # aiokafka retries retriable errors itself, without end: bound the wait, so an unreachable
                # coordinator delays commits (logged, counted) instead of stalling updates and stop.
                await asyncio.wait_for(self.consumer.commit(offsets), self.settings.kafka.request_timeout_ms / 1000)
            except (KafkaError, TimeoutError) as exc:
                retriable = isinstance(exc, (TimeoutError, CommitFailedError, RebalanceInProgressError)) or bool(
                    getattr(exc, "retriable", False))
                if not retriable:
                    raise
                COMMIT_FAILURES.inc()
                self.log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}"[:300],
                                 offsets={f"{tp.partition}": o for tp, o in offsets.items()})
                return
            self.ledger.mark_committed(offsets)
        self.log.debug("offsets_committed", offsets={f"{tp.partition}": o for tp, o in offsets.items()})

    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        await self._commit()
        self.buffer = [p for p in self.buffer if p.tp not in revoked]
        self.ledger.forget(revoked)

    # ---- publishing and checkpoints --------------------------------------------------------
    async def _publish(self, version: int, data: bytes, update: int) -> None:
        """Write the weights blob and send a candidate; paramsync verifies and publishes it."""
        key, sha = await asyncio.to_thread(self.policies.put_blob, data)
        rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data),
                            trainer_step=update)
        await self.producer.send_and_wait(self.topics.policy, PolicyMessage.of("candidate", rec).to_bytes(),
                                          key=KEY_CANDIDATE)
        VERSION.set(version)
        self.log.info("candidate_sent", policy_version=version, sha256=sha[:12], update=rec.trainer_step)

    async def _checkpoint(self) -> None:
        c = self.learner.counters
        step = c.updates
        current = await asyncio.to_thread(self.checkpoints.read_marker)
        if current is not None and current[0].version >= step:
            self.log.info("checkpoint_up_to_date", update=step)
            return
        offsets = self.ledger.snapshot()
        data = self.learner.state_bytes(offsets)
        key, sha = await asyncio.to_thread(self.checkpoints.put_blob, data,
                                           f"{self.checkpoints.prefix}/{step}/state.pt")
        rec = VersionRecord(version=step, blob=key, sha256=sha, size=len(data), trainer_step=step,
                            extra={"policy_version": c.policy_version, "offsets": offsets})
        await asyncio.to_thread(self.checkpoints.publish, rec, None if current is None else current[1])
        CHECKPOINTS.inc()
        pruned = await asyncio.to_thread(self.checkpoints.prune, self.cfg.keep_checkpoints)
        self.log.info("checkpoint_written", update=step, policy_version=c.policy_version, key=key,
                      pruned=pruned or None)

    async def _restore(self) -> None:
        found = await asyncio.to_thread(self.checkpoints.load_newer, None)
        if found is not None:
            record, data = found
            offsets = self.learner.restore(data)
            self.log.info("checkpoint_restored", update=record.version,
                          policy_version=self.learner.counters.policy_version, checkpoint_offsets=offsets)
        published = await asyncio.to_thread(self.policies.load_newer, self.learner.counters.policy_version)
        if published is not None:
            # The policy samplers act on is newer than the checkpoint (a crash after publishing):
            # continue from it, so the trainer's model and the behaviour policy agree.
            record, data = published
            self.learner.load_policy_weights(data)
            self.learner.counters.policy_version = record.version
            self.log.info("published_policy_loaded", policy_version=record.version)
        VERSION.set(self.learner.counters.policy_version)

    # ---- heartbeats ------------------------------------------------------------------------
    async def _maybe_heartbeat(self) -> None:
        if time.monotonic() - self._last_beat < self.cfg.heartbeat_interval_s:
            return
        self._last_beat = time.monotonic()
        c = self.learner.counters
        st = list(self.staleness)
        beat = TrainerBeat(
            id=self.id, policy_version=c.policy_version, updates=c.updates, env_steps_trained=c.env_steps_trained,
            fragments_trained=c.fragments_trained, samples_per_s=self.rate.rate(), last_update_at=self.last_update_at,
            staleness_mean=sum(st) / len(st) if st else None, staleness_max=max(st) if st else None,
            return_mean=sum(c.recent_returns) / len(c.recent_returns) if c.recent_returns else None,
            return_count=len(c.recent_returns), fragments_dropped_stale=self.dropped,
            fragments_dead_lettered=self.dead_lettered,
        )
        await self.producer.send(self.topics.heartbeats, beat.to_bytes(), key=self.id.encode())
