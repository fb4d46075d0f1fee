"""Which stability options matter after solving? An ablation in one process.

The full-stack `stability` figure needs 10+ minutes per seed and variant; collapses are stochastic, so an
ablation needs many seed-variants. This one runs the services' own RolloutWorker + Learner in lockstep
(``bench.inproc.lockstep``) with the workers acting ``LAG`` versions behind (about the stack's measured mean
lag), ``configs/cartpole.yaml``, until the last-100 mean first reaches 475, then ``POST_STEPS`` more env
steps; the figure is the lowest last-100 mean after solving and how many seeds fell below 450.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.context import Context, say
from bench.inproc import Curve, bench_jobs, lockstep_curve, parallel_map
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import first_reaching, rolling_mean
from bench.seeds import bench_seeds
from bench.stats import Spread
from shared.settings import Settings, load_settings

NAME = "stability_ablation"
TITLE = ("CartPole-v1 after solving, in one process (RolloutWorkers + Learner, behaviour policy 2 versions old unless "
         "FLYWHEEL_BENCH_STABILITY_ABLATION_LAG says otherwise): "
         "the lowest last-100 mean return in the env steps after it first reached 475, configs/cartpole.yaml "
         "as is, and with one option changed at a time.")
TARGET = "a variant that never falls below 450 on any seed"
LAG = 2
SOLVE_CAP = 250_000  # env steps: a seed that has not solved by then counts as not solved
FLOOR = 0.1
VARIANTS: dict[str, dict[str, Any]] = {
    "configured": {},
    "lr-floor-1e-4": {"learning_rate_end": 1e-4},  # a learning-rate floor of 1e-4 instead of the config's 1e-5
    "entropy": {"ent_coef": 0.01},
    "adv-floor": {"advantage_std_floor": FLOOR},
    "separate-clip": {"separate_grad_clip": True},
    "mask": {"objective": "decoupled", "behaviour_weight_mode": "mask"},  # the weight exists only there
    "clip-constant": {"clip_coef_end": None},  # no clip-range schedule: the config's clip_coef throughout
    "anneal-120k": {"anneal_env_steps": 120_000},  # the same floor, reached sooner
    "no-kl-stop": {"target_kl": None},  # every update runs all its epochs; the clip schedule is the only brake
    "kl-0.05": {"target_kl": 0.05},
    "zoo-shape": {"batch_fragments": 1, "epochs": 20, "minibatches": 1},  # rl-zoo's update shape (fewer env steps)
    "minibatches-4": {"minibatches": 4},  # 32 gradient steps of 128 samples an update (16 of 256 with 2)
    # The default objective (clip around the proximal policy, truncated behaviour weight); the config: plain PPO.
    "decoupled": {"objective": "decoupled"},
    "all": {"advantage_std_floor": FLOOR, "separate_grad_clip": True, "objective": "decoupled",
            "behaviour_weight_mode": "mask"},
}
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "all")
"""The variants a plain run measures (``all`` on request: FLYWHEEL_BENCH_STABILITY_ABLATION_VARIANTS)."""


def _post_steps(ctx: Context) -> int:
    return int(os.environ.get("FLYWHEEL_BENCH_STABILITY_ABLATION_POST_STEPS", 30_000 if ctx.quick else 200_000))


def _lag() -> int:
    return int(os.environ.get("FLYWHEEL_BENCH_STABILITY_ABLATION_LAG", LAG))


def _variants() -> list[str]:
    names = [v.strip() for v in os.environ.get("FLYWHEEL_BENCH_STABILITY_ABLATION_VARIANTS", ",".join(DEFAULT_VARIANTS))
             .split(",")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"FLYWHEEL_BENCH_STABILITY_ABLATION_VARIANTS: unknown {unknown}; choose from {list(VARIANTS)}")
    return names


def run_one(base: Settings, seed: int, variant: str, post_steps: int, lag: int = LAG) -> dict[str, Any]:
    tr = base.trainer.model_copy(update={"seed": seed, **VARIANTS[variant]})
    settings = base.model_copy(update={"trainer": tr})
    solved_at: list[int] = []

    def done(curve: Curve, steps: int) -> bool:
        if not solved_at:
            if len(curve) >= 100 and sum(r for _, _, r in curve[-100:]) / 100 >= 475.0:
                solved_at.append(steps)
            return steps >= SOLVE_CAP
        return steps >= solved_at[0] + post_steps

    t0 = time.monotonic()
    curve = lockstep_curve(settings, seed, 2, lag, done)
    m100 = rolling_mean(curve, 100)
    solved = first_reaching(m100, 475.0)
    after = [m for _, s, m in m100 if solved is not None and s >= solved[1]]
    return {"seed": seed, "variant": variant, "solved_steps": solved[1] if solved else None,
            "min_after": min(after) if after else None, "below_450": sum(1 for m in after if m < 450.0),
            "episodes_after": len(after), "wall_s": time.monotonic() - t0,
            "m100": [(s, m) for _, s, m in m100][:: max(1, len(m100) // 400)]}


def run(ctx: Context) -> FigureResult:
    seeds = bench_seeds(NAME, 10, 1, ctx)
    post = _post_steps(ctx)
    variants = _variants()
    lag = _lag()
    base = load_settings("configs/cartpole.yaml", environ={})
    jobs = bench_jobs()
    say(f"{NAME}: {len(seeds)} seeds x {len(variants)} variants, each until last-100 >= 475 and then {post:,} "
        f"env steps, {jobs} at a time")
    results = parallel_map(run_one, [(base, seed, v, post, lag) for seed in seeds for v in variants], jobs)
    res: dict[str, list[dict[str, Any]]] = {v: [r for r in results if r["variant"] == v] for v in variants}
    rows, headline = [], []
    for v, rs in res.items():
        lows = [r["min_after"] for r in rs]
        held = sum(1 for r in rs if r["min_after"] is not None and r["min_after"] >= 450.0)
        solved = sum(1 for r in rs if r["solved_steps"] is not None)
        rows.append(f"| {v} | {VARIANTS[v] or 'as configured'} | {solved} of {len(rs)} | "
                    f"{Spread.of(r['solved_steps'] or float('inf') for r in rs).fmt()} | "
                    + " / ".join("n/a" if x is None else f"{x:.0f}" for x in lows) + f" | {held} of {len(rs)} |")
        headline.append(Row(f"{v}: seeds that never fell below 450 after solving (lowest last-100 per seed)",
                            f"{held} of {len(rs)} ({' / '.join('n/a' if x is None else f'{x:.0f}' for x in lows)})",
                            "all", held == len(rs)))
    plot = panels(
        ctx.out_dir / "benchmarks-stability_ablation.png", f"CartPole-v1 in one process, lag {lag}",
        [(f"env steps ({v})", "mean return of the last 100 episodes",
          [(f"seed {r['seed']}", [s for s, _ in r["m100"]], [m for _, m in r["m100"]]) for r in rs])
         for v, rs in res.items()],
        hline=(450.0, "450"))
    details = "\n".join([
        "| variant | options | seeds solved | env steps to last-100 >= 475 | lowest last-100 after, per seed "
        "| seeds never below 450 |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    return FigureResult(
        headline=headline,
        numbers={"lag": lag, "post_steps": post, "seeds": list(seeds),
                 "runs": {v: [{k: x for k, x in r.items() if k != "m100"} for r in rs] for v, rs in res.items()}},
        settings={"jobs": jobs, "lag_versions": lag, "env_steps_after_solving": post, "solve_cap_env_steps": SOLVE_CAP,
                  "seeds": ", ".join(map(str, seeds)), "variants": "; ".join(f"{v}: {VARIANTS[v] or '-'}"
                                                                           for v in variants)},
        method=("In one process, per seed and variant: 2 RolloutWorkers and the trainer's Learner with "
                "`configs/cartpole.yaml` plus the variant's options (`trainer.learning_rate_end`, `trainer.ent_coef`, "
                "`trainer.advantage_std_floor`, "
                "`trainer.separate_grad_clip`, `trainer.behaviour_weight_mode`, `trainer.clip_coef_end`, "
                "`trainer.anneal_env_steps`, `trainer.objective`); each iteration collects "
                f"`batch_fragments` fragments round robin with the weights of {lag} updates ago, then one update "
                f"(`bench.inproc.lockstep`). Runs until the last-100 mean first reaches 475 (at most "
                f"{SOLVE_CAP:,} env steps), then {post:,} env steps more; the lowest running last-100 mean from "
                "the solve on. Runs are independent processes, `FLYWHEEL_BENCH_JOBS` (default: one per core) at "
                "a time. Seeds, env steps after solving and variants: `FLYWHEEL_BENCH_STABILITY_ABLATION_"
                "SEEDS`, `..._POST_STEPS`, `..._VARIANTS`, `..._LAG`."),
        details_md=details,
        plots=[plot],
    )
