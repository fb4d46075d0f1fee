"""Vectorised gymnasium envs, the latency wrapper of the benchmarks, and the fragment spec."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from shared.fragment import FragmentSpec


class LogNormalDelay:
    """Log-normal delays in seconds: with ``median_ms`` m and ``sigma`` s the p99 is m * exp(2.326 s)
    (s=1: about 10 m)."""

    def __init__(self, median_ms: float, sigma: float, seed: int | None = None) -> None:
        self._mu = float(np.log(median_ms / 1000.0))
        self._sigma = sigma
        self._rng = np.random.default_rng(seed)

    def draw(self, n: int | None = None) -> Any:
        """One delay, or ``n`` of them."""
        return self._rng.lognormal(self._mu, self._sigma, n)


class LogNormalLatency(gym.Wrapper):
    """Sleeps a log-normal time (:class:`LogNormalDelay`) on every step: an env whose steps have
    heavy-tailed latency."""

    def __init__(self, env: gym.Env, median_ms: float, sigma: float, seed: int | None = None) -> None:
        super().__init__(env)
        self._delay = LogNormalDelay(median_ms, sigma, seed)

    def step(self, action: Any) -> Any:
        time.sleep(float(self._delay.draw()))
        return self.env.step(action)


class OverlappedLogNormalLatency(gym.vector.VectorWrapper):
    """The same per-env log-normal delays, but the envs' delays overlap, as when each env is its own
    process or remote simulator: a vector step waits for the slowest of its ``num_envs`` delays
    instead of their sum. The envs' own computation stays sequential (it is what a core does)."""

    def __init__(self, env: gym.vector.VectorEnv, median_ms: float, sigma: float, seed: int | None = None) -> None:
        super().__init__(env)
        self._delay = LogNormalDelay(median_ms, sigma, seed)

    def step(self, actions: Any) -> Any:
        time.sleep(float(self._delay.draw(self.num_envs).max()))
        return self.env.step(actions)


def make_vector_env(
    env_id: str, num_envs: int, latency_median_ms: float = 0.0, latency_sigma: float = 1.0, seed: int | None = None,
    latency_overlap: bool = False,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies stepped in one process; finished episodes reset in the same step.

    With ``latency_median_ms`` > 0 every env step gets a log-normal delay (benchmarks): summed over
    the envs of a vector step, or with ``latency_overlap`` the slowest of them (envs in parallel)."""
    wrappers = []
    if latency_median_ms > 0 and not latency_overlap:
        wrappers.append(lambda e: LogNormalLatency(e, latency_median_ms, latency_sigma))
    envs = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        wrappers=wrappers or None,
    )
    if latency_median_ms > 0 and latency_overlap:
        return OverlappedLogNormalLatency(envs, latency_median_ms, latency_sigma, seed)
    return envs


def fragment_spec(env_id: str, max_bytes: int) -> FragmentSpec:
    """Observation shape and action space of ``env_id``: Box observations, Discrete or Box actions."""
    env = gym.make(env_id)
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"env.id={env_id!r}: only Box observation spaces are supported, got {obs_space}")
    if isinstance(act_space, gym.spaces.Discrete):
        return FragmentSpec(obs_shape=tuple(obs_space.shape), num_actions=int(act_space.n), max_bytes=max_bytes,
                            env_id=env_id)
    if isinstance(act_space, gym.spaces.Box) and act_space.shape:
        return FragmentSpec(obs_shape=tuple(obs_space.shape), num_actions=0, max_bytes=max_bytes, env_id=env_id,
                            action_shape=tuple(act_space.shape))
    raise ValueError(f"env.id={env_id!r}: only Discrete or (non-scalar) Box action spaces are supported, "
                     f"got {act_space}")
