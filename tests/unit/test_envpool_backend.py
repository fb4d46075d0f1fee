"""``env.backend``: the rule that picks gymnasium or EnvPool (pure), EnvPool's options against the one Atari table,
and, where EnvPool and ale-py are both installed, Pong on both backends: the same frames and fragments, and the same
episode statistics under one fixed action sequence and seeds (docs/pixels.md "Env backend")."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from shared.rl.atari import ATARI, AtariPreprocessing
from shared.rl.envpool_env import BackendUnavailable, choose_backend, envpool_options, envpool_task
from shared.rl.envs import env_options
from shared.settings import ConfigError, load_settings

PONG = "ALE/Pong-v5"
BOTH = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None or importlib.util.find_spec("ale_py") is None,
    reason="needs envpool and ale-py to compare the backends: pip install -e '.[atari,envpool]'")


# ---- the rule ----------------------------------------------------------------------------------------------------

def _never() -> list[str]:
    raise AssertionError("EnvPool's task list must not be asked for here")


def test_auto_takes_envpool_only_where_installed_and_the_game_is_supported() -> None:
    assert choose_backend("auto", PONG, installed=True, supported=lambda: ["Pong-v5"]) == "envpool"
    assert choose_backend("auto", PONG, installed=False, supported=_never) == "gymnasium"
    assert choose_backend("auto", PONG, installed=True, supported=lambda: ["Breakout-v5"]) == "gymnasium"
    for other in ("CartPole-v1", "MinAtar/Breakout-v1", "HalfCheetah-v5", "ALE/Pong-v4"):
        assert choose_backend("auto", other, installed=True, supported=_never) == "gymnasium"
    assert choose_backend("gymnasium", PONG, installed=True, supported=_never) == "gymnasium"
    assert choose_backend("envpool", PONG, installed=True, supported=lambda: ["Pong-v5"]) == "envpool"


def test_an_explicit_envpool_that_cannot_be_honoured_names_the_field_and_why() -> None:
    with pytest.raises(BackendUnavailable, match=r"env.backend='envpool'.*not installed.*pip install"):
        choose_backend("envpool", PONG, installed=False, supported=_never)
    with pytest.raises(BackendUnavailable, match=r"env.backend='envpool'.*env.id='CartPole-v1' is not an ALE/"):
        choose_backend("envpool", "CartPole-v1", installed=True, supported=_never)
    with pytest.raises(BackendUnavailable, match=r"env.backend='envpool'.*EnvPool has no task 'Pong-v5'"):
        choose_backend("envpool", PONG, installed=True, supported=lambda: [])
    with pytest.raises(BackendUnavailable, match=r"env.backend='nope'"):
        choose_backend("nope", PONG, installed=True, supported=_never)


def test_envpool_task_ids() -> None:
    assert envpool_task("ALE/Pong-v5") == "Pong-v5" and envpool_task("ALE/Breakout-v5") == "Breakout-v5"
    assert envpool_task("Pong-v5") is None and envpool_task("ALE/Pong-v4") is None
    assert envpool_task("HalfCheetah-v5") is None


def test_the_setting() -> None:
    assert load_settings(environ={}).env.backend == "auto"
    assert load_settings(environ={"FLYWHEEL_ENV_BACKEND": "envpool"}).env.backend == "envpool"
    with pytest.raises(ConfigError, match="backend"):
        load_settings(environ={"FLYWHEEL_ENV_BACKEND": "sample-factory"})


def test_a_worker_with_an_explicit_envpool_it_cannot_use_fails_at_start_up() -> None:
    from services.sampler.rollout import RolloutWorker
    from shared.rl.arch import PolicyArch

    with pytest.raises(BackendUnavailable, match="env.backend='envpool'"):
        RolloutWorker("CartPole-v1", 2, 4, "s1", PolicyArch(), seed=0, backend="envpool")


# ---- one table, two backends' options ----------------------------------------------------------------------------

def test_envpools_options_follow_the_atari_table() -> None:
    o = envpool_options()
    assert o["stack_num"] == 1  # single frames: the sampler stacks them
    assert (o["img_height"], o["img_width"], o["gray_scale"]) == (ATARI.screen_size, ATARI.screen_size, True)
    assert (o["frame_skip"], o["noop_max"]) == (ATARI.frame_skip, ATARI.noop_max) == (4, 30)
    assert o["episodic_life"] is ATARI.terminal_on_life_loss is False
    assert o["reward_clip"] is ATARI.reward_clip is False
    assert o["repeat_action_probability"] == ATARI.repeat_action_probability == 0.0
    assert o["full_action_space"] is ATARI.full_action_space is False
    assert o["use_fire_reset"] is False and o["use_inter_area_resize"] is True
    assert o["max_episode_steps"] == 27_000
    other = envpool_options(dataclasses.replace(ATARI, repeat_action_probability=0.25, terminal_on_life_loss=True,
                                                reward_clip=True, frame_skip=5))
    assert (other["repeat_action_probability"], other["episodic_life"], other["reward_clip"]) == (0.25, True, True)
    assert other["frame_skip"] == 5 and other["max_episode_steps"] == 108_000 // 5
    kwargs, wrappers = env_options(PONG)
    assert kwargs["repeat_action_probability"] == o["repeat_action_probability"]
    assert kwargs["full_action_space"] is o["full_action_space"]
    assert kwargs["max_num_frames_per_episode"] == o["max_episode_steps"] * o["frame_skip"]
    assert len(wrappers) == 1 and isinstance(ATARI, AtariPreprocessing)


def test_the_benchmarks_envpool_settings_are_the_samplers_but_for_the_stack() -> None:
    """``bench/peers/envpool_raw.py`` keeps its own copy (its child runs in a venv without Flywheel): only its
    ``stack_num`` (the policy's 4 frames) may differ from the sampler's options."""
    from bench.peers.envpool_raw import SETTINGS

    assert {k: v for k, v in SETTINGS.items() if k != "stack_num"} == {
        k: v for k, v in envpool_options().items() if k != "stack_num"}


# ---- Pong on both backends ---------------------------------------------------------------------------------------

@BOTH
def test_frames_are_single_hw_uint8_and_identical_after_reset() -> None:
    from shared.rl.envs import fragment_spec, make_vector_env

    assert fragment_spec(PONG, 1 << 20, backend="envpool") == fragment_spec(PONG, 1 << 20, backend="gymnasium")
    gym_env, pool = make_vector_env(PONG, 3, backend="gymnasium"), make_vector_env(PONG, 3, backend="envpool")
    try:
        assert pool.single_observation_space == gym_env.single_observation_space
        assert pool.single_action_space == gym_env.single_action_space
        a, _ = gym_env.reset(seed=0)
        b, _ = pool.reset(seed=0)
        assert a.shape == b.shape == (3, 84, 84) and a.dtype == b.dtype == np.uint8
        # Pong's first frames are still: the same grayscale and INTER_AREA resize give the same pixels
        np.testing.assert_array_equal(a, b)
        actions = np.array([2, 3, 1])
        for _ in range(50):
            a = gym_env.step(actions)[0]
            b = pool.step(actions)[0]
        assert a.shape == b.shape and a.dtype == b.dtype and 0 <= b.min() and b.max() <= 255
    finally:
        gym_env.close()
        pool.close()


def _pong_worker(backend: str, num_envs: int, steps: int) -> object:
    import torch

    from services.sampler.rollout import RolloutWorker
    from shared.rl.arch import PolicyArch
    from shared.rl.model import ActorCritic, weights_to_bytes

    arch = PolicyArch("nature_cnn", 512)
    worker = RolloutWorker(PONG, num_envs, steps, "s1", arch, seed=3, backend=backend)
    torch.manual_seed(0)
    worker.set_policy(0, weights_to_bytes(ActorCritic.for_arch(worker.spec, arch)))
    return worker


@BOTH
def test_fragments_have_the_same_format_and_truncation_on_both_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.rl.envpool_env as ep

    frags = {}
    for backend in ("gymnasium", "envpool"):
        worker = _pong_worker(backend, 2, 8)
        assert worker.backend == backend  # type: ignore[attr-defined]
        frags[backend] = worker.collect()  # type: ignore[attr-defined]
        worker.close()  # type: ignore[attr-defined]
    g, e = frags["gymnasium"], frags["envpool"]
    for name in ("obs", "actions", "logp", "rewards", "terminated", "truncated", "last_obs", "obs_history"):
        assert getattr(g, name).shape == getattr(e, name).shape, name
        assert getattr(g, name).dtype == getattr(e, name).dtype, name
    assert e.obs.shape == (8, 2, 84, 84) and e.obs_history.shape == (3, 2, 84, 84)

    # truncation: EnvPool's episodes cut at 5 steps; the worker records them as gymnasium's truncations
    monkeypatch.setattr(ep, "envpool_options", lambda pre=ATARI: {**envpool_options(pre), "max_episode_steps": 5})
    worker = _pong_worker("envpool", 2, 12)
    frag = worker.collect()  # type: ignore[attr-defined]
    worker.close()  # type: ignore[attr-defined]
    assert frag.truncated[:, 0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]
    assert not frag.terminated.any() and (frag.truncated[:, 0] == frag.truncated[:, 1]).all()
    assert frag.trunc_obs.shape == (4, 84, 84) and frag.trunc_obs.dtype == np.uint8
    assert frag.episode_lengths.tolist() == [5, 5, 5, 5]
    np.testing.assert_array_equal(frag.obs[5], frag.obs[0])  # the step after a cut starts from a reset frame


def _episodes(backend: str, num_envs: int, episodes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns and lengths of the first ``episodes`` Pong episodes under uniformly random actions drawn from
    ``seed`` (the same action sequence on both backends), counted as the sampler counts them."""
    from shared.rl.envs import make_vector_env

    env = make_vector_env(PONG, num_envs, backend=backend)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    ret, length = np.zeros(num_envs), np.zeros(num_envs, np.int64)
    returns: list[float] = []
    lengths: list[int] = []
    try:
        while len(returns) < episodes:
            _, reward, term, trunc, _ = env.step(rng.integers(0, 6, num_envs))
            ret += reward
            length += 1
            for i in np.flatnonzero(term | trunc):
                returns.append(float(ret[i]))
                lengths.append(int(length[i]))
                ret[i], length[i] = 0.0, 0
    finally:
        env.close()
    return np.asarray(returns[:episodes]), np.asarray(lengths[:episodes])


@BOTH
def test_episode_statistics_agree_under_one_fixed_policy() -> None:
    """32 episodes a backend (8 envs, seed 0, one random action sequence). The backends draw their no-ops from
    different generators, so episodes differ one by one; what must agree is the distribution. A random policy's Pong
    game lasts 750-1,300 steps (sd about 120 over 32 episodes: a standard error of the mean near 21, so near 30 for
    the difference of two means) and loses 21-0 to 21-4. The bounds, 10% of the mean length (about 3 standard errors)
    and 1.0 point of mean return, catch what a wrong option does: frame skip 3 or 5 instead of 4 moves the mean
    length by a quarter or more; FIRE at reset or sticky actions need not move these bounds under random play, so
    the options themselves are checked above. Deterministic for given versions: both backends are seeded."""
    g_ret, g_len = _episodes("gymnasium", 8, 32, seed=0)
    e_ret, e_len = _episodes("envpool", 8, 32, seed=0)
    assert abs(e_len.mean() - g_len.mean()) <= 0.10 * g_len.mean(), (g_len.mean(), e_len.mean())
    assert abs(np.median(e_len) - np.median(g_len)) <= 0.10 * np.median(g_len)
    assert abs(e_ret.mean() - g_ret.mean()) <= 1.0, (g_ret.mean(), e_ret.mean())
    assert -21 <= min(g_ret.min(), e_ret.min()) and max(g_ret.max(), e_ret.max()) <= -15
    assert g_len.min() >= 700 and e_len.min() >= 700  # 21 points take at least ~750 steps at frame skip 4


def test_a_vector_env_stepped_in_one_call_waits_the_sum_or_the_slowest_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """EnvPool steps its envs in one call, so the benchmarks' per-env delays are drawn for the vector step: their
    sum (``env.latency_overlap`` off, as the gymnasium backend's per-env wrapper) or their maximum."""
    import gymnasium as gym

    import shared.rl.envs as envs_mod
    from shared.rl.envs import LogNormalDelay, OverlappedLogNormalLatency

    slept: list[float] = []
    monkeypatch.setattr(envs_mod.time, "sleep", slept.append)
    draws = LogNormalDelay(2.0, 1.0, seed=5).draw(3)
    for overlap, expect in ((False, draws.sum()), (True, draws.max())):
        env = OverlappedLogNormalLatency(gym.make_vec("CartPole-v1", 3, vectorization_mode="sync"), 2.0, 1.0, seed=5,
                                         overlap=overlap)
        env.reset(seed=0)
        env.step(np.zeros(3, np.int64))
        env.close()
        assert slept.pop() == pytest.approx(expect)
