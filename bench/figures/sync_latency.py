"""Figure 4: policy sync latency, from a candidate to every live sampler acting on it (4 samplers,
default publish interval: a candidate after every update)."""

from __future__ import annotations

import time

from bench.common import Context, percentile, say, stack
from bench.report import FigureResult, Row

NAME = "sync_latency"
TITLE = "Policy sync latency p50/p95/p99: candidate -> every sampler acting on it; 4 samplers, default config."
TARGET = "p95 <= 0.25 s"
SAMPLERS = 4


def _pcts(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "p99": percentile(xs, 0.99),
            "max": max(xs) if xs else float("nan"), "n": len(xs)}


def run(ctx: Context) -> FigureResult:
    warmup, window = ctx.scale(8), ctx.scale(40)
    say(f"{NAME}: {SAMPLERS} samplers, {window:.0f} s")
    with stack(ctx, ctx.run_name(NAME)) as st:
        st.up(SAMPLERS)
        st.wait_trained(1, timeout_s=60)
        time.sleep(warmup)
        t0 = time.time()
        c0 = st.counters()
        time.sleep(window)
        c1 = st.counters()
        t1 = time.time()
        synced = [e for e in st.events("paramsync", "policy_synced", since=t0) if e["_t"] <= t1]
        sent = {e["policy_version"]: e["_t"] for e in st.events("trainer", "candidate_sent", since=t0 - 30)}
        adopted = [e for r in range(SAMPLERS) for e in st.events("sampler", "policy_adopted", replica=r, since=t0)
                   if e["_t"] <= t1]
    lat = [float(e["latency_s"]) for e in synced]
    e2e = [e["_t"] - sent[e["policy_version"]] for e in synced if e["policy_version"] in sent]
    ps, pe = _pcts(lat), _pcts(e2e)
    published = c1["updates"] - c0["updates"]
    triggers: dict[str, int] = {}
    for e in adopted:
        triggers[e.get("trigger", "?")] = triggers.get(e.get("trigger", "?"), 0) + 1
    per_sampler_adoptions = len(adopted) / SAMPLERS
    details = "\n".join([
        "| measured from | p50 s | p95 s | p99 s | max s | versions |",
        "|---|---|---|---|---|---|",
        f"| paramsync receives the candidate -> last live sampler's heartbeat shows it (`policy_synced.latency_s`) "
        f"| {ps['p50']:.3f} | {ps['p95']:.3f} | {ps['p99']:.3f} | {ps['max']:.3f} | {ps['n']} |",
        f"| trainer sends the candidate (`candidate_sent` log time) -> `policy_synced` log time "
        f"| {pe['p50']:.3f} | {pe['p95']:.3f} | {pe['p99']:.3f} | {pe['max']:.3f} | {pe['n']} |",
        "",
        f"In the {window:.0f} s window the trainer made {published:.0f} updates (one candidate each, "
        f"{published / window:.1f}/s); each sampler adopted {per_sampler_adoptions:.0f} versions "
        f"(triggers: {', '.join(f'{k} {v}' for k, v in sorted(triggers.items()))}): a sampler adopts only between "
        "fragments and skips to the newest version, and a version counts as synced once every live sampler is "
        "on it or a newer one.",
    ])
    return FigureResult(
        headline=[
            Row("p95 (paramsync's measure)", f"{ps['p95']:.3f} s", "<= 0.25 s", ps["p95"] <= 0.25),
            Row("p50 / p99 (paramsync's measure)", f"{ps['p50']:.3f} / {ps['p99']:.3f} s"),
            Row("p50 / p95 / p99 from the trainer's send", f"{pe['p50']:.3f} / {pe['p95']:.3f} / {pe['p99']:.3f} s"),
        ],
        numbers={"paramsync": ps, "from_trainer_send": pe, "updates_per_s": published / window,
                 "adoptions_per_sampler": per_sampler_adoptions, "adoption_triggers": triggers},
        settings={"samplers": SAMPLERS, "warmup_s": warmup, "window_s": window},
        method=(f"A fresh stack with {SAMPLERS} samplers and `configs/cartpole.yaml` unchanged (publish_every 1); "
                f"after the first update and {warmup:.0f} s warm-up, every `policy_synced` line paramsync logged "
                f"in a {window:.0f} s window; the trainer's `candidate_sent` lines give the second row."),
        details_md=details,
    )
