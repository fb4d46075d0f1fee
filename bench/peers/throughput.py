"""What one throughput run measured, the same fields for every side of the Pong figure (``bench.figures.peers_pong``).

A side reports a series of (seconds since its first env step, env steps trained so far) points, an env step being
one agent step of the vector (one action per env; ALE's frame skip of 4 makes it 4 emulator frames). For the
EnvPool ceiling the count is env steps stepped, since nothing trains. ``rate`` takes the steady part of the series
(from ``warmup_s`` to ``until_s``) so start-up and the first update's latency stay out of the rate; start-up is
reported beside it.

Invariant: ``series`` is in time order with non-decreasing counts (``of`` sorts and rejects a count that falls).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

FRAME_SKIP = 4  # emulator frames per env step, the same on every side (ALE v5 / Atari preprocessing)
MIN_SPAN_S = 5.0  # a rate over less time than this is not reported


def series_of(points: Iterable[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """``points`` sorted by time, checked: counts never fall (a falling count means two counters were mixed)."""
    out = tuple(sorted((float(t), int(n)) for t, n in points))
    for (t0, n0), (t1, n1) in zip(out, out[1:], strict=False):
        if n1 < n0:
            raise ValueError(f"env-step count fell from {n0} at {t0:.1f} s to {n1} at {t1:.1f} s")
    return out


def rate_between(series: tuple[tuple[float, int], ...], warmup_s: float, until_s: float) -> float | None:
    """Env steps per second between the first point at or after ``warmup_s`` and the last at or before
    ``until_s``; None when fewer than two such points span at least ``MIN_SPAN_S``."""
    inside = [(t, n) for t, n in series if warmup_s <= t <= until_s]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < MIN_SPAN_S:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0)


@dataclass(frozen=True)
class ThroughputRun:
    """One side's run of one seed. ``error`` says why a run has no rate (then ``series`` may be short)."""

    peer: str  # "Flywheel", "SB3 PPO", "Sample Factory APPO", "EnvPool (raw)"
    seed: int
    startup_s: float | None  # from starting the side (process or stack) to its first env step
    series: tuple[tuple[float, int], ...] = ()
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # cores used, update shape, versions: shown beside

    def rate(self, warmup_s: float, until_s: float) -> float | None:
        """Trained env steps per second over the steady window (None for a failed or too-short run)."""
        if self.error is not None:
            return None
        return rate_between(self.series, warmup_s, until_s)

    def frames_per_s(self, warmup_s: float, until_s: float) -> float | None:
        r = self.rate(warmup_s, until_s)
        return None if r is None else r * FRAME_SKIP

    def as_dict(self, warmup_s: float, until_s: float) -> dict[str, Any]:
        last = self.series[-1] if self.series else None
        return {"peer": self.peer, "seed": self.seed, "startup_s": self.startup_s,
                "env_steps_per_s": self.rate(warmup_s, until_s), "frames_per_s": self.frames_per_s(warmup_s, until_s),
                "points": len(self.series), "last_point": last, "error": self.error, **self.extra}


class UpdateClock:
    """Cuts ``learn()`` into updates from SB3's callback hooks, on a clock passed in (seconds since learn start).

    An update is a rollout (``rollout_start`` -> ``rollout_end``) and the ``train()`` after it (``rollout_end`` ->
    the next ``rollout_start``, or ``learn_end``). Invariant: each update is reported once, only after its
    ``train()`` returned, with the env steps of every rollout trained so far; a rollout cut short by the budget
    (no ``rollout_end``) is never reported, since SB3 does not train on it."""

    def __init__(self) -> None:
        self._rollout_at: float | None = None
        self._ended_at: float | None = None
        self._rollout_s = 0.0
        self._steps = 0

    def rollout_start(self, now: float) -> dict[str, Any] | None:
        report = self._finish(now)
        self._rollout_at = now
        return report

    def rollout_end(self, now: float, steps: int) -> None:
        if self._rollout_at is None:
            raise ValueError("a rollout ended that never started")
        self._rollout_s, self._ended_at, self._steps = now - self._rollout_at, now, steps
        self._rollout_at = None

    def learn_end(self, now: float) -> dict[str, Any] | None:
        return self._finish(now)

    def _finish(self, now: float) -> dict[str, Any] | None:
        if self._ended_at is None:
            return None
        report = {"event": "progress", "t": round(now, 4), "trained": self._steps,
                  "rollout_s": round(self._rollout_s, 4), "train_s": round(now - self._ended_at, 4)}
        self._ended_at = None
        return report
