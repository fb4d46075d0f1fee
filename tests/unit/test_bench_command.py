"""The command a figure's *Ran* line records: it must repeat the run, seeds and budgets included."""

from __future__ import annotations

from bench.__main__ import _command


def test_the_recorded_command_carries_the_bench_variables_that_were_set() -> None:
    env = {"FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS": "3", "FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S": "600 s",
           "FLYWHEEL_TRAINER_SEED": "7", "HOME": "/root"}
    assert _command(["--only", "peers_minatar"], env) == (
        "FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS=3 FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S='600 s' "
        ".venv/bin/python -m bench --only peers_minatar")
    assert _command([], {}) == ".venv/bin/python -m bench"
