"""Sample Factory 2.1.1 APPO on CartPole-v1 as a peer, in its own virtualenv that the bench creates.

SF 2.1.1 needs numpy < 2 and gymnasium < 1.0, which Flywheel's environment does not have, so
``ensure_venv`` makes ``.flywheel/cache/peers/sf-venv`` (``python3.11 -m venv``, then pip; pip's cache
keeps a second setup fast) and marks it done only once ``sample_factory`` imports there.

The settings are SF's documented CartPole-v1 command line (``sf_examples/train_gym_env.py`` at ``v2.1.1``,
its docstring), unchanged except where the run must differ: a seed, the experiment name and a train_dir
of our own, and ``--device=cpu`` (SF's default ``gpu`` fails without one; every peer here runs on the CPU).
``--num_workers`` keeps its default, the machine's CPU count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from bench.context import BENCH_HOME
from bench.peers.proc import run_lines
from bench.peers.run import PeerRun
from bench.peers.sf_log import SfLog
from bench.peers.venv import build_venv
from devstack import REPO_ROOT

VENV = REPO_ROOT / ".flywheel" / "cache" / "peers" / "sf-venv"
REQUIREMENTS = ("sample-factory==2.1.1", "numpy<2", "gymnasium<1.0")
PYTHON = "python3.11"
DOCUMENTED_ARGS = ("--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
                   "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1",
                   "--save_every_sec=10", "--experiment_summaries_interval=10", "--env=CartPole-v1")
SOURCE = "sf_examples/train_gym_env.py docstring, sample-factory v2.1.1"


def venv_python() -> Path:
    from bench.peers import venv

    return venv.venv_python(VENV)


def ensure_venv(timeout_s: float = 3600.0) -> Path:
    """The SF virtualenv's python, built first when it is missing or incomplete."""
    probe = ("import sample_factory, numpy, gymnasium, torch; print('numpy', numpy.__version__, 'gymnasium', "
             "gymnasium.__version__, 'torch', torch.__version__)")
    return build_venv(VENV, REQUIREMENTS, probe=probe, what="Sample Factory", python=PYTHON, timeout_s=timeout_s,
                      note="the first time downloads torch, minutes")


def versions() -> str:
    out = subprocess.run([str(venv_python()), "-c", "import importlib.metadata as m; print(', '.join(f'{p} ' + "
                          "m.version(p) for p in ('sample-factory', 'torch', 'numpy', 'gymnasium')))"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "unknown"


def command(seed: int, train_dir: Path, experiment: str) -> list[str]:
    return [str(venv_python()), "-m", "sf_examples.train_gym_env", *DOCUMENTED_ARGS, "--device=cpu", f"--seed={seed}",
            f"--experiment={experiment}", f"--train_dir={train_dir}"]


def run_seed(seed: int, *, threshold: float, timeout_s: float, stamp: str) -> PeerRun:
    """One SF run until its own last-100 report reaches ``threshold`` (then it is stopped) or ``timeout_s``."""
    ensure_venv()
    home = BENCH_HOME / "runs" / f"peers-sf-{stamp}-seed{seed}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled")

    def reached(t: float, line: str) -> bool:
        r = log.feed(t, line)
        return r is not None and r.last100 is not None and r.last100 >= threshold

    log = SfLog()
    res = run_lines(command(seed, home / "train_dir", f"cartpole-seed{seed}"), timeout_s=timeout_s, env=env,
                    cwd=home, on_line=reached, log=home / "console.log")
    solved = log.first_reaching(threshold)
    startup = log.ready_t
    last = log.reports[-1] if log.reports else None
    best = max((r.last100 for r in log.reports if r.last100 is not None), default=None)
    error = None
    if solved is None:
        why = (f"timed out after {timeout_s:.0f} s" if res.timed_out else f"exited with {res.rc}")
        error = (f"{why}; last report: {last.env_steps:,} env steps, last-100 {last.last100}, best {best}" if last
                 else f"{why} before its first report; output tail:\n{res.tail()}")
    return PeerRun("Sample Factory APPO", "SF example", seed, startup,
                   None if solved is None or startup is None else solved.t - startup,
                   None if solved is None else solved.env_steps, error,
                   {"reports": len(log.reports), "best_last100": best,
                    "last_env_steps": None if last is None else last.env_steps, "log": str(home / "console.log")})
