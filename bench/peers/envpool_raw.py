"""EnvPool's raw Pong rate: random actions, nothing learned, the ceiling of the Pong throughput figure
(``bench.figures.peers_pong``).

EnvPool is not in Flywheel's environment, so ``ensure_venv`` makes ``.flywheel/cache/peers/envpool-venv``
(``python3.11 -m venv``, then ``pip install envpool``) and marks it done only once ``envpool`` makes Pong there.
The child runs this file by path in that venv (``<venv python> bench/peers/envpool_raw.py --child --seconds 20
--num-envs 8 --threads 2 --seed 1``); it imports only numpy, envpool and the standard library, so nothing at this
module's top level may import more. It prints one JSON line ``{"event": "first_step", "wall": ...}`` just before
its first ``step``, a ``{"event": "progress", "t": seconds since the first step, "stepped": env steps}`` line
about every second, and ``{"event": "done", ...}`` after ``--seconds``.

``SETTINGS`` are EnvPool's Pong-v5 options chosen to match Flywheel's preprocessing (``shared.rl.envs``:
``ALE/Pong-v5`` with ``frameskip=1`` and ``repeat_action_probability=0``, gymnasium's ``AtariPreprocessing``
with up to 30 no-ops at reset, frame skip 4 with max-pooling of the last two frames, 84x84 grayscale by
``cv2.INTER_AREA``, no life-loss termination, rewards unclipped; 4 frames stacked for the policy; the minimal
action set; 108,000 emulator frames = 27,000 env steps an episode at most). One vector step of ``num_envs``
envs (``batch_size = num_envs``: synchronous, as a PPO rollout steps them) counts ``num_envs`` env steps.

The parent (``run``) returns a ``ThroughputRun``: start-up is from process start to the first step, the series
counts env steps stepped, ``extra`` has the cores the child used (its CPU time over its wall time) and the
settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.peers.proc import ProcResult
    from bench.peers.throughput import ThroughputRun

PEER = "EnvPool (raw)"
TASK = "Pong-v5"
REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".flywheel" / "cache" / "peers" / "envpool-venv"
REQUIREMENTS = ("envpool",)
PYTHON = "python3.11"
NUM_ENVS = 8  # 2 samplers x env.num_envs of configs/pong.yaml, SB3's n_envs
PROGRESS_EVERY_S = 1.0

# EnvPool's Atari options (its docs/api/atari.rst and the config of envpool.make_spec), set to Flywheel's Pong.
SETTINGS: dict[str, Any] = {
    "img_height": 84,                    # AtariPreprocessing(screen_size=84)
    "img_width": 84,
    "gray_scale": True,                  # grayscale_obs=True
    "stack_num": 4,                      # env.frame_stack 4 (the frames the policy sees)
    "frame_skip": 4,                     # frame_skip=4, max over the last two frames (both)
    "noop_max": 30,                      # noop_max=30
    "episodic_life": False,              # terminal_on_life_loss=False
    "zero_discount_on_life_loss": False,
    "reward_clip": False,                # rewards unclipped
    "repeat_action_probability": 0.0,    # gym.make(..., repeat_action_probability=0.0)
    "use_fire_reset": False,             # AtariPreprocessing presses no FIRE at reset
    "full_action_space": False,          # ALE v5's default: the game's minimal action set (6 for Pong)
    "use_inter_area_resize": True,       # cv2.INTER_AREA, as AtariPreprocessing resizes
    "max_episode_steps": 27_000,         # ALE v5: 108,000 emulator frames / frame skip 4
}


# ---- the parent: Flywheel's venv --------------------------------------------------------------------------------
def venv_python() -> Path:
    from bench.peers import venv

    return venv.venv_python(VENV)


def ensure_venv(timeout_s: float = 1800.0) -> Path:
    """The EnvPool virtualenv's python, built first when it is missing or incomplete (ready only once EnvPool
    makes ``TASK`` there)."""
    from bench.peers.venv import build_venv

    probe = (f"import envpool, numpy; envpool.make({TASK!r}, env_type='gymnasium', num_envs=1).close(); "
             "print('envpool', envpool.__version__, 'numpy', numpy.__version__)")
    return build_venv(VENV, REQUIREMENTS, probe=probe, what="EnvPool", python=PYTHON, timeout_s=timeout_s)


def progress_series(events: list[dict[str, Any]], count: str) -> tuple[tuple[float, int], ...]:
    """(t, ``count``) of every ``progress`` event, as a checked ``ThroughputRun`` series (a falling count raises)."""
    from bench.peers.throughput import series_of

    return series_of((float(ev["t"]), int(ev[count])) for ev in events if ev.get("event") == "progress")


def run_measured(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                 cwd: Path = REPO) -> tuple[ProcResult, float | None]:
    """``run_lines(cmd)`` and the cores the child used: its CPU seconds (user + system, from
    ``RUSAGE_CHILDREN``, so counted once it is reaped) over its wall time. Children reaped by other threads in
    the meantime would be counted too: run one side at a time."""
    from bench.peers.proc import run_lines

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    res = run_lines(cmd, timeout_s=timeout_s, env=env, cwd=cwd)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res, (cpu / wall if wall > 0 else None)


def child_command(seed: int, seconds: float, threads: int, num_envs: int = NUM_ENVS) -> list[str]:
    return [str(venv_python()), str(Path(__file__).resolve()), "--child", "--seconds", str(seconds), "--num-envs",
            str(num_envs), "--threads", str(threads), "--seed", str(seed)]


def run(seed: int, run_s: float, threads: int, *, num_envs: int = NUM_ENVS, grace_s: float = 120.0) -> ThroughputRun:
    """One EnvPool child stepping ``num_envs`` Pong envs on ``threads`` threads for ``run_s`` seconds."""
    import subprocess

    from bench.peers.throughput import ThroughputRun

    try:
        ensure_venv()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return ThroughputRun(PEER, seed, None, error=f"no EnvPool venv: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["PYTHONUNBUFFERED"] = "1"
    res, cores = run_measured(child_command(seed, run_s, threads, num_envs), timeout_s=run_s + grace_s, env=env)
    return run_of(seed, res, cores, threads, num_envs)


def run_of(seed: int, res: ProcResult, cores: float | None, threads: int, num_envs: int) -> ThroughputRun:
    """The ``ThroughputRun`` a finished child's output makes (pure: the tests feed it lines)."""
    from bench.peers.proc import by_event, json_events
    from bench.peers.throughput import ThroughputRun

    events = json_events(line for _, line in res.lines)
    last = by_event(events)
    first, done = last.get("first_step"), last.get("done")
    startup = None if first is None else float(first["wall"]) - res.wall_start
    extra: dict[str, Any] = {"cores": cores, "threads": threads, "num_envs": num_envs, "task": TASK,
                             "settings": dict(SETTINGS)}
    if done is not None:
        extra.update({k: done[k] for k in ("envpool", "numpy", "obs_shape", "obs_dtype", "num_actions",
                                          "cores_stepping") if k in done})
    error = None
    try:
        series = progress_series(events, "stepped")
    except (KeyError, ValueError) as exc:
        series, error = (), f"bad progress lines: {exc}"
    if done is None and error is None:
        error = f"no result ({'timed out' if res.timed_out else f'exit {res.rc}'}); output tail:\n{res.tail()}"
    return ThroughputRun(PEER, seed, startup, series, error, extra)


# ---- the child: EnvPool's venv (numpy, envpool and the standard library only) -----------------------------------
def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def child(seconds: float, num_envs: int, threads: int, seed: int) -> int:
    """Step ``num_envs`` envs with uniformly random actions for ``seconds`` after the first step."""
    import envpool  # type: ignore[import-not-found,unused-ignore]
    import numpy as np

    env = envpool.make(TASK, env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, num_threads=threads,
                       seed=seed, **SETTINGS)
    obs, _ = env.reset()
    n_actions = int(env.action_space.n)
    rng = np.random.default_rng(seed)
    emit({"event": "first_step", "wall": time.time()})
    cpu0 = time.process_time()
    t0 = time.monotonic()
    stepped, next_report, t = 0, PROGRESS_EVERY_S, 0.0
    while t < seconds:
        obs, *_ = env.step(rng.integers(0, n_actions, num_envs))
        stepped += num_envs
        t = time.monotonic() - t0
        if t >= next_report or t >= seconds:
            emit({"event": "progress", "t": round(t, 4), "stepped": stepped})
            next_report += PROGRESS_EVERY_S
    cpu = time.process_time() - cpu0
    env.close()
    emit({"event": "done", "stepped": stepped, "seconds": round(t, 4), "cores_stepping": cpu / t,
          "envpool": envpool.__version__, "numpy": np.__version__, "obs_shape": list(obs.shape),
          "obs_dtype": str(obs.dtype), "num_actions": n_actions})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="envpool_raw.py")
    p.add_argument("--child", action="store_true", required=True, help="step EnvPool (run in its venv)")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--num-envs", type=int, default=NUM_ENVS)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    for name in ("seconds", "num_envs", "threads"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    return child(a.seconds, a.num_envs, a.threads, a.seed)


if __name__ == "__main__":
    sys.exit(main())
