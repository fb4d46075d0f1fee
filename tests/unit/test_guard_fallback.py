"""The rollback guard's explosion fallback (services/trainer/guard.py; issue 29: a proof that can fail).

``explode_updates`` consecutive updates that refused a step, or whose loss or gradient norm is not finite
(NaN, +-inf) or too large, trigger an ``explosion`` rollback, which takes precedence over a fall. An explosion
before any version held a best restores the version of the last healthy update before the streak (none: no
decision); that version is among ``restorable_versions`` (the shell keeps its weights).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from services.trainer.guard import RollbackGuard
from shared.settings import GuardSettings

CFG = GuardSettings(enabled=True, drop=100.0, hold_tolerance=25.0, settle_updates=4, window=20, min_episodes=100,
                    blame_episodes=100, explode_updates=3, explode_loss=1e4, explode_grad_norm=1e3,
                    lr_factor=0.5, max_per_hour=3, cooldown_s=30.0)
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Stats:
    policy_loss: float = 0.01
    value_loss: float = 5.0
    skipped_steps: int = 0
    grad_norm: float | None = 1.0


HEALTHY = Stats()


class Run:
    """One update a second, 5 episodes an update, a new version per update."""

    def __init__(self) -> None:
        self.guard = RollbackGuard(CFG)
        self.now, self.version, self.episodes = 1000.0, 0, 0

    def step(self, mean: float | None, stats: Stats = HEALTHY) -> bool:
        self.now += 1.0
        self.version += 1
        self.episodes += 5
        return self.guard.observe_update(self.now, self.version, mean, self.episodes, stats)

    def explode(self, stats: Stats, updates: int = CFG.explode_updates, mean: float | None = 20.0) -> list[int]:
        versions = []
        for _ in range(updates):
            assert self.step(mean, stats) is False  # an exploding update never holds the best
            versions.append(self.version)
        return versions


@pytest.mark.parametrize(("stats", "causes"), [
    (Stats(value_loss=NAN), {"value_loss": "nan"}),
    (Stats(value_loss=INF), {"value_loss": "inf"}),
    (Stats(policy_loss=NAN), {"policy_loss": "nan"}),
    (Stats(policy_loss=-INF), {"policy_loss": "-inf"}),
    (Stats(grad_norm=NAN), {"grad_norm": "nan"}),
    (Stats(grad_norm=INF), {"grad_norm": "inf"}),
    (Stats(policy_loss=NAN, value_loss=NAN, grad_norm=NAN), {"policy_loss": "nan", "value_loss": "nan",
                                                             "grad_norm": "nan"}),
    (Stats(skipped_steps=4, grad_norm=None), {"skipped_steps": 4}),
])
def test_non_finite_stats_before_any_best_restore_the_last_healthy_version(stats: Stats,
                                                                           causes: dict[str, object]) -> None:
    run = Run()
    for _ in range(3):
        run.step(20.0)  # 15 episodes: no best yet (min_episodes is 100)
    healthy = run.version
    exploded = run.explode(stats)
    assert run.guard.best is None
    d = run.guard.decide(run.now)
    assert d is not None and (d.action, d.reason) == ("rollback", "explosion")
    assert d.to_version == healthy and d.remedy == "lower_lr" and d.lr_factor == CFG.lr_factor
    assert d.evidence["explosion_causes"] == causes and d.evidence["explosions"] == CFG.explode_updates
    assert d.evidence["best"] is None and d.evidence["to_version"] == healthy
    json.loads(json.dumps(d.evidence, allow_nan=False))  # non-finite values named, fit for an audit record
    kept = run.guard.restorable_versions()
    assert healthy in kept and not (kept & set(exploded))


def test_one_update_short_of_the_streak_decides_nothing() -> None:
    run = Run()
    run.step(20.0)
    run.explode(Stats(value_loss=NAN), updates=CFG.explode_updates - 1)
    assert run.guard.decide(run.now) is None
    run.explode(Stats(value_loss=NAN), updates=1)
    d = run.guard.decide(run.now)
    assert d is not None and d.to_version == 1


def test_the_fallback_is_the_last_healthy_update_before_this_streak() -> None:
    run = Run()
    for _ in range(2):
        run.step(20.0)
    run.explode(Stats(grad_norm=INF), updates=CFG.explode_updates - 1)
    run.step(20.0)  # healthy: the streak ends
    healthy = run.version
    run.explode(Stats(grad_norm=INF))
    d = run.guard.decide(run.now)
    assert d is not None and d.to_version == healthy


def test_the_fallback_works_without_any_episode_yet() -> None:
    run = Run()
    run.step(None)
    healthy = run.version
    run.explode(Stats(value_loss=NAN), mean=None)
    d = run.guard.decide(run.now)
    assert d is not None and d.reason == "explosion" and d.to_version == healthy and d.evidence["mean"] is None


def test_no_healthy_update_before_the_streak_decides_nothing() -> None:
    run = Run()
    run.explode(Stats(value_loss=NAN), updates=10)
    assert run.guard.decide(run.now) is None  # nothing the run may restore
    assert run.guard.restorable_versions() == frozenset()


def test_after_its_own_rollback_an_explosion_restores_the_restored_version() -> None:
    # The versions observed before the rollback were trained from abandoned weights (the fall's versions were
    # healthy updates, but they are what the rollback undid): the fallback is the restored version.
    run = Run()
    for _ in range(40):
        run.step(500.0)
    d = None
    for _ in range(40):
        run.step(300.0)
        d = run.guard.decide(run.now)
        if d is not None:
            break
    assert d is not None and d.reason == "return_fall" and d.to_version is not None
    run.guard.rolled_back(run.now, d)
    assert run.guard.restorable_versions() == {d.to_version}  # kept for a fallback, the abandoned ones not
    run.now += CFG.cooldown_s
    run.explode(Stats(value_loss=INF))
    again = run.guard.decide(run.now)
    assert again is not None and again.reason == "explosion" and again.to_version == d.to_version
    assert d.to_version in run.guard.restorable_versions()


def test_after_following_a_rollback_an_explosion_restores_the_followed_version() -> None:
    run = Run()
    for _ in range(10):
        run.step(20.0)
    run.guard.followed(4)  # an operator rolled back to version 4
    run.explode(Stats(policy_loss=NAN))
    d = run.guard.decide(run.now)
    assert d is not None and d.to_version == 4


def test_an_explosion_takes_precedence_over_a_fall() -> None:
    run = Run()
    for _ in range(40):
        run.step(500.0)
    for _ in range(CFG.window // 5 + 2):
        run.step(300.0)  # fallen for longer than the window: a fall would trigger
    run.explode(Stats(value_loss=NAN), mean=300.0)
    d = run.guard.decide(run.now)
    assert d is not None and d.reason == "explosion" and d.evidence["explosion_causes"] == {"value_loss": "nan"}


def test_a_non_finite_mean_is_refused_not_taken_for_a_best() -> None:
    run = Run()
    with pytest.raises(ValueError, match="finite"):
        run.guard.observe_update(run.now, 1, math.inf, 5, HEALTHY)
