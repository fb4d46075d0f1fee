"""bench.lag_look and the lockstep loop under it: the behaviour policy is exactly ``lag`` versions old."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import bench.inproc as inproc
from bench.lag_look import look
from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
from shared.settings import load_settings

CARTPOLE = str(Path(__file__).resolve().parents[2] / "configs" / "cartpole.yaml")


@pytest.mark.parametrize("lag", [0, 2])
def test_lockstep_acts_with_the_weights_of_exactly_lag_versions_ago(lag: int, monkeypatch: Any) -> None:
    published: list[bytes] = []  # published[v]: the weights of version v
    adopted: list[tuple[int, bytes, int]] = []  # (version adopted, its weights, fragments collected so far)
    collected = [0]
    weights, set_policy, collect = Learner.weights, RolloutWorker.set_policy, RolloutWorker.collect

    def record_weights(self: Learner) -> bytes:
        published.append(weights(self))
        return published[-1]

    def record_set(self: RolloutWorker, version: int, blob: bytes) -> None:
        adopted.append((version, blob, collected[0]))
        set_policy(self, version, blob)

    def count_collect(self: RolloutWorker) -> Any:
        frag = collect(self)
        assert frag.policy_version == self.policy_version
        collected[0] += 1
        return frag

    monkeypatch.setattr(Learner, "weights", record_weights)
    monkeypatch.setattr(RolloutWorker, "set_policy", record_set)
    monkeypatch.setattr(RolloutWorker, "collect", count_collect)
    settings = load_settings(CARTPOLE, environ={})
    per_update = settings.trainer.batch_fragments
    updates = 6
    inproc.lockstep_curve(settings, 1, 2, lag, lambda _c, steps: collected[0] >= updates * per_update)
    assert adopted, "the workers never adopted a policy"
    for version, blob, before in adopted:
        current = before // per_update  # updates done when this batch began
        assert version == max(0, current - lag)
        assert blob == published[version]
    assert max(v for v, _, _ in adopted) == max(0, updates - 1 - lag)


def test_look_reports_the_return_at_each_mark() -> None:
    out = look(CARTPOLE, seed=1, lag=1, steps=3_000, every=1_000, last=5)
    assert list(out["at"]) == ["1000", "2000", "3000"]
    assert out["episodes"] >= 5
    assert math.isfinite(out["at_end"]) and out["at_end"] == out["at"]["3000"]
    assert out["best_rolling"] >= out["at_end"]  # the last window is one of the rolling windows


def test_look_refuses_a_negative_lag() -> None:
    with pytest.raises(ValueError, match="lag"):
        look(CARTPOLE, seed=1, lag=-1, steps=1_000, every=500, last=5)
