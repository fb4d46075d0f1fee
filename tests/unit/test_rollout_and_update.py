"""The sampler's rollout and the trainer's update as pure code (no Kafka)."""

import numpy as np
import pytest
import torch

from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
from shared.fragment import decode_fragment, encode_fragment
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.rl.policy_np import WeightsError
from shared.settings import TrainerSettings

SPEC = fragment_spec("CartPole-v1", 1 << 22)


def test_rollout_makes_valid_fragments_with_episode_bookkeeping() -> None:
    learner = Learner(SPEC, TrainerSettings())
    w = RolloutWorker("CartPole-v1", num_envs=4, fragment_steps=60, sampler_id="s", arch=PolicyArch(hidden=64), seed=3)
    with pytest.raises(RuntimeError, match="no policy"):
        w.collect()
    w.set_policy(7, learner.weights())
    frag = w.collect()
    back = decode_fragment(*encode_fragment(frag), SPEC)  # passes full validation
    assert back.policy_version == 7 and back.obs.shape == (60, 4, 4)
    # A random CartPole policy ends episodes within 60 steps: returns are recorded and equal lengths.
    assert len(frag.episode_returns) == int((frag.terminated | frag.truncated).sum()) > 0
    np.testing.assert_allclose(frag.episode_returns, frag.episode_lengths)
    # Behaviour log-probs are those of the policy that acted.
    dist = learner.model.dist(torch.from_numpy(frag.obs))
    np.testing.assert_allclose(dist.log_prob(torch.from_numpy(frag.actions)).detach().numpy(), frag.logp, atol=1e-5)


def test_policy_with_wrong_shape_is_refused() -> None:
    w = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=4, sampler_id="s", arch=PolicyArch(hidden=32), seed=0)
    with pytest.raises(WeightsError, match="shape"):
        w.set_policy(1, Learner(SPEC, TrainerSettings(hidden=64)).weights())


def test_truncation_bootstraps_from_final_observation() -> None:
    w = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=5, sampler_id="s", arch=PolicyArch(hidden=64), seed=0)
    learner = Learner(SPEC, TrainerSettings())
    w.set_policy(0, learner.weights())
    frag = w.collect()
    frag.truncated[:] = 0
    frag.terminated[:] = 0
    frag.truncated[4, 0] = 1
    frag.trunc_obs = np.ones((1, 4), np.float32)
    from services.trainer.update import _targets

    cfg = learner.update_cfg
    *_, adv, ret = _targets(learner.model, [frag], cfg, torch.device("cpu"))
    with torch.no_grad():
        v_final = float(learner.model.value(torch.ones(4)))
        v_last = float(learner.model.value(torch.from_numpy(frag.obs[4, 0])))
    # Step 4 of env 0 is the last of its episode: target = r + gamma * V(final obs).
    assert float(ret.reshape(5, 2)[4, 0]) == pytest.approx(frag.rewards[4, 0] + cfg.gamma * v_final, abs=1e-5)
    assert float(adv.reshape(5, 2)[4, 0]) == pytest.approx(frag.rewards[4, 0] + cfg.gamma * v_final - v_last, abs=1e-5)


def test_update_improves_the_policy_on_cartpole() -> None:
    """A few in-process updates raise the mean return well above a random policy's (~22)."""
    cfg = TrainerSettings(epochs=20, minibatches=1, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, seed=1)
    learner = Learner(SPEC, cfg)
    w = RolloutWorker("CartPole-v1", num_envs=8, fragment_steps=32, sampler_id="s", arch=PolicyArch(hidden=64), seed=1)
    returns: list[float] = []
    for version in range(60):
        w.set_policy(version, learner.weights())
        frag = w.collect()
        returns.extend(frag.episode_returns.tolist())
        stats = learner.update([frag])
        assert np.isfinite(stats.policy_loss) and stats.env_steps == 256
    assert learner.counters.updates == 60
    assert np.mean(returns[-20:]) > 60, returns[-20:]


def test_checkpoint_round_trip_restores_everything() -> None:
    a = Learner(SPEC, TrainerSettings(seed=5))
    w = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=16, sampler_id="s", arch=PolicyArch(hidden=64), seed=0)
    w.set_policy(0, a.weights())
    frag = w.collect()
    a.update([frag])
    a.counters.policy_version = 4
    a.counters.recent_returns.extend([1.0, 2.0])
    blob = a.state_bytes({"r.samples:0": 17})
    b = Learner(SPEC, TrainerSettings(seed=99))
    assert b.restore(blob) == {"r.samples:0": 17}
    assert b.weights() == a.weights()
    assert (b.counters.updates, b.counters.policy_version, list(b.counters.recent_returns)) == (1, 4, [1.0, 2.0])
    # The optimizer state came back too: the next identical update gives identical weights.
    a.update([frag])
    b.update([frag])
    assert a.weights() == b.weights()
