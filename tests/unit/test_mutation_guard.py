"""services/trainer/guard.py at its boundaries (``make test-mutation``): every threshold is tested on both sides
of its edge (exactly at the bound, and just past it), with the evidence a decision carries."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from services.trainer.guard import HOUR_S, RollbackGuard, explosion_causes
from shared.settings import GuardSettings

CFG = GuardSettings(enabled=True, drop=100.0, hold_tolerance=25.0, settle_updates=2, window=10, min_episodes=10,
                    blame_episodes=20, explode_updates=2, explode_loss=100.0, explode_grad_norm=10.0,
                    lr_factor=0.5, max_per_hour=2, cooldown_s=30.0)


@dataclass(frozen=True)
class Stats:
    policy_loss: float = 0.0
    value_loss: float = 1.0
    skipped_steps: int = 0
    grad_norm: float | None = None


OK = Stats()


class Run:
    """One update a second, ``per`` episodes an update, a version per update, starting at episodes 0."""

    def __init__(self, cfg: GuardSettings = CFG, per: int = 5) -> None:
        self.g = RollbackGuard(cfg)
        self.now, self.version, self.episodes, self.per = 100.0, 0, 0, per

    def step(self, mean: float | None, stats: Stats = OK) -> bool:
        self.now += 1.0
        self.version += 1
        holds = self.g.observe_update(self.now, self.version, mean, self.episodes, stats)
        self.episodes += self.per
        return holds


def test_explosion_causes_at_and_past_each_bound() -> None:
    assert explosion_causes(Stats(policy_loss=100.0, value_loss=-100.0, grad_norm=10.0), CFG) == {}
    assert explosion_causes(Stats(policy_loss=-100.5), CFG) == {"policy_loss": -100.5}
    assert explosion_causes(Stats(value_loss=100.5), CFG) == {"value_loss": 100.5}
    assert explosion_causes(Stats(grad_norm=10.5), CFG) == {"grad_norm": 10.5}
    assert explosion_causes(Stats(grad_norm=math.inf), CFG) == {"grad_norm": "inf"}
    assert explosion_causes(Stats(skipped_steps=1), CFG) == {"skipped_steps": 1}
    assert explosion_causes(Stats(value_loss=math.nan, policy_loss=-math.inf), CFG) == {
        "policy_loss": "-inf", "value_loss": "nan"}


def test_the_best_counts_from_exactly_min_episodes_on() -> None:
    run = Run(per=5)
    assert run.step(300.0) is False  # episodes 0: the base
    assert run.step(300.0) is False  # 5
    assert run.g.best is None
    assert run.step(300.0) is True  # 10 = min_episodes
    assert run.g.best == 300.0 and run.g.best_version == 3


def test_an_equal_mean_does_not_move_the_best_version() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)
    assert run.g.best_version == 3
    run.step(300.0)
    assert run.g.best_version == 3
    run.step(300.5)
    assert run.g.best_version == 5


def test_a_version_holds_the_best_down_to_exactly_the_tolerance() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)
    assert run.step(275.0) is True  # best - hold_tolerance
    assert run.step(274.9) is False
    assert run.step(274.9, Stats(skipped_steps=1)) is False  # an exploding update never holds it


def test_a_fall_is_strictly_more_than_drop_below_the_best() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)
    for _ in range(10):
        run.step(200.0)  # exactly drop below: not fallen
    assert run.g.decide(run.now) is None
    run.step(199.9)  # the fall begins (episodes e)
    run.step(199.9)  # e + 5
    assert run.g.decide(run.now) is None
    run.step(199.9)  # e + 10 = window
    d = run.g.decide(run.now)
    assert d is not None and d.reason == "return_fall"
    assert d.evidence["episodes_fallen"] == 10 and d.evidence["drop"] == pytest.approx(100.1)
    assert d.evidence["mean"] == 199.9 and d.evidence["best"] == 300.0 and d.evidence["window"] == 10


def test_the_evidence_of_a_rollback() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    ev = d.evidence
    assert (ev["best_version"], ev["policy_version"], ev["episodes_seen"], ev["explosions"]) == (3, 9, 40, 0)
    assert ev["to_version"] == d.to_version and ev["to_version_mean"] == 300.0
    assert ev["drop_threshold"] == 100.0 and ev["explode_updates"] == 2 and ev["rollbacks_last_hour"] == 0
    assert ev["explosion_causes"] == {} and ev["revision"] is None and ev["changed_keys"] == []


def test_the_explosion_streak_and_its_evidence() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    run.step(300.0, Stats(grad_norm=50.0))
    assert run.g.decide(run.now) is None
    run.step(300.0, Stats(value_loss=500.0))
    d = run.g.decide(run.now)
    assert d is not None and d.reason == "explosion"
    assert d.evidence["explosions"] == 2 and d.evidence["explosion_causes"] == {"value_loss": 500.0}


def test_an_hour_old_rollback_no_longer_counts() -> None:
    assert HOUR_S == 3600.0
    g = RollbackGuard(CFG)
    g._rollbacks.extend([10.0, 20.0])
    assert g.rollbacks_last_hour(3609.9) == 2
    assert g.rollbacks_last_hour(3610.0) == 1
    assert g.rollbacks_last_hour(3620.0) == 0


def test_the_cooldown_ends_exactly_cooldown_s_after_a_rollback() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    run.g.rolled_back(run.now, d)
    until = run.now + 30.0
    for _ in range(3):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    assert run.g.decide(until - 0.1) is None
    again = run.g.decide(until)
    assert again is not None and again.action == "rollback"
    assert again.evidence["rollbacks_last_hour"] == 1


def test_a_revision_within_exactly_blame_episodes_is_blamed() -> None:
    for noted_at, blamed in ((20, True), (25, False)):
        run = Run()
        for _ in range(6):
            run.step(300.0)  # episodes 0..25, version 6 holds
        while (run.g._episodes or 0) < 50 - noted_at:
            run.step(300.0)
        run.g.note_config_revision(run.now, 4, ["trainer.learning_rate"])  # noted that many episodes before 50
        while (run.g._episodes or 0) < 50:
            run.step(300.0)
        for _ in range(3):
            run.step(150.0)  # the fall shows at episodes 55: blame counts to the observation before it, 50
        d = run.g.decide(run.now)
        assert d is not None
        assert (d.remedy == "revert_config") is blamed, (noted_at, d.remedy)


def test_a_revision_noted_twice_or_older_is_ignored() -> None:
    run = Run()
    g = run.g
    g.note_config_revision(run.now, 5, ["a"])
    g.note_config_revision(run.now, 5, ["b"])
    g.note_config_revision(run.now, 4, ["c"])
    g.note_config_revision(run.now, 6, [])
    g.note_config_revision(run.now, 7, ["d"], automatic=True)
    assert [(r.revision, r.changed_keys) for r in g._revisions] == [(5, ("a",))]
    g.note_config_revision(run.now, 6, ["b", "a"])
    assert [(r.revision, r.changed_keys) for r in g._revisions] == [(5, ("a",)), (6, ("a", "b"))]


def test_inputs_at_their_lower_bounds() -> None:
    g = RollbackGuard(CFG)
    assert g.observe_update(1.0, 0, None, 0, OK) is False  # version 0, no episode yet: fine
    assert g.observe_update(2.0, 0, None, 0, OK) is False  # the same count again: fine
    with pytest.raises(ValueError, match="negative"):
        g.observe_update(3.0, -1, None, 0, OK)
    with pytest.raises(ValueError, match="negative"):
        g.observe_update(3.0, 1, None, -1, OK)
    with pytest.raises(ValueError, match="the time must be a number"):
        g.decide(math.nan)
    g.followed(0)
    with pytest.raises(ValueError, match="negative version"):
        g.followed(-1)
    assert g.restorable_versions() == frozenset({0})


def test_a_time_going_back_is_taken_as_the_latest() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    run.g.rolled_back(run.now, d)
    assert run.g.decide(run.now - 1000.0) is None  # taken as now: still cooling down


def test_a_small_rise_of_the_best_keeps_the_versions_that_still_hold_it() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)  # version 3 holds 300
    run.step(310.0)  # a new best 310: versions at or above 285 still hold it
    assert run.g.best == 310.0
    assert {3, 4} <= run.g.restorable_versions()
    assert [h.version for h in run.g._holders] == [3, 4]
    run.step(340.0)  # 315 is the floor now: version 3 (300) and 4 (310) no longer hold it
    assert [h.version for h in run.g._holders] == [5]


def test_a_streak_longer_than_explode_updates_still_triggers() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(4):
        run.step(300.0, Stats(skipped_steps=2))
    d = run.g.decide(run.now)
    assert d is not None and d.reason == "explosion" and d.evidence["explosions"] == 4


def test_more_rollbacks_than_the_limit_still_exhaust() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None and d.action == "rollback"
    for _ in range(3):  # carried out three times (a retrying caller): over max_per_hour
        run.g.rolled_back(run.now, d)
    run.now += 100.0
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    again = run.g.decide(run.now)
    assert again is not None and again.action == "exhausted"


def test_what_the_guard_hands_out_cannot_be_altered() -> None:
    import dataclasses

    run = Run()
    for _ in range(3):
        run.step(300.0)
    run.g.note_config_revision(run.now, 1, ["k"])
    for obj in (run.g._holders[0], run.g._revisions[0]):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.episodes = 0  # type: ignore[misc,union-attr]


def test_any_clock_origin_works() -> None:
    """The guard's time is opaque: a clock that reads negative numbers decides like any other."""
    run = Run()
    run.now = -10_000.0
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None and d.action == "rollback"


def test_decisions_cannot_be_altered() -> None:
    import dataclasses

    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.to_version = 1  # type: ignore[misc]


def test_holders_are_kept_back_to_the_newest_settled_one() -> None:
    run = Run()  # settle_updates 2
    for _ in range(10):
        run.step(300.0)  # versions 3..10 hold the best (the first two are before min_episodes)
    assert [h.version for h in run.g._holders] == [8, 9, 10]


def test_the_newest_settled_holder_is_restored_after_updates_that_held_nothing() -> None:
    run = Run()
    for _ in range(10):
        run.step(300.0)  # holders 8, 9, 10
    for _ in range(3):
        run.step(250.0)  # below the tolerance, above the drop: no holder, no fall (updates 11-13)
    for _ in range(3):
        run.step(150.0)  # the fall begins at update 14: settled are holders at update <= 12, the newest 10
    d = run.g.decide(run.now)
    assert d is not None and d.to_version == 10


def test_the_floor_holder_survives_a_rise() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)  # version 3 holds 300
    run.step(325.0)  # new best 325: the floor is exactly 300
    assert [h.version for h in run.g._holders] == [3, 4]


def test_an_exploding_update_before_any_best_does_not_hold() -> None:
    run = Run()
    for _ in range(3):
        run.step(None)
    assert run.step(300.0, Stats(skipped_steps=1)) is False  # past min_episodes, but exploding: no best yet
    assert run.g.best is None


def test_old_revisions_are_forgotten_past_the_horizon() -> None:
    run = Run()
    run.g.note_config_revision(run.now, 1, ["k"])
    for _ in range(4):
        run.step(300.0)  # episodes 0..15: within 20 of the noting
    assert [r.revision for r in run.g._revisions] == [1]
    for _ in range(2):
        run.step(300.0)  # episodes 20, 25
    assert run.g._revisions == []


def test_a_revision_noted_before_any_update_counts_from_episode_zero() -> None:
    for first_episode, blamed in ((5, True), (6, False)):
        run = Run()
        run.episodes = first_episode
        run.g.note_config_revision(run.now, 3, ["trainer.learning_rate"])  # noted at episodes 0
        for _ in range(4):
            run.step(300.0)  # best from min_episodes on
        for _ in range(3):
            run.step(150.0)  # the fall shows at first_episode + 20, blame counts from first_episode + 15
        d = run.g.decide(run.now)
        assert d is not None and (d.remedy == "revert_config") is blamed, (first_episode, d.remedy)


def test_an_explosion_during_a_fall_blames_only_revisions_within_reach_of_the_explosion() -> None:
    run = Run()
    for _ in range(3):
        run.step(300.0)  # episodes 0-10
    run.step(300.0)  # 15
    run.g.note_config_revision(run.now, 2, ["trainer.learning_rate"])  # noted at 15
    run.step(300.0)  # 20
    run.step(300.0)  # 25
    run.step(150.0)  # 30: the fall shows (blame counts from 25, 10 after the noting: kept)
    run.step(150.0)  # 35
    run.step(150.0)  # 40
    run.step(150.0, Stats(skipped_steps=1))  # 45: the explosion streak shows, blame counts from 40: 25 after
    run.step(150.0, Stats(skipped_steps=1))  # 50
    d = run.g.decide(run.now)
    assert d is not None and d.reason == "explosion" and d.remedy == "lower_lr" and d.revert_revision is None


def test_a_culprit_holder_exactly_at_the_tolerance_is_restored() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)  # holders up to version 6
    run.step(275.0)  # version 7 holds, exactly best - hold_tolerance
    run.g.note_config_revision(run.now, 9, ["trainer.learning_rate"])
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None and d.remedy == "revert_config" and d.to_version == 7


def test_a_fall_counted_from_an_early_start() -> None:
    cfg = GuardSettings(**{**CFG.model_dump(), "min_episodes": 1})
    run = Run(cfg)
    run.step(300.0)  # episodes 0: the base
    run.step(300.0)  # 5: the best
    run.step(150.0)  # 10: the fall begins
    run.step(150.0)  # 15
    assert run.g.decide(run.now) is None
    run.step(150.0)  # 20: fallen for exactly window episodes
    d = run.g.decide(run.now)
    assert d is not None and d.evidence["episodes_fallen"] == 10 and d.evidence["drop"] == 150.0


def test_an_explosion_with_no_episode_yet_reports_zero_episodes() -> None:
    run = Run(per=0)
    run.step(None)
    run.step(None, Stats(skipped_steps=1))
    run.step(None, Stats(skipped_steps=1))
    d = run.g.decide(run.now)
    assert d is not None and d.evidence["episodes_seen"] == 0 and d.to_version == 1


def test_the_exhausted_decision_carries_the_rollback_it_replaces() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    run.g.rolled_back(run.now, d)
    run.g.rolled_back(run.now, d)
    run.now += 100.0
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    ex = run.g.decide(run.now)
    assert ex is not None and ex.action == "exhausted" and ex.lr_factor == 1.0
    assert ex.evidence["max_per_hour"] == 2 and ex.evidence["to_version"] is not None
    assert ex.evidence["to_version_mean"] == 300.0


def test_a_rollback_spelled_at_run_time_is_carried_out() -> None:
    from services.trainer.guard import Decision

    g = RollbackGuard(CFG)
    g.rolled_back(5.0, Decision("".join(["roll", "back"]), "return_fall", 3, "lower_lr", None, 0.5, {}))  # type: ignore[arg-type]
    assert g.rollbacks_last_hour(6.0) == 1


def test_a_negative_clock_cools_down_by_its_own_measure() -> None:
    run = Run()
    run.now = -10_000.0
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None
    run.g.rolled_back(run.now, d)
    run.now += 31.0
    for _ in range(6):
        run.step(300.0)
    for _ in range(3):
        run.step(150.0)
    again = run.g.decide(run.now)
    assert again is not None and again.action == "rollback"
    assert run.g._fall is not None
    with pytest.raises(Exception, match="cannot assign|FrozenInstanceError|frozen"):
        run.g._fall.episodes = 0  # type: ignore[misc]


def test_with_no_settling_only_the_newest_holder_is_kept() -> None:
    run = Run(GuardSettings(**{**CFG.model_dump(), "settle_updates": 0}))
    for _ in range(6):
        run.step(300.0)
    assert [h.version for h in run.g._holders] == [6]


def test_holders_left_behind_by_a_gap_are_dropped_when_a_new_one_comes() -> None:
    run = Run()
    for _ in range(10):
        run.step(300.0)  # holders 8, 9, 10
    for _ in range(3):
        run.step(250.0)  # updates 11-13 hold nothing
    run.step(300.0)  # update 14 holds: 10 is the newest settled one, 8 and 9 go
    assert [h.version for h in run.g._holders] == [10, 14]


def test_a_revision_is_forgotten_blame_episodes_after_it_was_noted() -> None:
    run = Run()
    run.step(300.0)
    run.step(300.0)  # episodes 5
    run.g.note_config_revision(run.now, 1, ["k"])  # noted at 5
    while (run.g._episodes or 0) < 25:
        run.step(300.0)
    assert [r.revision for r in run.g._revisions] == [1]  # 20 after: still within reach
    run.step(300.0)  # 30: 25 after
    assert run.g._revisions == []


def _feed(g: RollbackGuard, steps: list[tuple[int, float]], start_version: int = 0, now: float = 100.0) -> float:
    """Observe (episodes, mean) per update, versions counting from ``start_version + 1``."""
    for i, (episodes, mean) in enumerate(steps):
        now += 1.0
        g.observe_update(now, start_version + i + 1, mean, episodes, OK)
    return now


def test_the_default_return_window_is_the_last_100_episodes() -> None:
    """A holder observed within 100 episodes of the blamed revision posts a mean of episodes from before it."""
    cfg = GuardSettings(**{**CFG.model_dump(), "blame_episodes": 1000})
    for lag, restored in ((99, 2), (100, 4)):
        g = RollbackGuard(cfg)
        now = _feed(g, [(0, 300.0), (50, 300.0)])  # version 2 holds 300
        g.note_config_revision(now, 5, ["trainer.learning_rate"])  # at 50 episodes, update 2
        now = _feed(g, [(50 + lag - 50, 340.0), (50 + lag, 340.0), (50 + lag + 50, 340.0), (50 + lag + 60, 150.0),
                        (50 + lag + 65, 150.0), (50 + lag + 70, 150.0)], start_version=2, now=now)
        d = g.decide(now)
        assert d is not None and d.remedy == "revert_config" and d.to_version == restored, (lag, d.to_version)


def test_a_holder_exactly_return_window_after_the_revision_is_not_lagging() -> None:
    g = RollbackGuard(CFG, return_window=10)
    now = _feed(g, [(0, 300.0), (5, 300.0), (10, 300.0)])  # version 3 holds 300
    g.note_config_revision(now, 5, ["trainer.learning_rate"])  # at 10 episodes, update 3
    now = _feed(g, [(15, 340.0), (20, 340.0), (25, 340.0), (30, 150.0), (35, 150.0), (40, 150.0)],
                start_version=3, now=now)
    d = g.decide(now)
    assert d is not None and d.remedy == "revert_config" and d.to_version == 5  # 20 - 10 = the window: not lagging


def test_a_holder_from_before_the_revision_is_not_lagging() -> None:
    g = RollbackGuard(CFG)
    now = _feed(g, [(0, 300.0), (5, 300.0), (10, 300.0), (15, 300.0), (20, 320.0), (25, 300.0)])
    g.note_config_revision(now, 5, ["trainer.learning_rate"])  # the newest holder is version 6 (300)
    now = _feed(g, [(30, 340.0), (35, 150.0), (40, 150.0), (45, 150.0)], start_version=6, now=now)
    d = g.decide(now)
    # The settled holder (version 5, from before the revision) restores: version 6 no longer holds the best.
    assert d is not None and d.remedy == "revert_config" and d.to_version == 5


def test_a_culprit_holder_above_the_tolerance_still_holds() -> None:
    run = Run()
    for _ in range(6):
        run.step(300.0)
    run.step(290.0)  # version 7 holds (within 25 of 300)
    run.g.note_config_revision(run.now, 9, ["trainer.learning_rate"])
    for _ in range(3):
        run.step(150.0)
    d = run.g.decide(run.now)
    assert d is not None and d.remedy == "revert_config" and d.to_version == 7
