"""Continuous actions (Pendulum-v1), observation normalisation and reward scaling (pure code, no Kafka)."""

import io
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load as np_load

import services.sampler.rollout as rollout_mod
from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner, ReturnScaler
from shared.fragment import Fragment, decode_fragment, encode_fragment
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.rl.model import ActorCritic, load_weights
from shared.rl.policy_np import expected_shapes
from shared.settings import TrainerSettings

PENDULUM = fragment_spec("Pendulum-v1", 1 << 22)
CARTPOLE = fragment_spec("CartPole-v1", 1 << 22)
NORMED = TrainerSettings(normalize_observations=True, normalize_rewards=True, gamma=0.9, epochs=2, minibatches=4,
                         log_std_init=1.0)


def _worker(learner: Learner, seed: int = 0, steps: int = 50, **arch: object) -> RolloutWorker:
    shape = PolicyArch(hidden=64, normalize_observations=learner.cfg.normalize_observations, **arch)  # type: ignore[arg-type]
    w = RolloutWorker("Pendulum-v1", num_envs=3, fragment_steps=steps, sampler_id="s", arch=shape, seed=seed)
    w.set_policy(0, learner.weights())
    return w


def test_pendulum_rollout_steps_clipped_actions_and_keeps_the_unclipped_samples(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    learner = Learner(PENDULUM, NORMED)  # log_std 1: std e, so many samples fall outside [-2, 2]
    w = _worker(learner)
    stepped: list[np.ndarray] = []
    real_step = w.envs.step
    monkeypatch.setattr(w.envs, "step", lambda a: (stepped.append(np.array(a)), real_step(a))[1])
    frag = w.collect()
    w.close()
    back = decode_fragment(*encode_fragment(frag), PENDULUM)  # passes validation, schema 2
    assert back.actions.dtype == np.float32 and back.actions.shape == (50, 3, 1)
    assert np.abs(frag.actions).max() > 2.0  # unclipped in the fragment ...
    np.testing.assert_array_equal(np.stack(stepped), np.clip(frag.actions, -2.0, 2.0))  # ... clipped in the env
    with torch.no_grad():
        logp, _ = learner.model.logp_entropy(torch.from_numpy(frag.obs), torch.from_numpy(frag.actions))
    np.testing.assert_allclose(logp.numpy(), frag.logp, atol=1e-5)  # the log-density of the unclipped sample


def test_continuous_update_trains_log_std_and_is_finite() -> None:
    learner = Learner(PENDULUM, NORMED)
    assert learner.model.log_std is not None and float(learner.model.log_std.detach()[0]) == 1.0
    assert any(p is learner.model.log_std for p in learner.model.actor_parameters())  # clipped with the actor
    assert all(p is not learner.model.log_std for p in learner.model.critic_parameters())
    w = _worker(learner)
    stats = learner.update([w.collect(), w.collect()])
    w.close()
    assert stats.env_steps == 300 and stats.sgd_steps == 8 and np.isfinite(stats.policy_loss)
    assert float(learner.model.log_std.detach()[0]) != 1.0


def test_gsde_update_trains_the_noise_matrix_from_the_samplers_fragments() -> None:
    cfg = NORMED.model_copy(update={"gsde": True, "log_std_init": -1.0})
    learner = Learner(PENDULUM, cfg)
    log_std = learner.model.log_std
    assert log_std is not None and tuple(log_std.shape) == (64, 1)
    assert any(p is log_std for p in learner.model.actor_parameters())
    w = _worker(learner, gsde=True, sde_sample_freq=4)
    frags = [w.collect(), w.collect()]
    w.close()
    with torch.no_grad():
        logp, entropy = learner.model.logp_entropy(torch.from_numpy(frags[0].obs), torch.from_numpy(frags[0].actions))
    np.testing.assert_allclose(logp.numpy(), frags[0].logp, atol=1e-4)
    assert float(entropy.std()) > 0  # state-dependent spread
    before = log_std.detach().clone()
    stats = learner.update(frags)
    assert np.isfinite(stats.policy_loss) and not torch.equal(log_std.detach(), before)
    with pytest.raises(ValueError, match="trainer.gsde needs continuous actions; CartPole-v1"):
        Learner(CARTPOLE, TrainerSettings(gsde=True))
    # A checkpoint of the other kind does not fit: the trainer's restore refuses it (and with no usable
    # checkpoint the service refuses to start unless trainer.fresh_start).
    with pytest.raises(RuntimeError, match="size mismatch for log_std"):
        Learner(PENDULUM, NORMED).restore(learner.state_bytes({}))


def test_observation_statistics_are_updated_from_the_batch_and_published_with_the_weights() -> None:
    learner = Learner(PENDULUM, NORMED)
    norm = learner.model.obs_norm
    assert norm is not None
    w = _worker(learner)
    frags = [w.collect(), w.collect()]
    learner.update(frags)
    obs = np.concatenate([f.obs.reshape(-1, 3) for f in frags]).astype(np.float64)
    # Before this update's targets, the statistics took in the batch (the prior count is SB3's 1e-4).
    assert float(norm.count) == pytest.approx(300, abs=1e-3)
    np.testing.assert_allclose(norm.mean.numpy(), obs.mean(axis=0), atol=1e-4)
    np.testing.assert_allclose(norm.var.numpy(), obs.var(axis=0), rtol=1e-3)
    # The published blob carries them; a sampler adopting it normalises with exactly these numbers.
    blob = learner.weights()
    tensors = np_load(blob)
    np.testing.assert_array_equal(tensors["obs_norm.mean"], norm.mean.numpy())
    w.set_policy(1, blob)
    with torch.no_grad():
        want = learner.model.actor(norm(torch.from_numpy(frags[0].obs))).numpy()
    np.testing.assert_allclose(w.policy.logits(frags[0].obs), want, atol=1e-5)
    # A second batch folds in with the first (parallel update), not instead of it.
    learner.update([w.collect()])
    w.close()
    assert float(norm.count) == pytest.approx(450, abs=1e-3)
    # A checkpoint restores them (they are in the model's state_dict); so does loading the published blob.
    other = Learner(PENDULUM, NORMED)
    other.restore(learner.state_bytes({}))
    torch.testing.assert_close(other.model.obs_norm.mean, norm.mean)  # type: ignore[union-attr]
    fresh = ActorCritic.for_spec(PENDULUM, 64, normalize_observations=True)
    load_weights(fresh, blob)
    assert float(fresh.obs_norm.count) == pytest.approx(300, abs=1e-3)  # type: ignore[union-attr]


def test_without_normalisation_the_model_and_blob_are_as_before() -> None:
    learner = Learner(CARTPOLE, TrainerSettings())
    assert learner.model.obs_norm is None and learner.model.log_std is None and learner.return_scaler is None
    assert {k: v.shape for k, v in np_load(learner.weights()).items()} == expected_shapes(4, 2, 64)
    assert "reward_rms" not in torch.load(io.BytesIO(learner.state_bytes({})), weights_only=True)


def _frag(rewards: np.ndarray, done: np.ndarray) -> Fragment:
    t, n = rewards.shape
    return Fragment(obs=np.zeros((t, n, 3), np.float32), actions=np.zeros((t, n, 1), np.float32),
                    logp=np.zeros((t, n), np.float32), rewards=rewards.astype(np.float32),
                    terminated=done.astype(np.uint8), truncated=np.zeros((t, n), np.uint8),
                    trunc_obs=np.zeros((0, 3), np.float32), last_obs=np.zeros((n, 3), np.float32),
                    episode_returns=np.zeros(0, np.float32), episode_lengths=np.zeros(0, np.int32),
                    policy_version=0, sampler_id="s", env_id="Pendulum-v1")


def test_return_scaler_accumulates_per_fragment_and_resets_at_episode_ends() -> None:
    scaler = ReturnScaler(gamma=0.5)
    rewards = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    done = np.zeros((4, 2), bool)
    done[1, 0] = True  # env 0's episode ends at step 1: its return restarts at step 2
    f = _frag(rewards, done)
    np.testing.assert_allclose(scaler._discounted_returns(f), [[1, 2], [1.5, 3], [1, 3.5], [1.5, 3.75]])
    [scaled] = scaler.scale([f])
    returns = np.array([1, 2, 1.5, 3, 1, 3.5, 1.5, 3.75])
    # The first batch all but replaces the prior (count 1e-4): the std is that of these returns.
    assert scaler.var == pytest.approx(returns.var(), rel=1e-3) and scaler.count == pytest.approx(8, abs=1e-3)
    np.testing.assert_allclose(scaled.rewards, rewards / np.sqrt(returns.var() + 1e-8), rtol=1e-3)
    assert f.rewards[0, 0] == 1.0  # the input fragment is left as it was
    # Scaled rewards are clipped to +-10.
    [big] = scaler.scale([_frag(np.full((4, 2), 1e4), np.zeros((4, 2), bool))])
    assert big.rewards.max() <= ReturnScaler.CLIP


def test_reward_statistics_survive_a_checkpoint_and_old_checkpoints_still_restore() -> None:
    learner = Learner(PENDULUM, NORMED)
    w = _worker(learner)
    frag = w.collect()
    w.close()
    learner.update([frag])
    assert learner.return_scaler is not None and learner.return_scaler.count > 100
    restored = Learner(PENDULUM, NORMED)
    restored.restore(learner.state_bytes({"r.samples:0": 3}))
    assert restored.return_scaler is not None
    assert restored.return_scaler.state_dict() == learner.return_scaler.state_dict()
    # A checkpoint of a run without reward scaling (as every checkpoint before it) restores: fresh statistics.
    plain = Learner(PENDULUM, NORMED.model_copy(update={"normalize_rewards": False}))
    again = Learner(PENDULUM, NORMED)
    assert again.restore(plain.state_bytes({"r.samples:0": 9})) == {"r.samples:0": 9}
    assert again.return_scaler is not None and again.return_scaler.state_dict() == ReturnScaler(0.9).state_dict()


def test_per_fragment_latency_sleeps_one_draw_per_fragment(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    # rollout_mod.time is the time module itself: record this thread's sleeps only (a background thread left by
    # another test, sleeping in a loop, once added thousands of 1.0 s calls here and spun on the patched sleep).
    me, real_sleep = threading.current_thread(), time.sleep
    monkeypatch.setattr(rollout_mod.time, "sleep",
                        lambda s: sleeps.append(s) if threading.current_thread() is me else real_sleep(s))
    learner = Learner(CARTPOLE, TrainerSettings())
    w = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=8, sampler_id="s", arch=PolicyArch(hidden=64), seed=0,
                      fragment_latency_median_ms=30.0, fragment_latency_sigma=0.0)
    w.set_policy(0, learner.weights())
    for _ in range(3):
        w.collect()
    w.close()
    assert sleeps == pytest.approx([0.03] * 3)
    plain = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=8, sampler_id="s", arch=PolicyArch(hidden=64),
                          seed=0)
    plain.set_policy(0, learner.weights())
    plain.collect()
    plain.close()
    assert len(sleeps) == 3
