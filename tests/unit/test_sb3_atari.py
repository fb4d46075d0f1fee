"""The SB3 Pong throughput side's pure parts: configs/pong.yaml translated into SB3 PPO arguments, SB3's callback
hooks cut into updates, a child's output read into a series; and (with stable-baselines3 / ale-py) the network
against Flywheel's own and the env against Flywheel's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from bench.peers import sb3_atari
from bench.peers.proc import ProcResult
from bench.peers.throughput import UpdateClock
from shared.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pong.yaml"


def test_kwargs_carry_the_configs_values() -> None:
    s = load_settings(str(CONFIG))
    tr, env = s.trainer, s.env
    n_envs, stack, kw = sb3_atari.atari_kwargs(CONFIG, with_policy=False)
    batch = tr.batch_fragments * env.fragment_steps * env.num_envs
    assert n_envs == 2 * env.num_envs == 8 and stack == env.frame_stack == 4
    assert n_envs * kw["n_steps"] == batch == 1024 and kw["n_steps"] == 128  # one SB3 rollout = one update
    assert kw["batch_size"] == batch // tr.minibatches == 256
    assert kw["n_epochs"] == tr.epochs == 4
    budget = sb3_atari.BUDGET_STEPS
    for steps, lr, clip in ((0, 2.5e-4, 0.1), (5_000_000, (2.5e-4 + 2.5e-6) / 2, (0.1 + 0.001) / 2),
                            (10_000_000, 2.5e-6, 0.001), (30_000_000, 2.5e-6, 0.001)):  # annealed, then held
        progress = 1.0 - steps / budget
        assert kw["learning_rate"](progress) == pytest.approx(lr)
        assert kw["clip_range"](progress) == pytest.approx(clip)
    assert (kw["gamma"], kw["gae_lambda"], kw["ent_coef"]) == (tr.gamma, tr.gae_lambda, tr.ent_coef) == (0.99, 0.95,
                                                                                                         0.01)
    assert kw["vf_coef"] == pytest.approx(tr.vf_coef / 2) == 0.25  # SB3's MSE against Flywheel's 0.5 x MSE
    assert kw["max_grad_norm"] == tr.max_grad_norm == 0.5 and kw["normalize_advantage"] is tr.normalize_advantages
    assert kw["target_kl"] is None and tr.target_kl is None
    assert kw["policy_kwargs"] == {}


def test_kwargs_refuse_what_sb3_cannot_express(tmp_path: Path) -> None:
    data = yaml.safe_load(CONFIG.read_text())
    data["trainer"]["separate_grad_clip"] = True
    data["trainer"]["guard"] = {"enabled": True}
    bad = tmp_path / "guarded.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"trainer.separate_grad_clip.*trainer.guard.enabled"):
        sb3_atari.atari_kwargs(bad, with_policy=False)
    data = yaml.safe_load(CONFIG.read_text())
    data["trainer"]["model"] = "minatar_cnn"
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="Nature CNN only"):
        sb3_atari.atari_kwargs(other, with_policy=False)


def test_update_clock_reports_each_update_once_after_its_training() -> None:
    clock = UpdateClock()
    assert clock.rollout_start(0.0) is None  # nothing trained yet
    clock.rollout_end(2.0, 1024)
    first = clock.rollout_start(3.5)  # train() of the first rollout took 1.5 s
    assert first == {"event": "progress", "t": 3.5, "trained": 1024, "rollout_s": 2.0, "train_s": 1.5}
    clock.rollout_end(5.0, 2048)
    assert clock.learn_end(6.0) == {"event": "progress", "t": 6.0, "trained": 2048, "rollout_s": 1.5, "train_s": 1.0}
    assert clock.learn_end(7.0) is None  # reported once

    cut = UpdateClock()
    cut.rollout_start(0.0)
    cut.rollout_end(2.0, 1024)
    cut.rollout_start(3.0)  # the second rollout is cut by the budget: no rollout_end, no train()
    assert cut.learn_end(4.0) is None
    with pytest.raises(ValueError, match="never started"):
        UpdateClock().rollout_end(1.0, 8)


def _result(*lines: str, wall_start: float = 1000.0, rc: int | None = 0) -> ProcResult:
    return ProcResult(lines=[(0.1 * i, line) for i, line in enumerate(lines)], rc=rc, wall_start=wall_start)


def test_child_output_becomes_a_series_of_trained_steps() -> None:
    res = _result("loading...", '{"event": "learn_start", "wall": 1004.5}',
                  '{"event": "progress", "t": 3.5, "trained": 1024, "rollout_s": 2.0, "train_s": 1.5}',
                  "a warning line",
                  '{"event": "progress", "t": 6.0, "trained": 2048, "rollout_s": 1.5, "train_s": 1.0}',
                  '{"event": "done", "trained": 2048, "cores_learning": 1.9, "torch_default_threads": 2}')
    run = sb3_atari.run_of(3, res, 1.7, 2)
    assert run.error is None and run.peer == "SB3 PPO" and run.seed == 3
    assert run.startup_s == pytest.approx(4.5)
    assert run.series == ((0.0, 0), (3.5, 1024), (6.0, 2048))
    assert run.extra["cores"] == 1.7 and run.extra["torch_threads"] == 2 and run.extra["updates"] == 2
    assert run.extra["rollout_s_mean"] == pytest.approx(1.75) and run.extra["train_s_mean"] == pytest.approx(1.25)
    assert run.extra["cores_learning"] == 1.9 and run.extra["torch_default_threads"] == 2


def test_child_output_without_done_or_with_a_falling_count_is_an_error() -> None:
    died = sb3_atari.run_of(1, _result('{"event": "learn_start", "wall": 1003.0}', "Traceback ...", rc=1), 0.5, 2)
    assert died.error is not None and "exit 1" in died.error and "Traceback" in died.error
    assert died.startup_s == pytest.approx(3.0) and died.series == ((0.0, 0),)
    fell = sb3_atari.run_of(1, _result('{"event": "progress", "t": 1.0, "trained": 2048, "rollout_s": 1, "train_s": 1}',
                                       '{"event": "progress", "t": 2.0, "trained": 1024, "rollout_s": 1, "train_s": 1}',
                                       '{"event": "done"}'), None, 2)
    assert fell.error is not None and "fell" in fell.error and fell.series == ()


def _sb3_policy() -> object:
    pytest.importorskip("stable_baselines3")
    import gymnasium as gym
    from stable_baselines3.common.policies import ActorCriticCnnPolicy

    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)  # after VecFrameStack(4) and VecTransposeImage
    return ActorCriticCnnPolicy(space, gym.spaces.Discrete(6), lambda _: 2.5e-4, **sb3_atari.policy_kwargs())


def test_sb3_network_is_flywheels_nature_cnn() -> None:
    sb = _sb3_policy()
    import gymnasium as gym
    from stable_baselines3.common.policies import ActorCriticCnnPolicy

    from bench.peers.sb3_minatar_policy import FlywheelTorso
    from shared.rl.model import ImageActorCritic, make_torso

    assert isinstance(sb, ActorCriticCnnPolicy)
    extractor = sb.features_extractor
    assert isinstance(extractor, FlywheelTorso) and extractor.kind == "nature_cnn"
    torso, width = make_torso("nature_cnn", 4, 84, 84)
    assert extractor.features_dim == width == 512
    assert sum(p.numel() for p in extractor.parameters()) == sum(p.numel() for p in torso.parameters()) == 1_684_128
    fw = ImageActorCritic((84, 84), 6, "nature_cnn", frame_stack=4)  # Flywheel's Pong model
    assert sum(p.numel() for p in sb.parameters()) == sum(p.numel() for p in fw.parameters())
    torch.manual_seed(5)  # the same initialisation too (orthogonal, gain sqrt 2): same draws, same weights
    seeded = FlywheelTorso(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8))
    torch.manual_seed(5)
    reference, _ = make_torso("nature_cnn", 4, 84, 84)
    pairs = list(zip(seeded.torso.state_dict().values(), reference.state_dict().values(), strict=True))
    assert len(pairs) == 8 and all(torch.equal(a, b) for a, b in pairs)

    # Same weights, same stacked frames (uint8 0-255, oldest first): same logits and value. SB3 divides by 255
    # itself (normalize_images), as Flywheel's model does.
    with torch.no_grad():
        for dst, src in ((extractor.torso, fw.torso), (sb.action_net, fw.actor), (sb.value_net, fw.critic)):
            dst.load_state_dict(src.state_dict())
        frames = np.random.default_rng(0).integers(0, 256, (3, 4, 84, 84), dtype=np.uint8)
        fw_logp = fw.log_probs(torch.as_tensor(frames))
        fw_value = fw.value(torch.as_tensor(frames))
        obs = torch.as_tensor(frames)
        dist = sb.get_distribution(obs).distribution
        assert isinstance(dist, torch.distributions.Categorical)
        sb_logp = torch.log_softmax(dist.logits, -1)
        sb_value = sb.predict_values(obs).squeeze(-1)
    assert torch.allclose(sb_logp, fw_logp, atol=1e-5) and torch.allclose(sb_value, fw_value, atol=1e-5)


def test_sb3_envs_give_flywheels_frames() -> None:
    pytest.importorskip("stable_baselines3")
    pytest.importorskip("ale_py")
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecFrameStack

    from shared.rl.envs import make_vector_env

    kwargs, wrap = sb3_atari.make_env_fn("ALE/Pong-v5")
    sb = VecFrameStack(make_vec_env("ALE/Pong-v5", n_envs=2, seed=7, env_kwargs=kwargs, wrapper_class=wrap), 4)
    fw = make_vector_env("ALE/Pong-v5", 2)
    try:
        stacked = sb.reset()
        assert isinstance(stacked, np.ndarray)
        frames, _ = fw.reset(seed=7)  # env i seeded 7 + i on both sides: the same no-ops, the same frames
        assert stacked.shape == (2, 84, 84, 4) and stacked.dtype == np.uint8
        assert not stacked[..., :3].any()  # zeros before the episode's first frame, as shared.rl.frames stacks
        assert np.array_equal(stacked[..., -1], frames) and frames.any()
        actions = np.array([2, 3])
        stepped, *_ = sb.step(actions)
        frames, *_ = fw.step(actions)
        assert isinstance(stepped, np.ndarray) and np.array_equal(stepped[..., -1], frames)
    finally:
        sb.close()
        fw.close()
