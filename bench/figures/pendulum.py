"""Continuous actions: Pendulum-v1, the mean of the last 100 episode returns against env steps, Flywheel on
the full local stack (configs/pendulum.yaml) beside Stable-Baselines3 PPO with rl-zoo's hyperparameters."""

from __future__ import annotations

from typing import Any

from bench import sb3
from bench.context import Context, say
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import episode_curve, read_samples, return_at_steps, rolling_mean
from bench.seeds import bench_seeds
from bench.stack import stack
from bench.stats import Spread
from devstack import REPO_ROOT

NAME = "pendulum"
TITLE = ("Pendulum-v1 (continuous actions): mean return of the last 100 episodes at 25k / 50k / 75k / 100k env "
         "steps, Flywheel (full local stack, 2 samplers, configs/pendulum.yaml) beside SB3 PPO (rl-zoo).")
TARGET = "Flywheel's return at 100k env steps comparable to SB3 PPO's"
CONFIG = REPO_ROOT / "configs" / "pendulum.yaml"
ENV = "Pendulum-v1"
SAMPLERS = 2


def flywheel_seed(ctx: Context, seed: int, steps: int) -> list[tuple[float, int, float]]:
    run = ctx.run_name(NAME, f"seed{seed}")
    say(f"{NAME}: Flywheel seed {seed}, {SAMPLERS} samplers, until {steps:,} env steps")
    with stack(ctx, run, {"FLYWHEEL_TRAINER_SEED": seed, "FLYWHEEL_SAMPLER_SEED": seed}, config=CONFIG) as st:
        st.up(SAMPLERS)
        st.sample_until(steps, timeout_s=900)
    return episode_curve(read_samples(ctx, run, env_id=ENV))


def run(ctx: Context) -> FigureResult:
    if not CONFIG.exists():
        say(f"{NAME}: skipped: {CONFIG.relative_to(REPO_ROOT)} does not exist")
        return FigureResult(headline=[Row("skipped", f"{CONFIG.relative_to(REPO_ROOT)} does not exist (yet)")],
                            numbers={"skipped": True}, settings={}, method="Not run: no Pendulum config.")
    seeds = bench_seeds(NAME, 3, 1, ctx)
    steps = 20_000 if ctx.quick else 100_000
    marks = [steps // 4, steps // 2, 3 * steps // 4, steps]
    fw: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    for seed in seeds:  # one after another, never beside each other
        curve = flywheel_seed(ctx, seed, steps)
        fw.append({"seed": seed, "at": {m: return_at_steps(curve, m, 100) for m in marks},
                   "m100": rolling_mean(curve, 100), "episodes": len(curve)})
        say(f"{NAME}: SB3 PPO (rl-zoo Pendulum-v1), seed {seed}")
        b = sb3.run_ppo(ENV, seed, max_s=40.0 if ctx.quick else float("inf"))
        base.append({"seed": seed, "at": {m: return_at_steps(b["curve"], m, 100) for m in marks},
                     "m100": rolling_mean(b["curve"], 100), "wall_s": b["wall_s"], "env_steps": b["env_steps"]})
    table = {who: {m: Spread.of(r["at"][m] for r in rs if r["at"][m] == r["at"][m]) for m in marks}
             for who, rs in (("Flywheel", fw), ("SB3 PPO", base))}
    rows = [f"| {who} | " + " | ".join(table[who][m].fmt(0) for m in marks) + " |" for who in table]
    plot = panels(
        ctx.out_dir / "benchmarks-pendulum.png", f"Pendulum-v1 ({len(seeds)} seeds)",
        [("env steps", "mean return of the last 100 episodes",
          [(f"{who} seed {r['seed']}", [s for _, s, _ in r["m100"]], [v for _, _, v in r["m100"]])
           for who, rs in (("Flywheel", fw), ("SB3", base)) for r in rs])])
    details = "\n".join([
        "Last-100 mean return at env steps, median (min-max) over seeds:",
        "",
        "| | " + " | ".join(f"{m:,}" for m in marks) + " |",
        "|---|" + "---|" * len(marks),
        *rows,
        "",
        f"SB3: rl-zoo's Pendulum-v1 entry ({sb3.describe(ENV)}), CPU torch with 1 thread; returns from its Monitor "
        f"wrapper (raw, unnormalised). SB3 wall time for {base[0]['env_steps']:,} env steps: "
        f"{Spread.of(b['wall_s'] for b in base).fmt(0, ' s')}.",
    ])
    last = marks[-1]
    return FigureResult(
        headline=[
            Row(f"last-100 return at {last:,} env steps: Flywheel vs SB3 PPO (median over {len(seeds)} seeds)",
                f"{table['Flywheel'][last].fmt(0)} vs {table['SB3 PPO'][last].fmt(0)}"),
            Row(f"last-100 return at {marks[1]:,} env steps: Flywheel vs SB3 PPO",
                f"{table['Flywheel'][marks[1]].fmt(0)} vs {table['SB3 PPO'][marks[1]].fmt(0)}"),
        ],
        numbers={"marks": marks, "seeds": list(seeds), "table": table,
                 "flywheel": [{k: v for k, v in r.items() if k != "m100"} for r in fw],
                 "sb3": [{k: v for k, v in r.items() if k != "m100"} for r in base]},
        settings={"config": str(CONFIG.relative_to(REPO_ROOT)), "samplers": SAMPLERS, "env_steps": steps,
                  "seeds": f"FLYWHEEL_TRAINER_SEED = FLYWHEEL_SAMPLER_SEED = SB3 seed = {', '.join(map(str, seeds))}",
                  "sb3": sb3.describe(ENV)},
        method=(f"Per seed: a fresh stack with `{CONFIG.relative_to(REPO_ROOT)}` and {SAMPLERS} samplers until the "
                f"samplers made {steps:,} env steps; the fragments on `<run>.samples` read back in creation order, "
                "each finished episode placed at the env steps sampled so far; then SB3 PPO with the same seed "
                "(`bench.sb3`). The value at N env steps is the mean of the last 100 episodes finished within the "
                "first N (Pendulum episodes are 200 steps: 100 episodes are 20k env steps)."),
        details_md=details,
        plots=[plot],
    )
