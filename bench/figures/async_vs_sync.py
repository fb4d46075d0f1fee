"""Figure 2: asynchronous vs synchronous training with heavy-tailed latency, 8 samplers: per env step
(the envs of a sampler one after another, or overlapped) and per fragment.

Both modes run the same stack and settings; only ``mode`` differs. Throughput is env steps
sampled per second (equal to trained in sync mode), the trainer's busy fraction is the rate of
``flywheel_trainer_busy_seconds_total``, and the return is the mean of the last 100 episodes
finished within the first ``STEPS`` env steps (read from the fragments on ``<run>.samples``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import gymnasium as gym

from bench.context import Context, say
from bench.plots import panels
from bench.report import FigureResult, Row
from bench.samples import episode_curve, read_samples, return_at_steps, rolling_mean, seconds_to_steps
from bench.stack import stack
from bench.stats import Spread, percentile
from shared.rl.envs import LogNormalLatency

NAME = "async_vs_sync"
TITLE = ("8 samplers, env steps with log-normal latency (median 2 ms, sigma 1.0), the envs of a sampler stepping "
         "one after another or overlapping their delays, or one log-normal delay per fragment (median 100 ms, "
         "sigma 1.5): mode async vs mode sync - env-steps/s, trainer busy fraction, return after the same number "
         "of env steps.")
TARGET = "async >= 2.5x sync env-steps/s at equal return"
SAMPLERS = 8
REPEATS = 2
MEDIAN_MS, SIGMA = 2.0, 1.0
FRAGMENT_MEDIAN_MS, FRAGMENT_SIGMA = 100.0, 1.5
OVERRIDES = {
    "FLYWHEEL_ENV_NUM_ENVS": 4,
    "FLYWHEEL_ENV_LATENCY_MEDIAN_MS": MEDIAN_MS,
    "FLYWHEEL_ENV_LATENCY_SIGMA": SIGMA,
    "FLYWHEEL_TRAINER_BATCH_FRAGMENTS": 8,
    "FLYWHEEL_SAMPLER_MAX_BACKLOG": 0,  # flow control by credits: 16 fragments in flight (two batches of 8)
}
# The two ways a sampler's envs can spend their latency (shared/rl/envs.py); the first is the headline.
WORKLOADS: dict[str, tuple[dict[str, Any], str]] = {
    "sequential": ({}, "the envs of a sampler step one after another, so a vector step waits the *sum* of its "
                       "4 envs' delays"),
    "overlapped": ({"FLYWHEEL_ENV_LATENCY_OVERLAP": "true"},
                   "the envs wait out their delays concurrently (as envs in separate processes or remote "
                   "simulators do), so a vector step waits for the *slowest* of its 4 envs"),
    "fragment": ({"FLYWHEEL_ENV_LATENCY_MEDIAN_MS": 0, "FLYWHEEL_ENV_FRAGMENT_LATENCY_MEDIAN_MS": FRAGMENT_MEDIAN_MS,
                  "FLYWHEEL_ENV_FRAGMENT_LATENCY_SIGMA": FRAGMENT_SIGMA},
                 f"env steps are not delayed; each fragment gets one log-normal delay (median "
                 f"{FRAGMENT_MEDIAN_MS:g} ms, sigma {FRAGMENT_SIGMA:g}: p99 ~{FRAGMENT_MEDIAN_MS * 32.8 / 1000:.1f} s) "
                 "on top, so a fragment's generation time is heavy-tailed as a whole (an LLM rollout, a remote "
                 "simulator); a sync round waits for the slowest of 8 such fragments"),
}


def latency_probe(seconds: float, out: list[float]) -> None:
    """Time every step of one CartPole env behind the same latency wrapper the samplers use."""
    env = LogNormalLatency(gym.make("CartPole-v1"), MEDIAN_MS, SIGMA, seed=0)
    env.reset(seed=0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        out.append((time.perf_counter() - t0) * 1000.0)
        if term or trunc:
            env.reset()
    env.close()


def run_mode(ctx: Context, workload: str, mode: str, rep: int, steps: int, probe_s: float) -> dict[str, Any]:
    run = ctx.run_name(NAME, f"{workload[:3]}-{mode}{rep}")
    latencies: list[float] = []
    say(f"{NAME}: {workload} env latency, mode={mode} (run {rep + 1}), {SAMPLERS} samplers, until {steps} env steps")
    with stack(ctx, run, {"FLYWHEEL_MODE": mode, **OVERRIDES, **WORKLOADS[workload][0]}) as st:
        up_s = st.up(SAMPLERS)
        probe = threading.Thread(target=latency_probe, args=(probe_s, latencies), daemon=True)
        st.wait_trained(1, timeout_s=90)
        if probe_s > 0:
            probe.start()
        series = st.sample_until(steps, timeout_s=300)
        status = st.status()
        if probe_s > 0:
            probe.join()
    frags = read_samples(ctx, run)
    curve = episode_curve(frags)
    # Rates over 3 equal chunks of the polled series, skipping the first 10% (start-up transient).
    t_first, t_last = series[0]["t"], series[-1]["t"]
    start = t_first + 0.1 * (t_last - t_first)
    pts = [c for c in series if c["t"] >= start]
    chunks: list[dict[str, float]] = []
    n = len(pts) - 1
    parts = 3 if n >= 3 else 1  # a short (--quick) run may have too few polls for 3 chunks
    for k in range(parts):
        a, b = pts[k * n // parts], pts[(k + 1) * n // parts]
        dt = max(b["t"] - a["t"], 1e-9)
        chunks.append({"sampled": (b["sampled"] - a["sampled"]) / dt, "trained": (b["trained"] - a["trained"]) / dt,
                       "busy": (b["busy"] - a["busy"]) / dt})
    wall_to_steps = seconds_to_steps(frags, steps)
    by_sampler: dict[str, list[float]] = {}
    for f in frags:
        by_sampler.setdefault(f.sampler_id, []).append(f.created_at)
    gaps = [(b - a) * 1000.0 for ts in by_sampler.values() for a, b in zip(ts, ts[1:], strict=False)]
    return {
        "run": run,
        "up_s": up_s,
        "chunks": chunks,
        "return_at_steps": return_at_steps(curve, steps, 100),
        "return_at_steps_last20": return_at_steps(curve, steps, 20),
        "wall_to_steps_s": wall_to_steps,
        "staleness": status["staleness"],
        "dropped_stale": series[-1]["dropped"],
        "latency_ms": latencies,
        "fragment_interval_ms": {"p50": percentile(gaps, 0.5), "p90": percentile(gaps, 0.9),
                                 "p99": percentile(gaps, 0.99), "n": len(gaps)},
        "curve100": rolling_mean(curve, 100),
    }


def _compare(runs: dict[str, list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    """Throughput, return and wall-time comparison of the async and sync runs of one workload."""
    agg = {m: {k: Spread.of(c[k] for r in rs for c in r["chunks"]) for k in ("sampled", "trained", "busy")}
           for m, rs in runs.items()}
    ret = {m: Spread.of(r["return_at_steps"] for r in rs) for m, rs in runs.items()}
    wall = {m: Spread.of(r["wall_to_steps_s"] for r in rs) for m, rs in runs.items()}
    # At equal return: the highest last-100 mean every run reached (rounded down to 5), and how long each run
    # took to get there from its first fragment.
    common = min(max((v for _, _, v in r["curve100"]), default=0.0) for rs in runs.values() for r in rs)
    level = max(5.0, 5.0 * int(common // 5))
    to_level = {m: Spread.of(next((t for t, _, v in r["curve100"] if v >= level), float("inf")) for r in rs)
                for m, rs in runs.items()}
    steps_to_level = {m: Spread.of(next((x for _, x, v in r["curve100"] if v >= level), float("inf")) for r in rs)
                      for m, rs in runs.items()}
    return {
        "agg": agg, "ret": ret, "wall": wall, "level": level, "to_level": to_level, "steps_to_level": steps_to_level,
        "speedup": agg["async"]["sampled"].median / agg["sync"]["sampled"].median,
        "speedup_equal": to_level["sync"].median / to_level["async"].median,
    }


def _details(workload: str, runs: dict[str, list[dict[str, Any]]], cmp: dict[str, Any], steps: int) -> list[str]:
    agg, wall, to_level, steps_to_level = cmp["agg"], cmp["wall"], cmp["to_level"], cmp["steps_to_level"]
    rows = []
    gaps = runs["async"][0]["fragment_interval_ms"]
    for m, rs in runs.items():
        for i, r in enumerate(rs):
            c = r["chunks"]
            rows.append(f"| {m} {i + 1} | {Spread.of(x['sampled'] for x in c).fmt()} "
                        f"| {Spread.of(x['trained'] for x in c).fmt()} | {Spread.of(x['busy'] for x in c).fmt(2)} "
                        f"| {r['return_at_steps']:.1f} | {r['return_at_steps_last20']:.1f} "
                        f"| {r['wall_to_steps_s']:.1f} "
                        f"| {r['staleness']['mean'] or 0:.1f} / {r['staleness']['max']} | {r['dropped_stale']:.0f} |")
    return [
        f"### {workload.capitalize()} env latency",
        "",
        f"{WORKLOADS[workload][1][0].upper()}{WORKLOADS[workload][1][1:]}.",
        "",
        f"| run | env-steps/s sampled | env-steps/s trained | trainer busy fraction | return (last 100) at "
        f"{steps:,} steps | return (last 20) | wall s to {steps:,} steps | staleness mean / max | dropped stale |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Over all runs: async {agg['async']['sampled'].fmt()} vs sync {agg['sync']['sampled'].fmt()} env-steps/s "
        f"(**{cmp['speedup']:.2f}x**); wall time to {steps:,} env steps async {wall['async'].fmt(1, ' s')} vs sync "
        f"{wall['sync'].fmt(1, ' s')}.",
        "",
        f"At equal return: every run reached a last-100 mean of {cmp['level']:.0f}; async got there after "
        f"{to_level['async'].fmt(1, ' s')} ({steps_to_level['async'].fmt()} env steps), sync after "
        f"{to_level['sync'].fmt(1, ' s')} ({steps_to_level['sync'].fmt()} env steps): **{cmp['speedup_equal']:.2f}x** "
        "in wall time.",
        "",
        f"Time between one sampler's consecutive fragments (first async run, from the fragments' creation times; "
        f"includes sending and flow-control waits): p50 {gaps['p50']:.0f} ms, p90 {gaps['p90']:.0f} ms, p99 "
        f"{gaps['p99']:.0f} ms over {gaps['n']:,} intervals.",
        "",
    ]


def run(ctx: Context) -> FigureResult:
    steps = 10_000 if ctx.quick else 50_000
    repeats = 1 if ctx.quick else REPEATS
    probe_s = ctx.scale(15)
    by_workload: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for workload in WORKLOADS:
        runs: dict[str, list[dict[str, Any]]] = {"async": [], "sync": []}
        for rep in range(repeats):  # interleaved, so drift in the machine's load hits both modes alike
            first = workload == "sequential" and rep == 0
            runs["async"].append(run_mode(ctx, workload, "async", rep, steps, probe_s if first else 0.0))
            runs["sync"].append(run_mode(ctx, workload, "sync", rep, steps, 0.0))
        by_workload[workload] = runs
    cmps = {w: _compare(runs, steps) for w, runs in by_workload.items()}
    lat = by_workload["sequential"]["async"][0]["latency_ms"]
    p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
    plot = panels(
        ctx.out_dir / "benchmarks-async_vs_sync.png",
        f"async vs sync, {SAMPLERS} samplers, env latency median {MEDIAN_MS:g} ms sigma {SIGMA:g}",
        [("seconds since the first fragment", f"mean return of the last 100 episodes ({w} latency)",
          [(f"{m} {i + 1}", [t for t, _, _ in r["curve100"]], [v for _, _, v in r["curve100"]])
           for m, rs in runs.items() for i, r in enumerate(rs)])
         for w, runs in by_workload.items()]
        + [("env steps", "mean return of the last 100 episodes (sequential latency)",
            [(f"{m} {i + 1}", [x for _, x, _ in r["curve100"]], [v for _, _, v in r["curve100"]])
             for m, rs in by_workload["sequential"].items() for i, r in enumerate(rs)])],
    )
    details = "\n".join([
        *(line for w, runs in by_workload.items() for line in _details(w, runs, cmps[w], steps)),
        "Runs are unseeded and few, and runs of one mode differ a lot (compare the seeds in `solve`), so read the "
        "return columns as indicative only.",
        "",
        f"Env-step latency, measured in the bench process during the first async run (one CartPole env "
        f"behind the same `LogNormalLatency` wrapper, {len(lat):,} steps): p50 {p50:.2f} ms, "
        f"p90 {percentile(lat, 0.9):.2f} ms, p99 **{p99:.1f} ms**, max {max(lat):.1f} ms "
        f"(nominal p99 = {MEDIAN_MS:g} ms x e^(2.326 x {SIGMA:g}) = {MEDIAN_MS * 10.24:.1f} ms; the excess is "
        "sleep overshoot on a busy machine).",
        "",
        "Why the gap is what it is: async runs at the env-latency bound (or the trainer's rate, whichever is lower) "
        "and overlaps everything else with sampling. A sync round is one fragment per sampler, then the wait for "
        "the slowest of the 8, the update, the publish and every sampler's adoption, so the ratio is about "
        "1 + (sync's per-round overhead / fragment time). With sequential envs a fragment is 128 heavy-tailed "
        "sleeps in a row: it is long and its tail averages out, so the overhead is small in comparison. With "
        "overlapped envs a fragment is 32 waits for the slowest of 4 envs: shorter, with a heavier tail, so the "
        "same overhead weighs more. See bench/PERF-NOTES.md.",
    ])
    seq, ovl, frg = cmps["sequential"], cmps["overlapped"], cmps["fragment"]
    return FigureResult(
        headline=[
            Row("async / sync env-steps/s (sequential envs)", f"{seq['speedup']:.2f}x", ">= 2.5x",
                seq["speedup"] >= 2.5),
            Row(f"async / sync wall time to the same return, sequential envs (last-100 {seq['level']:.0f})",
                f"{seq['speedup_equal']:.2f}x", ">= 2.5x", seq["speedup_equal"] >= 2.5),
            Row("async / sync env-steps/s (overlapped envs)", f"{ovl['speedup']:.2f}x", ">= 2.5x",
                ovl["speedup"] >= 2.5),
            Row(f"async / sync wall time to the same return, overlapped envs (last-100 {ovl['level']:.0f})",
                f"{ovl['speedup_equal']:.2f}x", ">= 2.5x", ovl["speedup_equal"] >= 2.5),
            Row("async / sync env-steps/s (heavy-tailed per-fragment delay)", f"{frg['speedup']:.2f}x", ">= 2.5x",
                frg["speedup"] >= 2.5),
            Row(f"async / sync wall time to the same return, per-fragment delay (last-100 {frg['level']:.0f})",
                f"{frg['speedup_equal']:.2f}x", ">= 2.5x", frg["speedup_equal"] >= 2.5),
            Row(f"return (last 100) at {steps:,} env steps, async vs sync (per run, sequential envs)",
                " / ".join(f"{r['return_at_steps']:.0f}" for r in by_workload["sequential"]["async"]) + " vs "
                + " / ".join(f"{r['return_at_steps']:.0f}" for r in by_workload["sequential"]["sync"]),
                "equal (single runs: see text)", None),
            Row("trainer busy fraction, async vs sync (sequential envs)",
                f"{seq['agg']['async']['busy'].fmt(2)} vs {seq['agg']['sync']['busy'].fmt(2)}"),
            Row("env-step latency p99 (measured)", f"{p99:.1f} ms", "~20 ms", None),
        ],
        numbers={
            "steps": steps,
            "latency_ms": {"p50": p50, "p90": percentile(lat, 0.9), "p99": p99, "max": max(lat), "n": len(lat)},
            **{w: {
                "speedup": c["speedup"], "equal_return_level": c["level"], "speedup_equal_return": c["speedup_equal"],
                "seconds_to_level": c["to_level"], "steps_to_level": c["steps_to_level"],
                **{m: {"sampled_per_s": c["agg"][m]["sampled"], "trained_per_s": c["agg"][m]["trained"],
                       "busy_fraction": c["agg"][m]["busy"], "return_at_steps": c["ret"][m],
                       "wall_to_steps_s": c["wall"][m],
                       "runs": [{k: v for k, v in r.items() if k not in ("latency_ms", "curve100")}
                                for r in by_workload[w][m]]}
                   for m in ("async", "sync")}}
               for w, c in cmps.items()},
        },
        settings={"samplers": SAMPLERS, **{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()},
                  "mode": "async | sync", "env_latency": "sequential | overlapped (env.latency_overlap) | fragment "
                  f"(env.fragment_latency_median_ms {FRAGMENT_MEDIAN_MS:g}, sigma {FRAGMENT_SIGMA:g}, no per-step "
                  "delay)", "env_steps": steps, "runs_per_mode": repeats},
        method=(f"Each run: a fresh stack with {SAMPLERS} samplers; from the first update, counters polled every "
                f"second until {steps:,} env steps were sampled. Rates over 3 equal chunks of that span (the first "
                f"10% skipped); per workload {repeats} runs per mode, interleaved (async, sync, async, sync), "
                "median (min-max) over all chunks. Returns from the fragments on `<run>.samples` in creation "
                "order. `num_envs` lowered to 4 (8 samplers x 4 envs on 2 cores); `trainer.batch_fragments` 8 in "
                "both modes so an update sees the same 1,024 env steps (sync trains one fragment of every sampler), "
                "and flow control by credits (async: a window of two batches, 16 fragments, 2 per sampler; sync "
                "samplers wait for each new version instead). Two latency workloads with the same per-env delay "
                "distribution: sequential (the "
                "default `LogNormalLatency` wrapper) and overlapped (`env.latency_overlap: true`); a third with no "
                "per-step delay and one heavy-tailed delay per fragment (`env.fragment_latency_median_ms`, "
                "`env.fragment_latency_sigma`, applied by the sampler's RolloutWorker)."),
        details_md=details,
        plots=[plot],
    )
