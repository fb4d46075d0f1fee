"""Actor:learner ratio: one trainer with 2, 4 or 8 latency-bound samplers on CartPole-v1.

For each ratio, a fresh stack (its own run, so every ratio learns from scratch) runs until the samplers have
made ``STEPS`` env steps, and gives:

- the learner's busy fraction: rate of ``flywheel_trainer_busy_seconds_total`` from the first trained update
  to the end (how much of the learner the samplers keep busy);
- the lag at training time: mean policy lag of the fragments trained in that span, in versions
  (``flywheel_trainer_fragment_staleness_versions``: its sum over its count);
- the last-100 return at equal env steps: the mean of the last 100 episodes finished within the first
  ``STEPS`` env steps, read from ``<run>.samples`` after the run.

The samplers' env steps sleep log-normally (the settings of ``async_vs_sync``/``scaling``), so they are
latency-bound and the 2 cores are not what limits 8 of them.
"""

from __future__ import annotations

import functools
from typing import Any

from bench.context import Context, say
from bench.figures.async_vs_sync import MEDIAN_MS, OVERRIDES, SIGMA
from bench.plots import lines
from bench.report import FigureResult, Row
from bench.samples import episode_curve, read_samples, return_at_steps
from bench.stack import BenchStack, Window, cpu_table, stack
from bench.stats import Spread

NAME = "actor_learner"
TITLE = (f"Sampler:trainer ratio 2:1, 4:1, 8:1 on CartPole-v1 (env steps sleep log-normally, median {MEDIAN_MS:g} ms, "
         f"sigma {SIGMA:g}): learner busy fraction, lag at training time, last-100 return at equal env steps.")
TARGET = "measured (no target): where adding samplers stops feeding the learner and starts adding lag"
RATIOS = (2, 4, 8)
STEPS = 60_000
QUICK_STEPS = 8_000
STALENESS = "flywheel_trainer_fragment_staleness_versions"


def _producing(st: BenchStack, n: int) -> bool:
    return st.status_samplers_producing() >= n


def _staleness(st: BenchStack) -> tuple[float, float]:
    """(sum, count) of the trainer's lag histogram now."""
    page = st.scrape("trainer")
    return page.get(f"{STALENESS}_sum", 0.0), page.get(f"{STALENESS}_count", 0.0)


def measure(ctx: Context, n: int, steps: int) -> dict[str, Any]:
    """One stack with ``n`` samplers until ``steps`` env steps are sampled; the figure's numbers for it."""
    run = ctx.run_name(NAME, f"{n}to1")
    with stack(ctx, run, {"FLYWHEEL_MODE": "async", **OVERRIDES}) as st:
        say(f"{NAME}: {n} samplers : 1 trainer")
        st.up(n)
        st.wait_for(f"{n} samplers producing", functools.partial(_producing, st, n), 90)
        st.wait_trained(1, timeout_s=120)
        start, (lag_sum0, lag_n0) = st.counters(), _staleness(st)
        series = st.sample_until(steps, timeout_s=max(120.0, steps / 50.0))
        end, (lag_sum1, lag_n1) = series[-1], _staleness(st)
    dt = max(end["t"] - start["t"], 1e-9)
    windows = [_window(a, b) for a, b in zip(series, series[1:], strict=False) if b["t"] - a["t"] > 0]
    frags = read_samples(ctx, run)
    curve = episode_curve(frags)
    sampled = sum(f.steps for f in frags)
    return {
        "samplers": n,
        "seconds": dt,
        "busy_fraction": (end["busy"] - start["busy"]) / dt,
        "busy_spread": Spread.of(w["busy"] for w in windows) if windows else None,
        "lag_mean_versions": (lag_sum1 - lag_sum0) / (lag_n1 - lag_n0) if lag_n1 > lag_n0 else float("nan"),
        "sampled_per_s": (end["sampled"] - start["sampled"]) / dt,
        "trained_per_s": (end["trained"] - start["trained"]) / dt,
        "dropped_stale": end["dropped"] - start["dropped"],
        "return_last100": return_at_steps(curve, steps),
        "episodes": sum(1 for _, s, _ in curve if s <= steps),
        "env_steps_read": sampled,
        "cpu": cpu_table([_cpu_window(start, end)]),
    }


def _window(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    dt = b["t"] - a["t"]
    return {"busy": (b["busy"] - a["busy"]) / dt}


def _cpu_window(a: dict[str, float], b: dict[str, float]) -> Window:
    return Window.between(a, b)


def run(ctx: Context) -> FigureResult:
    steps = QUICK_STEPS if ctx.quick else STEPS
    res = {n: measure(ctx, n, steps) for n in RATIOS}
    headline = [Row(f"{n}:1 learner busy / lag / last-100 return",
                    f"{r['busy_fraction']:.2f} / {r['lag_mean_versions']:.2f} / {r['return_last100']:.0f}")
                for n, r in res.items()]
    rows = [f"| {n}:1 | {r['sampled_per_s']:,.0f} | {r['trained_per_s']:,.0f} | **{r['busy_fraction']:.2f}** | "
            f"{r['lag_mean_versions']:.2f} | {r['dropped_stale']:.0f} | **{r['return_last100']:.1f}** "
            f"({r['episodes']} episodes) | {r['seconds']:.0f} s |" for n, r in res.items()]
    plot = lines(
        ctx.out_dir / "benchmarks-actor_learner.png", "one trainer, 2-8 latency-bound samplers",
        "samplers per trainer", "learner busy fraction / mean lag (versions)",
        [("learner busy fraction", list(RATIOS), [res[n]["busy_fraction"] for n in RATIOS]),
         ("mean lag at training time (versions)", list(RATIOS), [res[n]["lag_mean_versions"] for n in RATIOS])],
    )
    details = "\n".join([
        f"Every ratio: a fresh run until the samplers made {steps:,} env steps; rates from the first trained "
        "update to the end.",
        "",
        "| samplers:trainer | env-steps/s sampled | env-steps/s trained | learner busy fraction | mean lag at "
        f"training (versions) | fragments dropped stale | last-100 return at {steps:,} env steps | run |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *[f"- {n}:1: {r['cpu']}" for n, r in res.items()],
    ])
    return FigureResult(
        headline=headline,
        numbers={str(n): {k: (v.as_dict() if isinstance(v, Spread) else v) for k, v in r.items()}
                 for n, r in res.items()},
        settings={**{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()}, "env_steps": steps,
                  "ratios": list(RATIOS)},
        method=(f"For each of {', '.join(f'{n}:1' for n in RATIOS)}: one stack in mode async with the settings "
                f"of `async_vs_sync` (env steps sleep log-normally, median {MEDIAN_MS:g} ms, sigma {SIGMA:g}), a "
                "fresh run (unseeded, one per ratio) with that many samplers and one trainer, until the samplers' "
                f"`flywheel_sampler_env_steps_total` reaches {steps:,}. Busy = rate of "
                f"`flywheel_trainer_busy_seconds_total`; lag = increase of `{STALENESS}_sum` over that of `_count`; "
                f"return = mean of the last 100 episodes finished within the first {steps:,} env steps, from the "
                "fragments on `<run>.samples`."),
        details_md=details,
        plots=[plot],
    )
