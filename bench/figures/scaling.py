"""Figure 3: throughput with 1, 2, 4, 8, 16, 32 latency-bound samplers, relative to 1, the knee (where
adding samplers stops paying), and where the trainer becomes the limit. One stack, scaled up in place
(running samplers are kept)."""

from __future__ import annotations

import functools
import time

from bench.context import Context, say
from bench.figures.async_vs_sync import MEDIAN_MS, OVERRIDES, SIGMA
from bench.plots import lines
from bench.report import FigureResult, Row
from bench.stack import BenchStack, cpu_table, measure_windows, stack
from bench.stats import Spread

NAME = "scaling"
TITLE = (f"Env-steps/s with 1, 2, 4, 8, 16, 32 samplers whose env steps sleep log-normally (median {MEDIAN_MS:g} ms, "
         f"sigma {SIGMA:g}; latency-bound: up to 8 samplers the 2 cores are not the limit), relative to 1 sampler.")
TARGET = ">= 1.95x / 3.85x / 7.5x at 2 / 4 / 8"
COUNTS = (1, 2, 4, 8, 16, 32)
KNEE_EFFICIENCY = 0.8
"""The knee: the first count whose env-steps/s per sampler falls below this fraction of one sampler's."""
TARGETS = {2: 1.95, 4: 3.85, 8: 7.5}


def _producing(st: BenchStack, n: int) -> bool:
    return st.status_samplers_producing() >= n


def run(ctx: Context) -> FigureResult:
    warmup, window, repeats = ctx.scale(6), ctx.scale(10), 3
    res: dict[int, dict[str, Spread]] = {}
    cpu: dict[int, str] = {}
    cpu_raw: dict[str, list[dict[str, float]]] = {}
    with stack(ctx, ctx.run_name(NAME), {"FLYWHEEL_MODE": "async", **OVERRIDES}) as st:
        for n in COUNTS:
            say(f"{NAME}: {n} samplers")
            st.up(n)
            if n == 1:
                st.wait_trained(1, timeout_s=90)
            # every new sampler has a policy and has produced
            st.wait_for(f"{n} samplers producing", functools.partial(_producing, st, n), 60)
            time.sleep(warmup)
            wins = measure_windows(st, window, repeats)
            cpu[n] = cpu_table(wins)
            cpu_raw[str(n)] = [w.cpu for w in wins]
            res[n] = {
                "sampled": Spread.of(w.sampled_per_s for w in wins),
                "trained": Spread.of(w.trained_per_s for w in wins),
                "busy": Spread.of(w.busy_fraction for w in wins),
                "backpressure": Spread.of(w.backpressure_fraction for w in wins),
                "capacity": Spread.of(w.trained_per_s / w.busy_fraction for w in wins if w.busy_fraction > 0),
            }
    base = res[1]["sampled"].median
    rel = {n: res[n]["sampled"].median / base for n in COUNTS}
    rows, headline = [], []
    for n in COUNTS:
        r = res[n]
        rows.append(f"| {n} | {r['sampled'].fmt()} | **{rel[n]:.3f}x** | {r['trained'].fmt()} | {r['busy'].fmt(2)} "
                    f"| {r['backpressure'].fmt(2)} | {r['capacity'].fmt()} |")
        if n in TARGETS:
            headline.append(Row(f"{n} samplers / 1", f"{rel[n]:.3f}x", f">= {TARGETS[n]}x", rel[n] >= TARGETS[n]))
    per_sampler = base
    cap8 = res[8]["capacity"].median
    limit_at = cap8 / per_sampler if per_sampler > 0 else float("nan")
    headline.append(Row("trainer busy fraction at 8 samplers", res[8]["busy"].fmt(2)))
    knee = next((n for n in COUNTS if rel[n] / n < KNEE_EFFICIENCY), None)
    headline.append(Row(f"knee: first count below {KNEE_EFFICIENCY:.0%} per-sampler efficiency",
                        "none up to 32" if knee is None else f"{knee} samplers ({rel[knee]:.2f}x)"))
    plot = lines(
        ctx.out_dir / "benchmarks-scaling.png", "env-steps/s vs samplers (latency-bound envs)", "samplers",
        "env-steps/s (sampled)",
        [("measured (median of windows)", list(COUNTS), [res[n]["sampled"].median for n in COUNTS])],
        ideal=(list(COUNTS), [base * n for n in COUNTS]),
        bands=[(list(COUNTS), [res[n]["sampled"].lo for n in COUNTS], [res[n]["sampled"].hi for n in COUNTS])],
    )
    details = "\n".join([
        "| samplers | env-steps/s sampled | vs 1 sampler | env-steps/s trained | trainer busy fraction "
        "| samplers paused by flow control (fraction of time) | trainer capacity (trained/s / busy) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Where the trainer becomes the limit: at 8 samplers it could train about {cap8:,.0f} env-steps/s if it "
        f"were busy all the time (trained rate / busy fraction, with 8 samplers competing for the cores), i.e. "
        f"about {limit_at:.0f} samplers' worth at {per_sampler:,.0f} env-steps/s each. The capacity column shows "
        "how it shrinks as samplers take CPU from it.",
        "",
        *[f"- {n} sampler{'s' if n > 1 else ''}: {cpu[n]}" for n in COUNTS],
    ])
    return FigureResult(
        headline=headline,
        numbers={"relative": rel, "per_count": {str(n): res[n] for n in COUNTS},
                 "trainer_limit_samplers_est": limit_at, "knee": knee, "cpu_cores": cpu_raw},
        settings={**{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()},
                  "warmup_s": warmup, "window_s": window, "windows": repeats},
        method=(f"One stack in mode async with the settings of `async_vs_sync`, scaled 1 -> 2 -> ... -> 32 samplers "
                f"(`LocalStack.up(samplers=n)` keeps the running ones). At each size: wait until every sampler "
                f"produces, {warmup:.0f} s warm-up, {repeats} windows of {window:.0f} s; env-steps/s = rate of the "
                "samplers' `flywheel_sampler_env_steps_total`, busy = rate of "
                "`flywheel_trainer_busy_seconds_total`."),
        details_md=details,
        plots=[plot],
    )
