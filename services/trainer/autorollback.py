"""The rollback guard's shell: carry out what :class:`~services.trainer.guard.RollbackGuard` decides.

- **keep what it may restore**: versions that hold the best are pinned against paramsync's pruning
  (``VersionedStore.pin``, with a TTL so a dead trainer pins nothing for good) and unpinned when the guard
  no longer names them;
- **roll back through the operator's path**: a durable rollback request (``shared.rollback``) plus a
  ``rollback`` control message to wake paramsync, which republishes the version's weights as the newest
  with a new lineage; the trainer follows that announcement like an operator's rollback (weights loaded,
  optimizer reset, the abandoned versions' fragments dropped);
- **change the cause**: ``revert_config`` writes a runtime revision whose overrides are those before the
  blamed one; ``lower_lr`` writes one with ``learning_rate`` and ``learning_rate_end`` multiplied by the
  factor. Both are written as actor ``trainer-guard``, so the guard never blames its own revisions;
- **say so**: audit ``auto_rollback`` with the guard's evidence (``guard_exhausted`` when the hour's
  rollbacks are spent), count ``flywheel_trainer_auto_rollbacks_total`` and set
  ``flywheel_trainer_guard_exhausted`` (the ``FlywheelAutoRollback`` and ``FlywheelGuardExhausted`` alerts).

Explicit inputs only; it never calls back into the trainer. Store and Kafka faults are transient: the
decision stays and is carried out on a later check.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.trainer import telemetry as m
from services.trainer.guard import Decision, RollbackGuard
from shared.bus import Publisher
from shared.marker import VersionedStore
from shared.messages import ControlCommand
from shared.retry import describe, is_transient
from shared.rollback import create_request, new_request_id
from shared.runtime import RuntimeConfig
from shared.settings import Settings
from shared.store import ObjectStore

GUARD_ACTOR = "trainer-guard"
PIN_TTL_S = 3600.0


class GuardShell:
    def __init__(self, guard: RollbackGuard, *, store: ObjectStore, run: str, policies: VersionedStore,
                 config: RuntimeConfig, producer: Publisher, control_topic: str, audit: m.Auditor, log: Any,
                 holder: str) -> None:
        self.guard = guard
        self.store = store
        self.run = run
        self.policies = policies
        self.config = config
        self.producer = producer
        self.control_topic = control_topic
        self.audit = audit
        self.log = log
        self.holder = holder
        self.pinned: set[int] = set()
        self.restoring: int | None = None
        """The version of the rollback requested and not yet followed: pinned until the trainer follows it."""

    def observe(self, now: float, version: int, mean: float | None, episodes: int, stats: Any) -> None:
        """After every update (no I/O: pins are written by :meth:`check`)."""
        self.guard.observe_update(now, version, mean, episodes, stats)

    def followed(self, version: int) -> None:
        """The trainer adopted a rollback to ``version`` (pins of the versions dropped are released by the
        next :meth:`check`)."""
        self.restoring = None
        self.guard.followed(version)

    def note_revision(self, now: float, revision: int, changed_keys: list[str], actor: str | None) -> None:
        self.guard.note_config_revision(now, revision, changed_keys, automatic=actor == GUARD_ACTOR)

    async def check(self, base: Settings, settings: Settings) -> Decision | None:
        """Keep pins current and carry out a decision, if any (the one carried out is returned)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self._sync_pins), 10)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.warning("guard_pin_failed", error=describe(exc))
        now = time.time()
        decision = self.guard.decide(now)
        m.GUARD_EXHAUSTED.set(1 if self.guard.rollbacks_last_hour(now) >= self.guard.cfg.max_per_hour else 0)
        if decision is None:
            return None
        if decision.action == "exhausted":
            m.GUARD_EXHAUSTED.set(1)
            self.log.error("guard_exhausted", **decision.evidence)
            await self.audit("guard_exhausted", decision.evidence,
                             f"{self.guard.cfg.max_per_hour} automatic rollbacks within an hour: not trying again, "
                             "a human is needed")
            return decision
        try:
            outcome = await asyncio.wait_for(asyncio.to_thread(self._carry_out, decision, base, settings), 30)
            await self.producer.send(self.control_topic, ControlCommand(
                command="rollback", request_id=outcome["request_id"], version=decision.to_version).to_bytes())
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.warning("auto_rollback_deferred", to_version=decision.to_version, error=describe(exc))
            return None  # decided again on the next check
        self.guard.rolled_back(time.time(), decision)
        m.AUTO_ROLLBACKS.labels(reason=decision.reason).inc()
        m.RECOVERIES.labels(action="auto_rollback").inc()
        self.log.warning("auto_rollback", to_version=decision.to_version, remedy=decision.remedy,
                         automatic_action=True, **outcome, evidence=decision.evidence)
        await self.audit("auto_rollback", {**decision.evidence, **outcome, "remedy": decision.remedy},
                         f"rollback to version {decision.to_version} requested; {decision.remedy}")
        return decision

    def _carry_out(self, decision: Decision, base: Settings, settings: Settings) -> dict[str, Any]:
        assert decision.to_version is not None
        # Pinned before it is requested: a holder seen since the last pin sync may be the target, and paramsync must
        # still have it when it takes the request (kept until the trainer follows the rollback).
        self.restoring = decision.to_version
        try:
            self.policies.pin(decision.to_version, self.holder, PIN_TTL_S)
            self.pinned.add(decision.to_version)
        except Exception as exc:  # the rollback goes on: paramsync still has a version this recent, as a rule
            if not is_transient(exc):
                raise
            self.log.warning("guard_pin_failed", version=decision.to_version, error=describe(exc))
        request_id = new_request_id()
        create_request(self.store, self.run, request_id, decision.to_version, GUARD_ACTOR)
        out: dict[str, Any] = {"request_id": request_id}
        if decision.remedy == "revert_config" and decision.revert_revision is not None:
            rev = self.config.revert(base, decision.revert_revision - 1, GUARD_ACTOR)
            out.update(config_revision=rev.revision, reverted_to=decision.revert_revision - 1)
        elif decision.remedy == "lower_lr":
            t = settings.trainer
            values = {"trainer.learning_rate": t.learning_rate * decision.lr_factor}
            if t.learning_rate_end is not None:
                values["trainer.learning_rate_end"] = t.learning_rate_end * decision.lr_factor
            rev = self.config.write(base, values, GUARD_ACTOR)
            out.update(config_revision=rev.revision, learning_rate=values["trainer.learning_rate"])
        return out

    def _sync_pins(self) -> None:
        """Pin every version a decision could restore (the best holders and the explosion fallback, the last
        healthy version), unpin the rest."""
        keep = set(self.guard.restorable_versions()) | ({self.restoring} if self.restoring is not None else set())
        for v in sorted(keep - self.pinned):
            self.policies.pin(v, self.holder, PIN_TTL_S)
            self.pinned.add(v)
        for v in sorted(self.pinned - keep):
            self.policies.unpin(v)
            self.pinned.discard(v)
