"""The Stable-Baselines3 PPO baseline: rl-zoo's tuned hyperparameters, run in this process on CPU torch
with 1 thread, one run at a time, never beside a stack.

Hyperparameters from rl-baselines3-zoo ``hyperparams/ppo.yml`` (checked against the stored file at
commits ``00128b5`` and ``208b6fd``: the ``CartPole-v1`` and ``Pendulum-v1`` entries are identical in
both). ``lin_X`` in the zoo is ``progress_remaining * X`` (1 -> 0 over ``n_timesteps``). Neither
stored version sets ``normalize`` for Pendulum-v1; ``FLYWHEEL_BENCH_SB3_PENDULUM_NORMALIZE=1`` adds
``VecNormalize`` (observations and rewards) for a run that wants it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def _lin(x: float) -> Callable[[float], float]:
    return lambda progress_remaining: progress_remaining * x


ZOO: dict[str, dict[str, Any]] = {
    "CartPole-v1": {
        "n_envs": 8, "n_timesteps": 100_000, "normalize": False,
        "ppo": {"n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20,
                "ent_coef": 0.0, "learning_rate": ("lin", 1e-3), "clip_range": ("lin", 0.2)},
    },
    "Pendulum-v1": {
        "n_envs": 4, "n_timesteps": 100_000, "normalize": False,
        "ppo": {"n_steps": 1024, "gae_lambda": 0.95, "gamma": 0.9, "n_epochs": 10, "ent_coef": 0.0,
                "learning_rate": 1e-3, "clip_range": 0.2, "use_sde": True, "sde_sample_freq": 4},
    },
}


def zoo_config(env_id: str) -> dict[str, Any]:
    """The zoo entry for ``env_id`` as run here (with the normalisation override applied)."""
    cfg = {**ZOO[env_id], "ppo": dict(ZOO[env_id]["ppo"])}
    if env_id == "Pendulum-v1" and os.environ.get("FLYWHEEL_BENCH_SB3_PENDULUM_NORMALIZE", "") in ("1", "true"):
        cfg["normalize"] = True
    return cfg


def describe(env_id: str) -> str:
    cfg = zoo_config(env_id)
    ppo = ", ".join(f"{k} {'lin_' + str(v[1]) if isinstance(v, tuple) else v}" for k, v in cfg["ppo"].items())
    return (f"n_envs {cfg['n_envs']}, n_timesteps {cfg['n_timesteps']:g}, MlpPolicy, {ppo}"
            + (", VecNormalize (obs + reward)" if cfg["normalize"] else ""))


def run_ppo(env_id: str, seed: int, *, stop_last100: float | None = None,
            max_s: float = float("inf")) -> dict[str, Any]:
    """Train SB3 PPO with the zoo's settings for ``env_id`` for its ``n_timesteps`` (the schedules span
    them), stopping early once the mean of the last 100 finished episodes reaches ``stop_last100`` or
    after ``max_s`` wall seconds.

    Returns ``curve``: (seconds since ``learn()`` began, env steps so far, return) per finished episode
    (Monitor's raw returns), ``solved``: (seconds, env steps) at ``stop_last100`` or None, and the
    wall seconds and env steps of the whole run."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from bench.peers.sb3_watch import EpisodeWatch, SolvedWatch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = zoo_config(env_id)
    kwargs: dict[str, Any] = {k: _lin(v[1]) if isinstance(v, tuple) else v for k, v in cfg["ppo"].items()}
    env = make_vec_env(env_id, n_envs=cfg["n_envs"], seed=seed)
    if cfg["normalize"]:
        env = VecNormalize(env)
    model = PPO("MlpPolicy", env, seed=seed, device="cpu", verbose=0, **kwargs)
    watch = (SolvedWatch(stop_last100, max_s, announce=False) if stop_last100 is not None
             else EpisodeWatch(max_s, announce=False))
    t0 = time.monotonic()
    try:
        model.learn(total_timesteps=cfg["n_timesteps"], callback=watch, progress_bar=False)
    finally:
        env.close()
        torch.set_num_threads(threads)
    return {"solved": getattr(watch, "solved", None), "curve": watch.curve, "wall_s": time.monotonic() - t0,
            "env_steps": int(model.num_timesteps), "seed": seed, "normalize": cfg["normalize"]}
