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


def test_the_figure_runs_every_side_per_seed_with_cores_and_tests_flywheel_against_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure's own ``run`` with every side replaced by a run at a fixed rate (the composition is under test,
    not the peers): both Sample Factory modes run, each run carries the cores and other work ``measured`` adds,
    and Flywheel is rank-tested against SF sync, SF async and SB3, not against EnvPool's ceiling."""
    from bench.peers import envpool_raw, measure, sb3_atari, sf_atari

    for name in ("machine_busy_seconds", "suite_cpu_seconds"):  # a quiet machine: fake runs take no time
        monkeypatch.setattr(measure, name, lambda: 0.0)
    monkeypatch.setattr(measure, "reap_children", lambda: 0)

    def side(peer: str, per_s: int) -> ThroughputRun:
        return ThroughputRun(peer, 1, 5.0, tuple((float(t), per_s * t) for t in range(0, 61, 5)), None,
                             {"cores": 1.0})

    order: list[str] = []

    def fake(peer: str, per_s: int):  # type: ignore[no-untyped-def]
        def run(seed: int, *args: object, **kw: object) -> ThroughputRun:
            order.append(peer)
            return side(peer, per_s)
        return run

    monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_PONG_SEEDS", "2")
    monkeypatch.setattr(sf_atari, "ensure_atari", lambda: None)
    monkeypatch.setattr(envpool_raw, "ensure_venv", lambda: None)
    monkeypatch.setattr(envpool_raw, "run", fake(peers_pong.CEILING, 4000))
    rates = {"sync": 300, "async": 500}
    monkeypatch.setattr(sf_atari, "run_seed", lambda seed, run_s, stamp, mode: fake(sf_atari.peer_name(mode),
                                                                                       rates[mode])(seed))
    monkeypatch.setattr(sb3_atari, "run_child", fake(sb3_atari.PEER, 200))
    monkeypatch.setattr(sb3_atari, "describe", lambda config, threads=None: "SB3 settings")
    monkeypatch.setattr(peers_pong, "run_flywheel", lambda ctx, seed, run_s, warmup_s: fake("Flywheel", 400)(seed))
    monkeypatch.setattr(peers_pong, "learner_ceiling", lambda: {"error": "not measured in a unit test"})
    monkeypatch.setattr(peers_pong, "timing", lambda ctx: (60.0, 20.0))
    res = peers_pong.run(Context(infra=None, stamp="t"))  # type: ignore[arg-type]
    assert order == [peers_pong.CEILING, sf_atari.PEER, sf_atari.PEER_ASYNC, sb3_atari.PEER, "Flywheel"] * 2
    assert set(res.numbers["rank_tests"]) == {f"Flywheel vs {p}" for p in (sf_atari.PEER, sf_atari.PEER_ASYNC,
                                                                            sb3_atari.PEER)}
    assert res.numbers["rank_tests"][f"Flywheel vs {sb3_atari.PEER}"]["prob_a_smaller"] == 0.0  # 400 > 200
    for body in res.numbers["peers"].values():
        assert all({"run_cores", "other_work_cores", "cores"} <= set(r) for r in body["runs"])
    assert res.headline[0].meets is False  # 1,600 frames/s is behind SF async's 2,000
