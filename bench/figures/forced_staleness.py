"""Forced staleness: every fragment is made by the policy of ``LAG`` updates ago. The decoupled objective
(clip around the proximal policy, importance weight to the behaviour policy) beside plain PPO (clip the
ratio to the behaviour policy itself), and the zero-lag loop for reference.

An in-process loop of the services' own RolloutWorker and Learner (``bench.inproc.lockstep``, as the
zero-staleness loop), so the lag is exact rather than whatever the stack's timing gives: the workers act with
the weights blob of ``LAG`` versions ago."""

from __future__ import annotations

import os
import time
from typing import Any

from bench.common import Context, Spread, bench_seeds, first_reaching, return_at_steps, rolling_mean, say
from bench.inproc import Curve, bench_jobs, lockstep_curve, parallel_map
from bench.plots import panels
from bench.report import FigureResult, Row
from shared.settings import Settings, load_settings

NAME = "forced_staleness"
TITLE = ("CartPole-v1, every fragment acted by the policy 16 versions old (FLYWHEEL_BENCH_FORCED_STALENESS_LAG): "
         "decoupled objective vs plain PPO "
         "(trainer.objective), return at equal env steps; the same loop without lag for reference.")
TARGET = "decoupled still solves (last-100 >= 475) where plain PPO degrades"
LAG = 16
SAMPLERS = 2


def forced_lag() -> int:
    """The lag in versions: ``FLYWHEEL_BENCH_FORCED_STALENESS_LAG``, else :data:`LAG`."""
    lag = int(os.environ.get("FLYWHEEL_BENCH_FORCED_STALENESS_LAG", LAG))
    if lag < 1:
        raise ValueError(f"FLYWHEEL_BENCH_FORCED_STALENESS_LAG must be >= 1, got {lag}")
    return lag


def lagged_run(settings: Settings, seed: int, lag: int, steps_budget: int) -> Curve:
    """:func:`bench.inproc.lockstep` with the workers acting ``lag`` versions behind, until ``steps_budget``
    env steps; the episode curve (seconds, env steps so far, return)."""
    return lockstep_curve(settings, seed, SAMPLERS, lag, lambda _curve, steps: steps >= steps_budget)


def _one(base: Settings, seed: int, objective: str, lag: int, budget: int, marks: list[int]) -> dict[str, Any]:
    tr = base.trainer.model_copy(update={"seed": seed, "objective": objective})
    t0 = time.monotonic()
    curve = lagged_run(base.model_copy(update={"trainer": tr}), seed, lag, budget)
    m100 = rolling_mean(curve, 100)
    return {"label": _label(objective, lag), "seed": seed, "wall_s": time.monotonic() - t0,
            "solved": first_reaching(m100, 475.0), "at": {m: return_at_steps(curve, m, 100) for m in marks},
            "m100": [(s, v) for _, s, v in m100]}


def _label(objective: str, lag: int) -> str:
    return f"{objective}, lag {lag}"


def run(ctx: Context) -> FigureResult:
    seeds = bench_seeds(NAME, 5, 1, ctx)
    lag = forced_lag()
    variants = (("decoupled", lag), ("ppo", lag), ("decoupled", 0))
    budget = 20_000 if ctx.quick else 150_000
    marks = [budget // 3, 2 * budget // 3, budget]
    base = load_settings("configs/cartpole.yaml", environ={})
    jobs = bench_jobs()
    say(f"{NAME}: {len(seeds)} seeds x {len(variants)} variants, lag {lag}, {budget:,} env steps each, "
        f"{jobs} at a time")
    results = parallel_map(_one, [(base, seed, o, g, budget, marks) for seed in seeds for o, g in variants], jobs)
    res: dict[str, list[dict[str, Any]]] = {_label(o, g): [r for r in results if r["label"] == _label(o, g)]
                                            for o, g in variants}
    at_budget = {v: Spread.of(r["at"][budget] for r in rs) for v, rs in res.items()}
    solved = {v: sum(1 for r in rs if r["solved"]) for v, rs in res.items()}
    dec, ppo = _label("decoupled", lag), _label("ppo", lag)
    meets = solved[dec] == len(seeds) and at_budget[ppo].median < at_budget[dec].median
    rows = []
    for v, rs in res.items():
        cells = " | ".join(Spread.of(r["at"][m] for r in rs).fmt(0) for m in marks)
        steps_to = Spread.of(r["solved"][1] if r["solved"] else float("inf") for r in rs)
        rows.append(f"| {v} | {cells} | {solved[v]} of {len(rs)} | {steps_to.fmt()} |")
    plot = panels(
        ctx.out_dir / "benchmarks-forced_staleness.png", f"CartPole-v1, behaviour policy {lag} versions old",
        [("env steps", "mean return of the last 100 episodes",
          [(f"{v} s{r['seed']}", [s for s, _ in r["m100"]], [x for _, x in r["m100"]])
           for v, rs in res.items() for r in rs])],
        hline=(475.0, "475"))
    details = "\n".join([
        "Last-100 mean return at env steps (median (min-max) over seeds), and how many seeds reached 475:",
        "",
        "| objective, lag | " + " | ".join(f"{m:,}" for m in marks) + " | seeds with last-100 >= 475 "
        "| env steps to 475 |",
        "|---|" + "---|" * len(marks) + "---|---|",
        *rows,
    ])
    return FigureResult(
        headline=[
            Row(f"seeds solved (last-100 >= 475 within {budget:,} env steps), lag {lag}: decoupled vs plain PPO",
                f"{solved[dec]} of {len(seeds)} vs {solved[ppo]} of {len(seeds)}", "decoupled all, PPO fewer/lower",
                meets),
            Row(f"last-100 return at {budget:,} env steps, lag {lag}: decoupled vs plain PPO (median over seeds)",
                f"{at_budget[dec].fmt(0)} vs {at_budget[ppo].fmt(0)}"),
            Row("same, no lag (decoupled)", at_budget[_label("decoupled", 0)].fmt(0)),
        ],
        numbers={"lag": lag, "budget_env_steps": budget, "seeds": list(seeds), "at_budget": at_budget,
                 "solved": solved, "runs": {v: [{k: x for k, x in r.items() if k != "m100"} for r in rs]
                                            for v, rs in res.items()}},
        settings={"jobs": jobs, "lag_versions": lag, "workers": SAMPLERS, "env_steps": budget, "trainer.objective":
                  "decoupled | ppo", "seeds": ", ".join(map(str, seeds))},
        method=(f"In one process per seed and variant (`FLYWHEEL_BENCH_JOBS`, default one per core, at a time): "
                f"{SAMPLERS} RolloutWorkers and the trainer's Learner with `configs/cartpole.yaml`. "
                "Each iteration collects `batch_fragments` fragments round robin, the workers acting with the "
                f"weights of {lag} updates ago (the first {lag} updates with version 0), then one update; repeated "
                f"until {budget:,} env steps. Returns of the episodes in the fragments, in order; last-100 running "
                "mean. `trainer.objective` selects the loss (decoupled: clip around the proximal policy with a "
                "truncated behaviour weight; ppo: clip the ratio to the behaviour policy). No fragment is dropped "
                "as stale here (the loop bypasses `max_staleness`), so both objectives see the same lag."),
        details_md=details,
        plots=[plot],
    )
