"""Stable-Baselines3 PPO on MinAtar Breakout as a peer at a fixed wall budget, with Flywheel's settings and
Flywheel's network, in a fresh process per seed so start-up (imports, envs, model) is measured.

What is shared (``minatar_kwargs``, from ``configs/minatar-breakout.yaml`` run by 2 samplers):

- envs: 2 samplers x ``env.num_envs`` envs become SB3's ``n_envs``; one update's samples
  (``batch_fragments x fragment_steps x num_envs``) become its rollout (``n_steps`` per env);
- the update: epochs, minibatch size (samples / ``minibatches``), learning rate and clip range (constant, or
  linear over ``anneal_env_steps`` then held, as in ``bench.peers.sb3_peer``), gamma, GAE lambda, entropy
  coefficient, value coefficient / 2 (Flywheel's value loss is 0.5 x MSE, SB3's is MSE: same gradient),
  gradient clip, per-minibatch advantage normalisation, Adam with eps 1e-5 (both);
- the network: ``shared.rl.model.make_torso("minatar_cnn", ...)`` itself as SB3's features extractor (one 3x3
  convolution of 16 channels, ReLU, flatten, 128 units, ReLU; Young & Tian 2019), shared by linear policy and
  value heads (``net_arch=[]``, ``share_features_extractor=True``), orthogonal init with the same gains
  (sqrt 2 torso, 0.01 policy head, 1 value head);
- the observations: as samplers send them, uint8 frames with booleans as 0/255 (``shared.rl.envs.as_observation``),
  channels last. SB3 sees a uint8 [0, 255] image space, transposes it to channels first (``VecTransposeImage``)
  and divides by 255 (``normalize_images``), as Flywheel's ``ImageActorCritic`` does: both nets see 0/1 inputs.

``NOT_SHARED`` lists what SB3 cannot express. Run as ``python -m bench.peers.sb3_minatar --seed 1 --wall-s 600
--threads 2`` (torch threads, default 1; CPU): it prints one JSON line ``{"event": "learn_start", "wall": ...}``
when ``learn()`` begins and one ``{"event": "done", ...}`` after stopping at the budget (``curve``: [seconds since
learn() began, env steps, return] per finished episode within the budget).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from bench.peers.proc import emit
from bench.peers.sb3_peer import UNEXPRESSIBLE, ppo_kwargs, update_shape
from devstack import REPO_ROOT
from shared.rl.envs import as_observation

CONFIG = REPO_ROOT / "configs" / "minatar-breakout.yaml"
BUDGET_STEPS = 50_000_000  # SB3 needs a total for its schedules; the wall budget stops it long before
WINDOW = 100  # episodes in the last-N mean

NOT_SHARED = (
    "asynchrony: Flywheel's 2 samplers act on a policy ~2 versions old while the trainer trains "
    "(max_staleness 8, credit flow control); SB3 collects with the current policy, then trains, in turn",
    "parallelism: Flywheel's samplers, trainer, paramsync and admin are separate processes spread over the "
    "machine's cores (samplers run the CNN in onnxruntime); SB3 steps its envs and trains in one process, with as "
    "many torch threads as the machine has cores (the figure's `sb3_threads`), so only its torch ops spread",
    "the objective: configs/minatar-breakout.yaml trains with the decoupled objective (clip around the policy at "
    "the update's start, truncated importance weight to the behaviour policy, cap 5); SB3 has plain PPO, clipped "
    "around the behaviour policy: the two are the same at zero lag",
    "the value loss: Flywheel's is 0.5 x MSE, SB3's is MSE, so vf_coef / 2 is passed (same gradient)",
    "the vector env: Flywheel's samplers use gymnasium's SyncVectorEnv (same-step autoreset), SB3 its "
    "DummyVecEnv; both make MinAtar/Breakout-v1 with MinAtar's defaults (sticky actions 0.1); seeds differ",
)


class Uint8Frames(gym.ObservationWrapper[np.ndarray, Any, Any]):
    """MinAtar's boolean frames as samplers send them: uint8, 0 or 255, same shape (channels last)."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        shape = env.observation_space.shape
        if shape is None:
            raise ValueError(f"image frames need a shaped observation space, got {env.observation_space}")
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        return as_observation(observation, "uint8")


def minatar_kwargs(config: Path = CONFIG) -> tuple[int, dict[str, Any]]:
    """(n_envs, PPO kwargs) equivalent to ``config`` run by ``SAMPLERS`` samplers; a ValueError names any
    setting SB3 cannot express (frame stacking, observation or reward normalisation, separate gradient clips,
    an advantage floor, the rollback guard, another network)."""
    s, n_envs, batch = update_shape(config, ("env.frame_stack", *UNEXPRESSIBLE))
    tr = s.trainer
    if tr.model not in ("minatar_cnn", "auto"):
        raise ValueError(f"the SB3 peer builds MinAtar's CNN only: {tr.model=}")
    from bench.peers.sb3_minatar_policy import MinAtarCNN  # stable-baselines3: the bench extra, imported here only

    return n_envs, ppo_kwargs(tr, n_envs, batch, BUDGET_STEPS,
                              {"features_extractor_class": MinAtarCNN, "net_arch": [],
                               "share_features_extractor": True, "normalize_images": True})


def describe(config: Path = CONFIG, threads: int = 1) -> str:
    from shared.settings import load_settings

    n_envs, kw = minatar_kwargs(config)
    tr = load_settings(str(config)).trainer
    lr = f"{tr.learning_rate:g}" + ("" if tr.learning_rate_end is None else
                                    f" -> {tr.learning_rate_end:g} over {tr.anneal_env_steps:,} env steps then held")
    clip = f"{tr.clip_coef:g}" + ("" if tr.clip_coef_end is None else f" -> {tr.clip_coef_end:g} likewise")
    kl = "none" if kw["target_kl"] is None else f"{kw['target_kl']:.4f} (= {tr.target_kl} / 1.5)"
    return (f"PPO('CnnPolicy'), n_envs {n_envs} (DummyVecEnv), n_steps {kw['n_steps']}, batch_size "
            f"{kw['batch_size']}, n_epochs {kw['n_epochs']}, learning_rate {lr}, clip_range {clip}, gamma "
            f"{kw['gamma']}, gae_lambda {kw['gae_lambda']}, ent_coef {kw['ent_coef']}, vf_coef {kw['vf_coef']:g} "
            f"(= {tr.vf_coef} x 0.5 MSE), max_grad_norm {kw['max_grad_norm']}, target_kl {kl}, features "
            "extractor shared.rl.model minatar_cnn (conv 3x3 16, 128 units), net_arch [], shared torso, "
            f"normalize_images (uint8 0/255 frames -> 0/1), CPU, {threads} torch thread(s)")


@dataclass(frozen=True)
class ChildResult:
    """What one SB3 process reported: start-up (process start to ``learn()``), its ``done`` line, or why not."""

    startup_s: float | None
    done: dict[str, Any] | None
    error: str | None


def run_child(seed: int, *, wall_s: float, config: Path = CONFIG, grace_s: float = 120.0,
              threads: int = 1) -> ChildResult:
    """One SB3 run in a fresh ``sys.executable`` process with ``threads`` torch threads, stopped by itself at
    ``wall_s`` of learning (killed ``grace_s`` later if it did not stop)."""
    from bench.peers.proc import by_event, json_events, run_lines

    cmd = [sys.executable, "-m", "bench.peers.sb3_minatar", "--seed", str(seed), "--wall-s", str(wall_s),
           "--config", str(config), "--threads", str(threads)]
    res = run_lines(cmd, timeout_s=wall_s + grace_s, cwd=REPO_ROOT)
    events = by_event(json_events(line for _, line in res.lines))
    start, done = events.get("learn_start"), events.get("done")
    startup = None if start is None else float(start["wall"]) - res.wall_start
    error = None
    if done is None:
        error = f"no result ({'timed out' if res.timed_out else f'exit {res.rc}'}); output tail:\n{res.tail()}"
    return ChildResult(startup, done, error)



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.sb3_minatar")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--wall-s", type=float, required=True, help="seconds of learning, from learn()'s start")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    a = p.parse_args(argv)
    if a.wall_s <= 0:
        p.error(f"--wall-s must be > 0, got {a.wall_s}")

    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    from shared.rl.envs import register_image_envs
    from shared.settings import load_settings

    torch.set_num_threads(a.threads)
    env_id = load_settings(str(a.config)).env.id
    register_image_envs(env_id)
    n_envs, kwargs = minatar_kwargs(a.config)
    env = make_vec_env(env_id, n_envs=n_envs, seed=a.seed, wrapper_class=Uint8Frames)
    model = PPO("CnnPolicy", env, seed=a.seed, device="cpu", verbose=0, **kwargs)
    from bench.peers.sb3_watch import EpisodeWatch

    watch = EpisodeWatch(max_s=a.wall_s)
    t0 = time.monotonic()
    model.learn(total_timesteps=BUDGET_STEPS, callback=watch, progress_bar=False)
    learn_s = time.monotonic() - t0
    env.close()
    recent = [r for _, _, r in watch.curve[-WINDOW:]]
    emit({"event": "done", "env_steps": watch.steps_within, "total_env_steps": int(model.num_timesteps),
           "learn_s": learn_s, "episodes": len(watch.curve), "curve": watch.curve,
           "last100": sum(recent) / len(recent) if recent else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
