"""Pong throughput, side by side: end-to-end trained frames per second of Flywheel (the local stack,
``configs/pong.yaml``: 2 samplers x 4 envs), Sample Factory APPO (its Atari example, 8 envs, as documented, which
is synchronous, and in asynchronous mode with double buffering and a rollout worker per core, the same envs and
update, ``bench.peers.sf_atari``) and Stable-Baselines3 PPO (8 envs, Flywheel's settings and Nature CNN, as many torch
threads as the machine has cores, ``bench.peers.sb3_atari``), against EnvPool's raw stepping rate of the same 8
envs with random actions (``bench.peers.envpool_raw``) as the ceiling of the machine.

Every side reports a series of (seconds since its first env step, env steps trained so far); the rate is taken
over the steady part, from ``warmup_s`` to the end of the run (``bench.peers.throughput``), so start-up and the
first update's latency stay out of it and start-up is reported beside. An env step is one action in one env;
ALE's frame skip makes it 4 frames, so frames/s = 4 x env steps/s on every side. The learner alone (Flywheel's
``Learner.update`` on the config's batches, one torch thread, no Kafka: ``bench.peers.learner_rate``) is
measured too: on a CPU it, not the envs, bounds every side's trained rate, which is what the profile line says.

Per seed each side runs once, one after another on the same machine (never two at once), with the other work on
the machine recorded and a run beside more than 0.2 cores of it redone once (``bench.peers.measure``). "Ahead" is
an exact rank-sum test of trained frames/s, Flywheel against each side (``bench.peers.stats.RankTest``).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.context import Context, say
from bench.peers import envpool_raw, flywheel_peer, sb3_atari, sf_atari
from bench.peers.measure import (
    OTHER_WORK_LIMIT,
    SB3_THREADS,
    cores_cell,
    cores_words,
    guarded,
    measured,
    redone_lines,
)
from bench.peers.proc import adopt_orphans, run_lines
from bench.peers.stats import MedianCI, RankTest
from bench.peers.throughput import FRAME_SKIP, ThroughputRun
from bench.report import FigureResult, Row
from bench.seeds import bench_seeds, env_seconds, ran_by
from bench.stack import BenchStack, Window
from devstack import REPO_ROOT

NAME = "peers_pong"
TITLE = ("Peers on Pong: end-to-end trained frames/s of Flywheel (local stack, 2 samplers x 4 envs), Sample "
         "Factory APPO (sync as documented, and async) and SB3 PPO (8 envs, Nature CNN), against EnvPool's raw rate "
         "of 8 envs, one machine, one run.")
TARGET = "Flywheel's median trained frames/s >= both Sample Factory modes' and >= 0.7 x EnvPool's raw rate"
SF_SIDES = tuple(sf_atari.peer_name(m) for m in sf_atari.MODES)
CONFIG = REPO_ROOT / "configs" / "pong.yaml"
SAMPLERS = flywheel_peer.SAMPLERS
FLYWHEEL = "Flywheel"
FLYWHEEL_BF16 = "Flywheel bf16"
# Flywheel's sides: configs/pong.yaml as shipped (float32), and the same with the learner in bf16 (autocast, on a CPU
# with native bf16 its matrix units). Environment-variable overrides, as the stack takes them.
FLYWHEEL_SIDES: dict[str, dict[str, str]] = {
    FLYWHEEL: {"FLYWHEEL_TRAINER_PRECISION": "fp32"},
    FLYWHEEL_BF16: {"FLYWHEEL_TRAINER_PRECISION": "bf16"},
}
CEILING = envpool_raw.PEER
# The issue-42 target for the bf16 side: trained frames/s against SB3's at equal cores (2.0x on a CPU with native
# bf16, 1.3x without) and against EnvPool's raw rate of the same envs.
BF16_VS_SB3 = {True: 2.0, False: 1.3}
BF16_VS_ENVPOOL = 0.35
# FLYWHEEL_BENCH_PEERS_PONG_SIDES picks the sides a run repeats (a comma list of these keys; default all). Sides
# left out are not re-measured: their figures from the entry before are kept, labelled with where they ran, and no
# ratio is taken against them.
SIDE_KEYS = {"envpool": CEILING, "sf_sync": SF_SIDES[0], "sf_async": SF_SIDES[1], "sb3": sb3_atari.PEER,
             "flywheel": FLYWHEEL, "flywheel_bf16": FLYWHEEL_BF16}
ENVPOOL_MAX_S = 60.0  # the raw rate is steady within seconds: a minute is plenty
POLL_S = 2.0

Runner = Callable[[int], ThroughputRun]


def timing(ctx: Context) -> tuple[float, float]:
    """(run_s, warmup_s): each side runs ``run_s`` from its first env step; rates start at ``warmup_s``."""
    run_s = env_seconds("FLYWHEEL_BENCH_PEERS_PONG_RUN_S", 60.0 if ctx.quick else 180.0)
    warmup_s = env_seconds("FLYWHEEL_BENCH_PEERS_PONG_WARMUP_S", 20.0 if ctx.quick else 45.0)
    if warmup_s + 10.0 > run_s:
        raise ValueError(f"FLYWHEEL_BENCH_PEERS_PONG_WARMUP_S={warmup_s:g} must end at least 10 s before "
                         f"FLYWHEEL_BENCH_PEERS_PONG_RUN_S={run_s:g}")
    return run_s, warmup_s


def chosen_sides() -> tuple[str, ...]:
    """The sides this run measures, in the figure's order: ``FLYWHEEL_BENCH_PEERS_PONG_SIDES`` (keys of
    ``SIDE_KEYS``) or all. Flywheel as shipped is always among them: every test is against it."""
    name = "FLYWHEEL_BENCH_PEERS_PONG_SIDES"
    raw = os.environ.get(name)
    if raw is None:
        return tuple(SIDE_KEYS.values())
    keys = {k.strip() for k in raw.split(",") if k.strip()}
    unknown = sorted(keys - set(SIDE_KEYS))
    if unknown or "flywheel" not in keys:
        raise ValueError(f"{name}={raw!r}: want a comma list of {', '.join(SIDE_KEYS)}, with flywheel among them"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(peer for key, peer in SIDE_KEYS.items() if key in keys)


def carried(earlier: Mapping[str, Any] | None, peers: Sequence[str]) -> dict[str, Any]:
    """The figures of ``peers`` (sides this run does not repeat) from the entry before it, each with where it
    was measured (a side carried once already keeps its own origin)."""
    if not earlier:
        return {}
    numbers = earlier.get("numbers", {})
    out: dict[str, Any] = {}
    for peer in peers:
        if peer in numbers.get("not_rerun", {}):
            out[peer] = numbers["not_rerun"][peer]
        elif peer in numbers.get("peers", {}):
            body = numbers["peers"][peer]
            out[peer] = {**{k: body[k] for k in ("frames_per_s", "startup_s", "cores") if k in body},
                         "seeds": numbers.get("seeds"), "run_s": numbers.get("run_s"), "ran_by": ran_by(earlier)}
    return out


def run_flywheel(ctx: Context, seed: int, run_s: float, warmup_s: float,
                 overrides: dict[str, Any] | None = None, peer: str = FLYWHEEL) -> ThroughputRun:
    """The local stack with ``configs/pong.yaml`` (and ``overrides``, environment-variable style): the
    trainer's trained-env-steps counter every ``POLL_S`` from the first fragment for ``run_s``; the cores each
    process group used over the steady window."""
    run = ctx.run_name(NAME, f"fw-seed{seed}")
    say(f"{NAME}: {peer} seed {seed}, {run_s:.0f} s from the first fragment")
    snaps: list[tuple[float, dict[str, float]]] = []

    def scrape(st: BenchStack, t: float) -> bool:
        try:
            c = st.counters()
            snaps.append((c["t"] - (time.monotonic() - t), c))  # the scrape's own instant, from the first fragment
        except Exception as exc:  # a busy trainer may miss one scrape; the next one counts
            say(f"{NAME}: a counters scrape failed ({type(exc).__name__}), next in {POLL_S:.0f} s")
        return t < run_s

    ran = flywheel_peer.run_stack(ctx, run, seed, CONFIG, scrape, overrides=overrides, first_fragment_s=180,
                                  poll_s=POLL_S)
    startup, error = ran.startup_s, ran.error
    if startup is None or not snaps:
        return ThroughputRun(peer, seed, startup, (), error or "no counters were read")
    steady = [(t, c) for t, c in snaps if t >= warmup_s]
    cores: dict[str, float] = {}
    busy: float | None = None
    if len(steady) >= 2:
        w = Window.between(steady[0][1], steady[-1][1], SAMPLERS)
        cores = {k: round(v, 3) for k, v in w.cpu.items()}
        busy = round(w.busy_fraction, 3)
    last = snaps[-1][1]
    return ThroughputRun(peer, seed, startup, tuple((t, int(c["trained"])) for t, c in snaps), error,
                         {"cores": round(sum(v for k, v in cores.items() if k not in ("machine", "bench")), 3),
                          "cores_by_process": cores, "learner_busy": busy, "sampled": int(last["sampled"]),
                          "updates": int(last["updates"])})


def learner_ceiling(threads: int = 1, updates: int = 3, precision: str = "fp32") -> dict[str, Any]:
    """Flywheel's learner alone on Pong batches (a child process, so its torch threads are its own)."""
    import json
    import sys

    cmd = [sys.executable, "-m", "bench.peers.learner_rate", "--config", str(CONFIG), "--threads", str(threads),
           "--updates", str(updates), "--precision", precision]
    res = run_lines(cmd, timeout_s=900, cwd=REPO_ROOT)
    for _, line in reversed(res.lines):
        if line.startswith("{"):
            out: dict[str, Any] = json.loads(line)
            return out
    return {"error": f"learner_rate exited with {res.rc}: {res.tail(5)}"}


def frames_ci(runs: Sequence[ThroughputRun], warmup_s: float, until_s: float) -> MedianCI:
    """Median trained frames/s over the runs that have a rate (a failed run counts as no value, not as 0)."""
    return MedianCI.of(r.frames_per_s(warmup_s, until_s) for r in runs if r.frames_per_s(warmup_s, until_s) is not None)


def verdict(fw: float, sf: float, ceiling: float) -> bool | None:
    """The target: Flywheel >= SF (the faster of its modes) and >= 0.7 x EnvPool. False when Flywheel has no
    rate; None (not decided) when a rival has none, since a missing rival proves nothing either way."""
    if not fw == fw or fw <= 0:
        return False
    if not (sf == sf and ceiling == ceiling):
        return None
    return fw >= sf and fw >= 0.7 * ceiling


def bf16_verdict(bf16: float, sb3: float, ceiling: float, native: bool) -> bool | None:
    """The issue-42 target: Flywheel in bf16 >= ``BF16_VS_SB3[native]`` x SB3 and >= ``BF16_VS_ENVPOOL`` x
    EnvPool's raw rate. False when the bf16 side has no rate; None when SB3 or EnvPool has none."""
    if not bf16 == bf16 or bf16 <= 0:
        return False
    if not (sb3 == sb3 and ceiling == ceiling):
        return None
    return bf16 >= BF16_VS_SB3[native] * sb3 and bf16 >= BF16_VS_ENVPOOL * ceiling


def compare(runs: dict[str, list[ThroughputRun]], windows: dict[str, tuple[float, float]]) -> dict[str, RankTest]:
    """Each Flywheel side's trained frames/s against each other side's that ran (EnvPool's raw rate is a ceiling,
    not a rival), and bf16 against float32: exact rank-sum tests, a run with no rate ranking worst."""
    def fps(peer: str) -> list[float | None]:
        return [r.frames_per_s(*windows[peer]) for r in runs[peer]]

    ran = [p for p in runs if runs[p]]
    ours = [p for p in FLYWHEEL_SIDES if p in ran]
    pairs = [(a, b) for a in ours for b in ran if b not in FLYWHEEL_SIDES and b != CEILING]
    pairs += [(FLYWHEEL_BF16, FLYWHEEL)] if FLYWHEEL_BF16 in ours and FLYWHEEL in ours else []
    return {f"{a} vs {b}": RankTest.of(fps(a), fps(b), failed=-math.inf) for a, b in pairs}


def run(ctx: Context) -> FigureResult:
    from services.trainer.compute import NATIVE_BF16_FLAGS, cpu_info

    run_s, warmup_s = timing(ctx)
    seeds = bench_seeds(NAME, 5, 1, ctx)
    chosen = chosen_sides()
    adopted = adopt_orphans()  # SF's workers orphaned by its stop are reaped here, their CPU counted
    ep_s, ep_warm = min(run_s, ENVPOOL_MAX_S), min(warmup_s, 5.0)
    threads = os.cpu_count() or 1
    native_bf16 = any(f in cpu_info()[1] for f in NATIVE_BF16_FLAGS)
    if any(p in chosen for p in SF_SIDES):
        sf_atari.ensure_atari()
    if CEILING in chosen:
        envpool_raw.ensure_venv()
    windows = {CEILING: (ep_warm, ep_s), sb3_atari.PEER: (warmup_s, run_s),
               **{peer: (warmup_s, run_s) for peer in (*SF_SIDES, *FLYWHEEL_SIDES)}}

    def sf_side(mode: str) -> Runner:
        return lambda seed: sf_atari.run_seed(seed, run_s=run_s, stamp=ctx.stamp, mode=mode)

    def fw_side(peer: str) -> Runner:
        return lambda seed: run_flywheel(ctx, seed, run_s, warmup_s, FLYWHEEL_SIDES[peer], peer)

    every: list[tuple[str, Runner]] = [
        (CEILING, lambda seed: envpool_raw.run(seed, ep_s, threads)),
        *((sf_atari.peer_name(mode), sf_side(mode)) for mode in sf_atari.MODES),
        (sb3_atari.PEER, lambda seed: sb3_atari.run_child(seed, run_s, SB3_THREADS)),
        *((peer, fw_side(peer)) for peer in FLYWHEEL_SIDES),
    ]
    sides = [(p, fn) for p, fn in every if p in chosen]
    kept = carried(ctx.earlier, [p for p, _ in every if p not in chosen])
    runs: dict[str, list[ThroughputRun]] = {p: [] for p, _ in sides}
    for seed in seeds:  # per seed every side, one after another: drift of the machine hits all alike
        for peer, fn in sides:
            # each side measures its own cores over the steady window (``cores``); the whole run's are ``run_cores``
            label = f"{NAME}: {peer} seed {seed}"
            r = measured(label, functools.partial(guarded, label, functools.partial(fn, seed),
                                                  functools.partial(ThroughputRun, peer, seed, None, ())),
                         cores_key="run_cores")
            runs[peer].append(r)
            fps = r.frames_per_s(*windows[peer])
            say(f"{NAME}:   -> {peer}: " + (f"{fps:,.0f} frames/s, start-up {r.startup_s or 0:.1f} s"
                                           if fps else f"no rate ({(r.error or 'too few points').splitlines()[0]})"))
    say(f"{NAME}: Flywheel's learner alone (1 torch thread, Pong batches, float32 and bf16)")
    ceiling_learner = learner_ceiling()
    ceiling_bf16 = learner_ceiling(precision="bf16") if FLYWHEEL_BF16 in runs else {"error": "bf16 side not run"}
    stats = {p: frames_ci(v, *windows[p]) for p, v in runs.items()}
    startup = {p: MedianCI.of(r.startup_s for r in v if r.startup_s is not None) for p, v in runs.items()}
    cores = {p: MedianCI.of(r.extra.get("cores") for r in v if r.extra.get("cores") is not None)
             for p, v in runs.items()}

    def median(peer: str) -> float:
        return stats[peer].median if peer in stats else math.nan

    fw, ep, sb3 = median(FLYWHEEL), median(CEILING), median(sb3_atari.PEER)
    sf_medians = [median(p) for p in SF_SIDES]
    sf = math.nan if any(m != m for m in sf_medians) else max(sf_medians)
    meets = verdict(fw, sf, ep)
    tests = compare(runs, windows)
    n = len(seeds)
    learner_fps = ceiling_learner.get("env_steps_per_s", float("nan")) * FRAME_SKIP

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "n/a"

    def cell(peer: str) -> str:
        return stats[peer].fmt(0) if peer in stats else "not run"

    headline = [
        Row(f"Flywheel: trained frames/s (Sample Factory sync / async {cell(SF_SIDES[0])} / "
            f"{cell(SF_SIDES[1])}, EnvPool raw {cell(CEILING)})",
            f"{stats[FLYWHEEL].fmt(0)} ({ratio(fw, sf)} the faster SF, {ratio(fw, ep)} EnvPool)", TARGET, meets)]
    if FLYWHEEL_BF16 in runs:
        bf = median(FLYWHEEL_BF16)
        want = BF16_VS_SB3[native_bf16]
        headline.append(Row(
            f"Flywheel bf16: trained frames/s (SB3 PPO {cell(sb3_atari.PEER)}, EnvPool raw {cell(CEILING)}; this CPU "
            f"{'has' if native_bf16 else 'lacks'} native bf16)",
            f"{stats[FLYWHEEL_BF16].fmt(0)} ({ratio(bf, sb3)} SB3, {ratio(bf, ep)} EnvPool, {ratio(bf, fw)} float32)",
            f">= {want:.1f}x SB3's and >= {BF16_VS_ENVPOOL:.2f}x EnvPool's raw rate", bf16_verdict(bf, sb3, ep,
                                                                                                 native_bf16)))
    for peer in runs:
        ok = sum(1 for r in runs[peer] if r.frames_per_s(*windows[peer]))
        headline.append(Row(f"{peer}: {'raw' if peer == CEILING else 'trained'} frames/s; start-up; cores "
                            f"({ok} of {n} ran)",
                            f"{stats[peer].fmt(0)}; {startup[peer].fmt(1, ' s')}; {cores[peer].fmt(2)}"))
    for peer in (p for p in FLYWHEEL_SIDES if p in runs):
        busy = MedianCI.of(r.extra.get("learner_busy") for r in runs[peer] if r.extra.get("learner_busy") is not None)
        headline.append(Row(f"{peer}: the learner's busy fraction over the steady window (seconds in updates per "
                            "second, `flywheel_trainer_busy_seconds_total`)", busy.fmt(2)))
    for pair, t in tests.items():
        a, b = pair.split(" vs ")
        headline.append(Row(f"{pair}: exact rank-sum test", t.words(a, b, "trained frames/s")))
    headline.append(Row("Flywheel's learner alone (1 torch thread, no Kafka): frames/s it can train",
                        f"{learner_fps:,.0f}" if learner_fps == learner_fps else "n/a"))
    if "env_steps_per_s" in ceiling_bf16:
        headline.append(Row("Flywheel's learner alone in bf16 (1 torch thread, no Kafka): frames/s it can train",
                            f"{ceiling_bf16['env_steps_per_s'] * FRAME_SKIP:,.0f}"))
    table = ["| side | ran | frames/s | env steps/s | start-up s | cores (steady window) | cores (whole run) | "
             "other work, cores | update shape |", "|---|---|---|---|---|---|---|---|---|"]
    shapes = {CEILING: "none (random actions, nothing trained)",
              **{p: "1,024 samples x 4 epochs (configs/pong.yaml), trainer 1 torch thread, "
                    + ", ".join(f"{k}={v}" for k, v in o.items()) for p, o in FLYWHEEL_SIDES.items()},
              sb3_atari.PEER: sb3_atari.describe(CONFIG, SB3_THREADS),
              **{p: _sf_shape(runs.get(p, ())) for p in SF_SIDES}}
    for peer, st in stats.items():
        ok = sum(1 for r in runs[peer] if r.frames_per_s(*windows[peer]))
        steps = MedianCI.of(r.rate(*windows[peer]) for r in runs[peer] if r.rate(*windows[peer]))
        table.append(f"| {peer} | {ok} of {n} | {st.fmt(0)} | {steps.fmt(0)} | {startup[peer].fmt(1)} | "
                     f"{cores[peer].fmt(2)} | {cores_cell(runs[peer], 'run_cores')} | "
                     f"{cores_cell(runs[peer], 'other_work_cores')} | {shapes[peer]} |")
    per_seed = ["| seed | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for i, seed in enumerate(seeds):
        cells = []
        for peer, v in runs.items():
            fps = v[i].frames_per_s(*windows[peer])
            cells.append(f"{fps:,.0f} / {v[i].startup_s or 0:.1f} s" if fps else "**failed**")
        per_seed.append(f"| {seed} | " + " | ".join(cells) + " |")
    failures = [f"- {r.peer} seed {r.seed}: {r.error.splitlines()[0]}" for v in runs.values() for r in v if r.error]
    fw_cores = [r.extra.get("cores_by_process", {}) for r in runs[FLYWHEEL] if r.extra.get("cores_by_process")]
    redone = redone_lines((r for v in runs.values() for r in v), lambda r: f"{r.peer} seed {r.seed}")
    not_run = [f"- {peer}: not re-run here (`FLYWHEEL_BENCH_PEERS_PONG_SIDES`); its figure from "
               f"`{k['ran_by'].get('commit')}` ({k['ran_by'].get('date')}): {_fmt_stored(k['frames_per_s'])} "
               "frames/s. No ratio or test here is taken against it." for peer, k in kept.items()
               if "frames_per_s" in k]
    details = "\n".join([
        f"Medians over {n} seeds, [range] (order statistics; with up to 5 seeds, the range). Each side runs "
        f"{run_s:.0f} s from its first env step (EnvPool "
        f"{ep_s:.0f} s); rates over [{warmup_s:.0f} s, end] ([{ep_warm:.0f} s, end] for EnvPool). frames/s = "
        f"{FRAME_SKIP} x env steps/s (ALE frame skip). `FLYWHEEL_BENCH_PEERS_PONG_RUN_S`, "
        "`FLYWHEEL_BENCH_PEERS_PONG_WARMUP_S`, `FLYWHEEL_BENCH_PEERS_PONG_SEEDS` set them (defaults 180 s, 45 s, "
        "5; --quick 60 s, 20 s, 1); `FLYWHEEL_BENCH_PEERS_PONG_SIDES` the sides (default all: "
        + ", ".join(SIDE_KEYS) + ").",
        "",
        *table,
        "",
        *(["Sides not measured in this run:", *not_run, ""] if not_run else []),
        "Per seed (frames/s / start-up):",
        "",
        *per_seed,
        "",
        "Failures:" if failures else "No run failed.",
        *failures,
        "",
        cores_words(adopted) + " Cores (steady window) are each side's own count over the rate's window: "
        "Flywheel's processes, SF's process session, SB3's and EnvPool's child; cores (whole run) include start-up.",
        *(["Redone:", *redone] if redone else ["No run was redone."]),
        "",
        "Exact rank-sum tests of trained frames/s (independent samples: the sides' runs of one seed number share no "
        "random stream, so they are not pairs; a run with no rate ranks worst):",
        "",
        *[f"- {t.words(a, b, 'trained frames/s')}" for (a, b), t in ((p.split(" vs "), t) for p, t in tests.items())],
        "",
        _why(stats, ceiling_learner, fw_cores),
        "",
        "Flywheel's cores by process over the steady window (per seed; `machine` is every process on it): "
        + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items(), key=lambda kv: (kv[0] == "machine", -kv[1])))
                    for c in fw_cores) + ".",
        "",
        "Sample Factory: " + "; ".join(sf_atari.NOT_SHARED) + ". Its async mode: " + ", ".join(
            f"{k}={v}" for k, v in sf_atari.async_layout(threads).items()) + " in place of the example's values.",
        "",
        "SB3: " + "; ".join(sb3_atari.NOT_SHARED) + ".",
        "",
        "EnvPool: " + ", ".join(f"{k}={v}" for k, v in envpool_raw.SETTINGS.items()) + f"; {threads} threads.",
    ])
    return FigureResult(
        headline=headline,
        numbers={"seeds": list(seeds), "run_s": run_s, "warmup_s": warmup_s, "learner_alone": ceiling_learner,
                 "learner_alone_bf16": ceiling_bf16, "native_bf16": native_bf16, "sides": list(runs),
                 "sb3_threads": SB3_THREADS, "other_work_limit_cores": OTHER_WORK_LIMIT,
                 "rank_tests": {pair: t.as_dict() for pair, t in tests.items()},
                 "peers": {p: {"frames_per_s": stats[p], "startup_s": startup[p], "cores": cores[p],
                               "runs": [r.as_dict(*windows[p]) for r in v]} for p, v in runs.items()},
                 "not_rerun": kept},
        settings={"config": "configs/pong.yaml", "seeds": list(seeds), "run_s": run_s, "warmup_s": warmup_s, "envs": 8,
                  "sides": list(runs),
                  **{p.lower().replace(" ", "_"): f"configs/pong.yaml, {SAMPLERS} samplers, the bench's local stack, "
                     + ", ".join(f"{k}={v}" for k, v in o.items()) for p, o in FLYWHEEL_SIDES.items()},
                  **{f"sample_factory {mode}": " ".join(sf_atari.command(0, REPO_ROOT / "<train_dir>", "<experiment>",
                                                                          mode=mode)[1:]) for mode in sf_atari.MODES},
                  "sb3": sb3_atari.describe(CONFIG, SB3_THREADS), "envpool": dict(envpool_raw.SETTINGS)},
        method=(
            "Each side is started fresh per seed and runs for a fixed time from its first env step; its trained "
            "env-step count is sampled as it runs (Flywheel: the trainer's env_steps_trained counter every "
            f"{POLL_S:.0f} s; SB3: a progress line after each update; Sample Factory: its `Total num frames` "
            "reports, which count samples after the learner's gradient passes, divided by the frame skip; EnvPool: "
            "env steps stepped). The rate is the count's growth over the steady window divided by its length. "
            "Start-up is from starting the side to its first env step. Flywheel's learner alone is "
            "`python -m bench.peers.learner_rate --config configs/pong.yaml --threads 1 --precision fp32` (and "
            "`bf16`)."),
        details_md=details,
    )


def _fmt_stored(ci: Mapping[str, Any]) -> str:
    """A median and range as ``MedianCI.fmt(0)`` writes them, from its JSON form in an earlier entry."""
    return f"{ci['median']:,.0f} [{ci['ci_lo']:,.0f}, {ci['ci_hi']:,.0f}]"


def _sf_shape(runs: Sequence[ThroughputRun] = ()) -> str:
    for r in runs:
        shape = r.extra.get("update")
        if shape:
            return ", ".join(f"{k} {v}" for k, v in dict(shape).items())
    return "see sf_atari"


def _why(stats: dict[str, MedianCI], learner: dict[str, Any], fw_cores: Sequence[dict[str, float]]) -> str:
    """The profile behind the target: what the learner alone can train, what the stack reached of it, and what
    0.7 x EnvPool would need."""
    if "env_steps_per_s" not in learner:
        return f"Flywheel's learner alone was not measured: {learner.get('error', 'no output')}."
    alone = float(learner["env_steps_per_s"]) * FRAME_SKIP
    secs = ", ".join(f"{x:.2f}" for x in learner["seconds"])
    fw, ep = stats[FLYWHEEL].median, stats[CEILING].median
    trainer = [c["trainer"] for c in fw_cores if "trainer" in c]
    parts = [f"Profile: Flywheel's learner alone (`Learner.update` on {learner['env_steps_per_update']:,}-step "
             f"batches, {learner['epochs']} epochs x {learner['minibatches']} minibatches, "
             f"{learner['threads']} torch thread) took {secs} s an update: {alone:,.0f} frames/s."]
    if fw == fw:
        parts.append(f"On the stack Flywheel trained {fw:,.0f} frames/s, {fw / alone:.0%} of that"
                     + (f", with the trainer process at {min(trainer):.2f}-{max(trainer):.2f} cores" if trainer else "")
                     + ": the learner's CPU time bounds it, not the envs or Kafka.")
    if ep == ep:
        parts.append(f"0.7 x EnvPool's raw rate is {0.7 * ep:,.0f} frames/s, {0.7 * ep / alone:.1f}x what the learner "
                     "alone trains on this CPU with these settings (every sample through the Nature CNN forward and "
                     "backward 4 times): the envs could feed it, the CPU cannot train it. A GPU learner "
                     "(`trainer.device: cuda`) is the way there; none was lent to measure it.")
    return " ".join(parts)
