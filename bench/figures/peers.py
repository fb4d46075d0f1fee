"""The asynchronous peers side by side on CartPole-v1: wall time and env steps until the mean return of the
last 100 episodes reaches 475, with start-up reported beside and included in an end-to-end column.

Peers, each seed's runs one after another on the same machine in the same invocation (never two at once):
Stable-Baselines3 PPO with rl-zoo's and with Flywheel's settings, Flywheel (local stack, 2 samplers) with
both, and Sample Factory 2.1.1 APPO with its documented CartPole-v1 command line in its own virtualenv
(``bench.peers``). Medians over seeds with order-statistic intervals (``bench.peers.stats``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from bench import sb3
from bench.context import BENCH_HOME, DEFAULT_CONFIG, Context, say
from bench.peers import flywheel_peer, sample_factory, sb3_peer
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
from bench.peers.run import PeerRun
from bench.peers.stats import MedianCI, RankTest, order_statistic_ranks
from bench.report import FigureResult, Row
from bench.seeds import bench_seeds

NAME = "peers"
TITLE = ("Peers on CartPole-v1: Sample Factory APPO, Stable-Baselines3 PPO and Flywheel (rl-zoo's and Flywheel's "
         "settings), wall seconds and env steps to last-100 >= 475, start-up and end-to-end, one machine, one run.")
TARGET = "every peer measured side by side (medians, 95% order-statistic intervals); failures reported"
THRESHOLD = 475.0
COMPARED = [(("Flywheel", "flywheel"), ("SB3 PPO", "flywheel")), (("Flywheel", "rl-zoo"), ("SB3 PPO", "rl-zoo")),
            (("Flywheel", "flywheel"), ("Sample Factory APPO", "SF example"))]
"""The rank tests: each peer against Flywheel with the same settings where they can be shared, and SF's example."""

Runner = Callable[[int], PeerRun]


def _peers(ctx: Context, timeout_s: float) -> list[tuple[str, str, Runner]]:
    zoo_yaml = flywheel_peer.zoo_config(BENCH_HOME / "runs" / f"peers-{ctx.stamp}" / "cartpole-rl-zoo.yaml")

    def sb3_run(settings: str) -> Runner:
        return lambda seed: sb3_peer.run_seed(seed, settings, threshold=THRESHOLD, timeout_s=timeout_s,
                                              config=DEFAULT_CONFIG, threads=SB3_THREADS)

    def fw_run(settings: str, config: Any) -> Runner:
        return lambda seed: flywheel_peer.run_seed(ctx, seed, settings, config, threshold=THRESHOLD,
                                                   timeout_s=timeout_s)

    def sf_run(seed: int) -> PeerRun:
        return sample_factory.run_seed(seed, threshold=THRESHOLD, timeout_s=timeout_s, stamp=ctx.stamp)

    return [("SB3 PPO", "rl-zoo", sb3_run("rl-zoo")), ("SB3 PPO", "flywheel", sb3_run("flywheel")),
            ("Flywheel", "flywheel", fw_run("flywheel", DEFAULT_CONFIG)),
            ("Flywheel", "rl-zoo", fw_run("rl-zoo", zoo_yaml)),
            ("Sample Factory APPO", "SF example", sf_run)]


def compare(runs: dict[tuple[str, str], list[PeerRun]]) -> dict[str, dict[str, RankTest]]:
    """For each pair in ``COMPARED`` both ran: exact rank-sum tests of end-to-end s, training s and env steps."""
    out: dict[str, dict[str, RankTest]] = {}
    for a, b in COMPARED:
        if a not in runs or b not in runs:
            continue
        ra, rb = runs[a], runs[b]
        out[f"{a[0]} ({a[1]}) vs {b[0]} ({b[1]})"] = {
            "end_to_end_s": RankTest.of([r.end_to_end_s for r in ra], [r.end_to_end_s for r in rb]),
            "train_s": RankTest.of([r.train_s for r in ra], [r.train_s for r in rb]),
            "env_steps": RankTest.of([None if r.env_steps is None else float(r.env_steps) for r in ra],
                                     [None if r.env_steps is None else float(r.env_steps) for r in rb])}
    return out


def _words(pair: str, test: RankTest, quantity: str) -> str:
    a, b = pair.split(" vs ")
    return test.words(a, b, {"end_to_end_s": "end-to-end s", "train_s": "training s",
                             "env_steps": "env steps"}[quantity])


def summarise(runs: list[PeerRun]) -> dict[str, MedianCI]:
    """Per-peer medians: training wall s, env steps, start-up s, end-to-end s (failed runs count as inf in
    training, env steps and end-to-end; a run with no start-up measured is left out of start-up)."""
    return {"train_s": MedianCI.of(r.train_s for r in runs),
            "env_steps": MedianCI.of(None if r.env_steps is None else float(r.env_steps) for r in runs),
            "startup_s": MedianCI.of(r.startup_s for r in runs if r.startup_s is not None),
            "end_to_end_s": MedianCI.of(r.end_to_end_s for r in runs)}


def _cell(r: PeerRun) -> str:
    if r.train_s is None:
        return "**failed**"
    return f"{r.train_s:.1f} s / {r.env_steps:,} / {r.startup_s or 0:.1f} s"


def _interval_words(n: int, cover: float) -> str:
    if n < 2:
        return "none with one seed."
    k, j, _ = order_statistic_ranks(n)
    kind = "the range" if k == 1 else f"sorted values {k} to {j} of {n}"
    short = "" if cover >= 0.95 else " (95% needs 6 runs; fewer cannot reach it)"
    return f"{kind}, which covers the true median with probability {cover:.1%}{short}."


def run(ctx: Context) -> FigureResult:
    seeds = bench_seeds(NAME, 5, 1, ctx)
    adopted = adopt_orphans()  # a killed peer's orphaned workers are reaped here, their CPU counted
    timeout_s = float(os.environ.get("FLYWHEEL_BENCH_PEERS_TIMEOUT_S", 90.0 if ctx.quick else 300.0))
    sample_factory.ensure_venv()
    peers = _peers(ctx, timeout_s)
    runs: dict[tuple[str, str], list[PeerRun]] = {(p, s): [] for p, s, _ in peers}
    for seed in seeds:  # per seed every peer, one after another: drift of the machine hits all alike
        for peer, settings, fn in peers:
            say(f"peers: {peer} ({settings}), seed {seed}")
            label = f"peers: {peer} ({settings}) seed {seed}"
            r = measured(label, functools.partial(guarded, label, functools.partial(fn, seed),
                                                  functools.partial(PeerRun, peer, settings, seed, None, None, None)))
            runs[(peer, settings)].append(r)
            say(f"peers:   -> {_cell(r)}" + (f" ({r.error.splitlines()[0]})" if r.error else ""))
    stats = {k: summarise(v) for k, v in runs.items()}
    n = len(seeds)
    cover = next(iter(stats.values()))["train_s"].coverage
    headline = []
    for (peer, settings), st in stats.items():
        ok = sum(1 for r in runs[(peer, settings)] if r.train_s is not None)
        headline.append(Row(
            f"{peer} ({settings}): wall s / env steps to last-100 >= 475; start-up; end-to-end ({ok} of {n} solved)",
            f"{st['train_s'].fmt(1, ' s')} / {st['env_steps'].fmt(0)}; {st['startup_s'].fmt(1, ' s')}; "
            f"{st['end_to_end_s'].fmt(1, ' s')}"))
    tests = compare(runs)
    for pair, t in tests.items():
        headline.append(Row(f"{pair}: exact rank-sum test",
                            _words(pair, t["end_to_end_s"], "end_to_end_s") + "; " + _words(pair, t["train_s"],
                                                                                             "train_s")))
    table = ["| peer | settings | solved | wall s to last-100 >= 475 | env steps | start-up s | end-to-end s | "
             "cores used | other work, cores |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (peer, settings), st in stats.items():
        ok = sum(1 for r in runs[(peer, settings)] if r.train_s is not None)
        table.append(f"| {peer} | {settings} | {ok} of {n} | {st['train_s'].fmt(1)} | {st['env_steps'].fmt(0)} | "
                     f"{st['startup_s'].fmt(1)} | {st['end_to_end_s'].fmt(1)} | "
                     f"{cores_cell(runs[(peer, settings)], 'cores')} | "
                     f"{cores_cell(runs[(peer, settings)], 'other_work_cores')} |")
    redone = redone_lines((r for v in runs.values() for r in v), lambda r: f"{r.peer} ({r.settings}) seed {r.seed}")
    per_seed = ["| seed | " + " | ".join(f"{p} ({s})" for p, s in runs) + " |",
                "|---|" + "---|" * len(runs)]
    for i, seed in enumerate(seeds):
        per_seed.append(f"| {seed} | " + " | ".join(_cell(v[i]) for v in runs.values()) + " |")
    failures = [f"- {r.peer} ({r.settings}) seed {r.seed}: {r.error.splitlines()[0]}"
                for v in runs.values() for r in v if r.error]
    details = "\n".join([
        f"Medians over {n} seeds, [interval] from order statistics: {_interval_words(n, cover)} A run that did "
        f"not reach 475 within {timeout_s:.0f} s counts as not reached (it sorts last). Seeds and the timeout "
        "come from `FLYWHEEL_BENCH_PEERS_SEEDS` / `FLYWHEEL_BENCH_PEERS_TIMEOUT_S` (defaults 5 and 300 s).",
        "",
        *table,
        "",
        "Per seed (wall s to last-100 >= 475 / env steps / start-up s):",
        "",
        *per_seed,
        "",
        "Failures:" if failures else "No run failed.",
        *failures,
        "",
        cores_words(adopted),
        *(["Redone:", *redone] if redone else ["No run was redone."]),
        "",
        "Rank tests (independent samples: two peers' runs of one seed number share no random stream, so they are "
        "not pairs):",
        "",
        *[f"- {pair}: " + "; ".join(_words(pair, t[q], q) for q in ("end_to_end_s", "train_s", "env_steps"))
          for pair, t in tests.items()],
        "",
        "SB3 with Flywheel's settings cannot share: " + "; ".join(sb3_peer.NOT_SHARED) + ".",
    ])
    described: dict[str, Any] = {
        "seeds": list(seeds), "timeout_s": timeout_s, "threshold": THRESHOLD,
        "sb3 rl-zoo": sb3.describe("CartPole-v1"),
        "sb3 flywheel": sb3_peer.describe_flywheel(DEFAULT_CONFIG),
        "flywheel flywheel": "configs/cartpole.yaml, 2 samplers",
        "flywheel rl-zoo": flywheel_peer.describe_zoo(),
        "sample factory": f"python -m sf_examples.train_gym_env {' '.join(sample_factory.DOCUMENTED_ARGS)} "
                          f"--seed=<seed> ({sample_factory.SOURCE}; {sample_factory.versions()})",
    }
    return FigureResult(
        headline=headline,
        numbers={"seeds": list(seeds), "timeout_s": timeout_s, "sb3_threads": SB3_THREADS,
                 "other_work_limit_cores": OTHER_WORK_LIMIT,
                 "rank_tests": {pair: {q: t.as_dict() for q, t in ts.items()} for pair, ts in tests.items()},
                 "peers": {f"{p} ({s})": {"summary": stats[(p, s)], "runs": [r.as_dict() for r in v]}
                           for (p, s), v in runs.items()}},
        settings=described,
        method=(
            "Each peer is started fresh per seed and stopped once its last-100 mean return reaches 475 or after "
            f"{timeout_s:.0f} s of training. Start-up: from starting the peer to its first env step; wall time: "
            "from the first env step to the first point where the mean of the last 100 finished episodes is >= "
            "475; end-to-end: both. SB3: a fresh `python -m bench.peers.sb3_peer` process (CPU torch, "
            f"{SB3_THREADS} thread(s)); start-up until `learn()` begins; returns from its Monitor wrapper, checked"
            " after every finished episode; env steps = `num_timesteps`. Flywheel: the local stack as in `solve` "
            "(2 samplers), start-up = stack up (every service healthy) + first fragment; returns and sampled env "
            "steps read back from `<run>.samples`, timed by the fragments' creation. Sample Factory: its own "
            "console reports, every 5 s: `Avg episode reward` (mean of the last `stats_avg` = 100 episodes of "
            "policy 0) and the `Total num frames` printed with it (env steps the learner has counted), timed when"
            " the bench read the line; start-up until `All inference workers are ready! Signal rollout workers to"
            " start!`. So SF's times and env steps are late by up to one 5 s report, which favours nobody but "
            "SF's rivals."),
        details_md=details,
    )
