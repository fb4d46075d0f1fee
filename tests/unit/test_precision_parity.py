"""The precision-parity figure's pure logic: its budget setting, the per-mark comparison and the target."""

from __future__ import annotations

import math

import pytest

from bench.context import Context
from bench.figures import FIGURES, precision_parity


def _results(fp32: list[float], bf16: list[float], steps: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for precision, finals in (("fp32", fp32), ("bf16", bf16)):
        for seed, v in enumerate(finals, 1):
            out.append({"precision": precision, "seed": seed,
                        "at": {m: v * m / steps for m in precision_parity.marks(steps)}})
    return out


def test_the_budget_reads_the_environment_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = Context(infra=None, stamp="t")  # type: ignore[arg-type]
    assert precision_parity.budget(ctx) == precision_parity.BUDGET
    quick = Context(infra=None, stamp="t", quick=True)  # type: ignore[arg-type]
    assert precision_parity.budget(quick) == precision_parity.QUICK_BUDGET
    monkeypatch.setenv("FLYWHEEL_BENCH_PRECISION_PARITY_STEPS", "200000")
    assert precision_parity.budget(ctx) == 200_000
    for bad in ("0", "-5", "lots", "1e6"):
        monkeypatch.setenv("FLYWHEEL_BENCH_PRECISION_PARITY_STEPS", bad)
        with pytest.raises(ValueError, match="PRECISION_PARITY_STEPS"):
            precision_parity.budget(ctx)


def test_bf16_clearly_behind_fails_the_target_and_equal_runs_pass() -> None:
    steps = 1000
    at, tests = precision_parity.compare(_results([10, 11, 12, 13, 14], [1, 2, 3, 4, 5], steps), steps)
    assert at[steps]["fp32"].median == 12 and at[steps]["bf16"].median == 3
    assert tests[steps].p_a_smaller < 0.05 and precision_parity.verdict(tests[steps]) is False
    at, tests = precision_parity.compare(_results([10, 12, 14, 16, 18], [11, 13, 15, 17, 19], steps), steps)
    assert precision_parity.verdict(tests[steps]) is True
    assert set(tests) == set(precision_parity.marks(steps)) == {250, 500, 750, 1000}


def test_a_run_with_no_return_at_a_mark_ranks_worst() -> None:
    steps = 1000
    res = _results([5, 5, 5, 5, 5], [6, 6, 6, 6, 6], steps)
    for r in res:
        if r["precision"] == "bf16":
            r["at"] = {m: math.nan for m in precision_parity.marks(steps)}  # no episode ended: no return
    _, tests = precision_parity.compare(res, steps)
    assert tests[steps].p_a_smaller < 0.05  # failures as -inf: behind every float32 run


def test_the_figure_is_registered() -> None:
    assert FIGURES["precision_parity"] is precision_parity
