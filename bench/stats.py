"""Repeated measurements summarised: median and range (``Spread``), percentiles, and the mean with a 95%
t-interval (``Interval``). The peer figures' order-statistic intervals and rank tests are in ``bench.peers.stats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import shared.service


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    lo: float
    hi: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        vs = [float(v) for v in values]
        if not vs:
            return cls(float("nan"), float("nan"), float("nan"), 0, ())
        return cls(statistics.median(vs), min(vs), max(vs), len(vs), tuple(vs))

    def fmt(self, digits: int = 0, unit: str = "") -> str:
        if self.n == 0:
            return "n/a"
        def f(x: float) -> str:
            return "not reached" if x == float("inf") else f"{x:,.{digits}f}"

        body = f(self.median) + (unit if self.median != float("inf") else "")
        if self.n > 1 and self.lo != self.hi:
            body += f" ({f(self.lo)}-{f(self.hi)})"
        return body

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n, "values": list(self.values)}


def timed_median(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` (``repeats`` 1: the one call's)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; NaN when empty (a figure with no data)."""
    value = shared.service.percentile(values, q)
    return float("nan") if value is None else value


# Two-sided 95% quantiles of Student's t by degrees of freedom (no scipy in the bench's dependencies).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


@dataclass(frozen=True)
class Interval:
    """Mean of independent runs with a 95% t-interval (half-width ``half``; NaN with fewer than 2 runs)."""

    mean: float
    half: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float]) -> Interval:
        vs = [float(v) for v in values if v == v]
        if not vs:
            return cls(float("nan"), float("nan"), 0, ())
        if len(vs) < 2:
            return cls(vs[0], float("nan"), 1, tuple(vs))
        df = len(vs) - 1
        t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96  # the next lower df: conservative
        return cls(statistics.fmean(vs), t * statistics.stdev(vs) / len(vs) ** 0.5, len(vs), tuple(vs))

    def fmt(self, digits: int = 0) -> str:
        if self.n == 0:
            return "n/a"
        return f"{self.mean:,.{digits}f}" + ("" if self.half != self.half else f" ± {self.half:,.{digits}f}")

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "ci95_half_width": self.half, "n": self.n, "values": list(self.values)}
