"""EnvPool as the samplers' env backend (``env.backend``, docs/pixels.md "Env backend").

EnvPool (extra ``envpool``) steps a sampler's ``env.num_envs`` Atari games in C++ with the same preprocessing as
the gymnasium backend: its own options are set from :data:`shared.rl.envs.ATARI` (:func:`envpool_options`).
:class:`EnvPoolVectorEnv` presents it as the gymnasium vector env the sampler steps (``AutoresetMode.SAME_STEP``):
single HW uint8 frames (EnvPool's ``stack_num`` 1: the sampler's ``FrameStacker`` stacks them, as for the
gymnasium backend), an env that ends is reset in the step that ended it, its last frame in ``info["final_obs"]``.

:func:`choose_backend` is the rule of ``env.backend`` (pure; :func:`resolve_backend` feeds it what is installed).
Only ``ALE/<Game>-v5`` ids map to EnvPool here (``<Game>-v5``); MuJoCo ids stay on gymnasium (EnvPool's MuJoCo
tasks were not checked against gymnasium's).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Collection
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from shared.rl.atari import ATARI, ATARI_PREFIX, AtariPreprocessing
from shared.rl.extras import install_command

BACKENDS = ("auto", "gymnasium", "envpool")
ATARI_VERSION = "-v5"


class BackendUnavailable(ValueError):
    """``env.backend: envpool`` cannot be honoured; the message names the field and why."""


def envpool_task(env_id: str) -> str | None:
    """EnvPool's task id for ``env_id`` (``ALE/Pong-v5`` -> ``Pong-v5``), or None when Flywheel does not run
    ``env_id`` on EnvPool (every id but ``ALE/<Game>-v5``)."""
    if env_id.startswith(ATARI_PREFIX) and env_id.endswith(ATARI_VERSION):
        return env_id[len(ATARI_PREFIX):]
    return None


def choose_backend(requested: str, env_id: str, *, installed: bool,
                   supported: Callable[[], Collection[str]]) -> str:
    """``gymnasium`` or ``envpool`` for ``env.backend`` ``requested`` and ``env.id`` ``env_id``: ``auto`` is
    ``envpool`` where EnvPool is ``installed`` and has the game (``supported()``: its task ids, asked only then),
    else ``gymnasium``; an explicit ``envpool`` that cannot be honoured raises :class:`BackendUnavailable`."""
    if requested not in BACKENDS:
        raise BackendUnavailable(f"env.backend={requested!r}: must be one of {', '.join(BACKENDS)}")
    if requested == "gymnasium":
        return "gymnasium"
    task = envpool_task(env_id)
    if task is None:
        why = (f"env.id={env_id!r} is not an {ATARI_PREFIX}<Game>{ATARI_VERSION} game, the only envs Flywheel "
               "steps on EnvPool")
    elif not installed:
        why = f"envpool is not installed: {install_command('envpool')}"
    elif task not in supported():
        why = f"EnvPool has no task {task!r} (env.id={env_id!r})"
    else:
        return "envpool"
    if requested == "auto":
        return "gymnasium"
    raise BackendUnavailable(f"env.backend='envpool' cannot be used: {why}")


def envpool_installed() -> bool:
    return importlib.util.find_spec("envpool") is not None


def envpool_tasks() -> list[str]:
    """Every task id of the installed EnvPool (imports it: about a second)."""
    from envpool.registration import list_all_envs

    return list(list_all_envs())


def resolve_backend(requested: str, env_id: str) -> str:
    """:func:`choose_backend` with what is installed here (EnvPool is imported only for ``ALE/`` ids)."""
    return choose_backend(requested, env_id, installed=envpool_installed(), supported=envpool_tasks)


def envpool_options(pre: AtariPreprocessing = ATARI) -> dict[str, Any]:
    """EnvPool's Atari options (its ``make_spec`` config) for the preprocessing ``pre``, one frame per
    observation."""
    return {
        "img_height": pre.screen_size,
        "img_width": pre.screen_size,
        "gray_scale": pre.grayscale,
        "stack_num": 1,                      # single frames: the sampler stacks them (shared.rl.frames)
        "frame_skip": pre.frame_skip,        # max over the last two frames, as gymnasium's wrapper
        "noop_max": pre.noop_max,
        "episodic_life": pre.terminal_on_life_loss,
        "zero_discount_on_life_loss": False,
        "reward_clip": pre.reward_clip,
        "repeat_action_probability": pre.repeat_action_probability,
        "use_fire_reset": False,             # EnvPool's default presses FIRE at reset; gymnasium's wrapper does not
        "full_action_space": pre.full_action_space,
        "use_inter_area_resize": True,       # cv2.INTER_AREA, as gymnasium's wrapper resizes
        "max_episode_steps": pre.max_episode_frames // pre.frame_skip,
    }


def frame_space(pre: AtariPreprocessing = ATARI) -> gym.spaces.Box:
    """One preprocessed frame, as the gymnasium backend's ``AtariPreprocessing`` gives it (HW, or HWC in colour)."""
    shape = (pre.screen_size, pre.screen_size) if pre.grayscale else (pre.screen_size, pre.screen_size, 3)
    return gym.spaces.Box(0, 255, shape, np.uint8)


def envpool_action_space(env_id: str) -> gym.spaces.Space[Any]:
    """The action space of ``env_id`` on EnvPool (its spec; no env is built)."""
    import envpool

    task = envpool_task(env_id)
    if task is None:
        raise BackendUnavailable(f"env.id={env_id!r} does not run on EnvPool")
    space: gym.spaces.Space[Any] = envpool.make_spec(task, **envpool_options()).gymnasium_action_space
    return space


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` EnvPool Atari games as a gymnasium vector env with same-step autoreset. The pool is built on
    the first :meth:`reset` (EnvPool seeds its envs when it is made: env ``i`` gets ``seed + i``, as gymnasium's
    vector ``reset(seed=...)``); ``reset(seed=s)`` rebuilds it seeded with ``s``. ``threads`` is EnvPool's
    ``num_threads`` (its worker threads; the calling thread waits for them)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env_id: str, num_envs: int, threads: int = 1) -> None:
        task = envpool_task(env_id)
        if task is None:
            raise BackendUnavailable(f"env.id={env_id!r} does not run on EnvPool")
        self.task, self.num_envs, self.threads = task, num_envs, threads
        self.single_observation_space = frame_space()
        self.single_action_space = envpool_action_space(env_id)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._shape = (num_envs, *self.single_observation_space.shape)
        self._ids = np.arange(num_envs, dtype=np.int32)
        self._pool: Any = None

    def _frames(self, obs: Any, env_id: Any, n: int) -> np.ndarray:
        """EnvPool's (n, 1, H, W) batch as (n, H, W) in ``env_id`` order (sync mode returns that order; checked)."""
        frames = np.asarray(obs).reshape((n, *self._shape[1:]))
        ids = np.asarray(env_id)
        return frames if n == 0 or bool((ids[1:] >= ids[:-1]).all()) else frames[np.argsort(ids, kind="stable")]

    def reset(self, *, seed: int | list[int] | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        import envpool

        if seed is not None or self._pool is None:
            if isinstance(seed, list):
                seed = seed[0]
            if seed is None:
                seed = int(np.random.default_rng().integers(2**31 - 1 - self.num_envs))
            if self._pool is not None:
                self._pool.close()
            self._pool = envpool.make(self.task, env_type="gymnasium", num_envs=self.num_envs,
                                      batch_size=self.num_envs, num_threads=self.threads, seed=int(seed),
                                      **envpool_options())
        obs, info = self._pool.reset()
        return self._frames(obs, info["env_id"], self.num_envs), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if self._pool is None:
            raise RuntimeError("EnvPoolVectorEnv.step before reset")
        obs, reward, term, trunc, info = self._pool.step(np.asarray(actions), self._ids)
        frames = self._frames(obs, info["env_id"], self.num_envs).copy()
        order = np.argsort(info["env_id"], kind="stable")
        reward = np.asarray(reward, np.float64)[order]
        term, trunc = np.asarray(term, bool)[order], np.asarray(trunc, bool)[order]
        done = term | trunc
        out: dict[str, Any] = {}
        if done.any():  # same-step autoreset: reset the ended envs now, keep their last frames
            ids = np.flatnonzero(done).astype(np.int32)
            out = {"final_obs": frames.copy(), "_final_obs": done}
            new, new_info = self._pool.reset(ids)
            frames[ids] = self._frames(new, new_info["env_id"], len(ids))
        return frames, reward, term, trunc, out

    def close_extras(self, **kwargs: Any) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
