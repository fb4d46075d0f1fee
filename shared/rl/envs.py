"""Vectorised gymnasium envs, the latency wrapper of the benchmarks, and the fragment spec.

Image envs (``docs/pixels.md``): MinAtar's (``MinAtar/Breakout-v1``, extra ``minatar``) and the ALE's
(``ALE/Pong-v5``, extra ``atari``) are registered here when their packages are installed. Boolean or
uint8 Box observations are image frames: samplers send them as uint8 (booleans become 0 or 255)."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from shared.fragment import FragmentSpec
from shared.rl.atari import ATARI, ATARI_PREFIX
from shared.rl.extras import install_command


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
    instead of their sum. The envs' own computation stays sequential (it is what a core does).
    With ``overlap`` False it waits their sum: :class:`LogNormalLatency` for a vector env that steps its envs in one
    call (EnvPool)."""

    def __init__(self, env: gym.vector.VectorEnv, median_ms: float, sigma: float, seed: int | None = None,
                 overlap: bool = True) -> None:
        super().__init__(env)
        self._delay = LogNormalDelay(median_ms, sigma, seed)
        self._overlap = overlap

    def step(self, actions: Any) -> Any:
        delays = self._delay.draw(self.num_envs)
        time.sleep(float(delays.max() if self._overlap else delays.sum()))
        return self.env.step(actions)


MINATAR_PREFIX = "MinAtar/"
MUJOCO_ENTRY_POINT = "gymnasium.envs.mujoco"


class EnvPackageMissing(RuntimeError):
    """The package an env id needs is not installed; the message names it and the command that installs it."""

    def __init__(self, env_id: str, extra: str, module: str) -> None:
        self.env_id, self.extra, self.module = env_id, extra, module
        super().__init__(f"env {env_id} needs the Python package {module!r}, which is not installed: "
                         f"{install_command(extra)} (or make up CONFIG=..., which installs it)")


def env_extra(env_id: str) -> tuple[str, str] | None:
    """(the project's extra, the module it provides) that ``env_id`` needs, or None when gymnasium alone makes it:
    ``minatar`` for ``MinAtar/`` ids, ``atari`` for ``ALE/`` ids, ``mujoco`` for gymnasium's MuJoCo envs."""
    if env_id.startswith(MINATAR_PREFIX):
        return "minatar", "minatar"
    if env_id.startswith(ATARI_PREFIX):
        return "atari", "ale_py"
    spec = gym.registry.get(env_id)
    if spec is not None and isinstance(spec.entry_point, str) and spec.entry_point.startswith(MUJOCO_ENTRY_POINT):
        return "mujoco", "mujoco"
    return None


def missing_extra(env_id: str) -> tuple[str, str] | None:
    """:func:`env_extra` when its module cannot be imported here, else None (nothing is imported to find out)."""
    need = env_extra(env_id)
    return need if need is not None and importlib.util.find_spec(need[1]) is None else None


def register_image_envs(env_id: str) -> None:
    """Register the MinAtar or ALE env ids when ``env_id`` is one of them (idempotent); raises
    :class:`EnvPackageMissing` when its package is not installed. Only the package ``env_id`` needs is
    imported: MinAtar's imports matplotlib and seaborn, seconds of every service's start-up that a CartPole
    run must not pay."""
    if env_id in gym.registry or not env_id.startswith((MINATAR_PREFIX, ATARI_PREFIX)):
        return
    missing = missing_extra(env_id)
    if missing is not None:
        raise EnvPackageMissing(env_id, *missing)
    if env_id.startswith(MINATAR_PREFIX):
        import minatar.gym

        minatar.gym.register_envs()
    else:
        import ale_py

        gym.register_envs(ale_py)




def env_options(env_id: str) -> tuple[dict[str, Any], list[Any]]:
    """``gym.make`` keyword arguments and wrappers of ``env_id`` for the gymnasium backend: ALE games get
    :data:`ATARI`'s preprocessing through gymnasium's ``AtariPreprocessing`` (frame skip 4 with max-pooling, up to
    30 no-ops at reset, 84x84 grayscale; no sticky actions; rewards unclipped)."""
    if not env_id.startswith(ATARI_PREFIX):
        return {}, []
    from gymnasium.wrappers import AtariPreprocessing as AtariWrapper

    def atari(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
        env = AtariWrapper(env, noop_max=ATARI.noop_max, frame_skip=ATARI.frame_skip, screen_size=ATARI.screen_size,
                           grayscale_obs=ATARI.grayscale, terminal_on_life_loss=ATARI.terminal_on_life_loss)
        if ATARI.reward_clip:  # the sign of the reward, as EnvPool's reward_clip and rl-zoo's ClipRewardEnv
            from gymnasium.wrappers import TransformReward

            return TransformReward(env, lambda r: float(np.sign(float(r))))
        return env

    kwargs = {"frameskip": 1, "repeat_action_probability": ATARI.repeat_action_probability,
              "full_action_space": ATARI.full_action_space,
              "max_num_frames_per_episode": ATARI.max_episode_frames}
    return kwargs, [atari]


def is_image_space(space: gym.Space[Any]) -> bool:
    """uint8 or boolean Box observations: image frames."""
    return isinstance(space, gym.spaces.Box) and space.dtype in (np.dtype(np.uint8), np.dtype(np.bool_))


def as_observation(obs: Any, dtype: str) -> np.ndarray:
    """Env observations as the fragment's dtype: float32, or uint8 frames (booleans become 0 or 255)."""
    arr = np.asarray(obs)
    if dtype == "uint8":
        return arr.astype(np.uint8) * np.uint8(255) if arr.dtype == np.bool_ else arr.astype(np.uint8, copy=False)
    return arr.astype(np.float32, copy=False)


def make_vector_env(
    env_id: str, num_envs: int, latency_median_ms: float = 0.0, latency_sigma: float = 1.0, seed: int | None = None,
    latency_overlap: bool = False, backend: str = "gymnasium",
) -> gym.vector.VectorEnv:
    """``num_envs`` copies stepped in one process; finished episodes reset in the same step.

    ``backend`` is a resolved ``env.backend`` (``shared.rl.envpool_env.resolve_backend``): ``gymnasium`` (a
    synchronous gymnasium vector env) or ``envpool`` (``ALE/`` games in EnvPool, the same preprocessing).
    With ``latency_median_ms`` > 0 every env step gets a log-normal delay (benchmarks): summed over
    the envs of a vector step, or with ``latency_overlap`` the slowest of them (envs in parallel)."""
    if backend == "envpool":
        from shared.rl.envpool_env import EnvPoolVectorEnv

        pool: gym.vector.VectorEnv = EnvPoolVectorEnv(env_id, num_envs)
        if latency_median_ms > 0:
            return OverlappedLogNormalLatency(pool, latency_median_ms, latency_sigma, seed, overlap=latency_overlap)
        return pool
    if backend != "gymnasium":
        raise ValueError(f"backend={backend!r}: gymnasium or envpool (resolve env.backend auto first)")
    register_image_envs(env_id)
    kwargs, wrappers = env_options(env_id)
    if latency_median_ms > 0 and not latency_overlap:
        wrappers.append(lambda e: LogNormalLatency(e, latency_median_ms, latency_sigma))
    envs = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        wrappers=wrappers or None,
        **kwargs,
    )
    if latency_median_ms > 0 and latency_overlap:
        return OverlappedLogNormalLatency(envs, latency_median_ms, latency_sigma, seed)
    return envs


def default_frame_stack(env_id: str) -> int:
    """Frames the policy sees per step unless ``env.frame_stack`` says otherwise: 4 for ALE games (rl-zoo's
    Atari setting), else 1."""
    return 4 if env_id.startswith(ATARI_PREFIX) else 1


def env_spaces(env_id: str, backend: str = "gymnasium") -> tuple[gym.Space[Any], gym.Space[Any]]:
    """One env's observation and action spaces on ``backend`` (a resolved ``env.backend``); EnvPool's need neither
    ale-py nor an env."""
    if backend == "envpool":
        from shared.rl.envpool_env import envpool_action_space, frame_space

        return frame_space(), envpool_action_space(env_id)
    register_image_envs(env_id)
    kwargs, wrappers = env_options(env_id)
    env = gym.make(env_id, **kwargs)
    for wrap in wrappers:
        env = wrap(env)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def fragment_spec(env_id: str, max_bytes: int, frame_stack: int | None = None,
                  backend: str = "gymnasium") -> FragmentSpec:
    """Observation shape and dtype and action space of ``env_id`` (on ``backend``, which gives the same ones):
    Box observations (uint8 or boolean ones are image frames, stacked ``frame_stack`` deep, None:
    :func:`default_frame_stack`), Discrete or Box actions."""
    if frame_stack is None:
        frame_stack = default_frame_stack(env_id)
    obs_space, act_space = env_spaces(env_id, backend)
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"env.id={env_id!r}: only Box observation spaces are supported, got {obs_space}")
    obs_dtype = "uint8" if is_image_space(obs_space) else "float32"
    if frame_stack > 1 and obs_dtype != "uint8":
        raise ValueError(f"env.frame_stack={frame_stack}: frame stacking is for image observations, {env_id} has "
                         f"{obs_space}")
    spec = FragmentSpec(obs_shape=tuple(obs_space.shape), num_actions=0, max_bytes=max_bytes, env_id=env_id,
                        obs_dtype=obs_dtype, frame_stack=frame_stack)
    if isinstance(act_space, gym.spaces.Discrete):
        return dataclasses.replace(spec, num_actions=int(act_space.n))
    if isinstance(act_space, gym.spaces.Box) and act_space.shape:
        return dataclasses.replace(spec, action_shape=tuple(act_space.shape))
    raise ValueError(f"env.id={env_id!r}: only Discrete or (non-scalar) Box action spaces are supported, "
                     f"got {act_space}")
