"""``python -m bench --extend``: seeds named by list, the earlier entry's other seeds kept with where they ran,
refused where the budgets differ, and the two peer figures rebuilt from their records with the same
summaries."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main
from bench.context import Context
from bench.figures import peers_minatar, peers_mujoco
from bench.seeds import bench_seeds, earlier_runs, parse_seeds, provenance_md


def test_seeds_are_a_count_or_a_list() -> None:
    assert parse_seeds("3") == (1, 2, 3)
    assert parse_seeds("4,5") == (4, 5)
    assert parse_seeds("4-6") == (4, 5, 6)
    assert parse_seeds("1, 4-5") == (1, 4, 5)
    for bad in ("", "0", "x", "2,2", "0-1", "5-4", "-1"):
        with pytest.raises(ValueError, match="FLYWHEEL_BENCH_X_SEEDS"):
            parse_seeds(bad, "FLYWHEEL_BENCH_X_SEEDS")


def _entry(runs: dict[str, list[dict[str, Any]]], **numbers: Any) -> dict[str, Any]:
    return {"command": "FLYWHEEL_BENCH_X_SEEDS=3 .venv/bin/python -m bench --only x", "date": "2026-12-02T14:39:18Z",
            "machine": {"commit": "045e1ee", "cpu_model": "AMD EPYC", "cores": 2},
            "numbers": {**numbers, "peers": {p: {"runs": v} for p, v in runs.items()}}}


def _ctx(earlier: dict[str, Any] | None, extend: bool = True) -> Context:
    return Context(infra=None, stamp="t", extend=extend, earlier=earlier)  # type: ignore[arg-type]


def test_earlier_runs_keep_the_seeds_not_repeated_and_say_where_they_ran() -> None:
    earlier = _entry({"A": [{"seed": s, "v": s} for s in (1, 2, 3)], "B": [{"seed": s} for s in (1, 2, 3)]},
                     wall_s=600.0)
    kept = earlier_runs(_ctx(earlier), "x", (3, 4), {"wall_s": 600.0})
    assert [r["seed"] for r in kept["A"]] == [1, 2] and [r["seed"] for r in kept["B"]] == [1, 2]
    assert kept["A"][0]["ran"] == {"command": earlier["command"], "commit": "045e1ee",
                                   "date": "2026-12-02T14:39:18Z", "cpu_model": "AMD EPYC", "cores": 2}
    # a record kept by an earlier merge keeps its own origin
    again = _entry({"A": [{"seed": 1, "ran": {"command": "c0", "commit": "0", "date": "d0", "cpu_model": "Xeon"}}]},
                   wall_s=600.0)
    assert earlier_runs(_ctx(again), "x", (4,), {"wall_s": 600.0})["A"][0]["ran"]["command"] == "c0"
    assert earlier_runs(_ctx(earlier, extend=False), "x", (4,), {"wall_s": 600.0}) == {}


def test_earlier_runs_refuse_another_budget_or_nothing_to_extend() -> None:
    earlier = _entry({"A": [{"seed": 1}]}, wall_s=600.0)
    with pytest.raises(ValueError, match=r"wall_s=600.0, this run 300.0"):
        earlier_runs(_ctx(earlier), "x", (2,), {"wall_s": 300.0})
    with pytest.raises(ValueError, match="no earlier result"):
        earlier_runs(_ctx(None), "x", (2,), {"wall_s": 600.0})


def test_provenance_names_each_runs_seeds() -> None:
    ran = {"command": "cmd A", "commit": "abc", "date": "D", "cpu_model": "EPYC"}
    line = provenance_md([{"seed": 2, "ran": ran}, {"seed": 1, "ran": ran}, {"seed": 4}, {"seed": 5}])
    assert "seeds 1, 2 from `cmd A` at commit `abc` on D (EPYC)" in line
    assert "seeds 4, 5 from this run" in line
    assert provenance_md([{"seed": 1}, {"seed": 2}]) == ""  # one run: nothing to say


def test_minatar_run_rebuilt_from_its_record_summarises_alike() -> None:
    curve = tuple((float(t), t * 10, float(t % 7)) for t in range(1, 600))
    live = peers_minatar.BudgetRun("Flywheel", 1, 600.0, 20.0, 5990, curve, None, {"fragments": 9})
    record = {**live.as_dict(), "ran": {"command": "c"}}
    kept = peers_minatar.BudgetRun.from_record(record)
    assert kept.last_at(600.0) == live.last_at(600.0) and kept.last_at(300.0) == live.last_at(300.0)
    assert peers_minatar.summarise([kept]) == peers_minatar.summarise([live])
    again = kept.as_dict()  # written back: the original numbers, its curve points, where it ran
    assert again["last100_curve"] == record["last100_curve"] and again["episodes"] == record["episodes"]
    assert again["ran"] == {"command": "c"} and again["fragments"] == 9
    with pytest.raises(KeyError, match="kept from an earlier run"):
        kept.last_at(100.0)
    failed = peers_minatar.BudgetRun.from_record({**record, "env_steps": None, "error": "boom",
                                                  "last100_at_budget": None, "last100_at_half": None})
    assert not failed.ok and math.isnan(failed.last_at(600.0))


def test_mujoco_run_rebuilt_from_its_record() -> None:
    live = peers_mujoco.BudgetRun("Flywheel (rl-zoo)", 2, 300_000, 25.0, 500.0, 3000.0, 300, 300_512, None,
                                  {"fragments": 3})
    kept = peers_mujoco.BudgetRun.from_record({**live.as_dict(), "ran": {"command": "c"}})
    assert kept.as_dict() == {**live.as_dict(), "extra": {"fragments": 3, "ran": {"command": "c"}}}
    assert peers_mujoco.PeerSummary.of([kept]) == peers_mujoco.PeerSummary.of([live])


def test_extend_is_refused_for_figures_without_seed_records(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--only", "solve", "--extend", "--out", str(tmp_path)])
    assert "--extend pools per-seed records" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--extend", "--out", str(tmp_path)])  # every figure: most have no per-seed records
    assert "--extend pools per-seed records" in capsys.readouterr().err


def test_extend_needs_the_seeds_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS", raising=False)
    with pytest.raises(ValueError, match="FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS=4,5"):
        bench_seeds("peers_minatar", 2, 1, _ctx({}))
    assert bench_seeds("peers_minatar", 2, 1, _ctx({}, extend=False)) == (1, 2)


def test_earlier_runs_refuse_peers_with_different_seeds() -> None:
    earlier = _entry({"A": [{"seed": 1}, {"seed": 2}], "B": [{"seed": 1}]}, wall_s=600.0)
    with pytest.raises(ValueError, match="different seeds per peer"):
        earlier_runs(_ctx(earlier), "x", (4,), {"wall_s": 600.0})
    assert [r["seed"] for r in earlier_runs(_ctx(earlier), "x", (2,), {"wall_s": 600.0})["A"]] == [1]


def test_mujoco_records_keep_their_origin_through_two_extensions() -> None:
    """MuJoCo's records carry ``ran`` in ``extra``: a second --extend must keep the first run's origin."""
    live = peers_mujoco.BudgetRun("Flywheel (rl-zoo)", 1, 300_000, 25.0, 500.0, 3000.0, 300, 300_512)
    first = {"command": "first", "commit": "a", "date": "d1", "cpu_model": "EPYC"}
    once = earlier_runs(_ctx(_entry({"F": [live.as_dict()]}, budget=300_000)), "x", (4,), {"budget": 300_000})
    assert once["F"][0]["ran"]["command"] == _entry({})["command"]
    written = peers_mujoco.BudgetRun.from_record({**live.as_dict(), "ran": first}).as_dict()  # after extension 1
    second = {**_entry({"F": [written]}, budget=300_000), "command": "second"}
    twice = earlier_runs(_ctx(second), "x", (5,), {"budget": 300_000})
    assert twice["F"][0]["ran"] == first
    assert peers_mujoco.BudgetRun.from_record(twice["F"][0]).extra["ran"] == first


def test_minatar_figure_pools_new_seeds_with_the_earlier_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure's own ``run`` with its two runners replaced (the pooling is under test, not the stacks): seeds
    1-3 from the earlier entry, 3 rerun and 4 new; the medians are over 1-4 with seed 3 from this run."""
    def fake(peer: str, base: float) -> peers_minatar.Runner:
        def run(seed: int, wall_s: float) -> peers_minatar.BudgetRun:
            curve = tuple((t, t * 100, base + seed) for t in (10.0, 290.0, 590.0))
            return peers_minatar.BudgetRun(peer, seed, wall_s, 10.0, 60_000, curve)
        return run

    monkeypatch.setattr(peers_minatar, "run_sb3", fake("SB3 PPO", 0.0))
    monkeypatch.setattr(peers_minatar, "run_flywheel", lambda ctx, seed, w: fake("Flywheel", 1.0)(seed, w))
    # describing SB3's settings imports stable-baselines3 (the bench extra, absent from `make test`)
    monkeypatch.setattr(peers_minatar.sb3_minatar, "describe", lambda config, threads=1: "SB3 settings")
    monkeypatch.setenv("FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS", "3,4")
    monkeypatch.delenv("FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S", raising=False)

    def rec(peer: str, seed: int, value: float) -> dict[str, Any]:
        return {"peer": peer, "seed": seed, "wall_s": 600.0, "startup_s": 5.0, "env_steps": 1000, "episodes": 9,
                "last100_at_half": value, "last100_at_budget": value, "last100_curve": [], "error": None}
    peers = {"SB3 PPO": [rec("SB3 PPO", s, 100.0) for s in (1, 2, 3)],
             "Flywheel": [rec("Flywheel", s, 0.0) for s in (1, 2, 3)]}
    with pytest.raises(ValueError, match="sb3_threads=None"):  # SB3 given other torch threads: not pooled
        peers_minatar.run(_ctx(_entry(peers, wall_s=600.0)))
    earlier = _entry(peers, wall_s=600.0, sb3_threads=peers_minatar.SB3_THREADS)
    res = peers_minatar.run(_ctx(earlier))
    assert res.numbers["seeds"] == [1, 2, 3, 4]
    fw = [r["last100_at_budget"] for r in res.numbers["peers"]["Flywheel"]["runs"]]
    sb = [r["last100_at_budget"] for r in res.numbers["peers"]["SB3 PPO"]["runs"]]
    assert fw == [0.0, 0.0, 4.0, 5.0] and sb == [100.0, 100.0, 3.0, 4.0]  # seed 3 is this run's
    assert res.numbers["peers"]["Flywheel"]["summary"]["last100_at_budget"].median == 2.0
    assert "seeds 1, 2 from `FLYWHEEL_BENCH_X_SEEDS=3" in res.details_md
    assert "seeds 3, 4 from this run" in res.details_md
    assert res.headline[0].meets is False  # median 2.0 against SB3's 52.0
    test = res.numbers["rank_tests"]["Flywheel vs SB3 PPO"]["last100_at_budget"]
    assert (test["n_a"], test["n_b"]) == (4, 4)  # over the pooled seeds
    assert all("cores" in r for r in res.numbers["peers"]["Flywheel"]["runs"] if r["seed"] >= 3)  # this run's
