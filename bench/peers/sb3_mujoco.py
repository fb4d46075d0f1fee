"""Stable-Baselines3 PPO on HalfCheetah-v5 with rl-zoo's HalfCheetah settings, a fresh process per seed (so
start-up is measured as it is for Flywheel), for the ``peers_mujoco`` figure.

The settings are rl-baselines3-zoo's ``hyperparams/ppo.yml`` entry ``HalfCheetah-v3`` (commit ``00128b5``;
the same values as ``HalfCheetah-v4`` at commit ``208b6fd``), copied into ``ZOO_HALFCHEETAH`` value for value.
The zoo's ``normalize: true`` wraps the env in ``VecNormalize`` (observations and rewards, clipped to +-10)
with the algorithm's ``gamma`` as the return's discount (``rl_zoo3/exp_manager.py``, its normalisation
pre-processing); ``n_timesteps`` (1e6) only bounds the zoo's run: every schedule here is constant, so
stopping at the bench's budget changes no setting.

Run as ``python -m bench.peers.sb3_mujoco --seed 1 --steps 300000 --max-s 1500``: one torch thread, CPU; it
prints one JSON line ``{"event": "learn_start", "wall": ...}`` when ``learn()`` begins and one ``{"event":
"done", ...}`` at the end: ``env_steps``, ``learn_s``, ``budget_s`` (seconds from learn start to the
``steps``-th env step, null if not reached), ``episodes``, ``last10`` (mean raw return of the last 10
finished training episodes, from the Monitor wrapper: the behaviour policy's, not normalised) and
``curve``: [seconds since learn start, env steps, return] per finished episode. Learning stops at the
``steps``-th env step (before the update that would follow it) or after ``max-s`` seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.peers.proc import emit
from devstack import REPO_ROOT

ENV_ID = "HalfCheetah-v5"
ZOO_SOURCE = ("rl-baselines3-zoo hyperparams/ppo.yml, HalfCheetah-v3 (commit 00128b5) = HalfCheetah-v4 "
              "(commit 208b6fd)")

# rl-baselines3-zoo hyperparams/ppo.yml, HalfCheetah-v3 / -v4, verbatim (n_timesteps 1e6 left out: a budget).
ZOO_HALFCHEETAH: dict[str, Any] = {
    "normalize": True,
    "n_envs": 1,
    "policy": "MlpPolicy",
    "batch_size": 64,
    "n_steps": 512,
    "gamma": 0.98,
    "learning_rate": 2.0633e-05,
    "ent_coef": 0.000401762,
    "clip_range": 0.1,
    "n_epochs": 20,
    "gae_lambda": 0.92,
    "max_grad_norm": 0.8,
    "vf_coef": 0.58096,
    "policy_kwargs": {"log_std_init": -2, "ortho_init": False, "activation_fn": "ReLU",
                      "net_arch": {"pi": [256, 256], "vf": [256, 256]}},
}
PPO_KEYS = ("batch_size", "n_steps", "gamma", "learning_rate", "ent_coef", "clip_range", "n_epochs", "gae_lambda",
            "max_grad_norm", "vf_coef")


def zoo_kwargs(entry: dict[str, Any] = ZOO_HALFCHEETAH) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(n_envs, PPO keyword arguments, VecNormalize keyword arguments) for ``entry`` as the zoo builds them:
    ``policy_kwargs.activation_fn`` names a ``torch.nn`` class; VecNormalize normalises observations and
    rewards with the algorithm's gamma. Raises ValueError for an entry the zoo would not run this way."""
    if entry.get("policy") != "MlpPolicy":
        raise ValueError(f"only MlpPolicy entries: policy={entry.get('policy')!r}")
    missing = [k for k in PPO_KEYS if k not in entry]
    if missing:
        raise ValueError(f"zoo entry lacks {missing}")
    from torch import nn

    pk = dict(entry.get("policy_kwargs", {}))
    if "activation_fn" in pk:
        act = getattr(nn, str(pk["activation_fn"]), None)
        if not (isinstance(act, type) and issubclass(act, nn.Module)):
            raise ValueError(f"policy_kwargs.activation_fn={pk['activation_fn']!r} is not a torch.nn module")
        pk["activation_fn"] = act
    ppo = {k: entry[k] for k in PPO_KEYS} | {"policy_kwargs": pk}
    vecnorm = {"norm_obs": True, "norm_reward": True, "gamma": entry["gamma"]} if entry.get("normalize") else {}
    return int(entry["n_envs"]), ppo, vecnorm


def describe() -> str:
    e = ZOO_HALFCHEETAH
    rest = ", ".join(f"{k} {e[k]}" for k in PPO_KEYS)
    pk = e["policy_kwargs"]
    return (f"{ENV_ID}, n_envs {e['n_envs']}, MlpPolicy, {rest}, log_std_init {pk['log_std_init']}, ortho_init "
            f"{pk['ortho_init']}, activation nn.{pk['activation_fn']}, net_arch pi/vf {pk['net_arch']['pi']}, "
            f"VecNormalize (obs + reward, clip 10, gamma {e['gamma']}); {ZOO_SOURCE}")


@dataclass(frozen=True)
class Sb3Result:
    """What one SB3 child reported. ``startup_s``: process start to ``learn()``; ``error`` says why a run has
    no ``done`` line (then the other fields are empty)."""

    seed: int
    startup_s: float | None
    learn_s: float | None = None
    budget_s: float | None = None
    env_steps: int = 0
    episodes: int = 0
    last10: float | None = None
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    error: str | None = None


def run_seed(seed: int, *, steps: int, timeout_s: float) -> Sb3Result:
    """One run in a fresh ``sys.executable`` process, killed (its process group) ``timeout_s + 120`` s in."""
    from bench.peers.proc import by_event, json_events, run_lines

    cmd = [sys.executable, "-m", "bench.peers.sb3_mujoco", "--seed", str(seed), "--steps", str(steps),
           "--max-s", str(timeout_s)]
    res = run_lines(cmd, timeout_s=timeout_s + 120.0, cwd=REPO_ROOT)
    events = by_event(json_events(line for _, line in res.lines))
    start, done = events.get("learn_start"), events.get("done")
    startup = None if start is None else float(start["wall"]) - res.wall_start
    if done is None:
        why = "timed out" if res.timed_out else f"exit {res.rc}"
        return Sb3Result(seed, startup, error=f"no result ({why}); output tail:\n{res.tail()}")
    budget_s, last10 = done["budget_s"], done["last10"]
    return Sb3Result(seed, startup, float(done["learn_s"]), None if budget_s is None else float(budget_s),
                     int(done["env_steps"]), int(done["episodes"]), None if last10 is None else float(last10),
                     [(float(t), int(s), float(r)) for t, s, r in done["curve"]])



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.sb3_mujoco")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, default=300_000, help="env steps to learn for (the budget)")
    p.add_argument("--max-s", type=float, default=1500.0, help="stop learning after this many seconds")
    a = p.parse_args(argv)
    if a.steps < 1 or a.max_s <= 0:
        p.error(f"--steps and --max-s must be positive: {a.steps=}, {a.max_s=}")

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from bench.peers.sb3_watch import StepBudgetWatch

    torch.set_num_threads(1)
    n_envs, kwargs, vecnorm = zoo_kwargs()
    env = make_vec_env(ENV_ID, n_envs=n_envs, seed=a.seed)  # each env in a Monitor: raw episode returns
    if vecnorm:
        env = VecNormalize(env, **vecnorm)
    model = PPO("MlpPolicy", env, seed=a.seed, device="cpu", verbose=0, **kwargs)
    watch = StepBudgetWatch(a.steps, a.max_s)
    t0 = time.monotonic()
    model.learn(total_timesteps=a.steps, callback=watch, progress_bar=False)
    env.close()
    last = [r for _, _, r in watch.curve[-10:]]
    emit({"event": "done", "env_steps": int(model.num_timesteps), "learn_s": time.monotonic() - t0,
          "budget_s": watch.budget_s, "episodes": len(watch.curve),
          "last10": sum(last) / len(last) if last else None, "curve": watch.curve})
    return 0


if __name__ == "__main__":
    sys.exit(main())
