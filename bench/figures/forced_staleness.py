"""Forced staleness: every fragment is made by the policy of ``LAG`` updates ago. The decoupled objective
(clip around the proximal policy, importance weight to the behaviour policy) beside plain PPO (clip the
ratio to the behaviour policy itself), and the zero-lag loop for reference: on CartPole-v1 (lag 16), and on
Pendulum-v1 (lag ``PENDULUM_LAG``), whose learning is far more sensitive to the behaviour policy's age.

An in-process loop of the services' own RolloutWorker and Learner (``bench.inproc.lockstep``, as the
zero-staleness loop), so the lag is exact rather than whatever the stack's timing gives: the workers act with
the weights blob of ``LAG`` versions ago."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from bench.context import Context, say
from bench.inproc import Curve, bench_jobs, lockstep_curve, parallel_map
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import first_reaching, return_at_steps, rolling_mean
from bench.seeds import bench_seeds
from bench.stats import Spread
from shared.settings import Settings, load_settings

NAME = "forced_staleness"
TITLE = ("Every fragment acted by the policy 16 versions old (CartPole-v1: FLYWHEEL_BENCH_FORCED_STALENESS_LAG; "
         "Pendulum-v1: FLYWHEEL_BENCH_FORCED_STALENESS_PENDULUM_LAG): decoupled objective vs plain PPO "
         "(trainer.objective), return at equal env steps; the same loop without lag for reference.")
TARGET = "decoupled still solves (last-100 >= 475) where plain PPO degrades"
LAG = 16
PENDULUM_LAG = 16
SAMPLERS = 2


def forced_lag(var: str = "FLYWHEEL_BENCH_FORCED_STALENESS_LAG", default: int = LAG) -> int:
    """The lag in versions: the environment variable ``var``, else ``default``."""
    lag = int(os.environ.get(var, default))
    if lag < 1:
        raise ValueError(f"{var} must be >= 1, got {lag}")
    return lag


def lagged_run(settings: Settings, seed: int, lag: int, steps_budget: int) -> Curve:
    """:func:`bench.inproc.lockstep` with the workers acting ``lag`` versions behind, until ``steps_budget``
    env steps; the episode curve (seconds, env steps so far, return)."""
    return lockstep_curve(settings, seed, SAMPLERS, lag, lambda _curve, steps: steps >= steps_budget)


def _one(base: Settings, seed: int, objective: str, lag: int, budget: int, marks: list[int],
         threshold: float | None) -> dict[str, Any]:
    tr = base.trainer.model_copy(update={"seed": seed, "objective": objective})
    t0 = time.monotonic()
    curve = lagged_run(base.model_copy(update={"trainer": tr}), seed, lag, budget)
    m100 = rolling_mean(curve, 100)
    return {"label": _label(objective, lag), "seed": seed, "wall_s": time.monotonic() - t0,
            "solved": first_reaching(m100, threshold) if threshold is not None else None,
            "at": {m: return_at_steps(curve, m, 100) for m in marks}, "m100": [(s, v) for _, s, v in m100]}


def _label(objective: str, lag: int) -> str:
    return f"{objective}, lag {lag}"


@dataclass(frozen=True)
class _Part:
    env: str
    config: str
    lag: int
    budget: int
    seeds: tuple[int, ...]
    threshold: float | None
    """CartPole: last-100 >= this counts as solved; None (Pendulum): compared by return only."""

    @property
    def variants(self) -> tuple[tuple[str, int], ...]:
        return ("decoupled", self.lag), ("ppo", self.lag), ("decoupled", 0)

    @property
    def marks(self) -> list[int]:
        return [self.budget // 4, self.budget // 2, self.budget] if self.threshold is None else \
            [self.budget // 3, 2 * self.budget // 3, self.budget]


def _summarise(ctx: Context, part: _Part, results: list[dict[str, Any]], png: str
               ) -> tuple[list[Row], dict[str, Any], str, str]:
    """Headline rows, numbers, a markdown table and the plot of one env's runs."""
    res = {_label(o, g): [r for r in results if r["label"] == _label(o, g)] for o, g in part.variants}
    at_budget = {v: Spread.of(r["at"][part.budget] for r in rs) for v, rs in res.items()}
    dec, ppo, lag0 = _label("decoupled", part.lag), _label("ppo", part.lag), _label("decoupled", 0)
    n = len(part.seeds)
    solved = {v: sum(1 for r in rs if r["solved"]) for v, rs in res.items()}
    rows = []
    for v, rs in res.items():
        cells = " | ".join(Spread.of(r["at"][m] for r in rs).fmt(0) for m in part.marks)
        if part.threshold is not None:
            steps_to = Spread.of(r["solved"][1] if r["solved"] else float("inf") for r in rs)
            cells += f" | {solved[v]} of {len(rs)} | {steps_to.fmt()}"
        rows.append(f"| {v} | {cells} |")
    extra = (" seeds with last-100 >= 475 | env steps to 475 |", "---|---|") if part.threshold is not None else ("", "")
    table = "\n".join([
        f"**{part.env}**, behaviour policy {part.lag} versions old, {n} seeds (`{part.config}`). Last-100 mean "
        "return at env steps (median (min-max) over seeds)"
        + (", and how many seeds reached 475:" if part.threshold is not None else ":"),
        "",
        "| objective, lag | " + " | ".join(f"{m:,}" for m in part.marks) + " |" + extra[0],
        "|---|" + "---|" * len(part.marks) + extra[1],
        *rows,
    ])
    plot = panels(
        ctx.out_dir / png, f"{part.env}, behaviour policy {part.lag} versions old",
        [("env steps", "mean return of the last 100 episodes",
          [(f"{v} s{r['seed']}", [s for s, _ in r["m100"]], [x for _, x in r["m100"]])
           for v, rs in res.items() for r in rs])],
        hline=(part.threshold, f"{part.threshold:g}") if part.threshold is not None else None)
    if part.threshold is not None:
        meets = solved[dec] == n and at_budget[ppo].median < at_budget[dec].median
        headline = [Row(f"{part.env}: seeds solved (last-100 >= 475 within {part.budget:,} env steps), lag "
                        f"{part.lag}: decoupled vs plain PPO", f"{solved[dec]} of {n} vs {solved[ppo]} of {n}",
                        "decoupled all, PPO fewer/lower", meets)]
    else:
        # Every decoupled seed ahead of every PPO seed: a separation no seed-to-seed noise explains.
        meets = at_budget[dec].lo > at_budget[ppo].hi
        headline = [Row(f"{part.env}: lowest decoupled seed above the highest plain-PPO seed at {part.budget:,} "
                        f"env steps, lag {part.lag}", f"{at_budget[dec].lo:.0f} vs {at_budget[ppo].hi:.0f}",
                        "decoupled learns where plain PPO degrades", meets)]
    headline += [
        Row(f"{part.env}: last-100 return at {part.budget:,} env steps, lag {part.lag}: decoupled vs plain PPO "
            "(median over seeds)", f"{at_budget[dec].fmt(0)} vs {at_budget[ppo].fmt(0)}"),
        Row(f"{part.env}: same, no lag (decoupled)", at_budget[lag0].fmt(0)),
    ]
    numbers = {"lag": part.lag, "budget_env_steps": part.budget, "seeds": list(part.seeds), "at_budget": at_budget,
               "solved": solved if part.threshold is not None else None,
               "runs": {v: [{k: x for k, x in r.items() if k != "m100"} for r in rs] for v, rs in res.items()}}
    return headline, numbers, table, plot


def run(ctx: Context) -> FigureResult:
    parts = [
        _Part("CartPole-v1", "configs/cartpole.yaml", forced_lag(), 20_000 if ctx.quick else 150_000,
              bench_seeds(NAME, 5, 1, ctx), 475.0),
        _Part("Pendulum-v1", "configs/pendulum.yaml",
              forced_lag("FLYWHEEL_BENCH_FORCED_STALENESS_PENDULUM_LAG", PENDULUM_LAG),
              20_000 if ctx.quick else 100_000,
              bench_seeds(f"{NAME}_pendulum", 3, 1, ctx), None),
    ]
    jobs = bench_jobs()
    calls = []
    for i, part in enumerate(parts):
        base = load_settings(part.config, environ={})
        say(f"{NAME}: {part.env}, {len(part.seeds)} seeds x {len(part.variants)} variants, lag {part.lag}, "
            f"{part.budget:,} env steps each, {jobs} at a time")
        calls += [(i, (base, seed, o, g, part.budget, part.marks, part.threshold))
                  for seed in part.seeds for o, g in part.variants]
    results = parallel_map(_one, [c for _, c in calls], jobs)
    headline: list[Row] = []
    numbers: dict[str, Any] = {}
    tables, plots = [], []
    for i, part in enumerate(parts):
        mine = [r for (j, _), r in zip(calls, results, strict=True) if j == i]
        png = "benchmarks-forced_staleness.png" if i == 0 else "benchmarks-forced_staleness-pendulum.png"
        rows, nums, table, plot = _summarise(ctx, part, mine, png)
        headline += rows
        numbers[part.env] = nums
        tables.append(table)
        plots.append(plot)
    cart, pend = parts
    return FigureResult(
        headline=headline,
        numbers=numbers,
        settings={"config": ", ".join(f"{p.config} ({p.env})" for p in parts),
                  "jobs": jobs, "workers": SAMPLERS, "trainer.objective": "decoupled | ppo",
                  **{f"{p.env}": f"lag {p.lag} versions, {p.budget:,} env steps, seeds "
                                 f"{', '.join(map(str, p.seeds))}, {p.config}" for p in parts}},
        method=(f"In one process per env, seed and variant (`FLYWHEEL_BENCH_JOBS`, default one per core, at a time): "
                f"{SAMPLERS} RolloutWorkers and the trainer's Learner with the env's config. "
                "Each iteration collects `batch_fragments` fragments round robin, the workers acting with the "
                "weights of `lag` updates ago (the first `lag` updates with version 0), then one update; repeated "
                f"until the budget ({cart.budget:,} env steps on CartPole, {pend.budget:,} on Pendulum, where a "
                "version is 2,048 env steps). Returns of the episodes in the fragments, in order; last-100 running "
                "mean. `trainer.objective` selects the loss (decoupled: clip around the proximal policy with a "
                "truncated behaviour weight; ppo: clip the ratio to the behaviour policy). No fragment is dropped "
                "as stale here (the loop bypasses `max_staleness`), so both objectives see the same lag."),
        details_md="\n\n".join(tables),
        plots=plots,
    )
