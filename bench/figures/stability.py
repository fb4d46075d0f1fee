"""Does a solved CartPole stay solved? Each seed's stack keeps running for minutes after its last-100 mean
first reaches 475; the lowest last-100 mean after that is the figure."""

from __future__ import annotations

import os
import time
from typing import Any

from bench.context import Context, say
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import episode_curve, first_reaching, read_samples, rolling_mean
from bench.seeds import bench_seeds
from bench.stack import stack
from bench.stats import Spread

NAME = "stability"
TITLE = ("CartPole-v1 on the full local stack (2 samplers, configs/cartpole.yaml): the lowest mean of the last 100 "
         "episode returns in the minutes after it first reached 475, per seed.")
TARGET = "never below 450 after solving"
SAMPLERS = 2
SOLVE_TIMEOUT_S = 180.0  # a seed that has not solved by then is reported as such and stopped
FLOOR = 0.1  # CartPole's advantages while learning have RMS ~1-10, after solving ~0.005
# The ablation: configs/cartpole.yaml as it is, one option changed at a time, and the three update options together.
VARIANTS: dict[str, dict[str, object]] = {
    "configured": {},
    "lr-floor-1e-4": {"FLYWHEEL_TRAINER_LEARNING_RATE_END": 1e-4},  # a floor of 1e-4, not the config's 1e-5
    "entropy": {"FLYWHEEL_TRAINER_ENT_COEF": 0.01},
    "adv-floor": {"FLYWHEEL_TRAINER_ADVANTAGE_STD_FLOOR": FLOOR},
    "separate-clip": {"FLYWHEEL_TRAINER_SEPARATE_GRAD_CLIP": "true"},
    "mask": {"FLYWHEEL_TRAINER_OBJECTIVE": "decoupled", "FLYWHEEL_TRAINER_BEHAVIOUR_WEIGHT_MODE": "mask"},
    "decoupled": {"FLYWHEEL_TRAINER_OBJECTIVE": "decoupled"},  # the default objective; the config: plain PPO
    "clip-constant": {"FLYWHEEL_TRAINER_CLIP_COEF_END": 0.2},  # = clip_coef: no clip-range schedule
    "anneal-120k": {"FLYWHEEL_TRAINER_ANNEAL_ENV_STEPS": 120_000},
    "all": {"FLYWHEEL_TRAINER_ADVANTAGE_STD_FLOOR": FLOOR, "FLYWHEEL_TRAINER_SEPARATE_GRAD_CLIP": "true",
            "FLYWHEEL_TRAINER_OBJECTIVE": "decoupled", "FLYWHEEL_TRAINER_BEHAVIOUR_WEIGHT_MODE": "mask"},
}


def _minutes(ctx: Context) -> float:
    return float(os.environ.get("FLYWHEEL_BENCH_STABILITY_MINUTES", 0.5 if ctx.quick else 10.0))


def _variants() -> list[str]:
    names = [v.strip() for v in os.environ.get("FLYWHEEL_BENCH_STABILITY_VARIANTS", "configured").split(",")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"FLYWHEEL_BENCH_STABILITY_VARIANTS: unknown {unknown}; choose from {list(VARIANTS)}")
    return names


def run_seed(ctx: Context, seed: int, hold_s: float, variant: str = "configured") -> dict[str, Any]:
    run = ctx.run_name(NAME, f"{variant}-seed{seed}")
    say(f"{NAME}: {variant}, seed {seed}: until the trainer's last-100 mean reaches 475, then {hold_s:.0f} s more")
    with stack(ctx, run, {"FLYWHEEL_TRAINER_SEED": seed, "FLYWHEEL_SAMPLER_SEED": seed, **VARIANTS[variant]}) as st:
        st.up(SAMPLERS)
        st.wait_for("the first fragment", lambda: st.status_samplers_producing() >= 1, 60, poll_s=0.2)
        # The trainer's /status mean (its last 100 consumed episodes) says roughly when; the exact point
        # comes from the fragments afterwards.
        try:
            st.wait_for("last-100 >= 475", lambda: (st.status()["episode_return"]["mean"] or 0.0) >= 475.0,
                        SOLVE_TIMEOUT_S, poll_s=1.0)
            solved_live = True
        except TimeoutError:
            solved_live = False
        if solved_live:
            time.sleep(hold_s)
        status = st.status()
    frags = read_samples(ctx, run, timeout_s=300.0)
    curve = episode_curve(frags)
    m100 = rolling_mean(curve, 100)
    solved = first_reaching(m100, 475.0)
    after = [(t, m) for t, _, m in m100 if solved is not None and t >= solved[0]]
    low = min(after, key=lambda x: x[1]) if after else None
    return {
        "seed": seed,
        "variant": variant,
        "solved": solved,
        "held_s": (after[-1][0] - solved[0]) if after and solved else 0.0,
        "min_after": low[1] if low else None,
        "min_after_at_s": low[0] if low else None,
        "points_below_450": sum(1 for _, m in after if m < 450.0),
        "episodes_after": len(after),
        "env_steps": curve[-1][1] if curve else 0,
        "staleness": status["staleness"],
        "m100": m100,
    }


def run(ctx: Context) -> FigureResult:
    seeds = bench_seeds(NAME, 5, 1, ctx)
    hold_s = _minutes(ctx) * 60.0
    variants = _variants()
    res = [run_seed(ctx, s, hold_s, v) for v in variants for s in seeds]
    lows = [r["min_after"] for r in res]
    ok = all(x is not None and x >= 450.0 for x in lows)
    rows = [f"| {r['variant']} | {r['seed']} | "
            + ("not reached" if r["solved"] is None else f"{r['solved'][0]:.1f} s / {r['solved'][1]:,}")
            + f" | {r['held_s'] / 60:.1f} | {r['episodes_after']:,} | "
            + ("n/a" if r["min_after"] is None else f"{r['min_after']:.1f} (at {r['min_after_at_s']:.0f} s)")
            + f" | {r['env_steps']:,} | {r['staleness']['mean'] or 0:.1f} / {r['staleness']['max']} |" for r in res]
    plot = panels(
        ctx.out_dir / "benchmarks-stability.png", f"CartPole-v1, local stack, {len(seeds)} seeds",
        [("seconds since the first fragment", "mean return of the last 100 episodes",
          [(f"{r['variant']} seed {r['seed']}", [t for t, _, _ in r["m100"]], [m for _, _, m in r["m100"]])
           for r in res])],
        hline=(450.0, "450"),
    )
    details = "\n".join([
        "| variant | seed | last-100 >= 475 first (wall s from the first fragment / env steps) | minutes held after "
        "| episodes after | lowest last-100 after solving | env steps in all | staleness mean / max (last 1,000 "
        "trained) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    return FigureResult(
        headline=[
            *[Row(f"{v}: lowest last-100 mean after solving, per seed ({len(seeds)} seeds, {hold_s / 60:g} min each)",
                  " / ".join("not solved" if r["min_after"] is None else f"{r['min_after']:.1f}"
                             for r in res if r["variant"] == v), ">= 450",
                  all(r["min_after"] is not None and r["min_after"] >= 450.0 for r in res if r["variant"] == v))
              for v in variants],
            Row("time to last-100 >= 475 (wall s from the first fragment)",
                Spread.of(r["solved"][0] if r["solved"] else float("inf") for r in res).fmt(1, " s")),
        ],
        numbers={"hold_s": hold_s, "seeds": [{k: v for k, v in r.items() if k != "m100"} for r in res],
                 "all_held": ok},
        settings={"samplers": SAMPLERS, "seeds": f"FLYWHEEL_TRAINER_SEED = FLYWHEEL_SAMPLER_SEED = "
                  f"{', '.join(map(str, seeds))}", "minutes_after_solving": hold_s / 60,
                  "solve_timeout_s": SOLVE_TIMEOUT_S,
                  "variants": "; ".join(f"{v}: {VARIANTS[v] or 'configs/cartpole.yaml as is'}" for v in variants)},
        method=("Per seed a fresh stack with 2 samplers. The bench polls the admin /status every second until the "
                "trainer's mean return (its last 100 consumed episodes) reaches 475, then lets the stack run "
                f"{hold_s / 60:g} more minutes (a seed that has not solved within {SOLVE_TIMEOUT_S:.0f} s is "
                "stopped). Afterwards every fragment on `<run>.samples` is read back in creation order; the "
                "running last-100 mean of the episodes' returns gives the first point >= 475 and the lowest value "
                "from there to the end. Seeds and minutes: `FLYWHEEL_BENCH_STABILITY_SEEDS`, "
                "`FLYWHEEL_BENCH_STABILITY_MINUTES`; the ablation's variants (the stability options alone and "
                "together): "
                f"`FLYWHEEL_BENCH_STABILITY_VARIANTS` from {', '.join(VARIANTS)}."),
        details_md=details,
        plots=[plot],
    )
