"""The rollback guard's shell (services/trainer/autorollback.py), what it must never do quietly (issue 29).

- Pins: the versions the guard may restore are pinned against paramsync's pruning, and every pin it wrote
  is released (``VersionedStore.unpin``) at the first check after the guard stops naming that version in
  ``restorable_versions``: after the trainer follows a rollback, after the guard's own rollback, when the
  best rises past what a version held.
- Errors: store and Kafka faults are transient (``shared.retry.is_transient``): a failed pin write is logged
  (``guard_pin_failed``) and written at the next check; a failed rollback is logged
  (``auto_rollback_deferred``) and decided again at the next check. Any other error propagates out of
  ``check``, and so ends the trainer's ``rollback-guard`` task (``shared.retry.every``), which stops the
  trainer loudly.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, UnsupportedVersionError

from services.trainer.autorollback import GUARD_ACTOR, GuardShell
from services.trainer.guard import RollbackGuard
from services.trainer.service import Trainer
from shared.bus import MemoryBus
from shared.kafka import Topics
from shared.marker import VersionedStore
from shared.messages import ControlCommand
from shared.retry import every
from shared.rollback import ROLLBACK_PREFIX
from shared.runtime import AuditLog, Auditor, RuntimeConfig
from shared.settings import GuardSettings, Settings, StoreSettings, TrainerSettings
from shared.store import PreconditionFailed, StoreError, open_store
from tests.marker_cases import publish_version

RUN = "r"
CFG = GuardSettings(enabled=True, drop=100.0, hold_tolerance=25.0, settle_updates=2, window=10, min_episodes=20,
                    blame_episodes=200, explode_updates=3, lr_factor=0.5, max_per_hour=3, cooldown_s=30.0)


@dataclass(frozen=True)
class Stats:
    policy_loss: float = 0.01
    value_loss: float = 5.0
    skipped_steps: int = 0
    grad_norm: float = 1.0


class Log:
    """Records every event (the shell's log is any structlog-like object)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _add(self, level: str, event: str, **kw: Any) -> None:
        self.events.append((level, event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        self._add("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, **kw)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for _, e, kw in self.events if e == event]


class FailingPins:
    """A VersionedStore whose pin writes raise ``error`` the next ``times`` times."""

    def __init__(self, inner: VersionedStore) -> None:
        self.inner = inner
        self.error: BaseException | None = None
        self.times = 0

    def pin(self, version: int, holder: str, ttl_s: float) -> None:
        if self.times > 0 and self.error is not None:
            self.times -= 1
            raise self.error
        self.inner.pin(version, holder, ttl_s)

    def unpin(self, version: int) -> None:
        self.inner.unpin(version)

    def __getattr__(self, name: str) -> Any:  # reads (records, marker) go to the store as they are
        return getattr(self.inner, name)


class FailingProducer:
    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.sent = 0

    async def send(self, topic: str, value: bytes, **kw: Any) -> None:
        self.sent += 1
        raise self.error


@dataclass
class Rig:
    sh: GuardShell
    settings: Settings
    store_pins: VersionedStore
    pins: FailingPins
    log: Log
    mem: MemoryBus
    version: int = 0
    episodes: int = 0

    def feed(self, means: list[float], published: bool = True) -> None:
        """One update per mean; ``published``: paramsync published each new version (none superseded)."""
        for mean in means:
            self.version += 1
            self.episodes += 5
            if published:
                publish_version(self.store_pins, self.version)
            self.sh.observe(time.time(), self.version, mean, self.episodes, Stats())

    async def check(self) -> Any:
        return await self.sh.check(self.settings, self.settings)

    def guard_restorable(self) -> frozenset[int]:
        return self.sh.guard.restorable_versions()

    def stored(self) -> set[int]:
        """The pins in the store, as paramsync's pruning reads them."""
        return self.store_pins.pinned()

    def requests(self) -> list[str]:
        return self.sh.store.list(f"{RUN}/{ROLLBACK_PREFIX}")

    def audited(self, action: str) -> list[Any]:
        return [e for e in AuditLog(self.sh.store, RUN).entries() if e.action == action]


def rig(tmp_path: Path) -> Rig:
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(learning_rate=1e-3, learning_rate_end=1e-5, guard=CFG))
    store = open_store(settings)
    mem = MemoryBus()
    mem.create(Topics.for_run(RUN).control, 1)
    log = Log()
    policies = VersionedStore(store, RUN, "policy")
    pins = FailingPins(policies)
    sh = GuardShell(RollbackGuard(CFG), store=store, run=RUN, policies=pins,  # type: ignore[arg-type]
                    config=RuntimeConfig(store, RUN), producer=mem.bus().publisher,
                    control_topic=Topics.for_run(RUN).control, audit=Auditor(AuditLog(store, RUN), log, "trainer"),
                    log=log, holder="t")
    return Rig(sh, settings, policies, pins, log, mem)


# ---- pins: what it pinned is released once the guard no longer names it ----

async def test_following_a_rollback_releases_the_pins_of_the_versions_dropped(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    assert await r.check() is None
    pinned = r.stored()
    assert len(pinned) >= 2 and pinned == r.sh.pinned
    kept = min(pinned)
    r.sh.followed(kept)  # an operator rolled back to ``kept``: the versions above it are abandoned
    assert await r.check() is None
    assert r.stored() == {kept} == r.sh.pinned


async def test_its_own_rollback_releases_every_pin_but_the_restored_version(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    d = await r.check()
    assert d is not None and d.action == "rollback" and d.to_version in r.stored()
    assert len(r.stored()) > 1
    assert await r.check() is None  # cooling down; the pins follow the guard's forgotten state
    assert r.stored() == {d.to_version} == r.sh.pinned


async def test_versions_that_held_a_lower_best_are_unpinned_when_the_best_rises(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([300.0] * 20)
    await r.check()
    at_300 = r.stored()
    assert at_300 and max(at_300) <= r.version
    first_500 = r.version + 1
    r.feed([500.0] * 10)
    await r.check()
    assert r.stored() and not (r.stored() & at_300)
    assert min(r.stored()) >= first_500 and r.stored() == r.sh.pinned
    assert r.stored() <= r.sh.guard.restorable_versions()


async def test_a_pinned_version_stays_pinned_while_the_guard_names_it(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    before = r.stored()
    await r.check()
    assert r.stored() == before  # no churn: a check without a change keeps every pin


# ---- the target: a version paramsync can republish ----

def named(r: Rig) -> int:
    """The version the guard names now (asking the pure guard decides nothing: it answers the same again)."""
    d = r.sh.guard.decide(time.time())
    assert d is not None and d.to_version is not None
    return d.to_version


async def test_a_version_paramsync_passed_over_is_replaced_by_the_newest_older_one_of_its_lineage(
        tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    target = named(r)
    # Paramsync publishes only the newest candidate of a burst: the named version and the one below it were
    # superseded (no history record), the marker is far past them.
    for v in (target, target - 1):
        r.sh.store.delete(r.store_pins.history_key(v))
    d = await r.check()
    assert d is not None and d.action == "rollback" and d.to_version == target - 2
    (entry,) = r.audited("auto_rollback")
    assert entry.params["to_version"] == target - 2 and entry.params["named_version"] == target
    kept = next(rec for rec in r.store_pins.records() if rec.version == target - 2)
    assert entry.params["to_sha256"] == kept.sha256
    (key,) = r.requests()
    assert json.loads(r.sh.store.get(key).data)["version"] == target - 2  # type: ignore[union-attr]
    (cmd,) = [ControlCommand.model_validate_json(m.value or b"") for m in r.mem.records(Topics.for_run(RUN).control)]
    assert cmd.version == target - 2
    assert target - 2 in r.stored(), "the substitute is pinned until the trainer follows"
    assert r.log.named("auto_rollback_substituted")


async def test_a_version_not_published_yet_waits_for_paramsync(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 20)
    r.feed([500.0] * 10 + [80.0] * 40, published=False)  # paramsync is behind: the marker is at 20
    target = named(r)
    assert target > 20
    assert await r.check() is None and await r.check() is None
    assert not r.requests() and not r.audited("auto_rollback")
    assert len(r.log.named("auto_rollback_waits")) == 1, "said once, not at every check"
    for v in range(21, r.version + 1):  # paramsync catches up
        publish_version(r.store_pins, v)
    d = await r.check()
    assert d is not None and d.to_version == target and len(r.requests()) == 1


def test_the_version_the_marker_names_is_restorable_before_its_history_record_is_written(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 5)
    r.sh.store.delete(r.store_pins.history_key(5))  # paramsync writes the marker first, then the history record
    assert r.sh._restorable(5).version == 5 and r.sh._restorable(4).version == 4


async def test_nothing_of_the_trainers_lineage_kept_is_said_loudly_and_requests_nothing(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30 + [80.0] * 40, published=False)
    target = named(r)
    for v in range(1, target):  # versions below the target, but of another lineage (abandoned by a rollback)
        publish_version(r.store_pins, v, lineage=7)
    publish_version(r.store_pins, r.version + 1, lineage=7)  # the marker is past the target
    assert await r.check() is None and await r.check() is None
    (said,) = r.log.named("auto_rollback_impossible")
    assert said["to_version"] == target and "lineage 0" in said["reason"]
    assert not r.requests() and not r.audited("auto_rollback") and r.sh.guard.rollbacks_last_hour(time.time()) == 0
    assert not r.mem.records(Topics.for_run(RUN).control)


# ---- errors: transient ones are logged and retried, every other one propagates ----

@pytest.mark.parametrize("error", [StoreError("store down"), TimeoutError("slow store")])
async def test_a_transient_pin_failure_is_logged_and_pinned_at_the_next_check(tmp_path: Path,
                                                                              error: Exception) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    r.pins.error, r.pins.times = error, 1
    assert await r.check() is None
    assert r.log.named("guard_pin_failed") and r.stored() == r.sh.pinned
    await r.check()
    assert len(r.stored()) >= 2 and r.stored() == r.sh.pinned
    assert r.stored() <= r.sh.guard.restorable_versions()


async def test_a_transient_pin_failure_does_not_stop_a_rollback(tmp_path: Path) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    r.pins.error, r.pins.times = StoreError("store down"), 100
    d = await r.check()
    assert d is not None and d.action == "rollback" and len(r.requests()) == 1


@pytest.mark.parametrize("error", [RuntimeError("a bug"), PreconditionFailed("lost a conditional write")])
async def test_a_non_transient_pin_failure_propagates(tmp_path: Path, error: Exception) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    r.pins.error, r.pins.times = error, 1
    with pytest.raises(type(error)):
        await r.check()
    assert not r.log.named("guard_pin_failed")


@pytest.mark.parametrize("error", [ConnectionError("broker gone"), KafkaConnectionError("broker gone")])
async def test_a_transient_failure_defers_the_rollback_to_the_next_check(tmp_path: Path, error: Exception) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    real = r.sh.producer
    r.sh.producer = FailingProducer(error)  # type: ignore[assignment]
    assert await r.check() is None
    (deferred,) = r.log.named("auto_rollback_deferred")
    assert not r.audited("auto_rollback") and r.sh.guard.rollbacks_last_hour(time.time()) == 0
    r.sh.producer = real
    d = await r.check()  # decided again, and carried out this time
    assert d is not None and d.action == "rollback" and d.to_version == deferred["to_version"]
    assert len(r.audited("auto_rollback")) == 1 and r.sh.guard.rollbacks_last_hour(time.time()) == 1


@pytest.mark.parametrize("error", [ValueError("a bug"), UnsupportedVersionError("not retriable")])
async def test_a_non_transient_failure_carrying_out_a_rollback_propagates(tmp_path: Path, error: Exception) -> None:
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    r.sh.producer = FailingProducer(error)  # type: ignore[assignment]
    with pytest.raises(type(error)):
        await r.check()
    assert r.sh.producer.sent == 1  # type: ignore[attr-defined]
    assert not r.log.named("auto_rollback_deferred") and not r.audited("auto_rollback")
    assert r.sh.guard.rollbacks_last_hour(time.time()) == 0  # not recorded as carried out


async def test_a_non_transient_failure_in_the_store_propagates(tmp_path: Path) -> None:
    # The durable rollback request is written with if_none_match: a lost conditional write is a decision,
    # not a fault, and must not be retried quietly.
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)

    put = r.sh.store.put

    def refuse_requests(key: str, *a: Any, **kw: Any) -> Any:
        if key.startswith(f"{RUN}/{ROLLBACK_PREFIX}"):
            raise PreconditionFailed("request id taken")
        return put(key, *a, **kw)

    r.sh.store.put = refuse_requests  # type: ignore[method-assign]
    with pytest.raises(PreconditionFailed, match="request id taken"):
        await r.check()
    assert not r.log.named("auto_rollback_deferred") and not r.log.named("guard_pin_failed")
    assert not r.requests() and r.sh.guard.rollbacks_last_hour(time.time()) == 0


async def test_the_trainers_guard_task_ends_on_a_non_transient_error_and_survives_a_transient_one(
        tmp_path: Path) -> None:
    """How the trainer runs the shell: ``Trainer.guard_check`` under ``every`` (its rollback-guard task)."""
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    trainer = SimpleNamespace(guard=r.sh, base_settings=r.settings, settings=r.settings)
    stop = asyncio.Event()

    def guard_task() -> asyncio.Task[None]:
        return asyncio.create_task(every(lambda: 0.01, lambda: Trainer.guard_check(trainer),  # type: ignore[arg-type]
                                         name="rollback-guard", log=r.log, stop_event=stop))

    r.pins.error, r.pins.times = StoreError("store down"), 3
    task = guard_task()
    for _ in range(500):
        await asyncio.sleep(0.01)
        if r.pins.times == 0 and r.stored():
            break
    assert not task.done() and r.stored() == r.sh.pinned and len(r.log.named("guard_pin_failed")) == 3
    stop.set()
    await asyncio.wait_for(task, 5)

    stop.clear()
    r.feed([500.0] * 10)  # a new version to pin
    r.pins.error, r.pins.times = RuntimeError("a bug"), 1
    task = guard_task()
    with pytest.raises(RuntimeError, match="a bug"):
        await asyncio.wait_for(task, 5)


async def test_the_trainer_applies_the_remedy_at_once_not_after_it_follows_the_rollback(tmp_path: Path) -> None:
    """A rollback is followed within about a second; the remedy's revision must already be in force then, not
    wait for the trainer's next runtime poll (updates at the blamed settings would break the restored weights)."""
    r = rig(tmp_path)
    r.feed([500.0] * 30)
    await r.check()
    r.feed([80.0] * 40)
    applied: list[Any] = []

    async def runtime_config() -> None:
        applied.append(RuntimeConfig(r.sh.store, RUN).latest())

    trainer = SimpleNamespace(guard=r.sh, base_settings=r.settings, settings=r.settings,
                              runtime_config=runtime_config)
    await Trainer.guard_check(trainer)  # type: ignore[arg-type]
    assert len(r.requests()) == 1
    (rev,) = applied
    assert rev is not None and rev.actor == GUARD_ACTOR, "the remedy's revision was not applied with the rollback"
    await Trainer.guard_check(trainer)  # type: ignore[arg-type]  # nothing decided (cooldown): nothing to apply
    assert len(applied) == 1


async def test_the_explosion_fallback_is_pinned_before_it_is_needed(tmp_path: Path) -> None:
    # Before any version held a best, an explosion restores the last healthy version: its weights must be
    # pinned against paramsync's pruning like a best holder's (the shell pinned best holders only).
    r = rig(tmp_path)
    r.sh.observe(time.time(), 1, None, 0, Stats())  # healthy, no episode yet: nothing holds a best
    r.sh.observe(time.time(), 2, None, 0, Stats(policy_loss=float("nan")))
    assert await r.check() is None
    assert 1 in r.guard_restorable() and r.stored() == {1} == r.sh.pinned
