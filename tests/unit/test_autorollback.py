"""The rollback guard's shell on the local store and the in-memory bus: what a decision leaves behind (a
durable rollback request, a remedy revision, an audit record, a control message, pins)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from services.trainer.autorollback import GUARD_ACTOR, GuardShell
from services.trainer.guard import RollbackGuard
from shared.bus import MemoryBus
from shared.kafka import Topics
from shared.logging import get_logger
from shared.marker import VersionedStore
from shared.messages import ControlCommand
from shared.runtime import AuditLog, Auditor, RuntimeConfig, apply_runtime
from shared.settings import GuardSettings, Settings, StoreSettings, TrainerSettings
from shared.store import open_store
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


def shell(tmp_path: Path) -> tuple[GuardShell, MemoryBus, Settings]:
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(learning_rate=1e-3, learning_rate_end=1e-5, guard=CFG))
    store = open_store(settings)
    mem = MemoryBus()
    mem.create(Topics.for_run(RUN).control, 1)
    log = get_logger()
    sh = GuardShell(RollbackGuard(CFG), store=store, run=RUN, policies=VersionedStore(store, RUN, "policy"),
                    config=RuntimeConfig(store, RUN), producer=mem.bus().publisher,
                    control_topic=Topics.for_run(RUN).control, audit=Auditor(AuditLog(store, RUN), log, "trainer"),
                    log=log, holder="t")
    return sh, mem, settings


def feed(sh: GuardShell, means: list[float], start_version: int, episodes: int) -> tuple[int, int]:
    v = start_version
    for mean in means:
        v += 1
        episodes += 5
        publish_version(sh.policies, v)  # paramsync published every candidate (none superseded)
        sh.observe(time.time(), v, mean, episodes, Stats())
    return v, episodes


async def test_a_fall_after_an_operator_change_rolls_back_and_reverts_it(tmp_path: Path) -> None:
    sh, mem, settings = shell(tmp_path)
    v, eps = feed(sh, [500.0] * 30, 0, 0)
    assert await sh.check(settings, settings) is None  # solved and holding: nothing to do
    assert sh.pinned, "the versions it may restore are pinned against pruning"
    assert VersionedStore(sh.store, RUN, "policy").pinned() == sh.pinned
    config = RuntimeConfig(sh.store, RUN)
    rev = config.write(settings, {"trainer.learning_rate": 1.0}, "operator")
    sh.note_revision(time.time(), rev.revision, ["trainer.learning_rate"], "operator")
    feed(sh, [80.0] * 40, v, eps)
    decision = await sh.check(settings, apply_runtime(settings, rev.settings))
    assert decision is not None and decision.action == "rollback" and decision.remedy == "revert_config"
    assert decision.to_version is not None and decision.to_version <= v
    # The operator's path: a durable request paramsync applies, and a control message that wakes it.
    (key,) = sh.store.list(f"{RUN}/ops/rollback/")
    req = json.loads(sh.store.get(key).data)  # type: ignore[union-attr]
    assert req["status"] == "pending" and req["version"] == decision.to_version and req["actor"] == GUARD_ACTOR
    (cmd,) = [ControlCommand.model_validate_json(r.value or b"") for r in mem.records(Topics.for_run(RUN).control)]
    assert cmd.command == "rollback" and cmd.request_id == req["request_id"]
    # The remedy: the revision before the operator's is current again (no overrides), written by the guard.
    latest = config.latest()
    assert latest is not None and latest.revision == rev.revision + 1 and latest.actor == GUARD_ACTOR
    assert apply_runtime(settings, latest.settings).trainer.learning_rate == 1e-3
    (entry,) = [e for e in AuditLog(sh.store, RUN).entries() if e.action == "auto_rollback"]
    assert entry.params["reason"] == "return_fall" and entry.params["best"] == 500.0
    assert await sh.check(settings, settings) is None  # cooling down: no second rollback for the same fall


async def test_a_fall_without_a_change_lowers_the_learning_rate(tmp_path: Path) -> None:
    sh, _mem, settings = shell(tmp_path)
    v, eps = feed(sh, [500.0] * 30, 0, 0)
    feed(sh, [80.0] * 40, v, eps)
    decision = await sh.check(settings, settings)
    assert decision is not None and decision.remedy == "lower_lr"
    latest = RuntimeConfig(sh.store, RUN).latest()
    assert latest is not None and latest.actor == GUARD_ACTOR
    applied = apply_runtime(settings, latest.settings).trainer
    assert applied.learning_rate == 5e-4 and applied.learning_rate_end == 5e-6


async def test_its_own_revision_is_never_blamed(tmp_path: Path) -> None:
    sh, _mem, settings = shell(tmp_path)
    v, eps = feed(sh, [500.0] * 30, 0, 0)
    sh.note_revision(time.time(), 7, ["trainer.learning_rate"], GUARD_ACTOR)
    feed(sh, [80.0] * 40, v, eps)
    decision = await sh.check(settings, settings)
    assert decision is not None and decision.remedy == "lower_lr"
