"""Medians of repeated runs with a distribution-free 95% interval from order statistics.

A run that failed (did not reach the threshold within its timeout) counts as ``inf``: it sorts last, so the
median and the interval stay defined and honest (an ``inf`` bound reads "not reached"), which a mean with a
t-interval could not do for censored runs.

For the sorted values x(1) <= ... <= x(n), the interval [x(k), x(n+1-k)] covers the true median with
probability 1 - 2 * P(Binomial(n, 1/2) <= k - 1). We take the largest k whose coverage is still >= 95%. With
n <= 5 no k reaches 95% (k = 1, the whole range, covers 1 - 2 / 2**n: 93.75% for 5 runs); then the interval is
the range and ``coverage`` says what it covers. Invariant: ``lo <= median <= hi`` whenever ``n > 0``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

INF = float("inf")


def _binom_cdf_half(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n if k >= 0 else 0.0


def order_statistic_ranks(n: int, level: float = 0.95) -> tuple[int, int, float]:
    """1-based ranks (k, n+1-k) of the narrowest symmetric order-statistic interval for the median whose
    coverage is >= ``level`` (the whole range when none is), and that interval's exact coverage."""
    if n < 1:
        raise ValueError(f"need at least one value, got {n=}")
    best = 1
    for k in range(1, n // 2 + 1):
        if 1.0 - 2.0 * _binom_cdf_half(k - 1, n) >= level:
            best = k
    return best, n + 1 - best, 1.0 - 2.0 * _binom_cdf_half(best - 1, n)


@dataclass(frozen=True)
class MedianCI:
    """Median of ``values`` (``inf`` = that run failed) with an order-statistic interval [lo, hi]."""

    median: float
    lo: float
    hi: float
    coverage: float  # exact probability that [lo, hi] covers the true median (>= 0.95 from 6 runs on)
    n: int
    failed: int  # runs counted as inf
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float | None]) -> MedianCI:
        vs = [INF if v is None or v != v else float(v) for v in values]
        if not vs:
            return cls(math.nan, math.nan, math.nan, math.nan, 0, 0, ())
        ordered = sorted(vs)
        k, j, cover = order_statistic_ranks(len(ordered))
        return cls(statistics.median(ordered), ordered[k - 1], ordered[j - 1], cover, len(ordered),
                   sum(1 for v in ordered if v == INF), tuple(vs))

    def fmt(self, digits: int = 1, unit: str = "") -> str:
        """``12.3 s [10.1, 15.0]``; ``not reached`` for inf; ``n/a`` without runs."""
        if self.n == 0:
            return "n/a"

        def f(x: float) -> str:
            return "not reached" if x == INF else f"{x:,.{digits}f}"

        body = f(self.median) + (unit if self.median != INF else "")
        if self.n > 1:
            body += f" [{f(self.lo)}, {f(self.hi)}]"
        return body

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "ci_lo": self.lo, "ci_hi": self.hi, "ci_coverage": round(self.coverage, 4),
                "ci_method": "order statistics", "n": self.n, "failed": self.failed, "values": list(self.values)}
