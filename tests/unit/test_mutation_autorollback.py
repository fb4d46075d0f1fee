"""services/trainer/autorollback.py (``make test-mutation``): what the shell writes, counts and audits for each
decision, the remedy's exact arithmetic, and the pins it keeps."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.trainer import telemetry as m
from services.trainer.autorollback import GUARD_ACTOR, PIN_TTL_S, GuardShell
from services.trainer.guard import Decision, RollbackGuard
from shared.bus import MemoryBus
from shared.kafka import Topics
from shared.logging import get_logger
from shared.marker import VersionedStore
from shared.runtime import AuditLog, Auditor, RuntimeConfig, apply_runtime
from shared.settings import GuardSettings, Settings, StoreSettings, TrainerSettings
from shared.store import open_store
from tests.marker_cases import publish_version

RUN = "r"
CFG = GuardSettings(enabled=True, drop=100.0, hold_tolerance=25.0, settle_updates=2, window=10, min_episodes=20,
                    blame_episodes=200, explode_updates=3, lr_factor=0.5, max_per_hour=1, cooldown_s=0.0)


@dataclass(frozen=True)
class Stats:
    policy_loss: float = 0.01
    value_loss: float = 5.0
    skipped_steps: int = 0
    grad_norm: float = 1.0


def shell(tmp_path: Path, lr_end: float | None = 1e-5) -> tuple[GuardShell, Settings]:
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(learning_rate=1e-3, learning_rate_end=lr_end, guard=CFG))
    store = open_store(settings)
    mem = MemoryBus()
    mem.create(Topics.for_run(RUN).control, 1)
    log = get_logger()
    sh = GuardShell(RollbackGuard(CFG), store=store, run=RUN, policies=VersionedStore(store, RUN, "policy"),
                    config=RuntimeConfig(store, RUN), producer=mem.bus().publisher,
                    control_topic=Topics.for_run(RUN).control, audit=Auditor(AuditLog(store, RUN), log, "trainer"),
                    log=log, holder="t")
    return sh, settings


def fall(sh: GuardShell, start: int = 0) -> int:
    v = start
    for mean in [500.0] * 30 + [80.0] * 40:
        v += 1
        publish_version(sh.policies, v)  # paramsync published every candidate
        sh.observe(time.time(), v, mean, v * 5, Stats())
    return v


def audited(sh: GuardShell, action: str) -> list[Any]:
    return [e for e in AuditLog(sh.store, RUN).entries() if e.action == action]


def counter(metric: Any, **labels: str) -> float:
    return float((metric.labels(**labels) if labels else metric)._value.get())


async def test_pins_last_an_hour(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    for v in range(1, 31):
        sh.observe(time.time(), v, 500.0, v * 5, Stats())
    before = time.time()
    assert await sh.check(settings, settings) is None
    assert PIN_TTL_S == 3600.0
    assert sh.pinned
    for v in sh.pinned:
        body = json.loads(sh.store.get(f"{RUN}/policy/pins/{v}.json").data)  # type: ignore[union-attr]
        assert body["holder"] == "t"
        assert before + 3600.0 - 1 <= body["until"] <= time.time() + 3600.0
    assert m.GUARD_EXHAUSTED._value.get() == 0


async def test_a_rollback_is_counted_audited_and_leaves_its_outcome(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    fall(sh)
    rollbacks = counter(m.AUTO_ROLLBACKS, reason="return_fall")
    recoveries = counter(m.RECOVERIES, action="auto_rollback")
    d = await sh.check(settings, settings)
    assert d is not None and d.action == "rollback" and d.remedy == "lower_lr"
    assert counter(m.AUTO_ROLLBACKS, reason="return_fall") == rollbacks + 1
    assert counter(m.RECOVERIES, action="auto_rollback") == recoveries + 1
    (entry,) = audited(sh, "auto_rollback")
    assert entry.params["remedy"] == "lower_lr" and entry.params["learning_rate"] == 5e-4
    assert entry.params["request_id"] and entry.params["config_revision"] == 1
    assert entry.outcome == f"rollback to version {d.to_version} requested; lower_lr"
    assert m.GUARD_EXHAUSTED._value.get() == 0  # read before this rollback: none yet this hour


async def test_the_hour_spent_is_said_once_audited_and_flagged(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    v = fall(sh)
    assert (await sh.check(settings, settings)) is not None
    sh.followed(v - 40)
    fall(sh, v)
    d = await sh.check(settings, settings)
    assert d is not None and d.action == "exhausted"
    assert m.GUARD_EXHAUSTED._value.get() == 1
    (entry,) = audited(sh, "guard_exhausted")
    assert entry.params["max_per_hour"] == 1
    assert entry.outcome.startswith("1 automatic rollbacks within an hour")
    assert len(audited(sh, "auto_rollback")) == 1
    m.GUARD_EXHAUSTED.set(0)
    assert await sh.check(settings, settings) is None
    assert m.GUARD_EXHAUSTED._value.get() == 1  # still spent: the hour's one rollback


async def test_lower_lr_without_an_end_rate_writes_only_the_rate(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path, lr_end=None)
    fall(sh)
    d = await sh.check(settings, settings)
    assert d is not None and d.remedy == "lower_lr"
    latest = RuntimeConfig(sh.store, RUN).latest()
    assert latest is not None and latest.actor == GUARD_ACTOR
    applied = apply_runtime(settings, latest.settings).trainer
    assert applied.learning_rate == 5e-4 and applied.learning_rate_end is None


async def test_revert_config_goes_back_to_the_revision_before_the_blamed_one(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    config = RuntimeConfig(sh.store, RUN)
    config.write(settings, {"trainer.learning_rate": 3e-3}, "operator")
    second = config.write(settings, {"trainer.learning_rate": 2e-3}, "operator")
    third = config.write(settings, {"trainer.learning_rate": 1.0}, "operator")
    assert third.revision == 3
    decision = Decision("rollback", "return_fall", 3, "revert_config", third.revision, 1.0, {"x": 1})
    out = sh._carry_out(decision, settings, settings)
    assert out["reverted_to"] == second.revision and out["config_revision"] == third.revision + 1
    latest = config.latest()
    assert latest is not None and apply_runtime(settings, latest.settings).trainer.learning_rate == 2e-3


async def test_store_calls_are_bounded_in_time(tmp_path: Path, monkeypatch: Any) -> None:
    """A store that hangs holds the check at most 10 s for the pins, 10 s for finding the version to restore
    and 30 s for carrying a rollback out."""
    sh, settings = shell(tmp_path)
    fall(sh)
    limits: list[float] = []
    real = asyncio.wait_for

    async def recording(aw: Any, timeout: float) -> Any:
        limits.append(timeout)
        return await real(aw, timeout)

    monkeypatch.setattr(asyncio, "wait_for", recording)
    assert await sh.check(settings, settings) is not None
    assert limits[:3] == [10, 10, 30]  # the pins, the target's record, the rollback (the audit has its own bound)


async def test_a_remedy_is_matched_by_value(tmp_path: Path) -> None:
    """Remedies compare by value: one spelled at run time (not the guard's interned literal) is carried out."""
    sh, settings = shell(tmp_path)
    config = RuntimeConfig(sh.store, RUN)
    first = config.write(settings, {"trainer.learning_rate": 2e-3}, "operator")
    second = config.write(settings, {"trainer.learning_rate": 1.0}, "operator")
    revert = Decision("rollback", "return_fall", 3, "".join(["revert", "_config"]), second.revision, 1.0, {})  # type: ignore[arg-type]
    assert sh._carry_out(revert, settings, settings)["reverted_to"] == first.revision
    lower = Decision("rollback", "return_fall", 3, "".join(["lower", "_lr"]), None, 0.5, {})  # type: ignore[arg-type]
    assert sh._carry_out(lower, settings, settings)["learning_rate"] == 5e-4


class RecordingPins:
    def __init__(self, inner: VersionedStore) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int]] = []

    def pin(self, version: int, holder: str, ttl_s: float) -> None:
        self.calls.append(("pin", version))
        self.inner.pin(version, holder, ttl_s)

    def unpin(self, version: int) -> None:
        self.calls.append(("unpin", version))
        self.inner.unpin(version)


async def test_pins_are_written_once_and_dropped_without_a_rewrite(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    rec = RecordingPins(sh.policies)
    sh.policies = rec  # type: ignore[assignment]
    for v in range(1, 31):
        sh.observe(time.time(), v, 500.0, v * 5, Stats())
    await sh.check(settings, settings)
    first = set(sh.pinned)
    assert rec.calls == [("pin", v) for v in sorted(first)]
    rec.calls.clear()
    await sh.check(settings, settings)
    assert rec.calls == []  # nothing changed: nothing written
    sh.followed(5)
    await sh.check(settings, settings)
    assert rec.calls == [("pin", 5)] + [("unpin", v) for v in sorted(first - {5})]
    assert sh.pinned == {5}


def test_the_shell_takes_its_collaborators_by_keyword(tmp_path: Path) -> None:
    sh, _ = shell(tmp_path)
    with pytest.raises(TypeError):
        GuardShell(sh.guard, sh.store, RUN, sh.policies, sh.config, sh.producer, "t", sh.audit, sh.log,  # type: ignore[misc]
                   "h")


def test_its_own_revision_is_recognised_by_value(tmp_path: Path) -> None:
    sh, _ = shell(tmp_path)
    for v in range(1, 31):
        sh.observe(time.time(), v, 500.0, v * 5, Stats())
    sh.note_revision(time.time(), 4, ["trainer.learning_rate"], "".join(["trainer-", "guard"]))  # as read back
    sh.note_revision(time.time(), 5, ["trainer.learning_rate"], "operator")
    assert [r.revision for r in sh.guard._revisions] == [5]


async def test_the_gauge_stays_up_past_the_limit(tmp_path: Path) -> None:
    sh, settings = shell(tmp_path)
    v = fall(sh)
    d = await sh.check(settings, settings)
    assert d is not None
    sh.guard.rolled_back(time.time(), d)  # a second one in the hour (carried out again): over max_per_hour 1
    m.GUARD_EXHAUSTED.set(0)
    sh.observe(time.time(), v + 1, 500.0, (v + 1) * 5, Stats())
    assert await sh.check(settings, settings) is None
    assert m.GUARD_EXHAUSTED._value.get() == 1


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((event, kw))


async def test_an_exhausted_decision_is_recognised_by_value_and_the_rollback_log_says_automatic(
        tmp_path: Path, monkeypatch: Any) -> None:
    sh, settings = shell(tmp_path)
    sh.log = Log()
    fall(sh)
    d = await sh.check(settings, settings)
    assert d is not None
    ((event, kw),) = [e for e in sh.log.events if e[0] == "auto_rollback"]
    assert kw["automatic_action"] is True and kw["to_version"] == d.to_version
    exhausted = Decision("".join(["exhaus", "ted"]), "return_fall", None, None, None, 1.0, {"x": 1})  # type: ignore[arg-type]
    monkeypatch.setattr(sh.guard, "decide", lambda now: exhausted)
    assert await sh.check(settings, settings) is exhausted
    assert [e for e in sh.log.events if e[0] == "guard_exhausted"]
    assert len(audited(sh, "auto_rollback")) == 1 and len(audited(sh, "guard_exhausted")) == 1
