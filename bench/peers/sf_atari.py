"""Sample Factory 2.1.1 APPO on Pong as a throughput peer (figure ``peers_pong``): trained env steps per second.

The run is SF's documented Atari command (``docs/09-environment-integrations/atari.md`` at ``v2.1.1``:
``python -m sf_examples.atari.train_atari --algo=APPO --env=... --experiment=...``) with the example's own
defaults (``sf_examples/atari/atari_params.py``), in the bench's SF virtualenv (``bench.peers.sample_factory``).
``PINNED`` repeats defaults the comparison rests on (``ensure_atari`` checks that each equals SF's default, so
pinning changes nothing); ``CHANGED`` is all that differs from the documented command, each with why.

Those defaults already match Flywheel's Pong (``configs/pong.yaml``): 8 envs (8 rollout workers x 1 env,
``worker_num_splits`` 1), the Nature CNN (``convnet_atari``: conv 32 8x8/4, 64 4x4/2, 64 3x3/1, ReLU, then
``encoder_conv_mlp_layers`` [512]; no RNN; one torso for policy and value), and the update shape: rollouts of
128 steps, ``batch_size`` 256 x ``num_batches_per_epoch`` 4 = 1,024 samples an update, ``num_epochs`` 4
passes over them. SF's example is synchronous (``async_rl`` False): sampling and training alternate.
``NOT_SHARED`` lists where the env or learner still differ.

Two modes are run side by side (``MODES``): ``sync``, the example as documented, and ``async``, the same example
with SF's own defaults for asynchronous training on this machine (``async_layout``): ``async_rl`` True and double
buffering (``worker_num_splits`` 2), both SF's general defaults and part of its Atari page's "better parameters
(more envs, double buffering, async learning)", and one rollout worker per core (SF's ``num_workers`` default is
the machine's core count), capped at 4 so that the same 8 envs split into an even number per worker (double
buffering needs one env per split). Held back from those "better parameters", to keep every side's 8 envs and
update shape: 16 workers x 8 envs, rollout 32, batch 1,024 x 1 (a 128-env configuration for a large machine).
So the two modes differ in how sampling and training overlap and in the workers' layout, not in the envs or the
update.

Install: SF's documented ``pip install sample-factory[atari]`` is ``gymnasium[atari, accept-rom-license]``,
whose AutoROM step downloads the ROMs while it builds and fails without the internet. ``ensure_atari`` installs
ale-py 0.9.1 instead (it ships the ROMs and works with gymnasium 0.29.1). ale-py >= 0.9 registers
``PongNoFrameskip-v4`` when ``ale_py`` is imported, and SF's ``make_atari_env`` calls ``gym.make`` without
importing it, in every spawned rollout worker; a one-line ``.pth`` in the venv imports ``ale_py`` at start-up
in processes whose environment has ``FLYWHEEL_SF_ATARI=1`` (inherited by SF's workers; CartPole runs skip it).

The series counts what SF's learner has TRAINED on (``bench.peers.sf_log``): ``Total num frames`` is
``Learner.env_steps``, raised after each batch's epochs by its size x ``env_frameskip`` (the example sets
``summaries_use_frameskip``), so it is divided by the frame skip read from the run's own ``config.json``.
Cores are the SF process tree's CPU seconds (``/proc``: every live process of SF's session, with what each
has reaped) from its READY line to its last report, over that wall time.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.context import BENCH_HOME, say
from bench.peers import sample_factory as sf
from bench.peers.proc import run_lines
from bench.peers.sf_log import SfLog
from bench.peers.throughput import FRAME_SKIP, ThroughputRun, series_of

PEER = "Sample Factory APPO, sync (its example)"
PEER_ASYNC = "Sample Factory APPO, async"
MODULE = "sf_examples.atari.train_atari"
DOCUMENTED_ARGS = ("--algo=APPO", "--env=atari_pong")
SOURCE = "docs/09-environment-integrations/atari.md and sf_examples/atari/atari_params.py, sample-factory v2.1.1"
ENVS = 8  # Flywheel's Pong: 2 samplers x 4 envs
PINNED: tuple[tuple[str, Any, str], ...] = (  # (SF option, its Atari default, why the comparison needs it)
    ("num_workers", 8, "8 rollout workers x 1 env = Flywheel's 8 envs"),
    ("num_envs_per_worker", 1, "8 x 1 = 8 envs; a multiple of worker_num_splits"),
    ("worker_num_splits", 1, "no double-buffering: 1 env per worker"),
    ("encoder_conv_architecture", "convnet_atari", "the Nature CNN's convolutions (32 8x8/4, 64 4x4/2, 64 3x3/1)"),
    ("encoder_conv_mlp_layers", [512], "the Nature CNN's 512-unit layer"),
    ("nonlinearity", "relu", "the Nature CNN's activation"),
    ("use_rnn", False, "a feed-forward policy, as Flywheel's"),
    ("env_frameskip", 4, "4 emulator frames an env step, max-pooled over the last 2"),
    ("env_framestack", 4, "4 stacked 84x84 gray frames"),
)
CHANGED: tuple[tuple[str, str], ...] = (  # (flag, why) - all that differs from the documented command
    ("--device=cpu", "SF's default gpu fails without one; every side of the figure runs on the CPU"),
    ("--seed={seed}", "one run per seed, as every side"),
    ("--experiment={experiment}", "the docs' placeholder, named per seed"),
    ("--train_dir={train_dir}", "a fresh home under the bench's runs/ (SF resumes from an existing one)"),
)
NOT_SHARED = (
    "FIRE at reset: SF's FireResetEnv presses FIRE then action 2 after every reset (Pong has FIRE); Flywheel does not",
    "grayscale: SF max-pools and resizes the RGB frame to 84x84, then converts it to gray (gymnasium "
    "ResizeObservation, GrayScaleObservation); Flywheel takes ALE's gray frame (AtariPreprocessing): same shape, "
    "slightly different pixels, and SF's env handles 3x the bytes per frame",
    "frame stack: SF stacks in the env and its rollout workers hand 4x84x84 observations on; Flywheel's samplers "
    "send single frames and the trainer rebuilds the stacks",
    "episodic life and reward clipping: SF's EpisodicLifeEnv and ClipRewardEnv; neither changes Pong (ALE "
    "reports 0 lives; rewards are already -1/0/+1)",
    "observations: SF normalises inputs with running mean/std (normalize_input, after obs_scale 255); Flywheel "
    "divides by 255",
    "returns: SF normalises returns (normalize_returns); Flywheel's update uses raw returns",
    "asynchrony: SF's Atari example is synchronous (async_rl False: collect 1,024 samples, train, repeat), so the "
    "figure runs it as documented and also in async mode (async_layout); Flywheel's samplers keep acting while the "
    "trainer trains",
)
ATARI_REQUIREMENTS = ("ale-py==0.9.1",)
PTH_NAME = "flywheel_sf_atari.pth"
PTH_ENV = "FLYWHEEL_SF_ATARI"
PTH_LINE = f'import os; os.environ.get("{PTH_ENV}") == "1" and __import__("ale_py")\n'


def flag(name: str, value: Any) -> str:
    """``--name=value`` as SF's argparse reads it (lists space-free: one int each here)."""
    if isinstance(value, list):
        value = " ".join(str(v) for v in value)
    return f"--{name}={value}"


def async_layout(cores: int) -> dict[str, Any]:
    """The async mode's options on a machine with ``cores`` cores: ``async_rl`` and double buffering (SF's
    defaults, and in its Atari "better parameters"), one rollout worker per core as SF's ``num_workers`` default
    (at most 4, so each worker keeps an even number of envs, one or more per split), and ``ENVS`` envs in all, as
    every side of the figure (the module's docstring lists what is held back)."""
    workers = max(w for w in (1, 2, 4) if w <= max(cores, 1))
    return {"async_rl": True, "num_workers": workers, "num_envs_per_worker": ENVS // workers, "worker_num_splits": 2}


MODES = ("sync", "async")
"""``sync``: the documented example; ``async``: the example with ``async_layout`` for this machine's cores."""


def peer_name(mode: str) -> str:
    return {"sync": PEER, "async": PEER_ASYNC}[mode]


def changed_flags(seed: int, train_dir: Path, experiment: str) -> list[str]:
    """``CHANGED`` filled in for one run."""
    values = {"seed": seed, "experiment": experiment, "train_dir": train_dir}
    return [f.format(**values) for f, _ in CHANGED]


def command(seed: int, train_dir: Path, experiment: str, python: Path | None = None, mode: str = "sync",
            cores: int | None = None) -> list[str]:
    """SF's documented Atari command line, the pinned defaults (in ``async`` mode with ``async_layout`` of
    ``cores``, default the machine's, in their place and ``async_rl`` after them), and ``CHANGED``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    options: dict[str, Any] = {name: value for name, value, _ in PINNED}
    if mode == "async":
        options.update(async_layout(cores if cores is not None else os.cpu_count() or 1))
    return [str(python or sf.venv_python()), "-m", MODULE, *DOCUMENTED_ARGS,
            *(flag(name, value) for name, value in options.items()), *changed_flags(seed, train_dir, experiment)]


def env_count(cfg: dict[str, Any]) -> int:
    """Envs stepped in all: rollout workers x envs per worker (SF's ``num_envs`` in ``rl_utils``)."""
    workers, per_worker = int(cfg["num_workers"]), int(cfg["num_envs_per_worker"])
    splits = int(cfg["worker_num_splits"])
    if per_worker % splits:
        raise ValueError(f"num_envs_per_worker={per_worker} is not a multiple of worker_num_splits={splits}")
    return workers * per_worker


def frames_per_step(cfg: dict[str, Any]) -> int:
    """What one agent step adds to SF's ``Total num frames``: ``env_frameskip`` with ``summaries_use_frameskip``."""
    return int(cfg["env_frameskip"]) if cfg["summaries_use_frameskip"] else 1


def update_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The learner's update as the figure shows it: samples an update, passes over them, minibatches."""
    return {"samples_per_update": int(cfg["batch_size"]) * int(cfg["num_batches_per_epoch"]),
            "epochs": int(cfg["num_epochs"]), "minibatch": int(cfg["batch_size"]),
            "minibatches_per_epoch": int(cfg["num_batches_per_epoch"]), "rollout": int(cfg["rollout"]),
            "async_rl": bool(cfg["async_rl"])}


def trained_series(log: SfLog, frames_per: int) -> tuple[tuple[float, int], ...]:
    """(seconds since READY, agent steps trained) from READY (0 trained) to the last report."""
    if log.ready_t is None:
        return ()
    ready = log.ready_t
    return series_of([(0.0, 0), *((r.t - ready, r.env_steps // frames_per) for r in log.reports if r.t >= ready)])


# ---- the SF process tree's CPU time (/proc) -------------------------------------------------------------------
@dataclass(frozen=True)
class ProcStat:
    """One ``/proc/<pid>/stat``: ids and CPU ticks (user + system, own and reaped children's)."""

    pid: int
    ppid: int
    session: int
    ticks: int

    @classmethod
    def parse(cls, text: str) -> ProcStat:
        """``pid (comm) state ppid pgrp session ... utime stime cutime cstime ...`` (comm may hold spaces)."""
        pid = int(text[: text.index("(")])
        rest = text[text.rindex(")") + 2:].split()  # from ``state``: field 3 of proc(5)
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])  # fields 14-17
        return cls(pid, int(rest[1]), int(rest[3]), utime + stime + cutime + cstime)


def _stats() -> list[ProcStat]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append(ProcStat.parse((d / "stat").read_text()))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return out


def session_cpu_s(session: int) -> float:
    """CPU seconds of every live process of ``session``."""
    return sum(s.ticks for s in _stats() if s.session == session) / os.sysconf("SC_CLK_TCK")


def sf_session() -> int | None:
    """SF's session: our child running SF's Atari module (``run_lines`` starts it as a session leader)."""
    me = os.getpid()
    for s in _stats():
        if s.ppid == me and s.session == s.pid:
            try:
                if MODULE in Path(f"/proc/{s.pid}/cmdline").read_text():
                    return s.pid
            except OSError:
                continue
    return None


# ---- install and run --------------------------------------------------------------------------------------------
def _probe() -> str:
    """A script for SF's venv: makes and steps ``atari_pong`` and prints, as JSON, the observation shape, the
    action count and each ``PINNED`` option whose value is not the pin, parsed without and with the pins."""
    pins = {name: value for name, value, _ in PINNED}
    pinned = [*DOCUMENTED_ARGS, "--experiment=probe", *(flag(k, v) for k, v in pins.items())]
    return (f"import json; from sf_examples.atari.train_atari import parse_atari_args; "
            f"from sf_examples.atari.atari_utils import make_atari_env; "
            f"cfgs = [parse_atari_args(argv=a) for a in ({pinned[:3]!r}, {pinned!r})]; "
            f"env = make_atari_env('atari_pong', cfgs[0], None); obs, _ = env.reset(seed=0); env.step(0); "
            f"print(json.dumps({{'obs': list(obs.shape), 'actions': int(env.action_space.n), "
            f"'off': [(k, i, getattr(c, k)) for i, c in enumerate(cfgs) for k, v in {pins!r}.items() "
            f"if getattr(c, k) != v]}}))")


def ensure_atari(timeout_s: float = 1800.0) -> Path:
    """SF's venv with what its Atari example needs; checks that ``atari_pong`` makes and steps an env and that
    every ``PINNED`` value is SF's default. RuntimeError when it cannot."""
    python = sf.ensure_venv()
    marker = sf.VENV / ".flywheel-atari-ready"
    want = " ".join(ATARI_REQUIREMENTS) + " | " + PTH_LINE.strip()
    if marker.exists() and marker.read_text().strip() == want:
        return python
    say(f"peers: installing {', '.join(ATARI_REQUIREMENTS)} into {sf.VENV} for SF's Atari example")
    pip = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *ATARI_REQUIREMENTS, *sf.REQUIREMENTS[1:]],
                         capture_output=True, text=True, timeout=timeout_s)
    if pip.returncode != 0:
        raise RuntimeError(f"pip could not install {ATARI_REQUIREMENTS} into {sf.VENV}: {pip.stderr[-2000:]}")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    (Path(site) / PTH_NAME).write_text(PTH_LINE)
    env = {**_clean_env(), PTH_ENV: "1"}
    check = subprocess.run([str(python), "-c", _probe()], capture_output=True, text=True, timeout=300, env=env)
    if check.returncode != 0:
        raise RuntimeError(f"SF's atari_pong does not make an env in {sf.VENV}: {check.stderr[-2000:]}")
    got = json.loads(check.stdout.strip().splitlines()[-1])
    if got["obs"] != [4, 84, 84] or got["off"]:
        raise RuntimeError(f"SF's Atari example is not what {__name__} assumes: observations {got['obs']} (want "
                           f"[4, 84, 84]); pinned options that differ (option, 0 default / 1 pinned, value): "
                           f"{got['off']}")
    marker.write_text(want + "\n")
    say(f"peers: SF's atari_pong works ({got['actions']} actions, observations {got['obs']})")
    return python


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    return env


def _versions(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(', '.join(f'{p} ' + m.version(p) "
                          "for p in ('sample-factory', 'torch', 'numpy', 'gymnasium', 'ale-py')))"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "unknown"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_seed(seed: int, *, run_s: float, stamp: str, startup_timeout_s: float = 600.0,
             mode: str = "sync") -> ThroughputRun:
    """One SF run in ``mode`` (``MODES``), stopped ``run_s`` seconds after its READY line (or
    ``startup_timeout_s`` without one). An SF failure comes back as the run's ``error`` with the output's tail;
    only a broken install raises."""
    python = ensure_atari()
    peer = peer_name(mode)
    home = BENCH_HOME / "runs" / f"peers-pong-sf-{mode}-{stamp}-seed{seed}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    experiment = f"pong-{mode}-seed{seed}"
    cmd = command(seed, home / "train_dir", experiment, python, mode)
    log, cpu = SfLog(), []  # cpu: (t, SF session's CPU seconds) at READY and at each report
    session: list[int] = []

    def on_line(t: float, line: str) -> bool:
        was_ready = log.ready_t is not None
        log.feed(t, line)
        if log.ready_t is None:
            return False
        if not was_ready and (found := sf_session()) is not None:
            session.append(found)
        if session and (not was_ready or "Total num frames" in line):
            cpu.append((t, session_cpu_s(session[0])))
        return t - log.ready_t >= run_s

    rusage0 = _cpu_s()
    res = run_lines(cmd, timeout_s=startup_timeout_s + run_s, env={**_clean_env(), PTH_ENV: "1"}, cwd=home,
                    on_line=on_line, log=home / "console.log")
    log.close()
    rusage_s = _cpu_s() - rusage0
    wall = res.lines[-1][0] if res.lines else 0.0
    extra: dict[str, Any] = {"log": str(home / "console.log"), "command": " ".join(cmd), "versions": _versions(python),
                             "changed": changed_flags(seed, home / "train_dir", experiment),
                             "not_shared": list(NOT_SHARED)}
    cfg_path = home / "train_dir" / experiment / "config.json"
    cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    error = None
    if not cfg or log.ready_t is None or not log.reports:
        why = f"timed out after {startup_timeout_s + run_s:.0f} s" if res.timed_out else f"exited with {res.rc}"
        error = f"{why} before {'its config' if not cfg else 'READY' if log.ready_t is None else 'a report'}; " \
                f"output tail:\n{res.tail()}"
        return ThroughputRun(peer, seed, log.ready_t, trained_series(log, FRAME_SKIP), error, extra)
    per = frames_per_step(cfg)
    last = log.reports[-1]
    extra.update(
        envs=env_count(cfg), update=update_shape(cfg), frames_per_count=per,
        series_counts=f"agent steps TRAINED: SF's 'Total num frames' (Learner.env_steps, raised after each batch's "
                      f"epochs by its size x {per}) / {per}",
        collected_steps=last.samples, trained_steps=last.env_steps // per,
        sf_fps_steps=None if last.fps is None else {
            k: None if v != v else v / per for k, v in zip(("10s", "60s", "300s"), last.fps, strict=True)},
        cores=None if len(cpu) < 2 else (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]),
        # RUSAGE_CHILDREN sees only SF's main process: its workers die with the group and are never reaped by it
        cores_rusage_children=rusage_s / wall if wall else None)
    if res.rc not in (None, 0):
        error = f"exited with {res.rc} after {len(log.reports)} reports; output tail:\n{res.tail()}"
    return ThroughputRun(peer, seed, log.ready_t, trained_series(log, per), error, extra)
