"""Stable-Baselines3 PPO on Pong as a throughput side of the Pong figure (``bench.figures.peers_pong``): env steps
TRAINED per second with Flywheel's settings and Flywheel's network, in a fresh process per seed so start-up
(imports, envs, model) is measured.

What is shared (``atari_kwargs``, from ``configs/pong.yaml`` run by 2 samplers):

- envs: 2 samplers x ``env.num_envs`` (4) = 8 envs, SB3's ``n_envs``; one update's samples
  (``batch_fragments x fragment_steps x num_envs`` = 1024) become its rollout (``n_steps`` 128 per env);
- the update: epochs (4), minibatch size (samples / ``minibatches`` = 256), learning rate and clip range (linear
  over ``anneal_env_steps`` then held, as in ``bench.peers.sb3_peer``), gamma, GAE lambda, entropy coefficient,
  value coefficient / 2 (Flywheel's value loss is 0.5 x MSE, SB3's is MSE: same gradient), gradient clip,
  per-minibatch advantage normalisation, Adam with eps 1e-5 (both);
- the network: ``shared.rl.model.make_torso("nature_cnn", ...)`` itself as SB3's features extractor
  (``bench.peers.sb3_minatar_policy.FlywheelTorso``: Mnih et al. 2015, three convolutions and 512 units), shared
  by linear policy and value heads (``net_arch=[]``, ``share_features_extractor=True``), orthogonal init with the
  same gains (sqrt 2 torso, 0.01 policy head, 1 value head);
- the env: each env is made as ``shared.rl.envs`` makes Flywheel's (``ALE/Pong-v5``, ``frameskip=1``,
  ``repeat_action_probability=0``, gymnasium's ``AtariPreprocessing``: up to 30 no-ops, frame skip 4 with
  max-pooling, 84x84 grayscale, no life-loss termination), plus a channel axis (``[84, 84]`` -> ``[84, 84, 1]``,
  the same bytes) that SB3's frame stacking needs; ``VecFrameStack(4)`` stacks them as Flywheel's
  ``shared.rl.frames`` does (oldest first, zeros before an episode's first frame); uint8 frames, which SB3 sees as
  an image space, transposes to channels first (``VecTransposeImage``) and divides by 255 (``normalize_images``),
  as Flywheel's ``ImageActorCritic`` does: both nets see 0-1 inputs.

``NOT_SHARED`` lists what differs. Run as ``python -m bench.peers.sb3_atari --seed 1 --run-s 120
[--torch-threads K]`` (CPU; K defaults to the machine's cores, torch's own default being all of them): it prints
``{"event": "learn_start", "wall": ...}`` when ``learn()`` begins, one ``{"event": "progress", "t": seconds since
learn start, "trained": env steps trained so far, "rollout_s": ..., "train_s": ...}`` after each update's
``train()`` returns, and ``{"event": "done", ...}`` after stopping at the first env step past ``--run-s``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from bench.peers.proc import emit
from bench.peers.sb3_peer import UNEXPRESSIBLE, ppo_kwargs, update_shape
from devstack import REPO_ROOT

if TYPE_CHECKING:
    import gymnasium as gym

    from bench.peers.proc import ProcResult
    from bench.peers.throughput import ThroughputRun

PEER = "SB3 PPO"
CONFIG = REPO_ROOT / "configs" / "pong.yaml"
BUDGET_STEPS = 50_000_000  # SB3 needs a total for its schedules; the wall budget stops it long before
TORSO = "nature_cnn"

NOT_SHARED = (
    "asynchrony: Flywheel's 2 samplers act on a policy ~2 versions old while the trainer trains (max_staleness "
    "8, credit flow control); SB3 collects a rollout with the current policy, then trains on it, in turn: its "
    "envs stand still while it trains and its learner while it steps",
    "parallelism: Flywheel's samplers, trainer, paramsync and admin are separate processes spread over the cores "
    "(samplers run the CNN with sampler.torch_threads 1); SB3 steps its 8 envs one after another in one process "
    "(DummyVecEnv) and runs the CNN, for acting and training, on --torch-threads threads (default: the machine's "
    "cores, as torch's own default)",
    "the objective: configs/pong.yaml trains with the decoupled objective (clip around the policy at the "
    "update's start, truncated importance weight to the behaviour policy, cap 5); SB3 has plain PPO, clipped "
    "around the behaviour policy: the two are the same at zero lag, and cost the same to compute",
    "the value loss: Flywheel's is 0.5 x MSE, SB3's is MSE, so vf_coef / 2 is passed (same gradient)",
    "the schedules: Flywheel anneals over trained env steps and holds; SB3 over progress of a fixed "
    f"{BUDGET_STEPS:,}-step budget, mapped so both reach the end value at anneal_env_steps (10M, far beyond a run)",
    "the wire: Flywheel's samplers send single frames (zstd-compressed) through Kafka and the trainer rebuilds the "
    "stacks; SB3 keeps the stacked frames in its rollout buffer, in memory",
    "the vector env: Flywheel's samplers use gymnasium's SyncVectorEnv (same-step autoreset), SB3 its DummyVecEnv "
    "with a Monitor per env; the same env construction; seeds differ",
)


def atari_kwargs(config: Path = CONFIG, *, with_policy: bool = True) -> tuple[int, int, dict[str, Any]]:
    """(n_envs, frames stacked, PPO kwargs) equivalent to ``config`` run by ``SAMPLERS`` samplers; a ValueError
    names any setting SB3 cannot express (observation or reward normalisation, separate gradient clips, an
    advantage floor, the rollback guard, another network). ``with_policy=False`` leaves ``policy_kwargs`` empty
    (they need stable-baselines3: :func:`policy_kwargs`)."""
    from shared.rl.envs import default_frame_stack

    s, n_envs, batch = update_shape(config, UNEXPRESSIBLE)
    tr, env = s.trainer, s.env
    if tr.model not in (TORSO, "auto"):
        raise ValueError(f"the SB3 Pong peer builds the Nature CNN only: {tr.model=}")
    stack = env.frame_stack if env.frame_stack is not None else default_frame_stack(env.id)
    return n_envs, stack, ppo_kwargs(tr, n_envs, batch, BUDGET_STEPS, policy_kwargs() if with_policy else {})


def policy_kwargs() -> dict[str, Any]:
    """Flywheel's Nature CNN as SB3's features extractor, shared by linear heads, on frames scaled to 0-1."""
    from bench.peers.sb3_minatar_policy import FlywheelTorso  # stable-baselines3: the bench extra, imported here only

    return {"features_extractor_class": FlywheelTorso, "features_extractor_kwargs": {"kind": TORSO}, "net_arch": [],
            "share_features_extractor": True, "normalize_images": True}


def describe(config: Path = CONFIG, torch_threads: int | None = None) -> str:
    from shared.settings import load_settings

    n_envs, stack, kw = atari_kwargs(config)
    tr = load_settings(str(config)).trainer
    lr = f"{tr.learning_rate:g}" + ("" if tr.learning_rate_end is None else
                                    f" -> {tr.learning_rate_end:g} over {tr.anneal_env_steps:,} env steps then held")
    clip = f"{tr.clip_coef:g}" + ("" if tr.clip_coef_end is None else f" -> {tr.clip_coef_end:g} likewise")
    kl = "none" if kw["target_kl"] is None else f"{kw['target_kl']:.4f} (= {tr.target_kl} / 1.5)"
    threads = torch_threads if torch_threads is not None else default_threads()
    return (f"PPO('CnnPolicy'), n_envs {n_envs} (DummyVecEnv), VecFrameStack({stack}), n_steps {kw['n_steps']}, "
            f"batch_size {kw['batch_size']}, n_epochs {kw['n_epochs']}, learning_rate {lr}, clip_range {clip}, "
            f"gamma {kw['gamma']}, gae_lambda {kw['gae_lambda']}, ent_coef {kw['ent_coef']}, vf_coef "
            f"{kw['vf_coef']:g} (= {tr.vf_coef} x 0.5 MSE), max_grad_norm {kw['max_grad_norm']}, target_kl {kl}, "
            f"features extractor shared.rl.model {TORSO}, net_arch [], shared torso, normalize_images (uint8 -> 0-1), "
            f"CPU, {threads} torch threads")


def default_threads() -> int:
    """The machine's cores (those this process may run on)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def channel_axis(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    """``[H, W]`` grayscale frames as ``[H, W, 1]`` (the bytes unchanged): SB3's frame stacking wants a channel
    axis."""
    from gymnasium.wrappers import ReshapeObservation

    shape = env.observation_space.shape
    if shape is None or len(shape) != 2:
        raise ValueError(f"want [H, W] grayscale frames from Flywheel's Atari preprocessing, got {shape}")
    return ReshapeObservation(env, (*shape, 1))


def run_child(seed: int, run_s: float, torch_threads: int | None = None, *, config: Path = CONFIG,
              grace_s: float = 120.0) -> ThroughputRun:
    """One SB3 run in a fresh ``sys.executable`` process, stopped by itself ``run_s`` seconds after
    ``learn()`` began (killed ``grace_s`` later if it did not stop)."""
    from bench.peers.envpool_raw import run_measured

    threads = torch_threads if torch_threads is not None else default_threads()
    cmd = [sys.executable, "-m", "bench.peers.sb3_atari", "--seed", str(seed), "--run-s", str(run_s),
           "--torch-threads", str(threads), "--config", str(config)]
    res, cores = run_measured(cmd, timeout_s=run_s + grace_s, cwd=REPO_ROOT)
    return run_of(seed, res, cores, threads)


def run_of(seed: int, res: ProcResult, cores: float | None, torch_threads: int) -> ThroughputRun:
    """The ``ThroughputRun`` a finished child's output makes (pure: the tests feed it lines). The series starts
    at (0, 0), learn start, and has a point per finished update."""
    from bench.peers.proc import by_event, json_events
    from bench.peers.throughput import ThroughputRun, series_of

    events = json_events(line for _, line in res.lines)
    last = by_event(events)
    start, done = last.get("learn_start"), last.get("done")
    startup = None if start is None else float(start["wall"]) - res.wall_start
    updates = [ev for ev in events if ev.get("event") == "progress"]
    extra: dict[str, Any] = {"cores": cores, "torch_threads": torch_threads, "updates": len(updates),
                             "rollout_s_mean": fmean(float(u["rollout_s"]) for u in updates) if updates else None,
                             "train_s_mean": fmean(float(u["train_s"]) for u in updates) if updates else None}
    if done is not None:
        extra.update({k: done[k] for k in ("cores_learning", "torch_default_threads", "n_envs", "n_steps",
                                          "stable_baselines3", "torch") if k in done})
    error = None
    try:
        series = series_of([(0.0, 0), *((float(u["t"]), int(u["trained"])) for u in updates)])
    except (KeyError, ValueError) as exc:
        series, error = (), f"bad progress lines: {exc}"
    if done is None and error is None:
        error = f"no result ({'timed out' if res.timed_out else f'exit {res.rc}'}); output tail:\n{res.tail()}"
    return ThroughputRun(PEER, seed, startup, series, error, extra)



def make_env_fn(env_id: str) -> tuple[dict[str, Any], Callable[[gym.Env[Any, Any]], gym.Env[Any, Any]]]:
    """``gym.make`` kwargs and the wrapper SB3's ``make_vec_env`` applies to each env (after its Monitor):
    ``shared.rl.envs.env_options``'s, Flywheel's own construction, then :func:`channel_axis`."""
    from shared.rl.envs import env_options, register_image_envs

    register_image_envs(env_id)
    kwargs, wrappers = env_options(env_id)

    def wrap(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
        for flywheel_wrapper in wrappers:
            env = flywheel_wrapper(env)
        return channel_axis(env)

    return kwargs, wrap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.sb3_atari")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--run-s", type=float, required=True, help="seconds of learning, from learn()'s start")
    p.add_argument("--torch-threads", type=int, default=default_threads(),
                   help="torch intra-op threads (default: the machine's cores)")
    p.add_argument("--config", type=Path, default=CONFIG)
    a = p.parse_args(argv)
    if a.run_s <= 0:
        p.error(f"--run-s must be > 0, got {a.run_s}")
    if a.torch_threads < 1:
        p.error(f"--torch-threads must be >= 1, got {a.torch_threads}")

    import importlib.metadata

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecFrameStack

    from bench.peers.sb3_atari_policy import UpdateWatch
    from shared.settings import load_settings

    torch_default = torch.get_num_threads()
    torch.set_num_threads(a.torch_threads)
    env_id = load_settings(str(a.config)).env.id
    n_envs, stack, kwargs = atari_kwargs(a.config)
    make_kwargs, wrapper = make_env_fn(env_id)
    env = VecFrameStack(make_vec_env(env_id, n_envs=n_envs, seed=a.seed, env_kwargs=make_kwargs,
                                     wrapper_class=wrapper), n_stack=stack)
    model = PPO("CnnPolicy", env, seed=a.seed, device="cpu", verbose=0, **kwargs)
    watch = UpdateWatch(a.run_s)
    model.learn(total_timesteps=BUDGET_STEPS, callback=watch, progress_bar=False)
    env.close()
    emit({"event": "done", "trained": watch.trained, "collected": int(model.num_timesteps),
          "learn_s": round(watch.learn_s, 4), "cores_learning": watch.cores, "torch_threads": torch.get_num_threads(),
          "torch_default_threads": torch_default, "n_envs": n_envs, "n_steps": kwargs["n_steps"],
          "obs_shape": list(model.observation_space.shape or ()), "stable_baselines3":
          importlib.metadata.version("stable-baselines3"), "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
