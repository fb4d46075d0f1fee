"""The rollback guard's shell: carry out what :class:`~services.trainer.guard.RollbackGuard` decides.

- **keep what it may restore**: versions that hold the best are pinned against paramsync's pruning
  (``VersionedStore.pin``, with a TTL so a dead trainer pins nothing for good) and unpinned when the guard
  no longer names them;
- **restore what paramsync can republish**: the guard names the trainer's versions, and paramsync publishes
  only the newest candidate of a burst, so a version it passed over has no history record and cannot be
  republished. Such a target is replaced by the newest published version below it of the same lineage
  (trained before it); a target paramsync has not reached yet waits for the next check;
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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.trainer import telemetry as m
from services.trainer.guard import Decision, RollbackGuard
from shared.bus import Publisher
from shared.marker import VersionedStore, VersionRecord
from shared.messages import ControlCommand
from shared.retry import describe, is_transient
from shared.rollback import create_request, new_request_id
from shared.runtime import Auditor, RuntimeConfig
from shared.settings import Settings
from shared.store import ObjectStore

GUARD_ACTOR = "trainer-guard"
PIN_TTL_S = 3600.0


class NotPublishedYet(Exception):
    """The guard's target is newer than the published marker: paramsync has not reached it yet."""


class NotRestorable(LookupError):
    """Neither the guard's target nor an older version of its lineage is kept in the store."""


class GuardShell:
    def __init__(self, guard: RollbackGuard, *, store: ObjectStore, run: str, policies: VersionedStore,
                 config: RuntimeConfig, producer: Publisher, control_topic: str, audit: Auditor, log: Any,
                 holder: str, lineage: Callable[[], int] = lambda: 0) -> None:
        self.guard = guard
        self.lineage = lineage
        """The rollback the trainer's weights descend from (0: none): the lineage a substitute must share."""
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
        self._said: set[tuple[str, int]] = set()  # (event, version) logged once: a decision is asked again each check

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
        named = decision.to_version
        assert named is not None
        try:
            target = await asyncio.wait_for(asyncio.to_thread(self._restorable, named), 10)
            decision = replace(decision, to_version=target.version,
                               evidence={**decision.evidence, "to_version": target.version})
            outcome = await asyncio.wait_for(asyncio.to_thread(self._carry_out, decision, base, settings), 30)
            outcome["to_sha256"] = target.sha256
            if target.version != named:
                outcome["named_version"] = named
                self.log.warning("auto_rollback_substituted", named_version=named, to_version=target.version,
                                 reason="paramsync passed over the named version (a newer candidate superseded it)")
            await self.producer.send(self.control_topic, ControlCommand(
                command="rollback", request_id=outcome["request_id"], version=target.version).to_bytes())
        except NotPublishedYet:
            self._say_once("info", "auto_rollback_waits", named,
                           reason="the version is not published yet: decided again at the next check")
            return None
        except NotRestorable as exc:
            # Loud, once per target; the decision stands (a later check may find it, e.g. a store back from a fault).
            self._say_once("error", "auto_rollback_impossible", named, reason=str(exc))
            return None
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.warning("auto_rollback_deferred", to_version=named, error=describe(exc))
            return None  # decided again on the next check
        self.guard.rolled_back(time.time(), decision)
        m.AUTO_ROLLBACKS.labels(reason=decision.reason).inc()
        m.RECOVERIES.labels(action="auto_rollback").inc()
        self.log.warning("auto_rollback", to_version=decision.to_version, remedy=decision.remedy,
                         automatic_action=True, **outcome, evidence=decision.evidence)
        await self.audit("auto_rollback", {**decision.evidence, **outcome, "remedy": decision.remedy},
                         f"rollback to version {decision.to_version} requested; {decision.remedy}")
        return decision

    def _say_once(self, level: str, event: str, version: int, **kw: Any) -> None:
        if (event, version) not in self._said:
            self._said.add((event, version))
            getattr(self.log, level)(event, to_version=version, **kw)

    def _restorable(self, version: int) -> VersionRecord:
        """The history record of the version a rollback to ``version`` restores: its own, or, when paramsync
        passed it over (the marker is past it and it has no record), the newest kept version below it of the
        trainer's lineage. Raises NotPublishedYet (the marker is below it) or NotRestorable."""
        records = self.policies.records()
        own = next((r for r in records if r.version == version), None)
        if own is not None:
            return own
        marker = self.policies.read_marker()
        if marker is None or marker[0].version < version:
            raise NotPublishedYet(version)
        if marker[0].version == version:  # published just now: the marker is written before its history record
            return marker[0]
        lineage = self.lineage()
        older = [r for r in records if r.version < version and r.lineage == lineage]
        if not older:
            raise NotRestorable(f"version {version} was never published (paramsync passed over it) and no older "
                                f"version of lineage {lineage} is kept")
        return max(older, key=lambda r: r.version)

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
