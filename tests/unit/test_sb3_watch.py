"""The SB3 peers' callback: episodes recorded within the time budget, and each peer's stop rule."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("stable_baselines3")

from bench.peers.sb3_watch import EpisodeWatch, SolvedWatch, StepBudgetWatch  # noqa: E402


def step(w: EpisodeWatch, steps: int, returns: list[float], at_s: float = 0.0) -> bool:
    """One vector step ``at_s`` seconds after learn() began, finishing episodes with ``returns``."""
    w.t0 = time.monotonic() - at_s
    w.num_timesteps = steps
    w.locals = {"infos": [{"episode": {"r": r}} for r in returns] + [{}]}
    return w._on_step()


def test_episodes_are_recorded_until_the_budget_and_the_step_past_it_stops_uncounted() -> None:
    w = EpisodeWatch(max_s=10.0)
    assert step(w, 8, [1.0, 2.0], at_s=1.0) and step(w, 16, [], at_s=5.0)
    assert not step(w, 24, [3.0], at_s=11.0)  # past the budget: stop, not recorded
    assert [(s, r) for _, s, r in w.curve] == [(8, 1.0), (8, 2.0)] and w.steps_within == 16


def test_solved_stops_when_the_last_window_mean_reaches_the_threshold() -> None:
    w = SolvedWatch(threshold=5.0, max_s=100.0, window=3)
    assert step(w, 8, [4.0, 5.0]) and w.solved is None  # two episodes: not a full window yet
    assert step(w, 16, [5.0]) and w.solved is None  # mean 4.67
    assert not step(w, 24, [6.0])  # 5, 5, 6: mean 5.33
    assert w.solved is not None and w.solved[1] == 24


def test_step_budget_stops_at_the_first_step_at_or_past_it() -> None:
    w = StepBudgetWatch(steps=20, max_s=100.0)
    assert step(w, 16, [1.0]) and w.budget_s is None
    assert not step(w, 24, [])
    assert w.budget_s is not None
