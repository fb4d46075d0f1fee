"""Does the learner in bf16 learn as it does in float32? MinAtar Breakout (``configs/minatar-breakout.yaml``), the
same seeds and env-step budget both ways, ``trainer.precision`` the only difference: last-100 return at equal env
steps, an exact rank-sum test per mark.

An in-process loop of the services' own RolloutWorkers and Learner at zero staleness (``bench.inproc.lockstep``, as
``forced_staleness`` uses), so the two sides differ only in the learner's numerics, not in how the stack's timing
spread the fragments' ages. Returns against env steps do not depend on how many runs share the machine, so runs go
``FLYWHEEL_BENCH_JOBS`` at a time (their wall times are recorded, not compared).

What it can show with 5 seeds a side is "no difference shown" or a difference; it cannot prove two curves equal.
The target is the weaker one the project can back: bf16's return at the budget is not shown lower than float32's
(one-sided p >= 0.05) and its median is within the seeds' spread of float32's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.context import Context, say
from bench.inproc import bench_jobs, lockstep_curve, parallel_map
from bench.peers.stats import MedianCI, RankTest
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import return_at_steps, rolling_mean
from bench.seeds import bench_seeds
from devstack import REPO_ROOT
from shared.settings import Settings, load_settings

NAME = "precision_parity"
TITLE = ("bf16 against float32 learning MinAtar Breakout: last-100 return at equal env steps, the learner's "
         "precision the only difference, the services' own RolloutWorkers and Learner in one loop.")
TARGET = "bf16's last-100 return at the budget not shown lower than float32's (one-sided rank-sum p >= 0.05)"
CONFIG = "configs/minatar-breakout.yaml"
ENV = "MinAtar/Breakout-v1"
PRECISIONS = ("fp32", "bf16")
SAMPLERS = 2
BUDGET = 600_000
QUICK_BUDGET = 40_000


def budget(ctx: Context) -> int:
    """Env steps per run: ``FLYWHEEL_BENCH_PRECISION_PARITY_STEPS``, else ``BUDGET`` (``QUICK_BUDGET`` under
    --quick)."""
    name = "FLYWHEEL_BENCH_PRECISION_PARITY_STEPS"
    raw = os.environ.get(name)
    if raw is None:
        return QUICK_BUDGET if ctx.quick else BUDGET
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want env steps, an integer > 0") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: want env steps, an integer > 0")
    return value


def marks(steps: int) -> list[int]:
    return [steps // 4, steps // 2, 3 * steps // 4, steps]


def one(base: Settings, seed: int, precision: str, steps: int) -> dict[str, Any]:
    """One run to ``steps`` env steps with the learner in ``precision`` (module level: runs in a worker)."""
    tr = base.trainer.model_copy(update={"seed": seed, "precision": precision, "device": "cpu"})
    t0 = time.monotonic()
    curve = lockstep_curve(base.model_copy(update={"trainer": tr}), seed, SAMPLERS, 0, lambda _c, s: s >= steps)
    m100 = rolling_mean(curve, 100)
    stride = max(1, len(m100) // 200)  # the plot's points, not every episode
    return {"precision": precision, "seed": seed, "wall_s": round(time.monotonic() - t0, 1),
            "episodes": len(curve), "at": {m: return_at_steps(curve, m, 100) for m in marks(steps)},
            "m100": [(s, round(v, 3)) for _, s, v in m100[::stride]]}


def compare(results: list[dict[str, Any]], steps: int) -> tuple[dict[int, dict[str, MedianCI]], dict[int, RankTest]]:
    """Per mark: each precision's median return over seeds, and bf16 against float32 (a run with no return at a
    mark ranks worst)."""
    by = {p: [r for r in results if r["precision"] == p] for p in PRECISIONS}
    at = {m: {p: MedianCI.of(r["at"][m] for r in by[p]) for p in PRECISIONS} for m in marks(steps)}
    tests = {m: RankTest.of((r["at"][m] for r in by["bf16"]), (r["at"][m] for r in by["fp32"]), failed=-float("inf"))
             for m in marks(steps)}
    return at, tests


def verdict(test: RankTest) -> bool:
    """The target: bf16 not shown lower than float32 at the budget."""
    return test.p_a_smaller >= 0.05


def run(ctx: Context) -> FigureResult:
    from devstack.services import validate_config
    from services.trainer.compute import NATIVE_BF16_FLAGS, cpu_info

    validate_config(REPO_ROOT / CONFIG, {}, install_extras=True, progress=say)  # MinAtar's package, where missing
    steps = budget(ctx)
    seeds = bench_seeds(NAME, 5, 1, ctx)
    jobs = bench_jobs()
    model, flags = cpu_info()
    native = any(f in flags for f in NATIVE_BF16_FLAGS)
    base = load_settings(CONFIG, environ={})
    say(f"{NAME}: {ENV}, {len(seeds)} seeds x {len(PRECISIONS)} precisions, {steps:,} env steps each, "
        f"{jobs} at a time")
    calls = [(base, seed, p, steps) for seed in seeds for p in PRECISIONS]
    results = parallel_map(one, calls, jobs)
    at, tests = compare(results, steps)
    final = tests[steps]
    n = len(seeds)
    headline = [
        Row(f"{ENV}: last-100 return at {steps:,} env steps, bf16 vs float32 ({n} seeds a side)",
            f"{at[steps]['bf16'].fmt(2)} vs {at[steps]['fp32'].fmt(2)}; {final.words('bf16', 'float32', 'return')}",
            TARGET, verdict(final)),
        Row("CPU", f"{model}; native bf16: {'yes' if native else 'no (bf16 arithmetic emulated)'}"),
    ]
    rows = [f"| {m:,} | {at[m]['fp32'].fmt(2)} | {at[m]['bf16'].fmt(2)} | {tests[m].p_two_sided:.3f} | "
            f"{tests[m].p_a_smaller:.3f} |" for m in marks(steps)]
    per_seed = [f"| {r['seed']} | {r['precision']} | {r['at'][steps]:.2f} | {r['episodes']:,} | {r['wall_s']:.0f} |"
                for r in sorted(results, key=lambda r: (r["seed"], r["precision"]))]
    details = "\n".join([
        f"Last-100 mean return at env steps, median [range] over {n} seeds (order statistics):",
        "",
        "| env steps | float32 | bf16 | two-sided p | one-sided p (bf16 lower) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Per run (wall seconds with the other runs beside it, not a speed figure):",
        "",
        "| seed | precision | last-100 at the budget | episodes | wall s |",
        "|---|---|---|---|---|",
        *per_seed,
    ])
    plot = panels(ctx.out_dir / "benchmarks-precision_parity.png", f"{ENV}: bf16 vs float32 learner",
                  [("env steps", "mean return of the last 100 episodes",
                    [(f"{r['precision']} s{r['seed']}", [s for s, _ in r["m100"]], [v for _, v in r["m100"]])
                     for r in results])])
    return FigureResult(
        headline=headline,
        numbers={"budget_env_steps": steps, "seeds": list(seeds), "native_bf16": native,
                 "at": {str(m): {p: ci for p, ci in v.items()} for m, v in at.items()},
                 "rank_tests": {str(m): t.as_dict() for m, t in tests.items()},
                 "runs": [{k: v for k, v in r.items() if k != "m100"} for r in results]},
        settings={"config": CONFIG, "env": ENV, "budget_env_steps": steps, "seeds": list(seeds), "jobs": jobs,
                  "workers": SAMPLERS, "trainer.precision": " | ".join(PRECISIONS),
                  "trainer.torch_threads": base.trainer.torch_threads},
        method=(f"In one process per seed and precision (`FLYWHEEL_BENCH_JOBS`, default one per core, at a time): "
                f"{SAMPLERS} RolloutWorkers and the trainer's Learner with `{CONFIG}`, `trainer.precision` set to "
                "fp32 or bf16 (autocast; the model's weights and Adam state stay float32 either way), the same seed "
                "for the learner and the workers on both sides. Each iteration collects `batch_fragments` fragments "
                "with the current policy, then one update, until the budget "
                f"(`FLYWHEEL_BENCH_PRECISION_PARITY_STEPS`, default {BUDGET:,}). Returns of the episodes in the "
                "fragments, in order; last-100 running mean at each mark; exact Wilcoxon rank-sum tests, bf16 "
                "against float32, per mark."),
        details_md=details,
        plots=[plot],
    )
