"""The trainer's periodic work, each job a named task (``shared.retry.every``) instead of a ``_maybe_*``
guard in the loop: announcements, credit grants, heartbeats, runtime config, the published marker and the
lease; plus the few per-pass checks the loop makes on publication (resend, deferred retry, stall) and the
bookkeeping after an update. Kept beside :class:`~services.trainer.service.Trainer` (it reads the same
parts) so that the loop stays short.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from services.trainer import telemetry as m
from services.trainer.intake import Batch
from services.trainer.lease import RENEW_S, TrainerLease
from services.trainer.tracking import update_scalars
from services.trainer.update import UpdateStats
from shared.credits import auto_window
from shared.fragment import Fragment
from shared.logging import fragment_fields
from shared.marker import BadPayload
from shared.messages import CreditGrant, SamplerBeat, TrainerBeat, parse_heartbeat
from shared.retry import describe, every, is_transient, read_forever
from shared.runtime import runtime_values
from shared.settings import Settings

if TYPE_CHECKING:
    from services.trainer.service import Trainer

POLICY_REFRESH_S = 5.0
"""Re-read the marker this often (announcements are the fast path; this covers lost ones)."""
RUNTIME_POLL_S = 2.0
"""Runtime settings (PATCH /config) are applied within this long."""
GUARD_CHECK_S = 1.0
"""The rollback guard decides this often (its windows are counted in episodes, not seconds)."""
GRANT_REFRESH_S = 1.0
"""Send a credit grant at least this often, even when nothing was consumed (a lost grant heals)."""


class TrainerTasks:
    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.consumed = asyncio.Event()  # wakes the credit-grant task
        self.lease = TrainerLease(trainer.store, trainer.settings.run, trainer.id)
        self._tasks: list[asyncio.Task[None]] = []
        self._sampler_seen: dict[str, float] = {}
        self._publication_wait_since: float | None = None
        self._unoffered_since: float | None = None  # ahead of the published version with no candidate sent
        self._stalled_logged = False
        self._revision_actor: str | None = None

    # ---- named tasks ---------------------------------------------------------------------------
    def start(self, stop: asyncio.Event) -> None:
        t = self.t
        jobs: list[tuple[str, Any]] = [
            ("trainer-announcements", read_forever(t.announcements, t.saw_announcement, name="announcements",
                                                   log=t.log)),
            ("trainer-credit-grants", every(lambda: GRANT_REFRESH_S, self.grant, name="credit-grants", log=t.log,
                                            stop_event=stop, wake=self.consumed)),
            ("trainer-heartbeats", every(lambda: t.cfg.heartbeat_interval_s, self.heartbeat, name="heartbeats",
                                         log=t.log, stop_event=stop)),
            ("trainer-runtime-config", every(lambda: RUNTIME_POLL_S, self.runtime_config, name="runtime-config",
                                             log=t.log, stop_event=stop)),
            ("trainer-marker-refresh", every(lambda: POLICY_REFRESH_S, self.refresh_marker, name="marker-refresh",
                                             log=t.log, stop_event=stop)),
        ]
        if t.leader:  # data-parallel ranks: rank 0 holds the lease and guards the group's model
            jobs += [
                ("trainer-lease", every(lambda: RENEW_S, self.renew_lease, name="lease", log=t.log, stop_event=stop)),
                ("trainer-rollback-guard", every(lambda: GUARD_CHECK_S, self.guard_check, name="rollback-guard",
                                                 log=t.log, stop_event=stop)),
            ]
        if t.rank_grants is not None:
            jobs.append(("trainer-rank-grants", read_forever(t.rank_grants, self.saw_rank_grant, name="rank-grants",
                                                             log=t.log)))
        self._tasks = [asyncio.create_task(job, name=name) for name, job in jobs]

    def raise_if_ended(self) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled():
                exc = task.exception()
                if exc is not None:
                    raise exc
                if not self.t._stop.is_set():
                    raise RuntimeError(f"background task {task.get_name()} ended")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- lease ---------------------------------------------------------------------------------
    async def acquire_lease(self) -> None:
        token = await self.t.retry(lambda: asyncio.to_thread(self.lease.acquire), "take the trainer lease", "store")
        self.t.log.info("trainer_lease_acquired", token=token)

    async def renew_lease(self) -> None:
        await asyncio.wait_for(asyncio.to_thread(self.lease.renew), 10)

    async def check_lease(self) -> None:
        await asyncio.wait_for(asyncio.to_thread(self.lease.check), 10)

    def lease_token(self) -> int | None:
        return self.lease.token

    async def release_lease(self) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self.lease.release), 10)
        except Exception as exc:  # the next trainer waits for it to expire instead
            self.t.log.warning("trainer_lease_release_failed", error=describe(exc))

    async def guard_check(self) -> None:
        await self.t.guard.check(self.t.base_settings, self.t.settings)

    # ---- flow control and heartbeats ------------------------------------------------------------
    async def grant(self) -> None:
        """Tell the samplers how far their fragments are consumed (shared.credits): one grant per credits
        partition, holding that shard's samplers only; never waits for an ack."""
        t = self.t
        grants = t.consumption.grants(t.id, time.monotonic())
        for grant in grants:
            try:
                await t.producer.send(t.topics.credits, grant.to_bytes(), key=b"credits", partition=grant.shard)
            except Exception as exc:  # the next grant carries the same counts
                if not is_transient(exc):
                    raise
                t.log.debug("credit_grant_failed", error=describe(exc), shard=grant.shard)
                return
            m.GRANTS.inc()
        m.CREDIT_WINDOW.set(grants[0].window)
        m.CREDITS_OUTSTANDING.set(t.consumption.outstanding(time.monotonic()))

    def saw_rank_grant(self, rec: Any) -> None:
        """Rank 0: another rank's grant; what it consumed counts in rank 0's windows and turns."""
        t = self.t
        try:
            grant = CreditGrant.model_validate_json(rec.value or b"")
        except ValueError as exc:
            t.log.warning("credit_grant_ignored", reason=str(exc)[:200])
            return
        if grant.trainer != t.id and not grant.allocates:
            t.consumption.merge(grant, time.monotonic())

    async def heartbeat(self) -> None:
        t, s = self.t, self.t.stats
        c = t.learner.counters
        if t.ranks is not None:  # a collective waiting on a rank that is gone or cut off: say so before it times out
            t.ranks.report(t.health_state, t.log, time.monotonic())
        stall = t.stall.check(time.monotonic(), t.intake.reference)
        beat = TrainerBeat(
            id=t.id, policy_version=c.policy_version, updates=c.updates, env_steps_trained=c.env_steps_trained,
            fragments_trained=c.fragments_trained, samples_per_s=s.rate.rate(), last_update_at=s.last_update_at,
            **s.staleness_summary(),
            return_mean=sum(c.recent_returns) / len(c.recent_returns) if c.recent_returns else None,
            return_count=len(c.recent_returns), fragments_dropped_stale=s.dropped,
            fragments_dead_lettered=s.dead_lettered, published_version=t.intake.published,
            stalled_since=None if stall is None else time.time() - (time.monotonic() - stall.since),
            stalled_reason=None if stall is None else stall.reason, nonfinite_steps_skipped=s.nonfinite_skipped,
            candidates_resent=t.publication.resent, health=t.health_state.as_dict(), started_at=s.started_at,
            staleness_per_sampler=s.lags.report(time.monotonic()), dropped_fraction=s.dropped_fraction(),
            learning_rate=t.learner.learning_rate(), config_revision=s.config_revision,
            rank=t.cfg.rank, world_size=t.cfg.world_size,
            weights_digest=None if t.digest is None else t.digest[1],
            digest_update=None if t.digest is None else t.digest[0],
        )
        try:
            await t.producer.send(t.topics.heartbeats, beat.to_bytes(), key=t.id.encode())
        except Exception as exc:  # a heartbeat is not worth stopping for; the next one retries
            if not is_transient(exc):
                raise
            t.log.debug("heartbeat_failed", error=describe(exc))

    # ---- runtime config and the published marker --------------------------------------------------
    async def runtime_config(self) -> None:
        """The newest runtime revision, applied on this trainer's own settings (``RuntimeApplier``), never
        between an update's steps. An unreadable revision leaves the settings as they are (degraded)."""
        t = self.t
        try:
            rev = await asyncio.wait_for(asyncio.to_thread(t.runtime.watcher.poll), 10)
        except Exception as exc:
            if not (is_transient(exc) or isinstance(exc, BadPayload)):
                raise
            t.health_state.degraded("config", f"runtime config unreadable: {describe(exc)}")
            t.log.warning("runtime_config_unreadable", error=describe(exc))
            return
        t.health_state.recovered("config")
        if rev is not None:
            async with t._update_lock:
                self._revision_actor = rev.actor
                t.runtime.handle(rev)

    def apply_settings(self, settings: Settings, revision: int) -> dict[str, Any]:
        t = self.t
        old = runtime_values(t.settings)
        t.settings, t.cfg = settings, settings.trainer
        t.learner.set_runtime(settings.trainer)
        t.intake.max_staleness = settings.trainer.max_staleness
        t.consumption.total_window = auto_window(settings)
        t.stats.config_revision = revision
        t.guard.guard.cfg = settings.trainer.guard
        m.LEARNING_RATE.set(t.learner.learning_rate())
        new = runtime_values(settings)
        changes = {k: {"old": old[k], "new": new[k]} for k in new if k.startswith("trainer.") and old[k] != new[k]}
        # The guard notes it as a possible cause of a fall (its own remedies, by their actor, never are).
        t.guard.note_revision(time.time(), revision, sorted(changes), self._revision_actor)
        return changes

    async def refresh_marker(self) -> None:
        await self.refresh_published()

    async def refresh_published(self) -> bool:
        """Re-read the marker (an announcement may not have reached us yet); True if it moved. A store that
        cannot be read marks the trainer degraded and leaves the reference as it was."""
        t = self.t
        before = t.intake.published
        try:
            marker = await t.publication.read_marker()
        except Exception as exc:
            if not is_transient(exc):
                raise
            t.health_state.degraded("store", f"marker read failed: {describe(exc)}")
            return False
        t.health_state.recovered("store")
        if marker is not None and await t.trusted(marker):
            t.intake.saw_published(marker[0].version)
        return t.intake.published != before

    # ---- per-pass checks -------------------------------------------------------------------------
    async def publication_watch(self) -> None:
        """Re-send a candidate paramsync has not published; retry a deferred one; report a stall."""
        t = self.t
        now = time.monotonic()
        pub = t.publication
        if pub.resend_due(t.intake.published, now, t.cfg.candidate_resend_s):
            await pub.resend("not published in time", t.intake.published)
        published = t.intake.published if t.intake.published is not None else -1
        if pub.candidate is not None or pub.deferred is not None or t.learner.counters.policy_version <= published:
            self._unoffered_since = None
        elif self._unoffered_since is None:
            self._unoffered_since = now
        elif now - self._unoffered_since > t.cfg.candidate_resend_s:
            # Ahead of what is published with nothing sent for it: a rollback abandoned the candidates, or a
            # checkpoint outlived its candidate's send. No resend and, once max_staleness ahead, no update
            # would ever move the marker, so offer the weights the trainer runs now.
            self._unoffered_since = None
            await t.publish_current("ahead of the published version with no candidate sent")
        if pub.retry_due(now) and (t._after_update is None or t._after_update.done()):
            await t._settle()  # the last update's commit and publish first (it may have sent a newer one)
            if pub.deferred is not None:
                # In the background slot of an update's commit + publish: the loop is not held by a slow store,
                # and the next update's publish waits for this one, so candidates stay in order.
                t._after_update = asyncio.create_task(pub.retry_deferred(), name="trainer-publish-retry")
        stall = t.stall.check(now, t.intake.reference)
        m.STALLED.set(0 if stall is None else 1)
        if stall is None:
            self._stalled_logged = False
        elif not self._stalled_logged:
            self._stalled_logged = True
            t.log.error("training_stalled", reason=stall.reason, published_version=t.intake.published,
                        policy_version=t.learner.counters.policy_version)
            await t.audit("training_stalled", {"reason": stall.reason}, "detected; re-sending the candidate")
            await pub.resend("training stalled", t.intake.published)

    def note_publication_wait(self) -> None:
        t = self.t
        now = time.monotonic()
        if self._publication_wait_since is None or now - self._publication_wait_since > 5.0:
            t.log.info("waiting_for_publication", policy_version=t.learner.counters.policy_version,
                       published_version=t.intake.published, lead=max(1, t.intake.bound))
            self._publication_wait_since = now
        m.PUBLICATION_WAITS.inc()

    async def poll_live_samplers(self) -> None:
        assert self.t.beats is not None
        for rec in await self.t.beats.poll(timeout_ms=0):
            try:
                beat = parse_heartbeat(rec.value or b"")
            except ValueError:
                continue
            if isinstance(beat, SamplerBeat):
                self._sampler_seen[beat.id] = time.monotonic()
        timeout = self.t.settings.paramsync.sampler_timeout_s
        now = time.monotonic()
        for sid in [s for s, seen in self._sampler_seen.items() if now - seen > 10 * timeout]:
            del self._sampler_seen[sid]  # per-sampler state expires

    def live_samplers(self) -> set[str] | None:
        if self.t.beats is None:
            return None
        now = time.monotonic()
        timeout = self.t.settings.paramsync.sampler_timeout_s
        return {sid for sid, seen in self._sampler_seen.items() if now - seen <= timeout}

    # ---- after an update ------------------------------------------------------------------------
    def updated(self, batch: Batch, stats: UpdateStats, elapsed: float) -> None:
        """Metrics and the outcome lines of one update (its records are in the ledger already)."""
        t, s = self.t, self.t.stats
        c = t.learner.counters
        now = time.monotonic()
        s.last_update_at = time.time()
        t.stall.trained(now)
        m.UPDATES.inc()
        m.BUSY.inc(elapsed)
        m.UPDATE_SECONDS.observe(elapsed)
        m.TRAINED.inc(len(batch.train))
        s.trained_run += len(batch.train)
        m.STEPS_TRAINED.inc(stats.env_steps)
        m.SAMPLE_PASSES.inc(stats.sample_passes)
        if stats.skipped_steps:
            m.NONFINITE.inc(stats.skipped_steps)
            s.nonfinite_skipped += stats.skipped_steps
            t.log.warning("nonfinite_steps_skipped", update=c.updates, skipped=stats.skipped_steps,
                          taken=stats.sgd_steps)
        s.rate.add(stats.env_steps)
        for p, staleness in zip(batch.train, batch.staleness, strict=True):
            s.staleness.append(staleness)
            s.lags.trained(p.frag.sampler_id, staleness, now)
            m.STALENESS.observe(staleness)
            f: Fragment = p.frag
            t.log.info("fragment_trained", outcome="trained", update=c.updates, staleness=staleness,
                       **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))
        lr = float(t.learner.optimizer.param_groups[0]["lr"])
        m.LEARNING_RATE.set(lr)
        if c.recent_returns:
            m.RETURN_MEAN.set(sum(c.recent_returns) / len(c.recent_returns))
        t.log.info("update_done", update=c.updates, fragments=len(batch.train), env_steps=stats.env_steps,
                   seconds=round(elapsed, 4), policy_loss=round(stats.policy_loss, 5),
                   value_loss=round(stats.value_loss, 5), entropy=round(stats.entropy, 4),
                   approx_kl=round(stats.approx_kl, 5), clip_fraction=round(stats.clip_fraction, 4),
                   behaviour_weight_mean=round(stats.behaviour_weight_mean, 4), sgd_steps=stats.sgd_steps,
                   learning_rate=lr, clip_coef=round(t.learner.update_cfg.clip_coef, 5),
                   stopped_early=stats.stopped_early, masked_fraction=round(stats.masked_fraction, 4),
                   grad_norm=round(stats.grad_norm, 4), explained_variance=round(stats.explained_variance, 4))
        rets, lens = c.recent_returns, c.recent_lengths
        t.tracker.scalars(c.updates, update_scalars(
            return_mean=sum(rets) / len(rets) if rets else None, length_mean=sum(lens) / len(lens) if lens else None,
            policy_loss=stats.policy_loss, value_loss=stats.value_loss, entropy=stats.entropy,
            approx_kl=stats.approx_kl, clip_fraction=stats.clip_fraction, explained_variance=stats.explained_variance,
            lag_mean=sum(batch.staleness) / len(batch.staleness) if batch.staleness else None,
            lag_max=max(batch.staleness, default=None), env_steps_per_s=s.rate.rate(), env_steps=c.env_steps_trained,
            learning_rate=lr))
