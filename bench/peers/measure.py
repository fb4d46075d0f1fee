"""What every peer figure records beside a run's own result: the cores the run used and the cores other work on
the machine took meanwhile, with a run beside too much other work redone once, and the torch threads SB3 is
given so that it has the cores Flywheel's processes share.

A run's record is any dataclass with an ``extra`` dict (``bench.peers.run.PeerRun``,
``bench.figures.peers_minatar.BudgetRun``, ``bench.peers.throughput.ThroughputRun``); the fields added are
``cores``, ``other_work_cores``, ``run_wall_s`` (the whole run's seconds, start-up and stop included) and, for a
redo, ``redone_after_other_work_cores``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from bench.context import say
from bench.machine import machine_busy_seconds, reap_children, suite_cpu_seconds
from bench.stats import Spread

OTHER_WORK_LIMIT = 0.2
"""Cores of other work on the machine during a run above which the run is redone (once)."""
SB3_THREADS = int(os.environ.get("FLYWHEEL_BENCH_PEERS_SB3_THREADS", os.cpu_count() or 1))
"""SB3's torch threads: as many as the machine's cores, which Flywheel's processes share (2 samplers, trainer,
paramsync, admin, Kafka, S3), so neither side is held to fewer cores than the other can use."""


class HasExtra(Protocol):
    @property
    def extra(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=HasExtra)
T = TypeVar("T")


def guarded(label: str, run: Callable[[], T], failed: Callable[[str], T]) -> T:
    """``run()``; a run that raised is ``failed(reason)``, a failed run with its reason, not a lost figure."""
    try:
        return run()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        say(f"{label} failed: {reason}")
        return failed(reason)


def measured(label: str, run: Callable[[], R], limit: float = OTHER_WORK_LIMIT, cores_key: str = "cores") -> R:
    """``run()`` (which returns a record, failed or not, and never raises) with the cores it used (this bench's
    CPU: the peer's processes once reaped, and the bench's Kafka and S3) and the cores other work took meanwhile
    (the machine's busy CPU less the bench's), each over the run's wall time, added to the record's ``extra``. A
    run beside more than ``limit`` cores of other work is redone once; the redo is kept whatever it ran beside,
    with the first attempt's figure recorded. ``cores_key`` names the field the run's cores go in (a figure whose
    runs measure their own cores over a steady window keeps those in ``cores`` and passes another name)."""
    first: float | None = None
    while True:
        t0, own0, busy0 = time.monotonic(), suite_cpu_seconds(), machine_busy_seconds()
        r = run()
        reap_children()
        wall = max(time.monotonic() - t0, 1e-9)
        own = suite_cpu_seconds() - own0
        other = max(machine_busy_seconds() - busy0 - own, 0.0) / wall
        extra = {**r.extra, cores_key: round(own / wall, 2), "other_work_cores": round(other, 2),
                 "run_wall_s": round(wall, 1)}
        if first is not None:
            extra["redone_after_other_work_cores"] = first
        r = dataclasses.replace(r, extra=extra)  # type: ignore[type-var]
        if other <= limit or first is not None:
            return r
        first = round(other, 2)
        say(f"{label} ran beside {other:.2f} cores of other work: redone once")


def cores_cell(runs: Iterable[HasExtra], key: str) -> str:
    """``1.53 [1.49, 1.60]``: the median [range] over runs of ``extra[key]`` (``cores`` or
    ``other_work_cores``); ``-`` when no run has it."""
    s = Spread.of(float(r.extra[key]) for r in runs if key in r.extra)
    return "-" if not s.n else f"{s.median:.2f}" + (f" [{s.lo:.2f}, {s.hi:.2f}]" if s.n > 1 else "")


def redone_lines(runs: Iterable[HasExtra], name: Callable[[Any], str]) -> list[str]:
    """One line per redone run: ``- <name(run)>: redone after X cores of other work; the redo ran beside Y``."""
    return [f"- {name(r)}: redone after {r.extra['redone_after_other_work_cores']:.2f} cores of other work; the "
            f"redo ran beside {r.extra['other_work_cores']:.2f}" for r in runs
            if "redone_after_other_work_cores" in r.extra]


def cores_words(adopted: bool) -> str:
    """The method's sentence on how cores and other work are counted."""
    return (f"Cores: each run's CPU seconds over its wall time, medians [range] over seeds: the peer's processes, "
            f"and the bench's Kafka and S3 (idle for SB3 and SF). Other work: the machine's busy CPU less that; a "
            f"run beside more than {OTHER_WORK_LIMIT} cores of it is redone once. SB3 ran with {SB3_THREADS} torch "
            f"thread(s) (`FLYWHEEL_BENCH_PEERS_SB3_THREADS`, default the machine's cores, which Flywheel's processes"
            f" share). " + ("The bench was its descendants' subreaper, so workers orphaned by a stop count too."
                            if adopted else "Workers orphaned by a stop are not counted (no subreaper here)."))
