"""The trainer's update in detail: batched targets, GAE, KL early stopping (pure code, no Kafka)."""

import numpy as np
import pytest
import torch

from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
from services.trainer.update import _targets, gae
from shared.fragment import Fragment
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.settings import TrainerSettings

SPEC = fragment_spec("CartPole-v1", 1 << 22)


def _fragments(learner: Learner, n: int, steps: int = 40, envs: int = 3) -> list[Fragment]:
    out = []
    for i in range(n):
        w = RolloutWorker("CartPole-v1", num_envs=envs, fragment_steps=steps, sampler_id=f"s{i}",
                          arch=PolicyArch(hidden=64), seed=i)
        w.set_policy(0, learner.weights())
        out.append(w.collect())
        w.close()
    return out


def _reference_gae(rewards: np.ndarray, values: np.ndarray, next_value: np.ndarray, done: np.ndarray,
                   gamma: float, lam: float) -> np.ndarray:
    """The textbook recursion, one env and one step at a time."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for i in range(N):
        running = 0.0
        for t in reversed(range(T)):
            nv = next_value[i] if t == T - 1 else values[t + 1, i]
            nd = 0.0 if done[t, i] else 1.0
            running = rewards[t, i] + gamma * nv * nd - values[t, i] + gamma * lam * nd * running
            adv[t, i] = running
    return adv


def test_gae_matches_the_textbook_recursion() -> None:
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(17, 5)).astype(np.float32)
    values = rng.normal(size=(17, 5)).astype(np.float32)
    next_value = rng.normal(size=5).astype(np.float32)
    done = rng.random((17, 5)) < 0.15
    got = gae(rewards, values, next_value, done, 0.97, 0.9)
    np.testing.assert_allclose(got, _reference_gae(rewards, values, next_value, done, 0.97, 0.9), rtol=1e-5, atol=1e-5)


def test_batched_targets_equal_per_fragment_targets() -> None:
    """One critic forward over several fragments (with different truncation counts) gives exactly what
    each fragment gives alone, in batch order."""
    learner = Learner(SPEC, TrainerSettings())
    frags = _fragments(learner, 3)
    # Give the fragments different numbers of truncations (and their final observations).
    for k, f in enumerate(frags):
        f.truncated[:] = 0
        f.terminated[:] = 0
        f.terminated[5, 0] = 1
        for j in range(k):
            f.truncated[10 + j, j % 3] = 1
        f.trunc_obs = np.full((k, 4), 0.1 * (k + 1), np.float32)
    cfg = learner.update_cfg
    together = _targets(learner.model, frags, cfg, torch.device("cpu"))
    alone = [_targets(learner.model, [f], cfg, torch.device("cpu")) for f in frags]
    for got, parts in zip(together, zip(*alone, strict=True), strict=True):
        torch.testing.assert_close(got, torch.cat(parts))
    # And the truncation bootstrap is applied where the truncations are: fragment 2, step 11, env 1.
    obs, *_, adv, ret = _targets(learner.model, [frags[2]], cfg, torch.device("cpu"))
    with torch.no_grad():
        v_final = float(learner.model.value(torch.full((4,), 0.3)))
        v_here = float(learner.model.value(torch.from_numpy(frags[2].obs[11, 1])))
    assert float(adv.reshape(40, 3)[11, 1]) == pytest.approx(frags[2].rewards[11, 1] + cfg.gamma * v_final - v_here,
                                                              abs=1e-5)


def test_target_kl_stops_the_epochs_early() -> None:
    """With a huge learning rate the policy leaves the proximal policy fast: target_kl cuts the update
    short (but never before the first step); without it every epoch runs."""
    base = {"epochs": 10, "minibatches": 4, "learning_rate": 0.05, "seed": 3}
    frags = _fragments(Learner(SPEC, TrainerSettings(**base)), 2)
    free = Learner(SPEC, TrainerSettings(**base)).update(frags)
    capped = Learner(SPEC, TrainerSettings(**base, target_kl=0.01)).update(frags)
    assert (free.sgd_steps, free.stopped_early) == (40, False)
    assert capped.stopped_early and 1 <= capped.sgd_steps < 40
    assert capped.approx_kl <= free.approx_kl


def test_target_kl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="target_kl"):
        TrainerSettings(target_kl=0)


def test_learning_rate_anneals_with_trained_steps_and_survives_a_restore() -> None:
    cfg = TrainerSettings(learning_rate=1e-3, learning_rate_end=1e-4, anneal_env_steps=1000)
    learner = Learner(SPEC, cfg)
    assert learner.learning_rate() == pytest.approx(1e-3)
    frags = _fragments(learner, 1, steps=50, envs=5)  # 250 env steps per update
    learner.update(frags)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the first update used the start rate
    assert learner.learning_rate() == pytest.approx(1e-3 - 0.25 * 9e-4)
    # A restored learner continues the schedule from its counters, not from the optimizer's saved rate.
    restored = Learner(SPEC, cfg)
    restored.restore(learner.state_bytes({}))
    assert restored.learning_rate() == pytest.approx(learner.learning_rate())
    for _ in range(5):
        learner.update(frags)
    assert learner.learning_rate() == pytest.approx(1e-4)  # held at the end rate past anneal_env_steps
    # An operator raises the held rate at runtime (trainer.learning_rate_end is a runtime key): it applies.
    learner.set_runtime(cfg.model_copy(update={"learning_rate_end": 5e-4}))
    assert learner.learning_rate() == pytest.approx(5e-4)
    assert Learner(SPEC, TrainerSettings(learning_rate=3e-4)).learning_rate() == 3e-4  # no schedule: constant


def test_clip_range_anneals_on_the_learning_rate_schedule() -> None:
    cfg = TrainerSettings(clip_coef=0.2, clip_coef_end=0.02, anneal_env_steps=1000)
    learner = Learner(SPEC, cfg)
    frags = _fragments(learner, 1, steps=50, envs=5)  # 250 env steps per update
    learner.update(frags)
    assert learner.update_cfg.clip_coef == pytest.approx(0.2)  # the first update used the start range
    assert learner.clip_coef() == pytest.approx(0.2 - 0.25 * 0.18)
    learner.update(frags)
    assert learner.update_cfg.clip_coef == pytest.approx(0.2 - 0.25 * 0.18)  # what the update clipped with
    restored = Learner(SPEC, cfg)
    restored.restore(learner.state_bytes({}))
    assert restored.clip_coef() == pytest.approx(learner.clip_coef())  # from the checkpointed counters
    for _ in range(4):
        learner.update(frags)
    assert learner.clip_coef() == pytest.approx(0.02)  # held past anneal_env_steps
    learner.set_runtime(cfg.model_copy(update={"clip_coef_end": 0.1}))  # a runtime key
    assert learner.clip_coef() == pytest.approx(0.1)
    assert Learner(SPEC, TrainerSettings(clip_coef=0.3)).clip_coef() == 0.3  # no schedule: constant
    with pytest.raises(ValueError, match="clip_coef_end"):
        TrainerSettings(clip_coef_end=0)


def test_non_finite_loss_skips_the_step_and_keeps_the_weights() -> None:
    # A fragment that slipped past validation with absurd rewards: the loss overflows to inf.
    learner = Learner(SPEC, TrainerSettings(epochs=2, minibatches=2))
    frags = _fragments(learner, 2)
    frags[0].rewards[:] = 1e30
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = learner.update(frags)
    assert stats.skipped_steps == 4 and stats.sgd_steps == 0
    for k, v in learner.model.state_dict().items():
        assert torch.isfinite(v).all() and torch.equal(v, before[k]), k
    # Good data afterwards trains normally.
    stats = learner.update(_fragments(learner, 2))
    assert stats.skipped_steps == 0 and stats.sgd_steps == 4
