"""Stable-Baselines3 PPO on CartPole-v1 as a peer, in a fresh process per seed so start-up (imports, envs,
model) is measured as it is for the other peers.

Two settings:

- ``rl-zoo``: rl-baselines3-zoo's CartPole-v1 entry, exactly as ``bench.sb3`` runs it.
- ``flywheel``: ``configs/cartpole.yaml`` translated (``flywheel_kwargs``): 2 samplers x ``env.num_envs`` envs
  become SB3's envs, an update's ``batch_fragments x fragment_steps x num_envs`` samples its rollout, the same
  epochs, minibatch size, annealed learning rate and clip range (linear over ``anneal_env_steps``, then held),
  gamma, GAE lambda, entropy and gradient clip, the same network (two tanh layers of ``hidden``, separate actor
  and critic). ``NOT_SHARED`` lists what SB3 cannot express.

Run as ``python -m bench.peers.sb3_peer --settings flywheel --seed 1 --threshold 475 --max-s 300``: it prints
one JSON line ``{"event": "learn_start", "wall": ...}`` when ``learn()`` begins and one ``{"event": "done",
...}`` at the end (``solved``: [seconds since learn() began, env steps] or null).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.peers.proc import emit
from bench.peers.run import PeerRun
from devstack import REPO_ROOT

if TYPE_CHECKING:
    from shared.settings import Settings, TrainerSettings

SAMPLERS = 2  # as bench.figures.solve runs the stack
FLYWHEEL_TOTAL_STEPS = 400_000  # SB3 needs a budget for its schedules; Flywheel's anneal ends at 200k and holds

NOT_SHARED = (
    "asynchrony: Flywheel's samplers act on a policy ~2 versions old (max_staleness 8, credit flow control); "
    "SB3 collects with the current policy",
    "the KL stop: Flywheel checks each minibatch against the update's starting policy and stops at target_kl; "
    "SB3 stops at 1.5 x target_kl, so target_kl / 1.5 is passed (same threshold, same k3 estimator)",
    "the value loss: Flywheel's is 0.5 x MSE, SB3's is MSE, so vf_coef / 2 is passed (same gradient)",
    "the schedules: Flywheel anneals over trained env steps and holds; SB3 over progress of a fixed "
    f"{FLYWHEEL_TOTAL_STEPS:,}-step budget, mapped so both reach the end value at anneal_env_steps and hold",
    "the rollback guard (trainer.guard): none in SB3",
    "initialisation: both orthogonal (sqrt 2 hidden, 0.01 policy head, 1 value head); SB3 seeds its own RNGs",
)


def held_linear(start: float, end: float, over: int, total: int) -> Callable[[float], float]:
    """SB3 schedule (of progress_remaining 1 -> 0 over ``total`` steps): linear start -> end over the first
    ``over`` env steps, then end."""
    def f(progress_remaining: float) -> float:
        steps = (1.0 - progress_remaining) * total
        return start + (end - start) * min(1.0, steps / over)

    return f


UNEXPRESSIBLE = ("trainer.normalize_observations", "trainer.normalize_rewards", "trainer.separate_grad_clip",
                 "trainer.advantage_std_floor", "trainer.guard.enabled")
"""Flywheel settings SB3 PPO has no counterpart for: the pixel peers refuse a config that sets them."""


def update_shape(config: Path, refuse: tuple[str, ...] = ()) -> tuple[Settings, int, int]:
    """(settings, n_envs, samples an update) of ``config`` run by ``SAMPLERS`` samplers, as SB3 runs it: one
    env per sampler env, an update's samples split evenly over them and into minibatches. A ValueError says
    where it cannot, and names each setting of ``refuse`` that ``config`` sets (names from ``UNEXPRESSIBLE``,
    ``env.frame_stack`` and ``trainer.objective``: another objective than plain PPO)."""
    from shared.settings import load_settings

    s = load_settings(str(config))
    tr, env = s.trainer, s.env
    n_envs = SAMPLERS * env.num_envs
    batch = tr.batch_fragments * env.fragment_steps * env.num_envs
    if batch % n_envs:
        raise ValueError(f"an update's samples must split evenly over SB3's envs: {batch=}, {n_envs=}")
    if batch % tr.minibatches:
        raise ValueError(f"an update's samples must split evenly into minibatches: {batch=}, {tr.minibatches=}")
    set_ = {"env.frame_stack": env.frame_stack not in (None, 1),
            "trainer.objective": tr.objective != "ppo",
            "trainer.normalize_observations": tr.normalize_observations,
            "trainer.normalize_rewards": tr.normalize_rewards,
            "trainer.separate_grad_clip": tr.separate_grad_clip,
            "trainer.advantage_std_floor": tr.advantage_std_floor > 0,
            "trainer.guard.enabled": tr.guard.enabled}
    bad = [k for k in refuse if set_[k]]
    if bad:
        raise ValueError(f"SB3 PPO cannot express {bad} of {config}")
    return s, n_envs, batch


def flywheel_kwargs(config: Path) -> tuple[int, dict[str, Any]]:
    """(n_envs, PPO kwargs) equivalent to ``config`` run by ``SAMPLERS`` samplers."""
    s, n_envs, batch = update_shape(config, ("trainer.objective",))
    tr = s.trainer
    return n_envs, ppo_kwargs(tr, n_envs, batch, FLYWHEEL_TOTAL_STEPS,
                              {"net_arch": {"pi": [tr.hidden, tr.hidden], "vf": [tr.hidden, tr.hidden]}})


def ppo_kwargs(tr: TrainerSettings, n_envs: int, batch: int, total_steps: int,
               policy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """SB3 PPO keyword arguments for Flywheel's trainer settings ``tr`` with ``batch`` samples an update over
    ``n_envs`` envs: the same epochs, minibatch size, held-linear learning rate and clip schedules (over a
    ``total_steps`` budget), gamma, lambda, entropy, gradient clip and KL stop (``NOT_SHARED`` says how the
    value-loss and KL conventions are mapped)."""
    lr_end = tr.learning_rate_end if tr.learning_rate_end is not None else tr.learning_rate
    clip_end = tr.clip_coef_end if tr.clip_coef_end is not None else tr.clip_coef
    return {
        "n_steps": batch // n_envs, "batch_size": batch // tr.minibatches, "n_epochs": tr.epochs,
        "learning_rate": held_linear(tr.learning_rate, lr_end, tr.anneal_env_steps, total_steps),
        "clip_range": held_linear(tr.clip_coef, clip_end, tr.anneal_env_steps, total_steps),
        "gamma": tr.gamma, "gae_lambda": tr.gae_lambda, "ent_coef": tr.ent_coef, "vf_coef": tr.vf_coef / 2,
        "max_grad_norm": tr.max_grad_norm, "normalize_advantage": tr.normalize_advantages,
        "target_kl": None if tr.target_kl is None else tr.target_kl / 1.5,
        "policy_kwargs": policy_kwargs,
    }


def describe_flywheel(config: Path) -> str:
    n_envs, kw = flywheel_kwargs(config)
    from shared.settings import load_settings

    tr = load_settings(str(config)).trainer
    return (f"n_envs {n_envs}, n_steps {kw['n_steps']}, batch_size {kw['batch_size']}, n_epochs {kw['n_epochs']}, "
            f"learning_rate {tr.learning_rate:g} -> {tr.learning_rate_end} over {tr.anneal_env_steps:,} steps then "
            f"held, clip_range {tr.clip_coef} -> {tr.clip_coef_end} likewise, gamma {kw['gamma']}, gae_lambda "
            f"{kw['gae_lambda']}, ent_coef {kw['ent_coef']}, vf_coef {kw['vf_coef']:g} (= {tr.vf_coef} x 0.5 MSE), "
            f"max_grad_norm {kw['max_grad_norm']}, target_kl {kw['target_kl']:.4f} (= {tr.target_kl} / 1.5), "
            f"net_arch pi/vf [{tr.hidden}, {tr.hidden}] tanh, {FLYWHEEL_TOTAL_STEPS:,}-step budget")


def run_seed(seed: int, settings: str, *, threshold: float, timeout_s: float, config: Path,
             threads: int = 1) -> PeerRun:
    """One SB3 run in a fresh ``sys.executable`` process with ``threads`` torch threads: start-up from process start
    to ``learn()``."""
    from bench.peers.proc import by_event, json_events, run_lines

    cmd = [sys.executable, "-m", "bench.peers.sb3_peer", "--settings", settings, "--seed", str(seed),
           "--threshold", str(threshold), "--max-s", str(timeout_s), "--config", str(config),
           "--threads", str(threads)]
    res = run_lines(cmd, timeout_s=timeout_s + 120.0, cwd=REPO_ROOT)
    events = by_event(json_events(line for _, line in res.lines))
    start, done = events.get("learn_start"), events.get("done")
    startup = None if start is None else start["wall"] - res.wall_start
    solved = None if done is None else done["solved"]
    error = None
    if done is None:
        error = f"no result ({'timed out' if res.timed_out else f'exit {res.rc}'}); output tail:\n{res.tail()}"
    elif solved is None:
        error = (f"last-100 did not reach {threshold:g} ({done['env_steps']:,} env steps, {done['learn_s']:.0f} s, "
                 f"last-100 {done['last100']:.1f})")
    return PeerRun("SB3 PPO", settings, seed, startup, None if solved is None else float(solved[0]),
                   None if solved is None else int(solved[1]), error,
                   {} if done is None else {"episodes": done["episodes"]})



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.sb3_peer")
    p.add_argument("--settings", choices=("rl-zoo", "flywheel"), required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--threshold", type=float, default=475.0)
    p.add_argument("--max-s", type=float, default=300.0)
    p.add_argument("--config", type=Path, default=Path("configs/cartpole.yaml"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    a = p.parse_args(argv)

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    from bench.peers.sb3_watch import SolvedWatch
    from bench.sb3 import _lin, zoo_config

    torch.set_num_threads(a.threads)
    if a.settings == "rl-zoo":
        cfg = zoo_config("CartPole-v1")
        n_envs, total = cfg["n_envs"], cfg["n_timesteps"]
        kwargs: dict[str, Any] = {k: _lin(v[1]) if isinstance(v, tuple) else v for k, v in cfg["ppo"].items()}
    else:
        n_envs, kwargs = flywheel_kwargs(a.config)
        total = FLYWHEEL_TOTAL_STEPS
    env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=a.seed)
    model = PPO("MlpPolicy", env, seed=a.seed, device="cpu", verbose=0, **kwargs)
    watch = SolvedWatch(a.threshold, a.max_s)
    t0 = time.monotonic()
    model.learn(total_timesteps=total, callback=watch, progress_bar=False)
    env.close()
    recent = [r for _, _, r in watch.curve[-100:]]
    emit({"event": "done", "solved": watch.solved, "episodes": len(watch.curve), "env_steps": int(model.num_timesteps),
          "learn_s": time.monotonic() - t0, "last100": sum(recent) / max(len(recent), 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
