"""The Pong throughput figure's pure logic: the steady-window rate, the target, the timing settings."""

from __future__ import annotations

import math

import pytest

from bench.context import Context
from bench.figures import FIGURES, peers_pong
from bench.peers.throughput import FRAME_SKIP, ThroughputRun, rate_between, series_of


def test_the_rate_is_the_growth_over_the_steady_window_only() -> None:
    s = series_of([(40, 4000), (0, 0), (20, 2000)])  # sorted by time
    assert s[0] == (0.0, 0) and rate_between(s, 0, 40) == pytest.approx(100.0)
    # 1,000 steps in the first 10 s (a burst), then 10 steps/s
    s = series_of([(0, 0), (10, 1000), (20, 1100), (30, 1200), (40, 1300)])
    assert rate_between(s, 10, 40) == pytest.approx(10.0)  # the burst before the warm-up is out
    assert rate_between(s, 35, 40) is None  # one point: no rate
    run = ThroughputRun("x", 1, 3.0, s)
    assert run.frames_per_s(10, 40) == pytest.approx(10.0 * FRAME_SKIP)
    assert ThroughputRun("x", 1, 3.0, s, error="boom").rate(10, 40) is None


def test_a_count_that_falls_is_refused() -> None:
    with pytest.raises(ValueError, match="fell"):
        series_of([(0, 10), (5, 3)])


def test_the_target_needs_both_rivals_and_both_bounds() -> None:
    assert peers_pong.verdict(100.0, 90.0, 140.0) is True
    assert peers_pong.verdict(100.0, 110.0, 140.0) is False  # slower than Sample Factory
    assert peers_pong.verdict(100.0, 90.0, 150.0) is False  # under 0.7 x EnvPool
    assert peers_pong.verdict(math.nan, 90.0, 140.0) is False  # Flywheel failed
    assert peers_pong.verdict(100.0, math.nan, 140.0) is None  # a rival failed: not decided


def test_failed_runs_are_left_out_of_the_median_not_counted_as_zero() -> None:
    s = series_of([(0, 0), (10, 100), (20, 200)])
    runs = [ThroughputRun("x", 1, 1.0, s), ThroughputRun("x", 2, None, (), error="died")]
    ci = peers_pong.frames_ci(runs, 0, 20)
    assert ci.n == 1 and ci.median == pytest.approx(10.0 * FRAME_SKIP)


def test_timing_reads_the_environment_and_refuses_a_warmup_that_eats_the_run(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    ctx = Context(infra=None, stamp="t")  # type: ignore[arg-type]
    assert peers_pong.timing(ctx) == (180.0, 45.0)
    monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_PONG_RUN_S", "50")
    with pytest.raises(ValueError, match="WARMUP_S"):
        peers_pong.timing(ctx)
    monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_PONG_RUN_S", "soon")
    with pytest.raises(ValueError, match="RUN_S='soon'"):
        peers_pong.timing(ctx)


def test_the_figure_is_registered() -> None:
    assert FIGURES["peers_pong"] is peers_pong
