"""CPU placement on a host the trainer shares with the samplers: ``trainer.dedicated_cores``.

On one host the samplers' work (environment steps, the policy's forward pass, compression) lands on whatever
core the scheduler picks, the learner's among them: every slice a sampler takes there stalls an update, and an
update is what bounds a pixel run's rate. With ``trainer.dedicated_cores: N`` (N > 0) the trainer pins itself to
the first N CPUs of its affinity (rank r of a data-parallel group: the r-th N) and every other Flywheel process
started with the same settings (samplers, paramsync, admin) pins itself to the CPUs after the trainers' share;
``trainer.torch_threads: auto`` then counts the pinned CPUs. The services call :func:`pin` before they import
torch or start a thread of their own, and pin every thread the process has by then, so every later thread
inherits the placement.

It means something only where the processes share a host (the local stack, one compose host): a sampler on
another host would leave that host's first CPUs idle. Where the host has no CPU left after the trainers'
share, nothing is pinned and the process says so (``cpus_not_pinned``). A container runtime places processes
itself (compose's ``cpuset``, the kubelet's static CPU manager policy with whole-CPU requests), and there this
setting stays 0. Linux only (``os.sched_setaffinity``); elsewhere nothing is pinned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.settings import Settings


@dataclass(frozen=True)
class Placement:
    """Where a process runs: ``cpus`` to pin to (None: not pinned) and why, in words for the log."""

    cpus: tuple[int, ...] | None
    reason: str


def cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's own notation, as ``taskset -c`` takes it)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def placement(service: str, settings: Settings, allowed: Sequence[int]) -> Placement:
    """Where ``service`` (``trainer``, ``sampler``, ``paramsync``, ``admin``) runs under ``settings`` when this
    process may use the CPUs ``allowed``."""
    cfg = settings.trainer
    n = cfg.dedicated_cores
    if n == 0:
        return Placement(None, "trainer.dedicated_cores 0: not pinned")
    cpus = sorted(set(allowed))
    share = n * cfg.world_size
    if share >= len(cpus):
        return Placement(None, f"trainer.dedicated_cores {n} x {cfg.world_size} trainer rank(s) would leave none of "
                               f"this process's {len(cpus)} CPU(s) ({cpu_list(cpus)}) to the samplers and services "
                               f"beside it: not pinned")
    if service == "trainer":
        mine = cpus[cfg.rank * n:(cfg.rank + 1) * n]
        who = f"trainer rank {cfg.rank}" if cfg.world_size > 1 else "the trainer"
        return Placement(tuple(mine), f"trainer.dedicated_cores {n}: {who} on CPU(s) {cpu_list(mine)} of "
                                      f"{cpu_list(cpus)}")
    rest = cpus[share:]
    return Placement(tuple(rest), f"trainer.dedicated_cores {n}: CPU(s) {cpu_list(cpus[:share])} left to the "
                                  f"trainer, {service} on {cpu_list(rest)}")


def _threads() -> list[int]:
    """This process's thread ids (Linux ``/proc/self/task``); just this thread where that cannot be read."""
    try:
        return [int(p.name) for p in Path("/proc/self/task").iterdir()]
    except OSError:
        return [0]


def pin(service: str, settings: Settings) -> Placement:
    """Apply :func:`placement` to this process, every thread it has now (later threads inherit it). Returns what
    was done; the caller logs it."""
    if not hasattr(os, "sched_setaffinity"):
        return Placement(None, "this platform has no sched_setaffinity: not pinned")
    where = placement(service, settings, sorted(os.sched_getaffinity(0)))
    if where.cpus is None:
        return where
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, where.cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return where
