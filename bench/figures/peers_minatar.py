"""MinAtar Breakout at a fixed wall budget, side by side: Flywheel (local stack, 2 samplers,
``configs/minatar-breakout.yaml``) against Stable-Baselines3 PPO with the same settings and network translated
(``bench.peers.sb3_minatar``). The measure is the mean return of the last 100 episodes finished within W
seconds of each side's first env step (and within W/2), the env steps taken in W, and start-up beside.

Per seed SB3 runs, then Flywheel, one after another on the same machine (never two at once), each with the cores
it used and the other work on the machine recorded and redone once beside more than 0.2 cores of it
(``bench.peers.measure``); SB3 gets as many torch threads as the machine has cores, which Flywheel's processes
share. Medians over seeds with order-statistic intervals (``bench.peers.stats``, 5 seeds by default), and an exact
rank-sum test of the last-100 at W for "ahead" (independent samples: the sides' runs of one seed number share no
random stream). Sample
Factory is not run: its 2.1.1 release ships no MinAtar env (``sf_examples`` has Atari, MuJoCo, VizDoom, DMLab,
Brax, EnvPool and IsaacGym), so it would need a custom env registration and a custom encoder for 10x10 frames,
which would be our port, not the peer's documented setup.

Invariant of the cut (``last_n_at``): only episodes that finished at or before the budget count, so a side
that ran past W (the stack stops a few seconds late, SB3 finishes its update) gains nothing from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.context import Context, say
from bench.peers import flywheel_peer, sb3_minatar, sb3_peer
from bench.peers.measure import (
    OTHER_WORK_LIMIT,
    SB3_THREADS,
    cores_cell,
    cores_words,
    guarded,
    measured,
    redone_lines,
)
from bench.peers.proc import adopt_orphans
from bench.peers.stats import MedianCI, RankTest
from bench.report import FigureResult, Row
from bench.samples import FragmentInfo, episode_curve, read_samples
from bench.seeds import bench_seeds, earlier_runs, env_seconds, provenance_md

NAME = "peers_minatar"
TITLE = ("Peers on MinAtar Breakout at a fixed wall budget: Flywheel (local stack, 2 samplers) against "
         "Stable-Baselines3 PPO with Flywheel's settings and CNN, last-100 return, env steps and start-up, one "
         "machine, each seed's sides one after the other.")
TARGET = "Flywheel's median last-100 at the budget >= SB3's"
EXTENDS = True  # `--extend` pools new seeds with the earlier entry's (``earlier_runs``)
CONFIG = sb3_minatar.CONFIG
ENV_ID = "MinAtar/Breakout-v1"
SAMPLERS = sb3_peer.SAMPLERS
WINDOW = sb3_minatar.WINDOW
STOP_MARGIN_S = 3.0  # the stack runs this much past W: fragments made just before W are on the topic
CURVE_POINTS = 10  # checkpoints of the last-100 curve kept in the numbers

Curve = Sequence[tuple[float, int, float]]  # (seconds since the first env step, env steps so far, return)


def last_n_at(curve: Curve, t: float, n: int = WINDOW) -> float:
    """Mean return of the last ``n`` episodes finished at or before ``t`` seconds (fewer when fewer finished;
    NaN when none did). ``curve`` is in finishing order."""
    rs = [r for s, _, r in curve if s <= t][-n:]
    return sum(rs) / len(rs) if rs else math.nan


def fragments_within(frags: Sequence[FragmentInfo], wall_s: float) -> tuple[list[tuple[float, int, float]], int]:
    """Flywheel's episode curve and env steps within ``wall_s`` of the first fragment (the first env step, as
    in ``bench.figures.peers``): episodes of fragments made after it are cut, and so are their steps."""
    curve = [c for c in episode_curve(list(frags)) if c[0] <= wall_s]
    if not frags:
        return curve, 0
    t0 = frags[0].created_at
    return curve, sum(f.steps for f in frags if f.created_at - t0 <= wall_s)


@dataclass(frozen=True)
class BudgetRun:
    """One side's run of one seed: start-up (start to first env step), env steps and finished episodes within
    the budget. ``error`` says why a run has no result (then ``env_steps`` is None). A run kept from an earlier
    entry (``from_record``) has no curve, only the last-100 at W and W/2 it was measured with (``recorded``)."""

    peer: str  # "SB3 PPO", "Flywheel"
    seed: int
    wall_s: float
    startup_s: float | None
    env_steps: int | None
    curve: tuple[tuple[float, int, float], ...] = ()
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    recorded: dict[float, float] = field(default_factory=dict)  # t -> last-100 at t, for a kept run

    @property
    def ok(self) -> bool:
        return self.error is None and self.env_steps is not None

    def last_at(self, t: float) -> float:
        if not self.ok:
            return math.nan
        if self.recorded:
            if t not in self.recorded:
                raise KeyError(f"{self.peer} seed {self.seed} was kept from an earlier run: only the last-100 at "
                               f"{sorted(self.recorded)} s is known, not at {t} s")
            return self.recorded[t]
        return last_n_at(self.curve, t)

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> BudgetRun:
        """A run from its ``as_dict`` record (an earlier entry's, kept by ``--extend``)."""
        known = {"peer", "seed", "wall_s", "startup_s", "env_steps", "error", "last100_at_half", "last100_at_budget"}
        wall = float(d["wall_s"])
        return cls(d["peer"], int(d["seed"]), wall, d["startup_s"], d["env_steps"], (), d["error"],
                   {k: v for k, v in d.items() if k not in known},
                   {wall: _num(d["last100_at_budget"]), wall / 2: _num(d["last100_at_half"])})

    def as_dict(self) -> dict[str, Any]:
        """Everything but the full curve (thousands of episodes): the last-100 at ``CURVE_POINTS`` times."""
        points = [(round(self.wall_s * i / CURVE_POINTS, 1), self.last_at(self.wall_s * i / CURVE_POINTS))
                  for i in range(1, CURVE_POINTS + 1)] if not self.recorded else []
        return {"peer": self.peer, "seed": self.seed, "wall_s": self.wall_s, "startup_s": self.startup_s,
                "env_steps": self.env_steps, "episodes": len(self.curve), "last100_at_half": self.last_at(
                    self.wall_s / 2), "last100_at_budget": self.last_at(self.wall_s), "last100_curve": points,
                "error": self.error, **self.extra}


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)  # benchmarks.json writes NaN as null


Runner = Callable[[int, float], BudgetRun]


def run_sb3(seed: int, wall_s: float) -> BudgetRun:
    say(f"{NAME}: SB3 PPO seed {seed}, {wall_s:.0f} s from learn()")
    res = sb3_minatar.run_child(seed, wall_s=wall_s, config=CONFIG, threads=SB3_THREADS)
    if res.done is None:
        return BudgetRun("SB3 PPO", seed, wall_s, res.startup_s, None, (), res.error)
    curve = tuple((float(t), int(s), float(r)) for t, s, r in res.done["curve"])
    return BudgetRun("SB3 PPO", seed, wall_s, res.startup_s, int(res.done["env_steps"]), curve, None,
                     {"learn_s": res.done["learn_s"], "rollouts": int(res.done["total_env_steps"]) // _batch()})


def _batch() -> int:
    n_envs, kw = sb3_minatar.minatar_kwargs(CONFIG)
    return int(n_envs * kw["n_steps"])


def run_flywheel(ctx: Context, seed: int, wall_s: float) -> BudgetRun:
    run = ctx.run_name(NAME, f"fw-seed{seed}")
    say(f"{NAME}: Flywheel seed {seed}, {wall_s:.0f} s from the first fragment")
    ran = flywheel_peer.run_stack(ctx, run, seed, CONFIG, lambda st, t: t < wall_s + STOP_MARGIN_S)
    startup, error = ran.startup_s, ran.error
    if startup is None:
        return BudgetRun("Flywheel", seed, wall_s, None, None, (), error or "the stack never produced a fragment")
    frags = read_samples(ctx, run, env_id=ENV_ID)
    curve, steps = fragments_within(frags, wall_s)
    if not frags:
        return BudgetRun("Flywheel", seed, wall_s, startup, None, (), "no fragment on the samples topic")
    return BudgetRun("Flywheel", seed, wall_s, startup, steps, tuple(curve), error,
                     {"fragments": len(frags), "last_policy_version": max(f.policy_version for f in frags)})


def summarise(runs: Sequence[BudgetRun]) -> dict[str, MedianCI]:
    """Medians with the order-statistic interval over the runs that have a result (failed runs are counted
    beside, not as a return): last-100 at W and W/2, env steps in W, start-up."""
    ok = [r for r in runs if r.ok]
    return {"last100_at_budget": MedianCI.of(r.last_at(r.wall_s) for r in ok),
            "last100_at_half": MedianCI.of(r.last_at(r.wall_s / 2) for r in ok),
            "env_steps": MedianCI.of(float(r.env_steps or 0) for r in ok),
            "startup_s": MedianCI.of(r.startup_s for r in runs if r.startup_s is not None)}


def compare(fw: Sequence[BudgetRun], sb3: Sequence[BudgetRun]) -> dict[str, RankTest]:
    """Flywheel against SB3, exact rank-sum tests of the last-100 at W and at W/2 and of the env steps in W (higher
    is better for each: a failed run ranks worst), and of start-up (lower is better)."""
    def ret(runs: Sequence[BudgetRun], half: bool) -> list[float | None]:
        return [r.last_at(r.wall_s / 2 if half else r.wall_s) if r.ok else None for r in runs]

    def steps(runs: Sequence[BudgetRun]) -> list[float | None]:
        return [float(r.env_steps) if r.ok and r.env_steps is not None else None for r in runs]

    return {"last100_at_budget": RankTest.of(ret(fw, False), ret(sb3, False), failed=-math.inf),
            "last100_at_half": RankTest.of(ret(fw, True), ret(sb3, True), failed=-math.inf),
            "env_steps": RankTest.of(steps(fw), steps(sb3), failed=-math.inf),
            "startup_s": RankTest.of([r.startup_s for r in fw], [r.startup_s for r in sb3])}


def verdict(fw: Sequence[BudgetRun], sb3: Sequence[BudgetRun]) -> bool | None:
    """The target: Flywheel's median last-100 at W >= SB3's. False when a Flywheel run failed; None (not
    decided) when only SB3 runs failed, since a missing rival proves nothing either way."""
    if not all(r.ok for r in fw):
        return False
    if not sb3 or not all(r.ok for r in sb3):
        return None
    a = summarise(fw)["last100_at_budget"].median
    b = summarise(sb3)["last100_at_budget"].median
    return bool(a >= b)


def _cell(r: BudgetRun) -> str:
    if not r.ok:
        return "**failed**"
    return (f"{r.last_at(r.wall_s):.2f} / {r.last_at(r.wall_s / 2):.2f} / {r.env_steps:,} / "
            f"{r.startup_s or 0:.1f} s")


def wall_budget(ctx: Context) -> float:
    return env_seconds("FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S", 60.0 if ctx.quick else 600.0)


def run(ctx: Context) -> FigureResult:
    wall_s = wall_budget(ctx)
    new_seeds = bench_seeds(NAME, 5, 1, ctx)
    adopted = adopt_orphans()  # orphaned workers of a stopped side are reaped here, their CPU counted
    peers: list[tuple[str, Runner]] = [("SB3 PPO", run_sb3),
                                       ("Flywheel", lambda seed, w: run_flywheel(ctx, seed, w))]
    # --extend: the earlier entry's other seeds, measured with the same budget and SB3's torch threads
    kept = earlier_runs(ctx, NAME, new_seeds, {"wall_s": wall_s, "sb3_threads": SB3_THREADS})
    runs: dict[str, list[BudgetRun]] = {p: [BudgetRun.from_record(d) for d in kept.get(p, [])] for p, _ in peers}
    for seed in new_seeds:  # per seed both sides, one after another: drift of the machine hits both alike
        for peer, fn in peers:
            label = f"{NAME}: {peer} seed {seed}"
            r = measured(label, functools.partial(guarded, label, functools.partial(fn, seed, wall_s),
                                                  functools.partial(BudgetRun, peer, seed, wall_s, None, None, ())))
            runs[peer].append(r)
            say(f"{NAME}:   -> {peer}: {_cell(r)}" + (f" ({r.error.splitlines()[0]})" if r.error else ""))
    for v in runs.values():
        v.sort(key=lambda r: r.seed)
    seeds = [r.seed for r in runs["Flywheel"]]
    if seeds != [r.seed for r in runs["SB3 PPO"]]:
        raise ValueError(f"{NAME}: the sides' seeds differ ({seeds} vs {[r.seed for r in runs['SB3 PPO']]})")
    stats = {p: summarise(v) for p, v in runs.items()}
    n = len(seeds)
    meets = verdict(runs["Flywheel"], runs["SB3 PPO"])
    fw, sb = stats["Flywheel"], stats["SB3 PPO"]
    tests = compare(runs["Flywheel"], runs["SB3 PPO"])
    quantities = {"last100_at_budget": f"last-100 at {wall_s:.0f} s", "last100_at_half": f"last-100 at "
                  f"{wall_s / 2:.0f} s", "env_steps": f"env steps in {wall_s:.0f} s", "startup_s": "start-up s"}
    headline = [Row(f"Flywheel: last-100 return at {wall_s:.0f} s (SB3 PPO: {sb['last100_at_budget'].fmt(2)})",
                    fw["last100_at_budget"].fmt(2), TARGET, meets)]
    for peer, st in stats.items():
        ok = sum(1 for r in runs[peer] if r.ok)
        headline.append(Row(
            f"{peer}: last-100 at {wall_s:.0f} s / at {wall_s / 2:.0f} s; env steps in {wall_s:.0f} s; start-up "
            f"({ok} of {n} ran)",
            f"{st['last100_at_budget'].fmt(2)} / {st['last100_at_half'].fmt(2)}; {st['env_steps'].fmt(0)}; "
            f"{st['startup_s'].fmt(1, ' s')}"))
    headline.append(Row("Flywheel vs SB3 PPO: exact rank-sum test",
                        tests["last100_at_budget"].words("Flywheel", "SB3 PPO", quantities["last100_at_budget"])))
    table = [f"| peer | ran | last-100 at {wall_s:.0f} s | last-100 at {wall_s / 2:.0f} s | env steps in "
             f"{wall_s:.0f} s | start-up s | cores used | other work, cores |", "|---|---|---|---|---|---|---|---|"]
    for peer, st in stats.items():
        ok = sum(1 for r in runs[peer] if r.ok)
        table.append(f"| {peer} | {ok} of {n} | {st['last100_at_budget'].fmt(2)} | {st['last100_at_half'].fmt(2)} "
                     f"| {st['env_steps'].fmt(0)} | {st['startup_s'].fmt(1)} | {cores_cell(runs[peer], 'cores')} | "
                     f"{cores_cell(runs[peer], 'other_work_cores')} |")
    per_seed = ["| seed | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for i, seed in enumerate(seeds):
        per_seed.append(f"| {seed} | " + " | ".join(_cell(v[i]) for v in runs.values()) + " |")
    failures = [f"- {r.peer} seed {r.seed}: {r.error.splitlines()[0]}" for v in runs.values() for r in v if r.error]
    records = [r.as_dict() for v in runs.values() for r in v]
    redone = redone_lines((r for v in runs.values() for r in v), lambda r: f"{r.peer} seed {r.seed}")
    pooled = provenance_md(records)
    details = "\n".join([
        f"Medians over {n} seeds, [interval] from order statistics (with up to 5 seeds, the range). The wall "
        f"budget W = {wall_s:.0f} s and the seeds come from `FLYWHEEL_BENCH_PEERS_MINATAR_WALL_S` / "
        "`FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS` (defaults 600 s and 5; --quick: 60 s and 1; a list such as `6,7` "
        "with `--extend` adds seeds to the earlier entry's).",
        *(["", pooled] if pooled else []),
        "",
        *table,
        "",
        f"Per seed (last-100 at {wall_s:.0f} s / at {wall_s / 2:.0f} s / env steps in {wall_s:.0f} s / start-up):",
        "",
        *per_seed,
        "",
        "Failures:" if failures else "No run failed.",
        *failures,
        "",
        cores_words(adopted),
        *(["Redone:", *redone] if redone else ["No run was redone."]),
        "",
        "Exact rank-sum tests, Flywheel against SB3 PPO (independent samples: the sides' runs of one seed number "
        "share no random stream, so they are not pairs; a failed run ranks worst):",
        "",
        *[f"- {tests[q].words('Flywheel', 'SB3 PPO', words)}" for q, words in quantities.items()],
        "",
        "SB3 with Flywheel's settings cannot share: " + "; ".join(sb3_minatar.NOT_SHARED) + ".",
        "",
        "Sample Factory is not run: its 2.1.1 release has no MinAtar env (its `sf_examples` cover Atari, MuJoCo, "
        "VizDoom, DMLab, Brax, EnvPool and IsaacGym), so it would need a custom env registration and a custom "
        "encoder for 10x10 frames: our port of it, not its documented setup.",
    ])
    return FigureResult(
        headline=headline,
        numbers={"seeds": list(seeds), "wall_s": wall_s, "window": WINDOW, "sb3_threads": SB3_THREADS,
                 "other_work_limit_cores": OTHER_WORK_LIMIT,
                 "rank_tests": {"Flywheel vs SB3 PPO": {q: t.as_dict() for q, t in tests.items()}},
                 "peers": {p: {"summary": stats[p], "runs": [r.as_dict() for r in v]} for p, v in runs.items()}},
        settings={"config": "configs/minatar-breakout.yaml", "seeds": list(seeds), "wall_s": wall_s, "env": ENV_ID,
                  "sb3": sb3_minatar.describe(CONFIG, SB3_THREADS),
                  "flywheel": f"configs/minatar-breakout.yaml, {SAMPLERS} samplers, the bench's local stack"},
        method=(
            f"Each side is started fresh per seed and stopped after W = {wall_s:.0f} s counted from its first env "
            "step; start-up (from starting it to its first env step) is reported beside. The return at the budget "
            f"is the mean of the last {WINDOW} episodes finished within W (and within W/2); env steps are those "
            "taken within W. SB3: a fresh `python -m bench.peers.sb3_minatar` process (CPU torch, "
            f"{SB3_THREADS} thread(s)), "
            "start-up until `learn()` begins, W from there (its callback stops `learn()` at the first env step "
            "after W, which is not counted); returns from its Monitor wrapper. Flywheel: the local stack as in "
            f"`peers` ({SAMPLERS} samplers), start-up = stack up (every service healthy) + first fragment, W from "
            "the first fragment's creation; returns and env steps read back from `<run>.samples`, timed by the "
            "fragments' creation (episodes and steps of fragments made after W are cut)."),
        details_md=details,
    )
