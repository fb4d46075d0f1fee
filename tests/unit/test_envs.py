"""The benchmark latency wrappers: what a vector step waits, with the sleeps recorded, not timed."""

import threading
import time

import gymnasium as gym
import numpy as np
import pytest

import shared.rl.envs as envs_mod
from shared.rl.envs import make_vector_env


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The env wrappers' sleeps in this thread, recorded instead of slept. ``time.sleep`` is patched
    process-wide (``envs_mod.time`` is the ``time`` module): a background thread left by an earlier test
    (the whole suite runs in one process) still sleeps for real, and its calls are not counted."""
    recorded: list[float] = []
    real_sleep = time.sleep
    here = threading.current_thread()

    def fake_sleep(seconds: float) -> None:
        if threading.current_thread() is here:
            recorded.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(envs_mod.time, "sleep", fake_sleep)
    return recorded


def test_sequential_envs_wait_the_sum_of_their_delays(sleeps: list[float]) -> None:
    envs = make_vector_env("CartPole-v1", 4, latency_median_ms=5.0, latency_sigma=0.0, seed=0)
    envs.reset(seed=0)
    for _ in range(3):
        envs.step(np.zeros(4, np.int64))
    envs.close()
    assert len(sleeps) == 12 and sleeps == pytest.approx([0.005] * 12)  # one delay per env per step


def test_overlapped_envs_wait_the_slowest_delay(sleeps: list[float]) -> None:
    envs = make_vector_env("CartPole-v1", 4, latency_median_ms=2.0, latency_sigma=1.0, seed=7, latency_overlap=True)
    envs.reset(seed=0)
    for _ in range(200):
        envs.step(np.zeros(4, np.int64))
    envs.close()
    assert len(sleeps) == 200  # one wait per vector step
    # The same seed draws the same 4 delays per step; the step waits for their maximum.
    rng = np.random.default_rng(7)
    want = [float(rng.lognormal(np.log(0.002), 1.0, 4).max()) for _ in range(200)]
    assert sleeps == pytest.approx(want)
    # The slowest of 4 is well above one env's median of 2 ms.
    assert np.median(sleeps) > 0.003


def test_no_latency_no_sleep(sleeps: list[float]) -> None:
    envs = make_vector_env("CartPole-v1", 2, seed=0)
    envs.reset(seed=0)
    envs.step(np.zeros(2, np.int64))
    envs.close()
    assert sleeps == []


def test_fragment_spec_of_a_box_action_space() -> None:
    from shared.rl.envs import fragment_spec

    spec = fragment_spec("Pendulum-v1", 1 << 20)
    assert spec.continuous and spec.action_shape == (1,) and spec.action_dim == 1 and spec.obs_shape == (3,)
    discrete = fragment_spec("CartPole-v1", 1 << 20)
    assert not discrete.continuous and discrete.action_shape == () and discrete.num_actions == 2


class _MultiBinaryEnv(gym.Env[np.ndarray, np.ndarray]):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.MultiBinary(3)


def test_fragment_spec_refuses_other_action_spaces() -> None:
    from shared.rl.envs import fragment_spec

    gym.register("FlywheelTest/MultiBinary-v0", entry_point=_MultiBinaryEnv)
    try:
        with pytest.raises(ValueError, match=r"env.id='FlywheelTest/MultiBinary-v0': only Discrete or .*Box action"):
            fragment_spec("FlywheelTest/MultiBinary-v0", 1 << 20)
    finally:
        del gym.registry["FlywheelTest/MultiBinary-v0"]
