"""The peers figure's pure parts: order-statistic intervals for the median, Sample Factory's console reports,
and the translation of configs/cartpole.yaml into SB3 PPO arguments."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.peers.run import PeerRun
from bench.peers.sf_log import READY, SfLog, parse
from bench.peers.stats import INF, MedianCI, RankTest, order_statistic_ranks

REPO = Path(__file__).resolve().parents[2]

# Lines as Sample Factory 2.1.1 prints them (colour codes included), read at the given seconds.
SF_LINES = [
    (1.0, "\x1b[36m[2026-12-01 21:23:25,711][09291] Experiment dir ... already exists!\x1b[0m"),
    (22.9, f"\x1b[37m\x1b[1m[2026-12-01 21:23:46,545][09291] {READY}\x1b[0m"),
    (27.1, "\x1b[36m[2026-12-01 21:23:50,716][09291] Fps is (10 sec: nan, 60 sec: nan, 300 sec: nan). Total num "
           "frames: 7680. Throughput: 0: nan. Samples: 5500. Policy #0 lag: (min: 0.0, avg: 1.6, max: 3.0)\x1b[0m"),
    (32.1, "[2026-12-01 21:23:55,716][09291] Fps is (10 sec: 2000.0, 60 sec: 2000.0, 300 sec: 2000.0). Total num "
           "frames: 20480. Throughput: 0: 1900.0. Samples: 20480. Policy #0 lag: (min: 0.0, avg: 1.0, max: 2.0)"),
    (32.1, "[2026-12-01 21:23:55,717][09291] Avg episode reward: [(0, '133.870')]"),
    (37.1, "[...][09291] Fps is (10 sec: 2000.0, ...). Total num frames: 40960. Throughput: 0: 1.0. Samples: 1."),
    (37.1, "[...][09291] Avg episode reward: [(0, '480.500')]"),
    (42.1, "[...][09291] Fps is (10 sec: 2000.0, ...). Total num frames: 51200. Throughput: 0: 1.0. Samples: 1."),
    (42.1, "[...][09291] Avg episode reward: [(0, '500.000')]"),
]


def test_order_statistic_ranks_match_the_binomial_tables() -> None:
    # n = 5: no symmetric pair reaches 95%; the range covers 1 - 2/32.
    k5, j5, cover5 = order_statistic_ranks(5)
    assert (k5, j5) == (1, 5) and cover5 == pytest.approx(1 - 2 / 32)
    # n = 6: the range covers 1 - 2/64 = 96.9% >= 95%; (2, 5) would cover only 78.1%.
    assert order_statistic_ranks(6)[:2] == (1, 6)
    # n = 10: (2, 9) covers 97.9%, (3, 8) 89.1%: the narrowest at >= 95% is (2, 9).
    k, j, cover = order_statistic_ranks(10)
    assert (k, j) == (2, 9) and cover == pytest.approx(0.978515625)
    with pytest.raises(ValueError, match="n=0"):
        order_statistic_ranks(0)


def test_median_interval_counts_failed_runs_as_not_reached() -> None:
    ci = MedianCI.of([12.0, None, 9.0, 15.0, 11.0])
    assert ci.median == 12.0 and (ci.lo, ci.hi) == (9.0, INF) and ci.failed == 1 and ci.n == 5
    assert ci.fmt(1, " s") == "12.0 s [9.0, not reached]"
    most_failed = MedianCI.of([None, None, 3.0])
    assert most_failed.median == INF and most_failed.fmt() == "not reached [3.0, not reached]"
    ten = MedianCI.of(float(v) for v in range(10, 0, -1))
    assert (ten.median, ten.lo, ten.hi) == (5.5, 2.0, 9.0)
    assert ten.lo <= ten.median <= ten.hi
    empty = MedianCI.of([])
    assert empty.n == 0 and math.isnan(empty.median) and empty.fmt() == "n/a"
    assert MedianCI.of([4.0]).fmt(1) == "4.0"


def test_rank_test_is_exact_and_handles_ties_and_failures() -> None:
    # Separated samples of 5 and 5: 1 split in C(10, 5) = 252 is as extreme on each side (scipy's exact
    # mannwhitneyu gives 2/252 two-sided for these).
    r = RankTest.of([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert r.p_a_smaller == pytest.approx(1 / 252) and r.p_two_sided == pytest.approx(2 / 252)
    assert r.p_a_larger == 1.0 and r.prob_a_smaller == 1.0
    assert "lower than" in r.words("Flywheel", "SB3", "end-to-end s")
    # One sample: no difference, whatever the ties.
    same = RankTest.of([3, 1, 2], [1, 2, 3])
    assert same.p_two_sided == 1.0 and same.prob_a_smaller == 0.5
    assert "no difference shown" in same.words("a", "b", "x")
    # Failed runs (None) rank last and tie with each other: a's one failure against b's two.
    f = RankTest.of([1, None, 3], [4, 5, None])
    assert f.rank_sum_a == 1 + 2 + 5.5 and f.prob_a_smaller == pytest.approx(6.5 / 9)
    assert f.p_two_sided > 0.05 and "no difference shown" in f.words("a", "b", "x")
    # Against scipy's exact test where it is defined (no ties).
    scipy_stats = pytest.importorskip("scipy.stats")
    a, b = [12.1, 15.3, 9.8, 20.4, 11.0], [14.2, 18.9, 22.5, 16.0, 25.1]
    ref = scipy_stats.mannwhitneyu(a, b, method="exact", alternative="two-sided").pvalue
    assert RankTest.of(a, b).p_two_sided == pytest.approx(ref)
    with pytest.raises(ValueError):
        RankTest.of([], [1.0])


def test_orphaned_workers_are_reaped_and_counted_after_adopt_orphans() -> None:
    """A peer's worker orphaned when its parent exits (SF's workers when the bench stops SF) is reparented to the
    bench, so its CPU time reaches the bench's children's count: what the peers figure reports as cores used. In
    a process of its own: a subreaper pytest would collect every test's orphans."""
    import subprocess
    import sys

    code = """
import subprocess, time
from bench.machine import reap_children, suite_cpu_seconds
from bench.peers.proc import adopt_orphans
if not adopt_orphans():
    print("skip"); raise SystemExit
before = suite_cpu_seconds()
# the child exits at once; its child burns a CPU for 1 s as an orphan
subprocess.run(["bash", "-c", '(timeout 1 sh -c "while :; do :; done") & exit 0'], check=True)
time.sleep(1.5)
print(reap_children(), suite_cpu_seconds() - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("no PR_SET_CHILD_SUBREAPER here")
    reaped, cpu = out.stdout.split()
    assert int(reaped) >= 1 and float(cpu) >= 0.5, out.stdout


def test_sf_log_pairs_each_reward_with_the_frames_printed_before_it() -> None:
    log = parse(SF_LINES)
    assert log.ready_t == 22.9
    assert [(r.t, r.env_steps, r.last100) for r in log.reports] == [
        (27.1, 7680, None), (32.1, 20480, 133.87), (37.1, 40960, 480.5), (42.1, 51200, 500.0)]
    hit = log.first_reaching(475.0)
    assert hit is not None and (hit.t, hit.env_steps) == (37.1, 40960)
    assert log.first_reaching(501.0) is None


def test_sf_log_feed_reports_as_lines_arrive() -> None:
    log = SfLog()
    done = [log.feed(t, line) for t, line in SF_LINES]
    completed = [r for r in done if r is not None]
    assert [r.last100 for r in completed] == [133.87, 480.5, 500.0]
    assert parse([]).reports == [] and parse([]).ready_t is None


def test_peer_run_end_to_end_needs_both_parts() -> None:
    assert PeerRun("x", "y", 1, 20.0, 10.5, 1000).end_to_end_s == 30.5
    assert PeerRun("x", "y", 1, 20.0, None, None, "timed out").end_to_end_s is None


def test_flywheel_settings_translate_to_sb3() -> None:
    pytest.importorskip("yaml")
    from bench.peers.sb3_peer import FLYWHEEL_TOTAL_STEPS, flywheel_kwargs

    n_envs, kw = flywheel_kwargs(REPO / "configs" / "cartpole.yaml")
    # 2 samplers x 8 envs; one update = 2 fragments x 32 steps x 8 envs = 512 samples, 4 minibatches.
    assert (n_envs, kw["n_steps"], kw["batch_size"], kw["n_epochs"]) == (16, 32, 128, 8)
    assert kw["target_kl"] == pytest.approx(0.02 / 1.5) and kw["vf_coef"] == pytest.approx(0.25)
    lr, clip = kw["learning_rate"], kw["clip_range"]
    assert lr(1.0) == pytest.approx(1e-3) and clip(1.0) == pytest.approx(0.2)
    at_200k = 1.0 - 200_000 / FLYWHEEL_TOTAL_STEPS
    assert lr(at_200k) == pytest.approx(1e-5) and lr(0.0) == pytest.approx(1e-5)  # then held
    assert clip(at_200k) == pytest.approx(0.05) and clip(0.0) == pytest.approx(0.05)
    assert lr(1.0 - 100_000 / FLYWHEEL_TOTAL_STEPS) == pytest.approx((1e-3 + 1e-5) / 2)


def test_update_shape_refuses_what_sb3_cannot_run(tmp_path: Path) -> None:
    from bench.peers.sb3_peer import UNEXPRESSIBLE, update_shape

    base = (REPO / "configs" / "cartpole.yaml").read_text()
    s, n_envs, batch = update_shape(REPO / "configs" / "cartpole.yaml")
    assert (n_envs, batch) == (2 * s.env.num_envs, s.trainer.batch_fragments * s.env.fragment_steps * s.env.num_envs)

    def shaped(extra: str, refuse: tuple[str, ...] = ()) -> None:
        path = tmp_path / "c.yaml"
        path.write_text(base + "\n" + extra)
        update_shape(path, refuse)

    with pytest.raises(ValueError, match="split evenly into minibatches"):
        shaped("trainer:\n  minibatches: 3\n")
    with pytest.raises(ValueError, match=r"cannot express \['trainer.objective'\]"):
        shaped("trainer:\n  objective: decoupled\n", ("trainer.objective",))
    shaped("trainer:\n  objective: decoupled\n")  # only refused where asked
    with pytest.raises(ValueError, match=r"cannot express \['trainer.normalize_rewards'\]"):
        shaped("trainer:\n  normalize_rewards: true\n  guard:\n    enabled: false\n", UNEXPRESSIBLE)


def test_zoo_config_for_flywheel_is_a_valid_config(tmp_path: Path) -> None:
    from bench.peers.flywheel_peer import zoo_config
    from shared.settings import load_settings

    s = load_settings(zoo_config(tmp_path / "zoo.yaml", REPO / "configs" / "cartpole.yaml"), environ={})
    tr = s.trainer
    # 2 samplers x 4 envs x 32 steps x 2 fragments = rl-zoo's 8 envs x 32 steps per update, one minibatch.
    assert (s.env.num_envs, s.env.fragment_steps, tr.batch_fragments, tr.minibatches, tr.epochs) == (4, 32, 2, 1, 20)
    assert tr.target_kl is None and tr.anneal_env_steps == 100_000
    assert tr.learning_rate_end is not None and tr.learning_rate_end < 1e-7


def test_the_wall_budget_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.context import Context
    from bench.figures.peers_minatar import wall_budget

    assert wall_budget(Context(infra=None, stamp="t")) == 600.0  # type: ignore[arg-type]
    assert wall_budget(Context(infra=None, stamp="t", quick=True)) == 60.0  # type: ignore[arg-type]
    monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S", "90")
    assert wall_budget(Context(infra=None, stamp="t")) == 90.0  # type: ignore[arg-type]
    for bad in ("0", "-5", "ten"):
        monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S", bad)
        with pytest.raises(ValueError, match=f"WALL_S={bad!r}: want seconds"):
            wall_budget(Context(infra=None, stamp="t"))  # type: ignore[arg-type]


def _runs(peer: str, returns: list[float]) -> list[object]:
    from bench.figures.peers_mujoco import BudgetRun

    return [BudgetRun(peer, i + 1, 300_000, 10.0, 600.0, r, 300, 300_000) for i, r in enumerate(returns)]


def test_mujoco_says_why_a_missed_return_target_was_missed() -> None:
    from bench.figures.peers_mujoco import PEERS, why_missed

    sb3 = _runs(PEERS[0], [2_938, 2_930, 4_774, 3_140, 4_609])
    missed = why_missed(_runs(PEERS[1], [3_005, 3_601, 3_496, 716, 1_642]), sb3, 300_000)  # type: ignore[arg-type]
    assert "-135 from SB3-zoo's (-4%)" in missed
    assert "ahead on 2 of 5 seeds" in missed and "seed 4: 716, seed 5: 1,642" in missed
    assert "ranges overlap" in missed and "bench.lag_look" in missed
    apart = why_missed(_runs(PEERS[1], [100, 200, 300, 400, 500]), sb3, 300_000)  # type: ignore[arg-type]
    assert "do not overlap" in apart and "ahead on 0 of 5" in apart
    assert why_missed(_runs(PEERS[1], [3_200, 3_601, 3_496, 3_100, 3_300]), sb3, 300_000) == ""  # type: ignore[arg-type]


def test_a_run_beside_other_work_is_redone_once_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """``measured`` with the machine's busy CPU faked: 1 core of other work during the first attempt, none
    during the redo; the redo is kept with the first attempt's figure, and a third attempt is never made."""
    from bench.peers import measure
    from bench.peers.run import PeerRun

    busy = iter([0.0, 100.0, 100.0, 100.0])  # (start, end) of each attempt; monotonic time advances 100 s each
    clock = iter([0.0, 100.0, 100.0, 200.0])
    monkeypatch.setattr(measure, "machine_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(measure, "suite_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(measure, "reap_children", lambda: 0)
    monkeypatch.setattr(measure.time, "monotonic", lambda: next(clock))
    calls: list[int] = []

    def run() -> PeerRun:
        calls.append(1)
        return PeerRun("SB3 PPO", "flywheel", 1, 10.0, 20.0, 1000)

    r = measure.measured("x", run)
    assert len(calls) == 2
    assert r.extra["redone_after_other_work_cores"] == 1.0 and r.extra["other_work_cores"] == 0.0
    assert measure.redone_lines([r], lambda r: "SB3 seed 1") == [
        "- SB3 seed 1: redone after 1.00 cores of other work; the redo ran beside 0.00"]
    assert measure.cores_cell([r], "cores") == "0.00"


def test_a_failed_run_ranks_worst_where_higher_is_better() -> None:
    """A return at a budget: a failed run (None) counts as -inf, so it cannot make its side look ahead."""
    t = RankTest.of([None, None, None], [1.0, 2.0, 3.0], failed=-INF)
    assert t.p_a_smaller == pytest.approx(1 / 20) and t.prob_a_smaller == 1.0
    assert "higher" not in t.words("a", "b", "return")


def test_a_redone_run_gets_a_fresh_run_name() -> None:
    """A redo must not resume the first attempt's checkpoint or read its fragments: its stack gets a new name."""
    from bench.context import Context

    ctx = Context(infra=None, stamp="s")  # type: ignore[arg-type]
    first, again, third = (ctx.run_name("peers_minatar", "fw-seed1") for _ in range(3))
    assert first == "bench-peers-minatar-s-fw-seed1"
    assert (again, third) == (f"{first}-2", f"{first}-3")
    assert ctx.run_name("peers_minatar", "fw-seed2") == "bench-peers-minatar-s-fw-seed2"


def test_a_peer_run_that_raised_is_a_failed_run_with_its_reason_not_a_lost_figure() -> None:
    import functools

    from bench.peers.measure import guarded

    def crash() -> PeerRun:
        raise RuntimeError("the peer's child exited 1")

    failed = functools.partial(PeerRun, "SB3 PPO", "flywheel", 3, None, None, None)
    r = guarded("peers: SB3 PPO (flywheel) seed 3", crash, failed)
    assert (r.peer, r.seed, r.end_to_end_s) == ("SB3 PPO", 3, None)
    assert r.error == "RuntimeError: the peer's child exited 1"
    ok = PeerRun("SB3 PPO", "flywheel", 3, 1.0, 2.0, 100, None)
    assert guarded("x", lambda: ok, failed) is ok
    with pytest.raises(KeyboardInterrupt):  # not an Exception: the bench stops
        guarded("x", lambda: (_ for _ in ()).throw(KeyboardInterrupt()), failed)
