"""Figure 6: recovery. Seconds from a trainer (re)start - the new process's start - to its first
committed update, and from a sampler restart to its first fragment, after kill -9."""

from __future__ import annotations

import time
from typing import Any

from bench.context import Context, say
from bench.report import FigureResult, Row
from bench.stack import BenchStack, stack
from bench.stats import Spread
from devstack.procs import port_is_free

NAME = "recovery"
TITLE = ("Restart after kill -9 (2 samplers, default config): trainer process start -> first committed update "
         "(`update_done`); sampler process start -> first fragment (`fragment_produced`).")
TARGET = "trainer <= 10 s, sampler <= 5 s"
REPEATS = 3


def _first(st: BenchStack, service: str, event: str, since: float, replica: int = 0) -> float | None:
    ev = st.events(service, event, replica=replica, since=since)
    return ev[0]["_t"] - since if ev else None


def restart(st: BenchStack, service: str, replica: int, until: str, phases: list[str],
            timeout_s: float = 90.0) -> dict[str, Any]:
    port = st.stack.port(service, replica)
    st.stack.kill(service, replica)
    # kill() returns when the main thread is a zombie; the other threads (and the listening socket)
    # can take a moment longer to go, and start() refuses a taken port.
    st.wait_for(f"port {port} released", lambda: port_is_free(port), 15, 0.05)
    t0 = time.time()
    st.stack.start(service, replica)
    st.wait_for(f"{service}-{replica} {until}", lambda: _first(st, service, until, t0, replica) is not None,
                timeout_s, poll_s=0.1)
    out: dict[str, Any] = {"total": _first(st, service, until, t0, replica)}
    for p in phases:
        out[p] = _first(st, service, p, t0, replica)
    return out


def run(ctx: Context) -> FigureResult:
    settle = ctx.scale(6)
    trainer: list[dict[str, Any]] = []
    sampler: list[dict[str, Any]] = []
    with stack(ctx, ctx.run_name(NAME)) as st:
        st.up(2)
        st.wait_trained(1, timeout_s=60)
        time.sleep(settle)
        for i in range(REPEATS):
            say(f"{NAME}: kill -9 + restart trainer ({i + 1}/{REPEATS})")
            trainer.append(restart(st, "trainer", 0, "update_done",
                                   ["config_resolved", "http_listening", "checkpoint_restored",
                                    "partitions_assigned", "fragment_consumed"]))
            time.sleep(settle)
            say(f"{NAME}: kill -9 + restart sampler-1 ({i + 1}/{REPEATS})")
            sampler.append(restart(st, "sampler", 1, "fragment_produced",
                                   ["config_resolved", "http_listening", "policy_adopted"]))
            time.sleep(settle / 2)
    tt = Spread.of(r["total"] for r in trainer)
    ts = Spread.of(r["total"] for r in sampler)

    def col(rs: list[dict[str, Any]], k: str) -> str:
        return Spread.of(r[k] for r in rs if r.get(k) is not None).fmt(1)

    details = "\n".join([
        "Seconds after the new process was spawned (median (min-max) of "
        f"{REPEATS} restarts), by the first log line of each stage:",
        "",
        "| trainer: settings validated (`config_resolved`) | imports done, HTTP up (`http_listening`) "
        "| checkpoint restored | consumer group joined (`partitions_assigned`) | first fragment consumed "
        "| **first update (`update_done`)** |",
        "|---|---|---|---|---|---|",
        f"| {col(trainer, 'config_resolved')} | {col(trainer, 'http_listening')} | "
        f"{col(trainer, 'checkpoint_restored')} | {col(trainer, 'partitions_assigned')} | "
        f"{col(trainer, 'fragment_consumed')} | **{tt.fmt(1)}** |",
        "",
        "| sampler: `config_resolved` | `http_listening` | first policy adopted "
        "| **first fragment (`fragment_produced`)** |",
        "|---|---|---|---|",
        f"| {col(sampler, 'config_resolved')} | {col(sampler, 'http_listening')} | "
        f"{col(sampler, 'policy_adopted')} | **{ts.fmt(1)}** |",
    ])
    return FigureResult(
        headline=[
            Row("trainer: process start -> first committed update", tt.fmt(1, " s"), "<= 10 s", tt.median <= 10),
            Row("sampler: process start -> first fragment", ts.fmt(1, " s"), "<= 5 s", ts.median <= 5),
        ],
        numbers={"trainer_s": tt, "sampler_s": ts, "trainer_phases": trainer, "sampler_phases": sampler},
        settings={"samplers": 2, "restarts": REPEATS},
        method=(f"One stack with 2 samplers; after it trains, {REPEATS} rounds of: SIGKILL the trainer, spawn it "
                "again (`LocalStack.start`), wait for its first `update_done` after the spawn time; then the same "
                "for sampler-1 and its first `fragment_produced`. Times are log timestamps minus the spawn time "
                "(one clock). The other processes keep running throughout; the trainer restarts from its last "
                "checkpoint (every 50 updates) and re-consumes what was not committed."),
        details_md=details,
    )
