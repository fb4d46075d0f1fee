"""Does asynchrony cost return? The mean of the last 100 episode returns at equal env steps, mode async vs
mode sync on the full local stack, CartPole-v1 and Acrobot-v1, several seeds, with 95% t-intervals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.context import Context, say
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import episode_curve, read_samples, return_at_steps, rolling_mean, seconds_to_steps
from bench.seeds import bench_seeds
from bench.stack import stack
from bench.stats import Interval
from devstack import REPO_ROOT

NAME = "async_sync_return"
TITLE = ("Return at equal env steps, mode async vs mode sync (full local stack, as many samplers as "
         "`trainer.batch_fragments`, so a sync round trains the same batch size): CartPole-v1 and Acrobot-v1.")
TARGET = "async / sync return >= 0.95 at equal env steps (each env)"


@dataclass(frozen=True)
class Task:
    env_id: str
    config: Path
    samplers: int  # = the config's batch_fragments: a sync update trains one fragment of every sampler
    steps: int  # env-step budget of a full run
    floor: float  # the worst return an episode can have: ratios compare returns above it


TASKS = (
    Task("CartPole-v1", REPO_ROOT / "configs" / "cartpole.yaml", 2, 100_000, 0.0),
    Task("Acrobot-v1", REPO_ROOT / "configs" / "acrobot.yaml", 4, 150_000, -500.0),
)
MODES = ("async", "sync")


def run_one(ctx: Context, task: Task, mode: str, seed: int, steps: int) -> dict[str, Any]:
    run = ctx.run_name(NAME, f"{task.env_id.split('-')[0].lower()}-{mode}-s{seed}")
    say(f"{NAME}: {task.env_id} mode={mode} seed {seed}, {task.samplers} samplers, until {steps:,} env steps")
    with stack(ctx, run, {"FLYWHEEL_MODE": mode, "FLYWHEEL_TRAINER_SEED": seed, "FLYWHEEL_SAMPLER_SEED": seed},
               config=task.config) as st:
        st.up(task.samplers)
        series = st.sample_until(steps, timeout_s=600)
        status = st.status()
    frags = read_samples(ctx, run, env_id=task.env_id)
    curve = episode_curve(frags)
    return {
        "seed": seed,
        "return": return_at_steps(curve, steps, 100),
        "episodes": sum(1 for _, s, _ in curve if s <= steps),
        "wall_s": seconds_to_steps(frags, steps),
        "reached": series[-1]["sampled"] >= steps,
        "staleness": status["staleness"],
        "dropped_stale": series[-1]["dropped"],
        "m100": [(s, m) for _, s, m in rolling_mean(curve, 100) if s <= steps],
    }


def _budget(ctx: Context, task: Task) -> int:
    """A fifth under --quick: Acrobot's first episodes (500 steps with an untrained policy, 32 envs) end only
    after 16k env steps."""
    return task.steps // 5 if ctx.quick else task.steps


def run(ctx: Context) -> FigureResult:
    seeds = bench_seeds(NAME, 5, 1, ctx)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task in TASKS:
        steps = _budget(ctx, task)
        out[task.env_id] = {m: [] for m in MODES}
        for seed in seeds:  # interleaved, so drift in the machine's load hits both modes alike
            for mode in MODES:
                out[task.env_id][mode].append(run_one(ctx, task, mode, seed, steps))
    headline, numbers, lines = [], {}, []
    for task in TASKS:
        runs = out[task.env_id]
        steps = _budget(ctx, task)
        iv = {m: Interval.of(r["return"] for r in runs[m]) for m in MODES}
        ratio = (iv["async"].mean - task.floor) / (iv["sync"].mean - task.floor)
        above = "" if task.floor == 0 else f" (returns above the floor {task.floor:g})"
        headline.append(Row(f"{task.env_id}: async / sync mean last-100 return at {steps:,} env steps{above}",
                            f"{ratio:.3f}", ">= 0.95", ratio >= 0.95))
        headline.append(Row(f"{task.env_id}: last-100 return at {steps:,} env steps, async vs sync (mean ± 95% CI, "
                            f"{len(seeds)} seeds)", f"{iv['async'].fmt(1)} vs {iv['sync'].fmt(1)}"))
        numbers[task.env_id] = {"steps": steps, "ratio": ratio, "floor": task.floor, "samplers": task.samplers,
                                **{m: {"return": iv[m], "runs": [{k: v for k, v in r.items() if k != "m100"}
                                                                 for r in runs[m]]} for m in MODES}}
        lines += [f"### {task.env_id} (`{task.config.relative_to(REPO_ROOT)}`, {task.samplers} samplers, "
                  f"{steps:,} env steps)", "",
                  "| seed | async return | sync return | async wall s to the budget | sync wall s "
                  "| async staleness mean / max | async dropped stale |", "|---|---|---|---|---|---|---|"]
        for a, s in zip(runs["async"], runs["sync"], strict=True):
            lines.append(f"| {a['seed']} | {a['return']:.1f} | {s['return']:.1f} | {a['wall_s']:.0f} "
                         f"| {s['wall_s']:.0f} | {a['staleness']['mean'] or 0:.1f} / {a['staleness']['max']} "
                         f"| {a['dropped_stale']:.0f} |")
        lines += ["", f"Mean ± 95% t-interval: async {iv['async'].fmt(1)}, sync {iv['sync'].fmt(1)}; ratio of means"
                  f"{above}: **{ratio:.3f}**.", ""]
    plot = panels(
        ctx.out_dir / "benchmarks-async_sync_return.png",
        f"async vs sync, return against env steps ({len(seeds)} seeds)",
        [("env steps", f"{env}: mean return of the last 100 episodes",
          [(f"{m} seed {r['seed']}", [s for s, _ in r["m100"]], [v for _, v in r["m100"]])
           for m in MODES for r in out[env][m]]) for env in out])
    return FigureResult(
        headline=headline,
        numbers={"seeds": list(seeds), **numbers},
        settings={"mode": "async | sync", "seeds": f"FLYWHEEL_TRAINER_SEED = FLYWHEEL_SAMPLER_SEED = "
                  f"{', '.join(map(str, seeds))}", "config": ", ".join(f"{t.config.relative_to(REPO_ROOT)} ({t.env_id})"
                                                                    for t in TASKS)},
        method=("Per env, seed and mode a fresh stack with that env's config and as many samplers as its "
                "`trainer.batch_fragments` (so a sync round, one fragment per sampler, is the same batch as an "
                "async update); counters polled every second until the samplers made the env-step budget. "
                "Afterwards the fragments on `<run>.samples` are read back in creation order; the figure is the "
                "mean return of the last 100 episodes finished within the budget. Seeds run interleaved (async, "
                "sync per seed). Mean ± 95% t-interval over seeds (independent runs). The ratio compares returns "
                "above the env's worst episode return (0 for CartPole, -500 for Acrobot's 500-step limit), so "
                "that it reads the same way for negative returns."),
        details_md="\n".join(lines),
        plots=[plot],
    )
