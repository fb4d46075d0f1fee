"""Figure 5: time to solve CartPole-v1 with the full local stack and configs/cartpole.yaml, 5 seeds, beside
the same code with zero staleness (bench.inproc.sequential_solve) and Stable-Baselines3 PPO with rl-zoo's
hyperparameters (bench.sb3), each seed's three runs one after another."""

from __future__ import annotations

import time
from typing import Any

from bench import sb3
from bench.context import Context, say
from bench.inproc import sequential_solve
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import FragmentInfo, episode_curve, first_reaching, read_samples, rolling_mean
from bench.seeds import bench_seeds
from bench.stack import stack
from bench.stats import Spread
from shared.settings import load_settings

NAME = "solve"
TITLE = ("Time to solve CartPole-v1 (full local stack, 2 samplers, configs/cartpole.yaml): wall seconds and env "
         "steps from the first fragment until the mean of the last 20 / last 100 episode returns reaches 475, "
         "beside the same code with zero staleness and Stable-Baselines3 PPO (rl-zoo hyperparameters).")
TARGET = ("Flywheel / SB3 wall time <= 0.4, Flywheel / zero-staleness wall time <= 1.2, Flywheel / SB3 env steps "
          "<= 1.2 (last-100 >= 475)")
SAMPLERS = 2
INF = float("inf")


def _duplicates(frags: list[FragmentInfo]) -> int:
    """Fragments of another sampler whose observations are byte-identical to one of sampler-0's: what
    samplers sharing one seed produce while they act with the same policy (0 with per-sampler seeds)."""
    first = {f.fingerprint for f in frags if f.sampler_id == "sampler-0"}
    return sum(1 for f in frags if f.sampler_id != "sampler-0" and f.fingerprint in first)


def run_seed(ctx: Context, seed: int, budget: float) -> dict[str, Any]:
    run = ctx.run_name(NAME, f"seed{seed}")
    say(f"{NAME}: seed {seed}, {budget:.0f} s from the first fragment")
    with stack(ctx, run, {"FLYWHEEL_TRAINER_SEED": seed, "FLYWHEEL_SAMPLER_SEED": seed}) as st:
        up_s = st.up(SAMPLERS)
        st.wait_for("the first fragment", lambda: st.status_samplers_producing() >= 1, 60, poll_s=0.2)
        time.sleep(budget + 1.0)
        status = st.status()
    frags = read_samples(ctx, run)
    curve = [c for c in episode_curve(frags) if c[0] <= budget]
    m20, m100 = rolling_mean(curve, 20), rolling_mean(curve, 100)
    s20, s100 = first_reaching(m20, 475.0), first_reaching(m100, 475.0)
    after = [m for t, _, m in m100 if s100 is not None and t >= s100[0]]
    return {
        "seed": seed,
        "solve20": s20,
        "solve100": s100,
        "min_last100_after": min(after) if after else None,
        "held": bool(after) and min(after) >= 450.0,
        "final_last100": m100[-1][2] if m100 else None,
        "episodes": len(curve),
        "env_steps": curve[-1][1] if curve else 0,
        "duplicate_fragments": _duplicates(frags),
        "staleness_mean": status["staleness"]["mean"],
        "stack_up_s": up_s,
        "trained": status["trainer"]["samples_trained"],
        "fragments": len(frags),
        "m20": m20,
        "m100": m100,
    }


def _fmt(x: tuple[float, int] | None) -> str:
    return "not reached" if x is None else f"{x[0]:.1f} s / {x[1]:,} steps"


def _ratio(a: float, b: float) -> float:
    return a / b if b not in (0.0, INF) and a != INF else INF


def _rfmt(x: float) -> str:
    return "n/a (a side did not solve)" if x == INF else f"{x:.2f}"


def run(ctx: Context) -> FigureResult:
    budget = 30.0 if ctx.quick else 90.0
    seeds = bench_seeds(NAME, 5, 1, ctx)
    # The process environment applies, as it does to the stack's services: a FLYWHEEL_TRAINER_* A/B changes
    # the stack and the zero-staleness loop alike.
    settings = load_settings("configs/cartpole.yaml")
    res, seq, base = [], [], []
    for seed in seeds:  # per seed: stack, zero-staleness loop, SB3, one after another (drift hits all three)
        res.append(run_seed(ctx, seed, budget))
        say(f"{NAME}: zero-staleness in-process loop, seed {seed}")
        tr = settings.trainer.model_copy(update={"seed": seed})
        seq.append(sequential_solve(settings.model_copy(update={"trainer": tr}), seed, SAMPLERS, max_s=budget))
        say(f"{NAME}: Stable-Baselines3 PPO (rl-zoo CartPole-v1), seed {seed}")
        b = sb3.run_ppo("CartPole-v1", seed, stop_last100=475.0, max_s=budget)
        base.append({k: v for k, v in b.items() if k != "curve"} | {"m100": rolling_mean(b["curve"], 100)})
    n = len(seeds)
    seq100_s = Spread.of(x["last100_s"] if x["last100_s"] is not None else INF for x in seq)
    seq100_steps = Spread.of(x["last100_steps"] if x["last100_steps"] is not None else INF for x in seq)
    sb_s = Spread.of(b["solved"][0] if b["solved"] else INF for b in base)
    sb_steps = Spread.of(b["solved"][1] if b["solved"] else INF for b in base)
    t100 = [r["solve100"][0] if r["solve100"] else INF for r in res]
    t20 = [r["solve20"][0] if r["solve20"] else INF for r in res]
    st100 = Spread.of(t100)
    st20 = Spread.of(t20)
    steps100 = Spread.of(r["solve100"][1] if r["solve100"] else INF for r in res)
    steps20 = Spread.of(r["solve20"][1] if r["solve20"] else INF for r in res)
    ratios = {"flywheel_over_sb3_wall": _ratio(st100.median, sb_s.median),
              "flywheel_over_zero_staleness_wall": _ratio(st100.median, seq100_s.median),
              "flywheel_over_sb3_env_steps": _ratio(steps100.median, sb_steps.median)}
    held = all(r["held"] for r in res)
    up = Spread.of(r["stack_up_s"] for r in res)
    rows = []
    for r in res:
        low = "n/a" if r["min_last100_after"] is None else f"{r['min_last100_after']:.1f}"
        rows.append(f"| {r['seed']} | {_fmt(r['solve20'])} | {_fmt(r['solve100'])} | {low} | "
                    f"{'yes' if r['held'] else 'no'} | {r['episodes']} | {r['env_steps']:,} | "
                    f"{r['duplicate_fragments']} of {r['fragments']} |")
    side = []
    for r, q, b in zip(res, seq, base, strict=True):
        qs = None if q["last100_s"] is None else (q["last100_s"], int(q["last100_steps"] or 0))
        side.append(f"| {r['seed']} | {_fmt(r['solve100'])} | {_fmt(qs)} | {_fmt(b['solved'])} |")
    plot = panels(
        ctx.out_dir / "benchmarks-solve.png", f"CartPole-v1: Flywheel local stack (2 samplers) vs SB3 PPO ({n} seeds)",
        [("seconds since the first fragment", "Flywheel: mean return of the last 20 episodes",
          [(f"seed {r['seed']}", [t for t, _, _ in r["m20"]], [m for _, _, m in r["m20"]]) for r in res]),
         ("seconds since the first fragment / learn()", "mean return of the last 100 episodes",
          [(f"Flywheel seed {r['seed']}", [t for t, _, _ in r["m100"]], [m for _, _, m in r["m100"]]) for r in res]
          + [(f"SB3 seed {b['seed']}", [t for t, _, _ in b["m100"]], [m for _, _, m in b["m100"]]) for b in base])],
        hline=(475.0, "475"),
    )
    details = "\n".join([
        "Per seed, last-100 >= 475 (wall s / env steps), the three runs of a seed one after another:",
        "",
        "| seed | Flywheel (local stack) | zero-staleness loop (same code, one process) | SB3 PPO (rl-zoo) |",
        "|---|---|---|---|",
        *side,
        "",
        f"Ratios of medians: Flywheel / SB3 wall time **{_rfmt(ratios['flywheel_over_sb3_wall'])}**, Flywheel / "
        f"zero-staleness wall time **{_rfmt(ratios['flywheel_over_zero_staleness_wall'])}**, Flywheel / SB3 env steps "
        f"**{_rfmt(ratios['flywheel_over_sb3_env_steps'])}**.",
        "",
        "| seed | last-20 >= 475 (wall / env steps) | last-100 >= 475 | lowest last-100 after that | stayed >= 450 "
        f"| episodes in {budget:.0f} s | env steps in {budget:.0f} s "
        "| fragments identical to one of sampler-0's (by observations) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"The stack's mean staleness was {Spread.of(r['staleness_mean'] or 0 for r in res).fmt(1)} versions.",
        "",
        f"SB3: Stable-Baselines3 PPO with rl-zoo's CartPole-v1 entry ({sb3.describe('CartPole-v1')}), "
        "CPU torch with 1 thread, in the bench process with nothing else running; wall time from the start of "
        "`learn()` (model built, imports done), env steps = `num_timesteps`, returns from its Monitor wrapper.",
        "",
        "The last column of the second table checks that samplers given one `FLYWHEEL_SAMPLER_SEED` do not produce "
        "the same data: fragments whose observations are byte-identical to one of sampler-0's (0 expected).",
    ])
    return FigureResult(
        headline=[
            Row(f"Flywheel / SB3 wall time to last-100 >= 475 ({n} seeds, medians)",
                _rfmt(ratios["flywheel_over_sb3_wall"]), "<= 0.4", ratios["flywheel_over_sb3_wall"] <= 0.4),
            Row("Flywheel / zero-staleness loop wall time", _rfmt(ratios["flywheel_over_zero_staleness_wall"]),
                "<= 1.2", ratios["flywheel_over_zero_staleness_wall"] <= 1.2),
            Row("Flywheel / SB3 env steps", _rfmt(ratios["flywheel_over_sb3_env_steps"]), "<= 1.2",
                ratios["flywheel_over_sb3_env_steps"] <= 1.2),
            Row(f"Flywheel last-100 >= 475: wall s from the first fragment / env steps ({n} seeds)",
                f"{st100.fmt(1, ' s')} / {steps100.fmt()}", "<= 8 s", st100.hi <= 8.0),
            Row("SB3 PPO (rl-zoo) last-100 >= 475: wall s / env steps", f"{sb_s.fmt(1, ' s')} / {sb_steps.fmt()}"),
            Row("zero-staleness loop last-100 >= 475: wall s / env steps",
                f"{seq100_s.fmt(1, ' s')} / {seq100_steps.fmt()}"),
            Row(f"Flywheel last-100 stays >= 450 for the rest of the {budget:.0f} s",
                "yes, all seeds" if held else "no", "never below 450", held),
            Row("Flywheel last-20 >= 475: wall s / env steps", f"{st20.fmt(1, ' s')} / {steps20.fmt()}"),
        ],
        numbers={"budget_s": budget, "seeds": list(seeds), "ratios": ratios, "solve100_s": st100, "solve20_s": st20,
                 "solve100_steps": steps100, "solve20_steps": steps20, "held_all": held,
                 "flywheel": [{k: v for k, v in r.items() if k not in ("m20", "m100")} for r in res],
                 "sequential_inprocess": seq, "sequential100_s": seq100_s, "sequential100_steps": seq100_steps,
                 "sb3": [{k: v for k, v in b.items() if k != "m100"} for b in base], "sb3_100_s": sb_s,
                 "sb3_100_steps": sb_steps},
        settings={"samplers": SAMPLERS, "seeds": f"FLYWHEEL_TRAINER_SEED = FLYWHEEL_SAMPLER_SEED = SB3 seed = "
                  f"{', '.join(map(str, seeds))}", "budget_s": budget, "sb3": sb3.describe("CartPole-v1")},
        method=(f"Per seed a fresh stack with 2 samplers; it runs {budget:.0f} s from the first fragment. Afterwards "
                "every fragment on `<run>.samples` is read back and ordered by creation time (the sampler's clock); "
                "each finished episode's return (fragments carry `episode_returns`) is placed at its fragment's "
                "creation time and at the cumulative env steps sampled so far. last-20 / last-100 are running means "
                "over that sequence (the behaviour policy's episodes, as in CleanRL's episodic-return curves). "
                f"Wall time counts from the first fragment, so stack start-up ({up.fmt(0, ' s')} here, until every "
                "service answered /healthz) is excluded. Then, same seed, the zero-staleness loop "
                "(`bench.inproc.sequential_solve`: the same RolloutWorkers and Learner in one loop, 2 workers, "
                "collect 2 fragments, update, every worker adopts the new weights) and SB3 PPO (`bench.sb3`), each "
                f"stopped at last-100 >= 475 or after {budget:.0f} s; never two of them at once."),
        details_md=details,
        plots=[plot],
    )
