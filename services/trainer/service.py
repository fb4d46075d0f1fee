"""The trainer service: pull fragments, validate, batch, update, *then* commit offsets.

A short loop over parts built from explicit inputs (docs/architecture.md, "The trainer"):
:class:`~services.trainer.group.ConsumerGroup` (ownership, the ledger of outcomes, commits,
dead-lettering), :class:`~services.trainer.publication.Publication` (candidates, deferral, resend),
:class:`~services.trainer.checkpoints.Checkpoints` (write, restore, fallback) and
:mod:`~services.trainer.telemetry` (metrics, lag, heartbeats), with the pure rules in ``intake.py``,
``ledger.py``, ``learner.py`` and ``guard.py``. What follows an update (commit, publish, checkpoint, the held
commits) has one owner, :class:`~services.trainer.tail.UpdateTail`. This class keeps the loop and the state the
parts share: the update lock, revoke handling, rollback following, runtime settings. One loop serves a single
trainer and data-parallel ranks: what to do each pass is decided by :mod:`~services.trainer.agreement` (alone, or
by the ranks' vote) and done here. Its periodic work runs as named tasks (``shared.background``) built here
from the parts in ``tasks.py`` (the lease, grants, live samplers, the publication watch), which decide and return
what to do; the acting that needs this trainer's state stays here. No part holds the trainer.

Every consumed record ends in exactly one typed outcome (trained, dropped as stale, dead-lettered),
counted and logged once with the fragment's identity, and folded into the ledger the checkpoint stores
beside the weights: ``flywheel verify`` proves exactly-once from the checkpoint and the topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import socket
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

import torch
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from services.trainer import telemetry as m
from services.trainer.agreement import Agreed, Agreement, Alone, Decision
from services.trainer.autorollback import GuardShell
from services.trainer.checkpoints import Checkpoints
from services.trainer.compute import choose as choose_compute
from services.trainer.compute import choose_threads
from services.trainer.group import ConsumerGroup
from services.trainer.guard import RollbackGuard
from services.trainer.intake import Batch, BatchStrategy, Intake, StallWatch, strategy_for
from services.trainer.learner import Learner
from services.trainer.lease import RENEW_S, TrainerLease
from services.trainer.outcomes import RecordOutcomes
from services.trainer.publication import Publication, announcement
from services.trainer.ranks import Ranks, Vote
from services.trainer.tail import UpdateTail
from services.trainer.tasks import (
    GRANT_REFRESH_S,
    Grants,
    HeldLease,
    LiveSamplers,
    PublicationWatch,
    record_update,
    trainer_beat,
)
from services.trainer.tracking import Tracker
from services.trainer.update import UpdateStats
from shared.background import Background
from shared.bus import Bus, Record, kafka_bus
from shared.credits import Consumption, auto_window
from shared.identity import IdentityCheck
from shared.kafka import Topics, trainer_group
from shared.logging import get_logger
from shared.marker import BadPayload, VersionedStore, VersionRecord
from shared.messages import PolicyMessage
from shared.retry import Health, Retrier, describe, every, is_transient, poll_or_pause, read_forever, stop_clients
from shared.rl.envs import fragment_spec
from shared.runtime import AuditLog, Auditor, RuntimeApplier, RuntimeConfig, RuntimeWatcher, runtime_values
from shared.settings import Settings
from shared.signing import (
    PolicyVerifier,
    Refusals,
    SignatureRefused,
    Signer,
    message_audit_params,
    record_audit_params,
)
from shared.store import open_store

DIGEST_EVERY = 10
"""Data-parallel ranks note their weights digest every this many updates (the same updates on every rank)."""
POLICY_REFRESH_S = 5.0
"""Re-read the marker this often (announcements are the fast path; this covers lost ones)."""
PREFETCH_POLL_MS = 10
"""Poll timeout while an update runs (Trainer._prefetch_while)."""
PREFETCH_POLL_BOUND_S = 0.5
"""A poll while an update runs that has not returned in this long is given up (a rebalance parks it)."""
FIND_LOST_S = 1.0
"""Look this often for records that left the log unread while no later record came (ConsumerGroup.find_lost)."""
RUNTIME_POLL_S = 2.0
"""Runtime settings (PATCH /config) are applied within this long."""
GUARD_CHECK_S = 1.0
"""The rollback guard decides this often (its windows are counted in episodes, not seconds)."""


class Trainer:
    name = "trainer"

    def __init__(self, settings: Settings, trainer_id: str | None = None, bus: Bus | None = None,
                 strategy: BatchStrategy | None = None) -> None:
        self.id = trainer_id or f"trainer-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger()
        self.spec = dataclasses.replace(fragment_spec(settings.env.id, settings.kafka.max_message_bytes,
                                                      settings.env.frame_stack),
                                        max_abs_value=settings.trainer.max_abs_value)
        # torch_threads and precision: as set, or chosen by measurement for `auto` (services/trainer/compute.py);
        # the settings carry the choice, so runtime revisions and checkpoints restore apply on top of it.
        threads = choose_threads(settings.trainer)
        torch.set_num_threads(threads[0])
        learner = Learner(self.spec, settings.trainer)
        self.compute = choose_compute(settings, learner, self.spec, threads)
        settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(
            update={"precision": self.compute.precision, "torch_threads": threads[0]})})
        self.settings = self.base_settings = settings
        self.cfg = settings.trainer
        self.learner = learner if learner.update_cfg.bf16 == (self.compute.precision == "bf16") else \
            Learner(self.spec, self.cfg)  # the same seed: the same initial weights
        m.report_compute(self.compute)
        self.log.info("compute_chosen", **self.compute.as_dict())
        # Data-parallel ranks (services/trainer/ranks.py): None for a single trainer.
        self.ranks = (Ranks(world_size=self.cfg.world_size, rank=self.cfg.rank, rendezvous=self.cfg.rendezvous,
                            timeout_s=self.cfg.rank_timeout_s, device=self.learner.device)
                      if self.cfg.world_size > 1 else None)
        self.leader = self.ranks is None or self.ranks.leader  # publishes, checkpoints, guards, holds the lease
        self.agreement: Agreement = Alone() if self.ranks is None else Agreed(self.ranks)
        self.digest: tuple[int, str] | None = None  # (update, weights digest) for the heartbeat
        store = open_store(settings)
        self.store = store
        self.audit = Auditor(AuditLog(store, settings.run), self.log, "trainer")
        repaired = self.audit.repair_hook
        self.runtime = RuntimeApplier(RuntimeWatcher(RuntimeConfig(store, settings.run, on_repair=repaired("config"))),
                                      settings, self._apply_settings, self.log, "trainer")
        self.lineage = 0  # the newest rollback the model descends from
        self.pending_rollback: PolicyMessage | None = None
        self.policies = VersionedStore(store, settings.run, "policy", on_repair=repaired("policy"))
        # Announcements and the marker count as published only with paramsync's signature (docs/security.md):
        # a forged version never becomes the staleness reference. Each refusal is logged, counted and audited.
        self.verifier = PolicyVerifier.from_settings(settings)
        self.refusals = Refusals("trainer", self.log)
        # Signs each candidate and checkpoint with the trainer's own key: paramsync publishes only what it signed,
        # and a restore takes only this run's signed checkpoints. None: signing is off.
        self.signer = Signer.from_settings(settings, "trainer")
        self.health_state = Health("trainer")
        self.retry = Retrier(self.health_state, self.log)
        instance = self.cfg.group_instance_id
        if self.ranks is not None and instance is not None:
            instance = f"{instance}-rank{self.cfg.rank}"  # static member ids must differ between ranks
        bus = bus or kafka_bus(settings, trainer_group(settings.run), instance)
        self.lag_reader = bus.lag
        self.create_topics = bus.create_topics
        self.producer, self.source, self.announcements = bus.publisher, bus.source, bus.tail(self.topics.policy)
        kafka_timeout_s = settings.kafka.request_timeout_ms / 1000
        self.group = ConsumerGroup(self.source, self.producer, samples_topic=self.topics.samples,
                                   dlq_topic=self.topics.dlq, max_message_bytes=settings.kafka.max_message_bytes,
                                   kafka_timeout_s=kafka_timeout_s, health=self.health_state, retry=self.retry,
                                   audit=self.audit, log=self.log)
        self.publication = Publication(self.policies, self.producer, policy_topic=self.topics.policy,
                                       kafka_timeout_s=kafka_timeout_s, health=self.health_state, retry=self.retry,
                                       audit=self.audit, log=self.log,
                                       sign=None if self.signer is None else self.signer.sign_message)
        ckpt_store = VersionedStore(store, settings.run, "checkpoints", on_repair=repaired("checkpoints"))
        self.checkpoints = Checkpoints(ckpt_store,
                                       keep=self.cfg.keep_checkpoints, health=self.health_state, retry=self.retry,
                                       audit=self.audit, log=self.log, run=settings.run,
                                       sign=None if self.signer is None else self.signer.sign_checkpoint,
                                       check=self.verifier.check_checkpoint)
        # How batches form (async, or the synchronous baseline) is the one thing settings.mode changes here.
        strategy = strategy or strategy_for(settings.mode, self.cfg.batch_fragments, self.cfg.poll_max_records)
        self.intake = Intake(max_staleness=self.cfg.max_staleness, batch_timeout_s=self.cfg.batch_timeout_s,
                             strategy=strategy)
        self.stall = StallWatch(self.cfg.stall_after_s, time.monotonic())
        shards = settings.kafka.credits_partitions
        self.consumption = Consumption(auto_window(settings), live_after_s=settings.paramsync.sampler_timeout_s,
                                       shards=shards, allocates=self.leader)
        # Data-parallel ranks: rank 0 decides windows and turns, so it reads what the other ranks consumed
        # from their grants (every credits partition; O(samplers) per second in all, one reader).
        self.rank_grants = (bus.tail(self.topics.credits, partitions={self.topics.credits: range(shards)})
                            if self.ranks is not None and self.leader else None)
        self.stats = m.TrainerStats()
        # A strategy that waits for every live sampler (sync) learns who is live from their heartbeats.
        self.beats = bus.tail(self.topics.heartbeats) if strategy.needs_live_samplers else None
        rollback_guard = RollbackGuard(self.cfg.guard, return_window=self.cfg.return_window)
        self.guard = GuardShell(rollback_guard, store=store, run=settings.run, policies=self.policies,
                                config=self.runtime.watcher.config, producer=self.producer,
                                control_topic=self.topics.control, audit=self.audit, log=self.log, holder=self.id,
                                lineage=lambda: self.lineage)
        # TensorBoard (on by default), MLflow when configured; rank 0's only (the ranks train one model).
        self.tracker = Tracker.from_settings(settings) if self.leader else Tracker()
        self.lease = HeldLease(TrainerLease(store, settings.run, self.id), self.retry, self.log)
        self.grants = Grants(self.consumption, self.producer, topic=self.topics.credits, trainer_id=self.id,
                             log=self.log, seen=self.group.seen)
        # Heartbeats (read only when a strategy waits for live samplers) and fragments each keep a book of bindings.
        handover_s = settings.sampler.identity_handover_s
        self.live = LiveSamplers(IdentityCheck("trainer", self.log, handover_s))
        self.watch = PublicationWatch()
        self.background = Background("trainer")
        self.tail = UpdateTail(self.group, self.publication, self.checkpoints, publish_extra=self._lineage_extra,
                               checkpoint_extra=self._checkpoint_extra, fence=self.lease.check)
        self._revision_actor: str | None = None  # who wrote the runtime revision being applied
        self.outcomes = RecordOutcomes(group=self.group, intake=self.intake, stall=self.stall,
                                       consumption=self.consumption, stats=self.stats, spec=self.spec, log=self.log,
                                       consumed=self.grants.consumed, refresh_published=self.refresh_published,
                                       identity=IdentityCheck("trainer", self.log, handover_s), audit=self.audit)
        self._stop = asyncio.Event()
        self._rebalancing = False  # from a revoke callback to the assignment: no prefetch polls meanwhile
        self._started = False
        self._update_lock = asyncio.Lock()  # a revoke, a rollback and a runtime change wait for the update
        self._fatal: BaseException | None = None  # a fatal error met inside a rebalance callback
        self._update_failed = False

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.retry(self.create_topics, "create topics", "kafka")
        if self.ranks is not None:
            await self._check_partitions()
        if self.leader:
            await self.lease.acquire()  # the other ranks are fenced by rank 0: none trains without it
        if self.ranks is not None:
            self.log.info("rank_rendezvous", rank=self.ranks.rank, world_size=self.ranks.world_size,
                          rendezvous=self.ranks.rendezvous, backend=self.ranks.backend)
            await asyncio.to_thread(self.ranks.join)
            self.log.info("rank_joined", rank=self.ranks.rank, world_size=self.ranks.world_size)
        if self.leader:
            await self._restore()
        if self.ranks is not None:
            await self._share_restore()
        await self.retry(self.producer.start, "start producer", "kafka")
        marker = await self.retry(self.publication.read_marker, "read policy marker", "store")
        if not await self.trusted(marker):
            pass  # a forged marker: neither published nor absent (paramsync's next version moves it)
        elif marker is None and not self.leader:
            pass  # rank 0 publishes version 0
        elif marker is None:
            c = self.learner.counters
            await self.publication.publish(c.policy_version, self.learner.weights(), c.updates, self._lineage_extra(),
                                           required=True)  # version 0
        else:
            self.intake.saw_published(marker[0].version)
        await self.retry(self.source.start, "start consumer", "kafka")
        self.source.subscribe(self.topics.samples, self._on_revoke, self._on_assign)
        await self.retry(self.announcements.start, "start announcement reader", "kafka")
        if self.beats is not None:
            await self.retry(self.beats.start, "start heartbeat reader", "kafka")
        if self.rank_grants is not None:
            await self.retry(self.rank_grants.start, "start rank grant reader", "kafka")
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        """One loop for one trainer or many ranks: poll, then decide (``self.agreement``) and act until the pass
        is over; the agreement is the only part that differs between the two."""
        self._stop = self.retry.stop_event = stop_event
        self.background.start_all(self._jobs(stop_event))
        while True:
            if self._fatal is not None:
                raise self._fatal
            self.background.raise_if_ended(stop_event.is_set())
            if not stop_event.is_set():
                await self._poll_once()
                if self.beats is not None:
                    self.live.saw(await self.beats.poll(timeout_ms=0), time.monotonic(),
                                  self.settings.paramsync.sampler_timeout_s)
            while True:
                decision = await self._decide_and_act(stop_event.is_set())
                if decision.stop:
                    return
                if not decision.again:
                    break
            await self._after_pass()

    async def _decide_and_act(self, stopping: bool) -> Decision:
        """Form this trainer's batch, agree on what to do with it, and do that: adopt rank 0's settings, then
        follow a rollback (releasing the batch, formed before it), stop, train, or nothing."""
        now, live = time.monotonic(), self._live_samplers()
        batch = self._form_batch(now, live)
        decision = await self.agreement.decide(Vote(
            ready=bool(batch.train), stop=stopping, rollback=self.pending_rollback,
            learner=(self.learner.cfg, self.learner.update_cfg), checkpoint=self.checkpoints.last))
        if decision.adopt is not None:  # rank 0's hyperparameters, rollbacks and checkpoints are the group's
            self.pending_rollback = None
            self.learner.cfg, self.learner.update_cfg = decision.adopt.learner
            runs = "bf16" if self.learner.update_cfg.bf16 else "fp32"
            if runs != self.compute.precision:  # what the group runs is rank 0's choice: say so, not this rank's own
                self.compute = dataclasses.replace(self.compute, precision=runs,
                                                   precision_reason="rank 0's choice, adopted with its settings")
                m.report_compute(self.compute)
            self.tail.adopt_checkpoint(decision.adopt.checkpoint)
        if decision.rollback is not None:
            self.intake.put_back(batch.train)  # formed before the rollback: staleness is checked again after it
            await self.follow_rollback(decision.rollback)
        elif decision.stop:
            self.intake.put_back(batch.train)
            if self.ranks is not None:
                async with self._update_lock:
                    await self._exchange_ledgers()  # rank 0's final checkpoint holds every rank's outcomes
                self.log.info("ranks_stopping", stopping=list(decision.stopping_ranks))
        elif decision.train:
            if decision.force:  # another rank's batch is due: train what this one holds with it
                batch = self._form_batch(now, live, force=True, note_wait=False)
            await self._train(batch)
        return decision

    def _form_batch(self, now: float, live: set[str] | None, force: bool = False, note_wait: bool = True) -> Batch:
        batch = self.intake.form_batch(now, live, force=force)
        self.outcomes.drop_stale(batch)
        if batch.waiting_publication and note_wait:  # a forced form in the same pass counts no second wait
            self._note_publication_wait()
        return batch

    async def _after_pass(self) -> None:
        await self.tail.after_pass()
        if self.leader:
            await self._publication_watch()

    # ---- periodic work -------------------------------------------------------------------------
    def _jobs(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The named background tasks: announcements, credit grants, heartbeats, runtime config, the marker;
        rank 0 adds the lease and the rollback guard, and reads the other ranks' grants."""
        log = self.log
        jobs: list[tuple[str, Coroutine[Any, Any, None]]] = [
            ("announcements", read_forever(self.announcements, self.saw_announcement, name="announcements", log=log)),
            ("credit-grants", every(lambda: GRANT_REFRESH_S, self.grants.send, name="credit-grants", log=log,
                                    stop_event=stop, wake=self.grants.consumed)),
            ("heartbeats", every(lambda: self.cfg.heartbeat_interval_s, self.heartbeat, name="heartbeats", log=log,
                                 stop_event=stop)),
            ("find-lost", every(lambda: FIND_LOST_S, self.group.find_lost, name="find-lost", log=log,
                                stop_event=stop)),
            ("runtime-config", every(lambda: RUNTIME_POLL_S, self.runtime_config, name="runtime-config", log=log,
                                     stop_event=stop)),
            ("marker-refresh", every(lambda: POLICY_REFRESH_S, self._refresh_marker, name="marker-refresh", log=log,
                                     stop_event=stop)),
        ]
        if self.leader:  # data-parallel ranks: rank 0 holds the lease and guards the group's model
            jobs += [
                ("lease", every(lambda: RENEW_S, self.lease.renew, name="lease", log=log, stop_event=stop)),
                ("rollback-guard", every(lambda: GUARD_CHECK_S, self.guard_check, name="rollback-guard", log=log,
                                         stop_event=stop)),
            ]
        if self.rank_grants is not None:
            jobs.append(("rank-grants", read_forever(self.rank_grants, self.grants.saw_rank_grant, name="rank-grants",
                                                     log=log)))
        return jobs

    async def heartbeat(self) -> None:
        if self.ranks is not None:  # a collective waiting on a rank that is gone or cut off: say so before it times out
            self.ranks.report(self.health_state, self.log, time.monotonic())
        beat = trainer_beat(trainer_id=self.id, learner=self.learner, stats=self.stats, intake=self.intake,
                            stall=self.stall.check(time.monotonic(), self.intake.reference),
                            publication=self.publication, health=self.health_state, cfg=self.cfg, digest=self.digest,
                            lost=self.group.lost(), compute=self.compute.as_dict())
        try:
            await self.producer.send(self.topics.heartbeats, beat.to_bytes(), key=self.id.encode())
        except Exception as exc:  # a heartbeat is not worth stopping for; the next one retries
            if not is_transient(exc):
                raise
            self.log.debug("heartbeat_failed", error=describe(exc))

    async def guard_check(self) -> None:
        decision = await self.guard.check(self.base_settings, self.settings)
        if decision is not None and decision.action == "rollback":
            # The remedy's revision (revert_config, lower_lr) is applied now, before the restored weights train:
            # the rollback is followed as soon as paramsync announces it (about a second), the runtime poll comes
            # only every RUNTIME_POLL_S, and updates in between at the blamed settings would break the restored
            # weights again.
            await self.runtime_config()

    async def runtime_config(self) -> None:
        """The newest runtime revision, applied on this trainer's own settings (``RuntimeApplier``), never
        between an update's steps. An unreadable revision leaves the settings as they are (degraded)."""
        try:
            rev = await asyncio.wait_for(asyncio.to_thread(self.runtime.watcher.poll), 10)
        except Exception as exc:
            if not (is_transient(exc) or isinstance(exc, BadPayload)):
                raise
            self.health_state.degraded("config", f"runtime config unreadable: {describe(exc)}")
            self.log.warning("runtime_config_unreadable", error=describe(exc))
            return
        self.health_state.recovered("config")
        if rev is not None:
            async with self._update_lock:
                self._revision_actor = rev.actor
                self.runtime.handle(rev)

    def _apply_settings(self, settings: Settings, revision: int) -> dict[str, Any]:
        old = runtime_values(self.settings)
        self.settings, self.cfg = settings, settings.trainer
        self.learner.set_runtime(settings.trainer)
        self.intake.max_staleness = settings.trainer.max_staleness
        self.consumption.total_window = auto_window(settings)
        self.stats.config_revision = revision
        self.guard.guard.cfg = settings.trainer.guard
        m.LEARNING_RATE.set(self.learner.learning_rate())
        new = runtime_values(settings)
        changes = {k: {"old": old[k], "new": new[k]} for k in new if k.startswith("trainer.") and old[k] != new[k]}
        # The guard notes it as a possible cause of a fall (its own remedies, by their actor, never are).
        self.guard.note_revision(time.time(), revision, sorted(changes), self._revision_actor)
        return changes

    async def refresh_published(self) -> bool:
        """Re-read the marker (an announcement may not have reached us yet); True if it moved. A store that
        cannot be read marks the trainer degraded and leaves the reference as it was."""
        before = self.intake.published
        try:
            marker = await self.publication.read_marker()
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.health_state.degraded("store", f"marker read failed: {describe(exc)}")
            return False
        self.health_state.recovered("store")
        if marker is not None and await self.trusted(marker):
            self.intake.saw_published(marker[0].version)
        return self.intake.published != before

    async def _refresh_marker(self) -> None:
        await self.refresh_published()

    async def _publication_watch(self) -> None:
        """Re-send a candidate paramsync has not published; offer the current weights when nothing was sent for
        them; retry a deferred one; report a stall."""
        now = time.monotonic()
        pub, published = self.publication, self.intake.published
        if pub.resend_due(published, now, self.cfg.candidate_resend_s):
            await pub.resend("not published in time", published)
        published = self.intake.published
        ahead = self.learner.counters.policy_version > (published if published is not None else -1)
        if self.watch.offer_current(now, offered=pub.candidate is not None or pub.deferred is not None, ahead=ahead,
                                    after_s=self.cfg.candidate_resend_s):
            await self.publish_current("ahead of the published version with no candidate sent")
        await self.tail.retry_deferred(now)
        stall = self.stall.check(now, self.intake.reference)
        m.STALLED.set(0 if stall is None else 1)
        if self.watch.newly_stalled(stall) and stall is not None:
            self.log.error("training_stalled", reason=stall.reason, published_version=self.intake.published,
                           policy_version=self.learner.counters.policy_version)
            await self.audit("training_stalled", {"reason": stall.reason}, "detected; re-sending the candidate")
            await pub.resend("training stalled", self.intake.published)

    def _note_publication_wait(self) -> None:
        if self.watch.log_wait(time.monotonic()):
            self.log.info("waiting_for_publication", policy_version=self.learner.counters.policy_version,
                          published_version=self.intake.published, lead=max(1, self.intake.bound))
        m.PUBLICATION_WAITS.inc()

    def _live_samplers(self) -> set[str] | None:
        if self.beats is None:
            return None
        return self.live.live(time.monotonic(), self.settings.paramsync.sampler_timeout_s)

    # ---- data-parallel ranks ------------------------------------------------------------------
    async def _check_partitions(self) -> None:
        """Every rank needs a partition of its own: fewer partitions than ranks is refused at start."""
        reader = self.lag_reader()
        try:
            await self.retry(reader.start, "start lag reader", "kafka")
            parts = len(await self.retry(lambda: reader.lag(trainer_group(self.settings.run), self.topics.samples),
                                         "read samples partitions", "kafka"))
        finally:
            await stop_clients([reader], self.log)
        if parts < self.cfg.world_size:
            raise ValueError(f"trainer.world_size is {self.cfg.world_size} but {self.topics.samples} has {parts} "
                             "partitions: every rank needs at least one (raise kafka.samples_partitions for a new "
                             "run, or add partitions to the topic)")

    async def _share_restore(self) -> None:
        """Every rank starts from rank 0's restored state (weights, optimizer, counters, ledger, lineage),
        so the ranks are identical from the first step whatever each could read from the store."""
        assert self.ranks is not None
        state: dict[str, Any] | None = None
        if self.leader:
            offsets, ledger = self.group.ledger.snapshot(), self.group.ledger.state()
            state = {"learner": self.learner.state_bytes(offsets, ledger), "offsets": offsets, "ledger": ledger,
                     "lineage": self.lineage, "abandoned": self.intake.abandoned,
                     "checkpoint": self.checkpoints.last, "unseen_from_origin": self.group.unseen_from_origin}
        state = await asyncio.to_thread(self.ranks.broadcast, state)
        assert state is not None
        if not self.leader:
            self.learner.restore(state["learner"])
            self.group.restore(state["ledger"], state["offsets"])
            for lo, hi in state["abandoned"]:
                self.intake.abandon(lo, hi)
            self.lineage = state["lineage"]
            self.checkpoints.last = state["checkpoint"]
            self.group.unseen_from_origin = state["unseen_from_origin"]
            self.intake.model_version = self.learner.counters.policy_version
            m.VERSION.set(self.learner.counters.policy_version)
        self._note_digest()
        self.log.info("rank_state_shared", update=self.learner.counters.updates,
                      policy_version=self.learner.counters.policy_version, weights_digest=self.digest)

    async def _exchange_ledgers(self) -> None:
        """Every rank's ledger entries for the partitions it owns, to every rank (under the update lock)."""
        assert self.ranks is not None
        # Export every partition still assigned, those being revoked included: an update that ran while a
        # revoke waited for the lock trained their records, and the next owner must resume after them. Adopt
        # only for partitions this rank no longer reads.
        held = set(self.source.assignment())
        owned = held - self.group.revoking
        exported = await asyncio.to_thread(self.ranks.gather, self.group.ledger.export(held))
        merged: dict[str, dict[str, Any]] = {}
        for entries in exported:
            for key, d in entries.items():
                if key not in merged or int(d["end"]) > int(merged[key]["end"]):
                    merged[key] = d
        self.group.ledger.adopt(merged, owned)

    def _note_digest(self) -> None:
        c = self.learner.counters
        self.digest = (c.updates, hashlib.sha256(self.learner.weights()).hexdigest()[:16])

    async def _poll_once(self, timeout_ms: int | None = None, want: int | None = None) -> None:
        want = self.intake.wants() if want is None else want
        timeout_ms = self.intake.strategy.poll_timeout_ms if timeout_ms is None else timeout_ms
        if want == 0:  # waiting for a publication with a batch held: consume (and grant) nothing more
            await asyncio.sleep(timeout_ms / 1000)
            return
        polled = await poll_or_pause(lambda: self.source.poll(max_records=want, timeout_ms=timeout_ms),
                                     what="poll", health=self.health_state, log=self.log)
        await self._take_polled(polled or {})

    async def _take_polled(self, polled: dict[TopicPartition, list[Record]]) -> None:
        """Each polled record's outcome, in order. While a partition's records are being taken, the group knows the
        lowest offset still in hand (the consumer's position is already past them: not a loss, ``find_lost``)."""
        for tp, records in polled.items():
            try:
                for rec in records:
                    if not self.group.owned(tp):  # revoked while an earlier record was handled
                        self.log.info("revoked_records_skipped", partition=tp.partition, from_offset=rec.offset)
                        break
                    self.group.in_hand[tp] = rec.offset
                    await self.outcomes.take(tp, rec, self.learner)
            finally:
                self.group.in_hand.pop(tp, None)

    async def stop(self) -> None:
        try:
            if self._started:
                try:
                    await self.tail.settle()
                except Exception as exc:  # already the reason run() ended, or it will be logged with it
                    self.log.error("background_commit_publish_failed", error=describe(exc))
                await self.group.commit()
                updates = self.learner.counters.updates
                if self._update_failed:
                    self.log.error("final_checkpoint_skipped", reason="an update failed part-way; the previous "
                                   "checkpoint stays the resume point")
                elif not self.leader:
                    pass  # rank 0 writes the group's checkpoint
                elif updates and self.checkpoints.holds(updates, self.group.ledger.snapshot()):
                    self.log.info("checkpoint_up_to_date", update=updates)
                elif updates:
                    try:  # fenced like every checkpoint: a trainer that lost its lease writes none
                        await asyncio.wait_for(self.tail.checkpoint(self.learner), 30)
                    except Exception as exc:  # the store is down: the next start resumes from the previous one
                        self.log.error("final_checkpoint_failed", error=describe(exc))
        finally:
            await self.background.stop()
            clients: list[Any] = [self.source, self.announcements, self.producer]
            if self.beats is not None:
                clients.append(self.beats)
            if self.rank_grants is not None:
                clients.append(self.rank_grants)
            await stop_clients(clients, self.log)
            if self.leader:
                await self.lease.release()
            self.tracker.close()
            if self.ranks is not None:
                self.ranks.close()

    def health(self) -> dict[str, Any]:
        c = self.learner.counters
        stall = self.stall.check(time.monotonic(), self.intake.reference)
        return {"ok": self._started, "updates": c.updates, "policy_version": c.policy_version,
                **self.health_state.as_dict(), "stalled": None if stall is None else stall.reason}

    # ---- update, then commit ---------------------------------------------------------------
    async def _train(self, batch: Batch) -> None:
        async with self._update_lock:
            gone = [p for p in batch.train if not self.group.owned(p.tp)]
            if gone:  # formed before a revoke that ran while this waited for the lock: not ours to train
                self.intake.release(gone)
                keep = [(p, st) for p, st in zip(batch.train, batch.staleness, strict=True) if self.group.owned(p.tp)]
                batch = Batch(train=[p for p, _ in keep], staleness=[st for _, st in keep])
                self.log.info("revoked_batch_items_released", count=len(gone))
                if not batch.train and self.ranks is None:  # a rank takes part in the update all the same
                    return
            t0 = time.perf_counter()
            frags = [p.frag for p in batch.train]
            spent = [0.0]  # the update's own time, in its thread (what the learner was busy for)

            def timed_update() -> UpdateStats:
                t = time.perf_counter()
                try:
                    return self.learner.update(frags) if self.ranks is None else self.learner.update(frags, self.ranks)
                finally:
                    spent[0] = time.perf_counter() - t

            update = asyncio.ensure_future(asyncio.to_thread(timed_update))
            try:
                try:
                    await self._prefetch_while(update)
                finally:
                    if not update.done():  # the prefetch failed: the update thread still finishes first
                        await asyncio.wait([update])
                stats = update.result()
            except BaseException as exc:
                self._update_failed = True  # the weights may hold part of this update: no final checkpoint
                failed = None if update.cancelled() else update.exception()
                if failed is not None and failed is not exc:  # raised beside the prefetch's error: not lost
                    self.log.error("update_failed", error=describe(failed))
                raise
            self.stats.busy.add(spent[0])
            # The ledger takes the outcomes in the same step as the weights took the gradients.
            for p in batch.train:
                self.group.finished(p.tp, p.offset, "trained")
            if self.ranks is not None:
                await self._exchange_ledgers()
                if self.learner.counters.updates % DIGEST_EVERY == 0:
                    self._note_digest()
            record_update(batch, stats, time.perf_counter() - t0, learner=self.learner, trainer_stats=self.stats,
                          stall=self.stall, tracker=self.tracker, log=self.log)
            await self._after_update_step(stats)

    async def _prefetch_while(self, update: asyncio.Future[UpdateStats]) -> None:
        """While the update runs in its thread, poll and decode the records of the next batch (what
        ``Intake.wants_ahead`` says it still needs, none once it is complete), so the learner finds it ready instead of
        waiting for the poll and the decode after the update. Short polls (``PREFETCH_POLL_MS``, bounded by
        ``PREFETCH_POLL_BOUND_S``), each batch of records taken whole: a record is never left half-handled, so a
        record being taken (a dead-letter send, a store read) can hold the next update that long. None while a
        rebalance is under way (its revoke callback waits for this update). Records taken now are admitted as any
        other; the staleness bound is applied when their batch is formed."""
        while not update.done() and not self._stop.is_set() and not self._rebalancing:
            want = self.intake.wants_ahead()
            if want == 0:
                break
            try:
                # Bounded: during a rebalance aiokafka parks a poll until the new assignment, which waits for the
                # revoke callback, which waits for this update's lock: a poll left waiting would never return.
                polled = await asyncio.wait_for(self.source.poll(max_records=want, timeout_ms=PREFETCH_POLL_MS),
                                                PREFETCH_POLL_BOUND_S)
            except (TimeoutError, KafkaError) as exc:  # the loop's own poll, after the update, deals with Kafka
                self.log.debug("prefetch_stopped", reason=describe(exc) or "the poll did not return in time")
                break
            await self._take_polled(polled)
        await asyncio.wait([update])

    async def _after_update_step(self, stats: UpdateStats) -> None:
        """The model's version moves every ``publish_every`` updates; rank 0 (or a single trainer) makes the
        candidate and shows the guard the update; the tail commits (only now, after the optimizer step),
        publishes and checkpoints."""
        await self.tail.settle()
        c = self.learner.counters
        candidate = None
        if c.updates % self.cfg.publish_every == 0:
            c.policy_version += 1  # the model is at that version now (every rank counts; rank 0 publishes)
            self.intake.model_version = c.policy_version
            if self.leader:
                candidate = (c.policy_version, self.learner.weights(), c.updates)  # as of this update
        if self.leader:
            mean = sum(c.recent_returns) / len(c.recent_returns) if c.recent_returns else None
            self.guard.observe(time.time(), c.policy_version, mean, c.episodes, stats)
        await self.tail.after_update(self.learner, candidate, leader=self.leader,
                                     checkpoint_every=self.cfg.checkpoint_every)

    def _lineage_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"lineage": self.lineage} if self.lineage else {}
        if self.checkpoints.last is not None:
            extra["checkpoint"] = self.checkpoints.last  # the checkpoint these weights descend from
        return extra

    async def publish_current(self, why: str) -> None:
        """Send the weights the trainer runs now as a candidate of its current version and lineage."""
        async with self._update_lock:
            await self.tail.settle()
            c = self.learner.counters
            self.log.warning("candidate_offered_again", policy_version=c.policy_version, reason=why,
                             published_version=self.intake.published, automatic_action=True)
            await self.publication.publish(c.policy_version, self.learner.weights(), c.updates, self._lineage_extra())
        m.RECOVERIES.labels(action="offer_candidate_again").inc()

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"lineage": self.lineage, "abandoned": self.intake.abandoned, "trainer_id": self.id,
                "lease": self.lease.token}

    async def _restore(self) -> None:
        """Resume from the newest usable checkpoint, then follow what was published since (a rollback, a
        version numbering ahead of the checkpoint)."""
        self.learner, restored = await self.checkpoints.resume(
            self.learner, lambda: Learner(self.spec, self.cfg), self.group, self.intake, self.cfg.fresh_start)
        self.lineage = 0 if restored is None else restored.lineage
        # A deliberate fresh start trains a new model from the group's offsets, not from the run's origin.
        self.group.unseen_from_origin = not (restored is None and self.checkpoints.fresh_start_at is not None)
        marker = await self.retry(self.publication.read_marker, "read policy marker", "store")
        if not await self.trusted(marker):
            marker = None  # neither a rollback to follow nor a version to number after
        c = self.learner.counters
        lost = restored is None and self.checkpoints.fresh_start_at is None
        if marker is not None and lost and marker[0].version > 0:
            raise RuntimeError(f"policy version {marker[0].version} is published but no checkpoint exists (lost?); "
                               "refusing to train a new model from scratch under it: set trainer.fresh_start=true "
                               "to do so deliberately")
        if marker is not None and marker[0].lineage > self.lineage:
            # A rollback was published after this checkpoint: continue from the published weights.
            rec = marker[0]
            data = await self.retry(lambda: asyncio.to_thread(self.policies.fetch, rec), "fetch policy", "store")
            self._adopt_rollback(PolicyMessage.of("announce", rec), data)
            self.log.warning("rollback_followed_at_start", policy_version=rec.version, lineage=self.lineage)
        if marker is not None and marker[0].version > c.policy_version:
            # Samplers act on a version newer than the checkpoint (a crash after publishing). The model stays
            # the checkpoint's (its weights reflect exactly the checkpoint's offsets); only the numbering moves
            # on, so the next candidate is newer than what is published.
            self.log.info("version_numbering_advanced", checkpoint_version=c.policy_version,
                          published_version=marker[0].version)
            c.policy_version = marker[0].version
        self.intake.model_version = c.policy_version
        m.VERSION.set(c.policy_version)

    # ---- rebalances --------------------------------------------------------------------------
    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        """Before partitions leave: let the update in progress finish and commit it (its records are
        trained by this member and must not be re-delivered), commit, then drop the rest of theirs."""
        self._rebalancing = True  # first: an update's prefetch stops polling (it would wait for this callback)
        self.group.revoking |= revoked
        try:
            async with self._update_lock:
                try:
                    await self.tail.settle()
                except Exception as exc:
                    if not is_transient(exc):
                        self._fatal = exc  # raised by the loop: a rebalance callback must not hide it
                    raise
                finally:
                    await self.group.commit(include=revoked)
        except Exception as exc:  # the rebalance goes on; the new owner gets the uncommitted tail
            self.log.warning("revoke_commit_failed", error=describe(exc))
        finally:
            removed = self.intake.revoke(revoked)
            self.group.forget(revoked)
            if removed:
                self.log.info("revoked_fragments_released", count=len(removed),
                              partitions=sorted({p.tp.partition for p in removed}))

    async def _on_assign(self, assigned: set[TopicPartition]) -> None:
        """Every assigned partition is read from where this model's ledger ends (``ConsumerGroup.assigned``).
        A rank waits for the update in progress: its ledger exchange may bring the newest entry of a
        partition another rank just gave up."""
        async with self._update_lock if self.ranks is not None else contextlib.nullcontext():
            self.group.assigned(assigned)
        for tp in assigned:
            off = self.group.ledger.resume_offset(tp)
            if off is not None:
                self.intake.seeked(tp, off)
        self._rebalancing = False

    # ---- rollback ----------------------------------------------------------------------------
    async def trusted(self, marker: tuple[VersionRecord, str] | None) -> bool:
        """False when the marker's record lacks paramsync's valid signature (logged, counted, audited once)."""
        if marker is None:
            return True
        try:
            self.verifier.check_record(marker[0])
        except SignatureRefused as exc:
            if self.refusals.note_record(exc, marker[0], "marker", published_version=self.intake.published):
                await self.audit("policy_signature_refused", record_audit_params(exc, marker[0], "marker"),
                                 "refused: not taken as published")
            return False
        return True

    def saw_announcement(self, rec: Record) -> Awaitable[None] | None:
        """An announcement moves the published version (the staleness reference) only when paramsync signed it;
        a refused one returns the audit write, which the reader awaits."""
        msg = announcement(rec)
        if msg is None:
            return None
        try:
            self.verifier.check_message(msg)
        except SignatureRefused as exc:
            if self.refusals.note_message(exc, msg, offset=rec.offset, published_version=self.intake.published):
                return self.audit("policy_signature_refused", message_audit_params(exc, msg, offset=rec.offset),
                                  "refused: not taken as published")
            return None
        self.intake.saw_published(msg.version)
        if msg.rollback_of is not None and msg.lineage > self.lineage:
            self.pending_rollback = msg
        return None

    def _adopt_rollback(self, msg: PolicyMessage, data: bytes) -> tuple[int, int]:
        """Continue from republished weights with a fresh optimizer; the versions between the restored one
        and the republished one are abandoned: their fragments are dropped as stale, never trained."""
        c = self.learner.counters
        abandoned = (int(msg.rollback_of or 0) + 1, msg.version - 1)
        self.learner.load_policy_weights(data)
        self.learner.reset_optimizer()
        # The weights are now exactly the rollback's, so the model's version is the rollback's, even where
        # this trainer had already sent candidates numbered past it (a rollback published while the trainer
        # ran ahead of paramsync): those candidates were never published and are abandoned, so their numbers
        # are free, and keeping the higher number would leave the trainer max_staleness ahead of a published
        # version that nothing will ever move (it waits for publication; no update, no candidate).
        c.policy_version = msg.version
        self.intake.model_version = c.policy_version
        self.intake.saw_published(msg.version)
        if msg.rollback_of is not None:
            self.intake.abandon(*abandoned)
        self.lineage = msg.lineage
        self.publication.abandon()
        self.tail.checkpoint_due = True  # a restart must neither re-train the old history on top nor forget the abandon
        return abandoned

    async def follow_rollback(self, msg: PolicyMessage) -> None:
        """An operator (or the guard) rolled the policy back: adopt it, checkpoint before training on."""
        async with self._update_lock:
            self.pending_rollback = None
            if msg.lineage <= self.lineage:  # a re-announcement of a rollback already followed
                return
            await self.tail.settle()
            data = await self.retry(lambda: asyncio.to_thread(self.policies.fetch, msg.record()), "fetch rollback",
                                    "store")
            abandoned = self._adopt_rollback(msg, data)
            m.VERSION.set(self.learner.counters.policy_version)
            if self.leader:
                self.guard.followed(msg.version)
            if self.ranks is not None:  # every rank follows at the same step; rank 0 checkpoints for all
                await self._exchange_ledgers()
            if self.leader:
                await self.tail.checkpoint(self.learner)
        m.RECOVERIES.labels(action="follow_rollback").inc()
        self.log.warning("rollback_followed", rollback_of=msg.rollback_of, policy_version=msg.version,
                         abandoned=list(abandoned), optimizer="reset")
        await self.audit("trainer_followed_rollback", {"rollback_of": msg.rollback_of, "version": msg.version},
                         "weights loaded, optimizer reset, abandoned versions dropped")
