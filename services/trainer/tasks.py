"""The parts of the trainer's periodic work, built from explicit inputs: each decides and returns what to do, or
acts only on the objects it is handed. :class:`~services.trainer.service.Trainer` builds the named tasks from
them, runs the per-pass checks and acts on what they decide; nothing here holds the trainer or its state.

- :class:`HeldLease`: the trainer lease (``lease.py``) with the waits the trainer gives each step.
- :class:`Grants`: credit grants to the samplers, and (rank 0) the other ranks' grants merged in.
- :class:`LiveSamplers`: who is live, from the samplers' heartbeats (the synchronous baseline waits for them).
- :class:`PublicationWatch`: when to offer the current weights, when a stall is new, when to log a wait.
- :func:`trainer_beat` and :func:`record_update`: the heartbeat's content; the metrics and lines of one update.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.trainer import telemetry as m
from services.trainer.intake import Batch, Intake, Stall, StallWatch
from services.trainer.learner import Learner
from services.trainer.lease import TrainerLease
from services.trainer.publication import Publication
from services.trainer.tracking import Tracker, update_scalars
from services.trainer.update import UpdateStats
from shared.bus import Publisher, Record
from shared.credits import Consumption
from shared.fragment import Fragment
from shared.identity import IdentityCheck, beat_message, record_time
from shared.logging import fragment_fields
from shared.messages import CreditGrant, SamplerBeat, TrainerBeat, parse_heartbeat
from shared.retry import Health, Retrier, describe, is_transient
from shared.settings import TrainerSettings

GRANT_REFRESH_S = 1.0
"""Send a credit grant at least this often, even when nothing was consumed (a lost grant heals)."""
PUBLICATION_WAIT_LOG_S = 5.0
"""``waiting_for_publication`` is logged at most this often (every wait is counted)."""


class HeldLease:
    """The trainer lease as the trainer uses it: taken at start (retried while the store is down), renewed by a
    task, checked before every checkpoint (10 s each), released at stop (a failure is only logged)."""

    def __init__(self, lease: TrainerLease, retry: Retrier, log: Any) -> None:
        self.lease = lease
        self.retry = retry
        self.log = log

    async def acquire(self) -> None:
        token = await self.retry(lambda: asyncio.to_thread(self.lease.acquire), "take the trainer lease", "store")
        self.log.info("trainer_lease_acquired", token=token)

    async def renew(self) -> None:
        await asyncio.wait_for(asyncio.to_thread(self.lease.renew), 10)

    async def check(self) -> None:
        await asyncio.wait_for(asyncio.to_thread(self.lease.check), 10)

    @property
    def token(self) -> int | None:
        return self.lease.token

    async def release(self) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self.lease.release), 10)
        except Exception as exc:  # the next trainer waits for it to expire instead
            self.log.warning("trainer_lease_release_failed", error=describe(exc))


class Grants:
    """Flow control (``shared.credits``): tell the samplers how far their fragments are consumed."""

    def __init__(self, consumption: Consumption, producer: Publisher, *, topic: str, trainer_id: str,
                 log: Any, seen: Callable[[], dict[int, int]] = dict) -> None:
        self.consumption = consumption
        self.seen = seen  # the samples partitions' positions (ConsumerGroup.seen), sent with every grant
        self.producer = producer
        self.topic = topic
        self.trainer_id = trainer_id
        self.log = log
        self.consumed = asyncio.Event()  # set when records are consumed: wakes the grant task

    async def send(self) -> None:
        """One grant per credits partition, holding that shard's samplers only; never waits for an ack."""
        grants = self.consumption.grants(self.trainer_id, time.monotonic())
        seen = self.seen()  # with the counts, before any await: a consumed fragment is never passed uncounted
        for grant in grants:
            grant.seen = seen
            try:
                await self.producer.send(self.topic, grant.to_bytes(), key=b"credits", partition=grant.shard)
            except Exception as exc:  # the next grant carries the same counts
                if not is_transient(exc):
                    raise
                self.log.debug("credit_grant_failed", error=describe(exc), shard=grant.shard)
                return
            m.GRANTS.inc()
        m.CREDIT_WINDOW.set(grants[0].window)
        m.CREDITS_OUTSTANDING.set(self.consumption.outstanding(time.monotonic()))

    def saw_rank_grant(self, rec: Record) -> None:
        """Rank 0: another rank's grant; what it consumed counts in rank 0's windows and turns."""
        try:
            grant = CreditGrant.model_validate_json(rec.value or b"")
        except ValueError as exc:
            self.log.warning("credit_grant_ignored", reason=str(exc)[:200])
            return
        if grant.trainer != self.trainer_id and not grant.allocates:
            self.consumption.merge(grant, time.monotonic())


class LiveSamplers:
    """A sampler is live while its heartbeats arrive within ``timeout_s``; one unseen for ten times that is
    forgotten. A heartbeat under an id bound to another key (``shared.identity``) makes nobody live."""

    def __init__(self, identity: IdentityCheck | None = None) -> None:
        self._seen: dict[str, float] = {}
        self.identity = identity

    def saw(self, records: Iterable[Record], now: float, timeout_s: float) -> None:
        for rec in records:
            try:
                beat = parse_heartbeat(rec.value or b"")
            except ValueError:
                continue
            if isinstance(beat, SamplerBeat):
                if self.identity is not None and self.identity.refusal(
                        "heartbeat", beat.id, rec.headers, beat_message(rec.value or b""), record_time(rec)):
                    continue
                self._seen[beat.id] = now
        for sid in [s for s, seen in self._seen.items() if now - seen > 10 * timeout_s]:
            del self._seen[sid]

    def live(self, now: float, timeout_s: float) -> set[str]:
        return {sid for sid, seen in self._seen.items() if now - seen <= timeout_s}


class PublicationWatch:
    """The loop's per-pass decisions about publication, with the times they depend on."""

    def __init__(self) -> None:
        self._unoffered_since: float | None = None  # ahead of the published version with no candidate sent
        self._stalled_logged = False
        self._wait_logged_at: float | None = None

    def offer_current(self, now: float, *, offered: bool, ahead: bool, after_s: float) -> bool:
        """True when the trainer has been ahead of the published version for ``after_s`` with no candidate sent
        or deferred: a rollback abandoned the candidates, or a checkpoint outlived its candidate's send. No
        resend and, once max_staleness ahead, no update would ever move the marker, so the trainer offers the
        weights it runs now."""
        if offered or not ahead:
            self._unoffered_since = None
        elif self._unoffered_since is None:
            self._unoffered_since = now
        elif now - self._unoffered_since > after_s:
            self._unoffered_since = None
            return True
        return False

    def newly_stalled(self, stall: Stall | None) -> bool:
        """True for the first pass of a stall (it is logged, audited and answered once)."""
        if stall is None:
            self._stalled_logged = False
            return False
        if self._stalled_logged:
            return False
        self._stalled_logged = True
        return True

    def log_wait(self, now: float) -> bool:
        """True when a wait for publication is to be logged (at most every ``PUBLICATION_WAIT_LOG_S``)."""
        if self._wait_logged_at is None or now - self._wait_logged_at > PUBLICATION_WAIT_LOG_S:
            self._wait_logged_at = now
            return True
        return False


def trainer_beat(*, trainer_id: str, learner: Learner, stats: m.TrainerStats, intake: Intake, stall: Stall | None,
                 publication: Publication, health: Health, cfg: TrainerSettings,
                 digest: tuple[int, str] | None, lost: tuple[int, list[int]] = (0, []),
                 compute: dict[str, Any] | None = None) -> TrainerBeat:
    """The trainer's heartbeat as of now."""
    c, s = learner.counters, stats
    return TrainerBeat(
        id=trainer_id, policy_version=c.policy_version, updates=c.updates, env_steps_trained=c.env_steps_trained,
        fragments_trained=c.fragments_trained, samples_per_s=s.rate.rate(), last_update_at=s.last_update_at,
        **s.staleness_summary(),
        return_mean=sum(c.recent_returns) / len(c.recent_returns) if c.recent_returns else None,
        return_count=len(c.recent_returns), fragments_dropped_stale=s.dropped,
        fragments_dead_lettered=s.dead_lettered, published_version=intake.published,
        records_lost=lost[0], records_lost_partitions=lost[1], compute=compute,
        learner_busy_fraction=s.busy.fraction(),
        stalled_since=None if stall is None else time.time() - (time.monotonic() - stall.since),
        stalled_reason=None if stall is None else stall.reason, nonfinite_steps_skipped=s.nonfinite_skipped,
        candidates_resent=publication.resent, health=health.as_dict(), started_at=s.started_at,
        staleness_per_sampler=s.lags.report(time.monotonic()), dropped_fraction=s.dropped_fraction(),
        learning_rate=learner.learning_rate(), config_revision=s.config_revision,
        rank=cfg.rank, world_size=cfg.world_size,
        weights_digest=None if digest is None else digest[1],
        digest_update=None if digest is None else digest[0],
    )


def record_update(batch: Batch, stats: UpdateStats, elapsed: float, *, learner: Learner,
                  trainer_stats: m.TrainerStats, stall: StallWatch, tracker: Tracker, log: Any) -> None:
    """Metrics and the outcome lines of one update (its records are in the ledger already)."""
    s = trainer_stats
    c = learner.counters
    now = time.monotonic()
    s.last_update_at = time.time()
    stall.trained(now)
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
        log.warning("nonfinite_steps_skipped", update=c.updates, skipped=stats.skipped_steps, taken=stats.sgd_steps)
    s.rate.add(stats.env_steps)
    for p, staleness in zip(batch.train, batch.staleness, strict=True):
        s.staleness.append(staleness)
        s.lags.trained(p.frag.sampler_id, staleness, now)
        m.STALENESS.observe(staleness)
        f: Fragment = p.frag
        log.info("fragment_trained", outcome="trained", update=c.updates, staleness=staleness,
                 **fragment_fields(f.sample_id, f.sampler_id, f.policy_version, p.tp.partition, p.offset))
    lr = float(learner.optimizer.param_groups[0]["lr"])
    m.LEARNING_RATE.set(lr)
    if c.recent_returns:
        m.RETURN_MEAN.set(sum(c.recent_returns) / len(c.recent_returns))
    log.info("update_done", update=c.updates, fragments=len(batch.train), env_steps=stats.env_steps,
             seconds=round(elapsed, 4), policy_loss=round(stats.policy_loss, 5),
             value_loss=round(stats.value_loss, 5), entropy=round(stats.entropy, 4),
             approx_kl=round(stats.approx_kl, 5), clip_fraction=round(stats.clip_fraction, 4),
             behaviour_weight_mean=round(stats.behaviour_weight_mean, 4), sgd_steps=stats.sgd_steps,
             learning_rate=lr, clip_coef=round(learner.update_cfg.clip_coef, 5),
             stopped_early=stats.stopped_early, masked_fraction=round(stats.masked_fraction, 4),
             grad_norm=round(stats.grad_norm, 4), explained_variance=round(stats.explained_variance, 4))
    rets, lens = c.recent_returns, c.recent_lengths
    tracker.scalars(c.updates, update_scalars(
        return_mean=sum(rets) / len(rets) if rets else None, length_mean=sum(lens) / len(lens) if lens else None,
        policy_loss=stats.policy_loss, value_loss=stats.value_loss, entropy=stats.entropy,
        approx_kl=stats.approx_kl, clip_fraction=stats.clip_fraction, explained_variance=stats.explained_variance,
        lag_mean=sum(batch.staleness) / len(batch.staleness) if batch.staleness else None,
        lag_max=max(batch.staleness, default=None), env_steps_per_s=s.rate.rate(), env_steps=c.env_steps_trained,
        learning_rate=lr))
