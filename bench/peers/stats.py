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

import itertools
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


@dataclass(frozen=True)
class RankTest:
    """The Wilcoxon rank-sum (Mann-Whitney) test of two independent samples, exact: every way of splitting the
    pooled ranks into groups of the two sizes is counted (ties get their mid-rank; a failed run, ``inf``, ties
    with the other failures and ranks last). Independent samples, not pairs: two peers' runs of one seed number
    share nothing but the number (their random generators differ), so pairing them would claim a link there is
    none."""

    n_a: int
    n_b: int
    rank_sum_a: float
    p_two_sided: float
    """The chance, were both samples from one distribution, of a rank sum at least this far from its mean."""
    p_a_smaller: float
    """One-sided: the chance of a rank sum for ``a`` this small or smaller (``a`` tends to smaller values)."""
    p_a_larger: float
    prob_a_smaller: float
    """P(a value of ``a`` < one of ``b``) + half P(equal), over every pair: the effect size (0.5 = no effect)."""

    @classmethod
    def of(cls, a: Iterable[float | None], b: Iterable[float | None], failed: float = INF) -> RankTest:
        """``failed`` is what a failed run (None or NaN) counts as: ``inf`` where lower is better (seconds to a
        target), ``-inf`` where higher is better (a return at a budget), so a failure always ranks worst."""
        xs = [failed if v is None or v != v else float(v) for v in a]
        ys = [failed if v is None or v != v else float(v) for v in b]
        if not xs or not ys:
            raise ValueError(f"both samples need values, got {len(xs)} and {len(ys)}")
        pooled = sorted(xs + ys)
        rank: dict[float, float] = {}
        i = 0
        while i < len(pooled):  # mid-ranks for ties
            j = i
            while j + 1 < len(pooled) and pooled[j + 1] == pooled[i]:
                j += 1
            rank[pooled[i]] = (i + j) / 2 + 1
            i = j + 1
        ranks = [rank[v] for v in xs + ys]
        n, m = len(xs), len(ys)
        w = sum(ranks[:n])
        mean = n * (n + m + 1) / 2
        if math.comb(n + m, n) > 500_000:
            raise ValueError(f"an exact test of {n} + {m} values enumerates too many splits")
        sums = [sum(ranks[k] for k in idx) for idx in itertools.combinations(range(n + m), n)]
        eps = 1e-9
        total = len(sums)
        pairs = [(1.0 if x < y else 0.5 if x == y else 0.0) for x in xs for y in ys]
        return cls(n, m, w,
                   p_two_sided=sum(1 for s in sums if abs(s - mean) >= abs(w - mean) - eps) / total,
                   p_a_smaller=sum(1 for s in sums if s <= w + eps) / total,
                   p_a_larger=sum(1 for s in sums if s >= w - eps) / total,
                   prob_a_smaller=sum(pairs) / len(pairs))

    def words(self, a: str, b: str, quantity: str) -> str:
        """``Flywheel ahead of SB3 on end-to-end s (exact rank-sum test, one-sided p = 0.004, ...)``: ahead or
        behind only at p < 0.05 one-sided, else no difference shown."""
        detail = (f"exact Wilcoxon rank-sum, {self.n_a} vs {self.n_b} runs, two-sided p = {self.p_two_sided:.3f}, "
                  f"P({a} lower) = {self.prob_a_smaller:.2f}")
        if self.p_a_smaller < 0.05:
            verdict = f"{a} lower than {b} (one-sided p = {self.p_a_smaller:.3f})"
        elif self.p_a_larger < 0.05:
            verdict = f"{a} higher than {b} (one-sided p = {self.p_a_larger:.3f})"
        else:
            verdict = f"no difference shown between {a} and {b}"
        return f"{quantity}: {verdict} ({detail})"

    def as_dict(self) -> dict[str, Any]:
        return {"test": "exact Wilcoxon rank-sum (Mann-Whitney), mid-ranks for ties, failures as inf",
                "n_a": self.n_a, "n_b": self.n_b, "rank_sum_a": self.rank_sum_a,
                "p_two_sided": round(self.p_two_sided, 5), "p_a_smaller": round(self.p_a_smaller, 5),
                "p_a_larger": round(self.p_a_larger, 5), "prob_a_smaller": round(self.prob_a_smaller, 4)}
