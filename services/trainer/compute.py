"""``trainer.torch_threads: auto`` and ``trainer.precision: auto``, chosen by measurement when the trainer starts.

Threads: the cores this process may use (its CPU affinity, capped by a cgroup CPU quota, as a container limit
sets it) less ``trainer.cores_reserved`` (what the samplers and other services on the same host need), at least
one: never more threads than cores, which would only make the update's kernels wait on each other.

Precision on a CPU: float32 always; bfloat16 autocast only where the CPU has native bf16 arithmetic (``lscpu``
flags ``avx512_bf16`` or ``amx_bf16``), and only when one epoch of this run's update, timed on a batch of this
run's shapes (random data, a copy of the model and a fresh optimizer: the real model is untouched), runs at least
``BF16_SPEEDUP`` times faster in bf16 than in float32. An MLP on CartPole gains nothing from bf16 (casts cost more
than its tiny matmuls save) and stays float32; the convolutions of the Nature CNN are where bf16 units pay.
On a CUDA device ``auto`` is bf16 where the device supports it. An explicit ``fp32`` or ``bf16`` is taken as
given. The decision, its reason and the figures behind it are logged (``compute_chosen``), reported in the
trainer's heartbeat (``/status`` ``trainer.compute``) and exported as metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.trainer.update import ppo_update
from shared.fragment import Fragment, FragmentSpec
from shared.placement import cpu_list
from shared.rl.frames import stack_frames
from shared.settings import Settings, TrainerSettings

BF16_SPEEDUP = 1.3
"""bf16 is taken only when its timed epoch is at least this many times faster than float32's."""
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PROBE_RUNS = 3
"""Timed epochs per precision (after one untimed warm-up each, the precisions in turn); the median counts."""


@dataclass
class Compute:
    """What the trainer computes with, and why."""

    threads: int
    threads_reason: str
    precision: str  # "fp32" or "bf16": what the update runs
    precision_reason: str
    device: str
    cpu_model: str
    native_bf16: bool
    cpu_flags: list[str] = field(default_factory=list)
    """The CPU's matrix and vector flags that matter here (AVX-512, bf16, AMX, VNNI)."""
    fp32_samples_per_s: float | None = None
    """Env steps per second of one timed update epoch in float32 (None: not timed)."""
    bf16_samples_per_s: float | None = None
    cpus: str | None = None
    """The CPUs this process may run on at start, in the kernel's notation (``0``, ``2-5``): after
    ``trainer.dedicated_cores`` pinned it (shared/placement.py); None where the platform cannot say."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the machine ---------------------------------------------------------------------------------
def cpu_info(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The CPU's model name and its flags (empty where /proc/cpuinfo is not there)."""
    model, flags = "unknown", set[str]()
    try:
        text = path.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _own_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 ``cpu`` controller path (None where absent)."""
    v2 = v1 = None
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path
            elif "cpu" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """The tightest CPU quota, in cores, on this process's cgroup and its parents (v2 ``cpu.max``; v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None when none is set or none is readable."""
    v2, v1 = _own_cgroups(proc_cgroup)
    limits: list[float] = []
    if v2 is not None:
        d = root / v2.lstrip("/")
        while True:
            try:
                quota, period = (d / "cpu.max").read_text().split()[:2]
                if quota != "max":
                    limits.append(int(quota) / int(period))
            except (OSError, ValueError):
                pass
            if d == root or root not in d.parents:
                break
            d = d.parent
    if v1 is not None:
        for base in (root / "cpu", root / "cpu,cpuacct"):
            d = base / v1.lstrip("/")
            try:
                q = int((d / "cpu.cfs_quota_us").read_text())
                p = int((d / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if q > 0 and p > 0:
                limits.append(q / p)
            break
    return min(limits) if limits else None


def usable_cores(limit: float | None = None) -> tuple[float, str]:
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota (``limit``: that quota,
    read from this process's cgroups when None); and how that was found."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = os.cpu_count() or 1
    if limit is None:
        limit = cgroup_cpu_limit()
    if limit is not None and limit < affinity:
        return limit, f"cgroup CPU quota {limit:g} cores (affinity {affinity})"
    return float(affinity), f"{affinity} cores in its CPU affinity" + ("" if limit is None else
                                                                       f" (cgroup quota {limit:g})")


def choose_threads(cfg: TrainerSettings, cores: tuple[float, str] | None = None) -> tuple[int, str]:
    """``trainer.torch_threads``: as given, or for ``auto`` the usable cores less ``cores_reserved``, at least 1."""
    if cfg.torch_threads != "auto":
        return int(cfg.torch_threads), "trainer.torch_threads as set"
    have, how = cores if cores is not None else usable_cores()
    free = have - cfg.cores_reserved
    threads = max(1, int(free + 1e-9))
    return threads, (f"auto: {how}, less trainer.cores_reserved {cfg.cores_reserved:g} for the samplers and "
                     f"services beside it = {free:g} -> {threads} thread(s)")


# ---- the probe -----------------------------------------------------------------------------------
def probe_fragments(spec: FragmentSpec, count: int, steps: int, envs: int, seed: int = 0) -> list[Fragment]:
    """``count`` fragments of random data in this run's shapes (as a sampler of ``envs`` envs x ``steps`` steps
    makes them), for timing an update; never trained on by the real model."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        def obs(*lead: int) -> np.ndarray:
            shape = (*lead, *spec.obs_shape)
            if spec.obs_dtype == "uint8":
                return rng.integers(0, 256, shape, dtype=np.uint8)
            return rng.standard_normal(shape).astype(np.float32)

        if spec.continuous:
            actions = rng.standard_normal((steps, envs, *spec.action_shape)).astype(np.float32)
        else:
            actions = rng.integers(0, spec.num_actions, (steps, envs)).astype(np.int64)
        out.append(Fragment(
            obs=obs(steps, envs), actions=actions, logp=np.full((steps, envs), -1.0, np.float32),
            rewards=rng.standard_normal((steps, envs)).astype(np.float32),
            terminated=np.zeros((steps, envs), np.uint8), truncated=np.zeros((steps, envs), np.uint8),
            trunc_obs=obs(0), last_obs=obs(envs), episode_returns=np.zeros(0, np.float32),
            episode_lengths=np.zeros(0, np.int32), policy_version=0, sampler_id="probe", env_id=spec.env_id or "",
            obs_history=obs(spec.frame_stack - 1, envs) if spec.frame_stack > 1 else None))
    return out


def _epoch_runner(learner: Any, fragments: list[Fragment], bf16: bool) -> Callable[[], float]:
    """A function that runs one epoch of ``learner``'s update on ``fragments`` and returns its seconds, on a copy
    of its model and a fresh optimizer of the same kind (fused Adam): the learner itself is untouched."""
    model = copy.deepcopy(learner.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-5, fused=True)
    cfg = dataclasses.replace(learner.update_cfg, epochs=1, target_kl=None, bf16=bf16)
    frags = [stack_frames(f, learner.frame_stack) for f in fragments] if learner.frame_stack > 1 else fragments
    generator = torch.Generator().manual_seed(0)

    def run() -> float:
        t0 = time.perf_counter()
        ppo_update(model, optimizer, frags, cfg, learner.device, generator)
        return time.perf_counter() - t0

    return run


def time_epoch(learner: Any, fragments: list[Fragment], bf16: bool, runs: int = PROBE_RUNS) -> float:
    """Env steps per second of one epoch of ``learner``'s update on ``fragments`` (median of ``runs`` after a
    warm-up), on a copy of its model: the learner itself is untouched."""
    return time_both(learner, fragments, runs, (bf16,))[bf16]


def time_both(learner: Any, fragments: list[Fragment], runs: int = PROBE_RUNS,
              precisions: tuple[bool, ...] = (False, True)) -> dict[bool, float]:
    """Env steps per second of one update epoch per precision (False: float32, True: bf16), the precisions timed
    in turn (a warm-up each, then ``runs`` rounds alternating), so that a machine getting busier or quieter
    meanwhile weighs on both alike; the median of each."""
    runners = {p: _epoch_runner(learner, fragments, p) for p in precisions}
    for run in runners.values():
        run()  # warm-up: allocations, lazy kernels
    seconds: dict[bool, list[float]] = {p: [] for p in precisions}
    for _ in range(runs):
        for p, run in runners.items():
            seconds[p].append(run())
    steps = sum(f.steps for f in fragments)
    return {p: steps / statistics.median(s) for p, s in seconds.items()}


def choose(settings: Settings, learner: Any, spec: FragmentSpec, threads: tuple[int, str],
           flags_source: tuple[str, set[str]] | None = None,
           timer: Callable[[Any, list[Fragment], bool], float] | None = None) -> Compute:
    """The precision the update runs in (``trainer.precision``), timed where ``auto`` leaves it open."""
    cfg = settings.trainer
    model_name, flags = flags_source if flags_source is not None else cpu_info()
    native = any(f in flags for f in NATIVE_BF16_FLAGS)
    shown = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni"))
    device = learner.device
    given = Compute(threads=threads[0], threads_reason=threads[1], precision="fp32", precision_reason="",
                    device=str(device), cpu_model=model_name, native_bf16=native, cpu_flags=shown,
                    cpus=cpu_list(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    if cfg.precision != "auto":
        return dataclasses.replace(given, precision=cfg.precision, precision_reason="trainer.precision as set")
    if device.type == "cuda":
        supported = bool(torch.cuda.is_bf16_supported())
        return dataclasses.replace(given, precision="bf16" if supported else "fp32", precision_reason=(
            "auto on CUDA: the device supports bf16" if supported else "auto on CUDA: the device has no bf16"))
    if not native:
        return dataclasses.replace(given, precision_reason=(
            f"auto: this CPU has no native bf16 (none of {', '.join(NATIVE_BF16_FLAGS)}): float32"))
    env = settings.env
    frags = probe_fragments(spec, cfg.batch_fragments, env.fragment_steps, env.num_envs)
    if timer is None:
        rates = time_both(learner, frags)
        fp32, bf16 = rates[False], rates[True]
    else:
        fp32, bf16 = timer(learner, frags, False), timer(learner, frags, True)
    ratio = bf16 / fp32
    took = ratio >= BF16_SPEEDUP
    why = (f"auto: one update epoch of this run's shapes timed at {fp32:,.0f} env steps/s in float32 and "
           f"{bf16:,.0f} in bf16 ({ratio:.2f}x) with {threads[0]} thread(s): "
           + (f"bf16, at least {BF16_SPEEDUP}x faster" if took else f"float32 (bf16 needs {BF16_SPEEDUP}x)"))
    return dataclasses.replace(given, precision="bf16" if took else "fp32", precision_reason=why,
                               fp32_samples_per_s=round(fp32, 1), bf16_samples_per_s=round(bf16, 1))
