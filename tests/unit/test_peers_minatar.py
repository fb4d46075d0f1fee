"""The MinAtar peers figure's pure parts: configs/minatar-breakout.yaml translated into SB3 PPO arguments, the
SB3 features extractor against Flywheel's own CNN (same layers, same outputs for the same frames), and the
cut of a run's episodes at the wall budget."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("stable_baselines3")

from stable_baselines3.common.policies import ActorCriticCnnPolicy  # noqa: E402

from bench.figures.peers_minatar import BudgetRun, fragments_within, last_n_at, summarise, verdict  # noqa: E402
from bench.peers import sb3_minatar, sb3_minatar_policy  # noqa: E402
from bench.samples import FragmentInfo
from shared.settings import load_settings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "minatar-breakout.yaml"


def test_kwargs_carry_the_configs_values() -> None:
    s = load_settings(str(CONFIG))
    tr, env = s.trainer, s.env
    n_envs, kw = sb3_minatar.minatar_kwargs(CONFIG)
    batch = tr.batch_fragments * env.fragment_steps * env.num_envs
    assert n_envs == 2 * env.num_envs == 32
    assert n_envs * kw["n_steps"] == batch == 2048  # one SB3 rollout = one Flywheel update's samples
    assert kw["batch_size"] == batch // tr.minibatches == 256
    assert kw["n_epochs"] == tr.epochs == 4
    for progress in (1.0, 0.5, 0.0):  # no anneal in the config: constant over the whole budget
        assert kw["learning_rate"](progress) == pytest.approx(tr.learning_rate) == 5e-4
        assert kw["clip_range"](progress) == pytest.approx(tr.clip_coef) == 0.2
    assert (kw["gamma"], kw["gae_lambda"], kw["ent_coef"]) == (tr.gamma, tr.gae_lambda, tr.ent_coef)
    assert kw["vf_coef"] == pytest.approx(tr.vf_coef / 2)  # SB3's MSE against Flywheel's 0.5 x MSE
    assert kw["max_grad_norm"] == tr.max_grad_norm and kw["normalize_advantage"] is tr.normalize_advantages
    assert kw["target_kl"] is None and tr.target_kl is None
    pk = kw["policy_kwargs"]
    assert pk["features_extractor_class"] is sb3_minatar_policy.MinAtarCNN and pk["net_arch"] == []
    assert pk["share_features_extractor"] is True and pk["normalize_images"] is True


def test_kwargs_refuse_what_sb3_cannot_express(tmp_path: Path) -> None:
    data = yaml.safe_load(CONFIG.read_text())
    data["env"]["frame_stack"] = 2
    data["trainer"]["separate_grad_clip"] = True
    data["trainer"]["guard"] = {"enabled": True}
    bad = tmp_path / "stacked.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"env.frame_stack.*trainer.separate_grad_clip.*trainer.guard.enabled"):
        sb3_minatar.minatar_kwargs(bad)


def _sb3_policy() -> ActorCriticCnnPolicy:
    import gymnasium as gym

    _, kw = sb3_minatar.minatar_kwargs(CONFIG)
    space = gym.spaces.Box(0, 255, (4, 10, 10), np.uint8)  # after SB3's VecTransposeImage
    return ActorCriticCnnPolicy(space, gym.spaces.Discrete(3), lambda _: 5e-4, **kw["policy_kwargs"])


def test_sb3_network_is_flywheels_minatar_cnn() -> None:
    from shared.rl.model import ImageActorCritic

    fw = ImageActorCritic((10, 10, 4), 3, "minatar_cnn")
    sb = _sb3_policy()
    extractor = sb.features_extractor
    assert isinstance(extractor, sb3_minatar_policy.MinAtarCNN)
    fw_shapes = [tuple(p.shape) for p in [*fw.torso.parameters(), *fw.actor.parameters(), *fw.critic.parameters()]]
    sb_shapes = [tuple(p.shape) for m in (extractor, sb.action_net, sb.value_net)
                 for p in m.parameters()]
    assert sb_shapes == fw_shapes == [(16, 4, 3, 3), (16,), (128, 1024), (128,), (3, 128), (3,), (1, 128), (1,)]
    assert sum(p.numel() for p in sb.parameters()) == sum(p.numel() for p in fw.parameters()) == 132_308

    # Same weights, same frames as the samplers send them (uint8 0/255, channels last): same logits and value.
    # SB3 gets them transposed to channels first and divides by 255 itself (normalize_images), as Flywheel does.
    with torch.no_grad():
        for dst, src in ((extractor.torso, fw.torso), (sb.action_net, fw.actor), (sb.value_net, fw.critic)):
            dst.load_state_dict(src.state_dict())
        rng = np.random.default_rng(0)
        frames = (rng.random((5, 10, 10, 4)) < 0.3).astype(np.uint8) * 255
        fw_logp = fw.log_probs(torch.as_tensor(frames))
        fw_value = fw.value(torch.as_tensor(frames))
        obs = torch.as_tensor(frames.transpose(0, 3, 1, 2).copy()).float()
        dist = sb.get_distribution(obs).distribution
        assert isinstance(dist, torch.distributions.Categorical)
        sb_logp = torch.log_softmax(dist.logits, -1)
        sb_value = sb.predict_values(obs).squeeze(-1)
    assert torch.allclose(sb_logp, fw_logp, atol=1e-6) and torch.allclose(sb_value, fw_value, atol=1e-6)


def test_frames_reach_sb3_as_the_samplers_send_them() -> None:
    pytest.importorskip("minatar")
    import gymnasium as gym

    from shared.rl.envs import register_image_envs

    register_image_envs("MinAtar/Breakout-v1")
    env = sb3_minatar.Uint8Frames(gym.make("MinAtar/Breakout-v1"))
    obs, _ = env.reset(seed=1)
    assert obs.dtype == np.uint8 and obs.shape == (10, 10, 4) and set(np.unique(obs)) <= {0, 255}
    assert env.observation_space == gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)
    env.close()


def test_return_at_budget_counts_only_episodes_finished_by_then() -> None:
    curve = [(float(t), 10 * t, float(t)) for t in range(1, 201)]  # episode t ends at t s with return t
    assert last_n_at(curve, 150.0) == pytest.approx(sum(range(51, 151)) / 100)  # the last 100 by 150 s
    assert last_n_at(curve, 150.5) == last_n_at(curve, 150.0)  # nothing finished in between
    assert last_n_at(curve, 10.0) == pytest.approx(5.5)  # fewer than 100: what there is
    assert last_n_at(curve, 200.0, n=2) == pytest.approx(199.5)
    assert math.isnan(last_n_at(curve, 0.5))


def test_flywheel_fragments_are_cut_at_the_budget() -> None:
    def frag(t: float, steps: int, *returns: float) -> FragmentInfo:
        return FragmentInfo(1000.0 + t, steps, returns, "s0", 0)

    frags = [frag(0.0, 1024, 1.0), frag(5.0, 1024, 2.0, 3.0), frag(10.0, 1024, 9.0), frag(10.5, 1024, 50.0)]
    curve, steps = fragments_within(frags, 10.0)
    assert [r for _, _, r in curve] == [1.0, 2.0, 3.0, 9.0] and steps == 3 * 1024
    assert last_n_at(curve, 10.0) == pytest.approx(15.0 / 4)
    assert fragments_within([], 10.0) == ([], 0)


def test_verdict_compares_medians_and_a_failed_flywheel_run_misses() -> None:
    def run(peer: str, seed: int, ret: float | None) -> BudgetRun:
        if ret is None:
            return BudgetRun(peer, seed, 10.0, 5.0, None, (), "boom")
        return BudgetRun(peer, seed, 10.0, 5.0, 1000, ((9.0, 900, ret),))

    fw = [run("Flywheel", 1, 6.0), run("Flywheel", 2, 4.0)]
    assert verdict(fw, [run("SB3 PPO", 1, 5.0), run("SB3 PPO", 2, 5.0)]) is True  # 5.0 >= 5.0
    assert verdict(fw, [run("SB3 PPO", 1, 5.0), run("SB3 PPO", 2, 5.2)]) is False
    assert verdict([run("Flywheel", 1, 9.0), run("Flywheel", 2, None)], [run("SB3 PPO", 1, 1.0)]) is False
    assert verdict(fw, [run("SB3 PPO", 1, None)]) is None
    st = summarise([*fw, run("Flywheel", 3, None)])
    assert st["last100_at_budget"].n == 2 and st["last100_at_budget"].median == pytest.approx(5.0)



def test_one_gradient_equals_sb3_ppo_on_the_same_data_and_weights() -> None:
    """The peer comparison's premise: given the same fragments and weights, Flywheel's update and SB3 PPO's
    ``train()`` compute the same gradient (full batch, one epoch, clipping off so the raw gradients show): the
    same GAE and bootstraps, advantage normalisation, clipped surrogate, entropy bonus and value-loss scale."""
    pytest.importorskip("minatar")
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import configure

    from bench.inproc import _worker
    from services.trainer.learner import Learner
    from shared.rl.envs import fragment_spec, register_image_envs

    torch.manual_seed(0)
    s = load_settings(str(CONFIG), environ={})
    tr = s.trainer.model_copy(update={"epochs": 1, "minibatches": 1, "device": "cpu", "max_grad_norm": 1e9})
    learner = Learner(fragment_spec(s.env.id, s.kafka.max_message_bytes), tr)
    workers = [_worker(s, i, 7 + i) for i in range(2)]
    try:
        for w in workers:
            w.set_policy(0, learner.weights())
            w.collect()  # a fragment in: episodes end inside the batch, some envs mid-episode at its start
        frags = [w.collect() for w in workers]
    finally:
        for w in workers:
            w.close()
    steps = frags[0].rewards.shape[0]
    assert sum(int(f.terminated.sum()) for f in frags) > 0
    register_image_envs(s.env.id)
    n_envs, kw = sb3_minatar.minatar_kwargs(CONFIG)
    kw.update(n_steps=steps, batch_size=steps * n_envs, n_epochs=1, max_grad_norm=1e9)
    env = make_vec_env(s.env.id, n_envs=n_envs, seed=0, wrapper_class=sb3_minatar.Uint8Frames)
    model = PPO("CnnPolicy", env, device="cpu", verbose=0, **kw)
    env.close()
    names = {"features_extractor.torso.0.weight": "torso.0.weight", "features_extractor.torso.0.bias": "torso.0.bias",
             "features_extractor.torso.3.weight": "torso.3.weight", "features_extractor.torso.3.bias": "torso.3.bias",
             "action_net.weight": "actor.weight", "action_net.bias": "actor.bias",
             "value_net.weight": "critic.weight", "value_net.bias": "critic.bias"}
    ours = learner.model.state_dict()
    theirs = model.policy.state_dict()
    assert {k for k in theirs if not k.startswith(("pi_features", "vf_features"))} == set(names)

    def our_name(key: str) -> str:  # SB3 also lists the shared extractor as pi_/vf_features_extractor
        for alias in ("pi_features_extractor.", "vf_features_extractor."):
            if key.startswith(alias):
                key = "features_extractor." + key[len(alias):]
        return names[key]

    model.policy.load_state_dict({k: ours[our_name(k)].clone() for k in theirs})
    # SB3's buffer from the same steps: both fragments' envs side by side, frames channels first.
    buf = model.rollout_buffer
    obs = np.concatenate([f.obs for f in frags], axis=1).transpose(0, 1, 4, 2, 3)
    actions = np.concatenate([f.actions for f in frags], axis=1)
    logp = np.concatenate([f.logp for f in frags], axis=1)
    rewards = np.concatenate([f.rewards for f in frags], axis=1).astype(np.float32)
    done = np.concatenate([f.terminated | f.truncated for f in frags], axis=1).astype(np.float32)
    last = np.concatenate([f.last_obs for f in frags]).transpose(0, 3, 1, 2)
    with torch.no_grad():
        for t in range(steps):
            values = model.policy.predict_values(torch.as_tensor(obs[t])).flatten()
            starts = done[t - 1] if t else np.zeros(n_envs, np.float32)
            buf.add(obs[t], actions[t][:, None], rewards[t], starts, values, torch.as_tensor(logp[t]))
        buf.compute_returns_and_advantage(model.policy.predict_values(torch.as_tensor(last)).flatten(), done[-1])

    def capture(optimizer: torch.optim.Optimizer, into: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
                ) -> None:
        step = optimizer.step

        def grab() -> None:
            into.update({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
            step()
        optimizer.step = grab  # type: ignore[method-assign,assignment]

    ours_g: dict[str, torch.Tensor] = {}
    theirs_g: dict[str, torch.Tensor] = {}
    capture(learner.optimizer, ours_g, dict(learner.model.named_parameters()))
    capture(model.policy.optimizer, theirs_g, {names[n]: p for n, p in model.policy.named_parameters() if n in names})
    learner.update(frags)
    model.set_logger(configure(None, []))
    model._current_progress_remaining = 1.0
    model.train()
    assert set(ours_g) == set(theirs_g) == set(names.values())
    for n in ours_g:
        torch.testing.assert_close(ours_g[n], theirs_g[n], rtol=1e-3, atol=1e-6, msg=n)
