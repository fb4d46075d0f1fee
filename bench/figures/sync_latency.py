"""Figure 4: policy sync latency, from a candidate to every live sampler acting on it (4 samplers,
default publish interval: a candidate after every update)."""

from __future__ import annotations

import time
from typing import Any

from bench.context import Context, say
from bench.report import FigureResult, Row
from bench.samples import read_samples
from bench.stack import stack
from bench.stats import percentile

NAME = "sync_latency"
TITLE = "Policy sync latency p50/p95/p99: candidate -> every sampler acting on it; 4 samplers, default config."
TARGET = "p95 <= 0.25 s"
SAMPLERS = 4


def _pcts(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "p99": percentile(xs, 0.99),
            "max": max(xs) if xs else float("nan"), "n": len(xs)}


def _med(xs: list[float]) -> float:
    return percentile(xs, 0.5)


def _stages(synced: list[dict[str, Any]], sent: dict[int, float], published: dict[int, float],
            adoptions: dict[int, list[tuple[float, int]]], made: dict[str, list[float]]) -> dict[str, Any]:
    """Split each synced version's latency into publish / last adoption / heartbeat, and say what the last
    sampler to adopt was doing when the version was published."""
    out: dict[str, Any] = {"publish": [], "adopt": [], "beat": [], "slow": []}
    for e in synced:
        v = e["policy_version"]
        if v not in sent or v not in published:
            continue
        firsts = []
        for r, ads in adoptions.items():
            t = next((t for t, ver in ads if ver >= v), None)
            if t is not None:
                firsts.append((t, r))
        if len(firsts) < len(adoptions):
            continue
        last, r = max(firsts)
        out["publish"].append(published[v] - sent[v])
        out["adopt"].append(max(0.0, last - published[v]))
        out["beat"].append(e["_t"] - last)
        if last - published[v] > 0.25:
            ends = made.get(f"sampler-{r}", [])
            before = [c for c in ends if c <= last + 0.01]
            mid = bool(before) and before[-1] > published[v]
            out["slow"].append(("mid-fragment" if mid else "between", last - published[v]))
    gaps = []
    for ends in made.values():
        gaps += [b - a for a, b in zip(ends, ends[1:], strict=False)]
    out["collect_p50"], out["collect_p95"] = percentile(gaps, 0.5), percentile(gaps, 0.95)
    return out


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
        published = {e["policy_version"]: e["_t"] for e in st.events("paramsync", "policy_published", since=t0 - 30)}
        adoptions = {r: [(e["_t"], e["policy_version"]) for e in st.events("sampler", "policy_adopted", replica=r)]
                     for r in range(SAMPLERS)}
        adopted = [e for r in range(SAMPLERS) for e in st.events("sampler", "policy_adopted", replica=r, since=t0)
                   if e["_t"] <= t1]
    # fragment creation times: the end of each collect
    made: dict[str, list[float]] = {f"sampler-{r}": [] for r in range(SAMPLERS)}
    for f in read_samples(ctx, st.run):
        made.setdefault(f.sampler_id, []).append(f.created_at)
    stages = _stages(synced, sent, published, adoptions, made)
    lat = [float(e["latency_s"]) for e in synced]
    e2e = [e["_t"] - sent[e["policy_version"]] for e in synced if e["policy_version"] in sent]
    ps, pe = _pcts(lat), _pcts(e2e)
    updates = c1["updates"] - c0["updates"]
    triggers: dict[str, int] = {}
    for e in adopted:
        triggers[e.get("trigger", "?")] = triggers.get(e.get("trigger", "?"), 0) + 1
    per_sampler_adoptions = len(adopted) / SAMPLERS
    st_rows = [f"| {label} | {_pcts(xs)['p50']:.3f} | {_pcts(xs)['p95']:.3f} | {_pcts(xs)['p99']:.3f} | {len(xs)} |"
               for label, xs in (("trainer sends -> paramsync has verified, moved the marker, announced "
                                  "(`policy_published`)", stages["publish"]),
                                 ("-> the last sampler adopts it or a newer one (`policy_adopted`)", stages["adopt"]),
                                 ("-> paramsync sees that sampler's heartbeat (`policy_synced`)", stages["beat"]))]
    slow = stages["slow"]
    mid = [x for x in slow if x[0] == "mid-fragment"]
    idle = [x for x in slow if x[0] != "mid-fragment"]
    details = "\n".join([
        "| measured from | p50 s | p95 s | p99 s | max s | versions |",
        "|---|---|---|---|---|---|",
        f"| paramsync receives the candidate -> last live sampler's heartbeat shows it (`policy_synced.latency_s`) "
        f"| {ps['p50']:.3f} | {ps['p95']:.3f} | {ps['p99']:.3f} | {ps['max']:.3f} | {ps['n']} |",
        f"| trainer sends the candidate (`candidate_sent` log time) -> `policy_synced` log time "
        f"| {pe['p50']:.3f} | {pe['p95']:.3f} | {pe['p99']:.3f} | {pe['max']:.3f} | {pe['n']} |",
        "",
        "Where the time goes (same versions, log timestamps, one clock):",
        "",
        "| stage | p50 s | p95 s | p99 s | versions |",
        "|---|---|---|---|---|",
        *st_rows,
        "",
        f"Of the {len(slow)} versions whose last adoption came more than 0.25 s after the publish, "
        f"{len(mid)} found that sampler in the middle of a fragment (it finished the fragment after the publish and "
        f"adopted right after; median wait {_med([x[1] for x in mid]):.2f} s), {len(idle)} found it between "
        f"fragments - paused by flow control or in the send path - and it still took median "
        f"{_med([x[1] for x in idle]):.2f} s to adopt. A fragment's collect took median "
        f"{stages['collect_p50']:.3f} s, p95 {stages['collect_p95']:.3f} s here (creation-time gaps of consecutive "
        "fragments of one sampler with no pause between them are not separable from pauses, so this is an upper "
        "bound).",
        "",
        f"In the {window:.0f} s window the trainer made {updates:.0f} updates (one candidate each, "
        f"{updates / window:.1f}/s); each sampler adopted {per_sampler_adoptions:.0f} versions "
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
        numbers={"paramsync": ps, "from_trainer_send": pe,
                 "stages": {k: _pcts(v) for k, v in stages.items() if k in ("publish", "adopt", "beat")},
                 "slow_versions": {"total": len(slow), "mid_fragment": len(mid), "between_fragments": len(idle)},
                 "updates_per_s": updates / window,
                 "adoptions_per_sampler": per_sampler_adoptions, "adoption_triggers": triggers},
        settings={"samplers": SAMPLERS, "warmup_s": warmup, "window_s": window},
        method=(f"A fresh stack with {SAMPLERS} samplers and `configs/cartpole.yaml` unchanged (publish_every 1); "
                f"after the first update and {warmup:.0f} s warm-up, every `policy_synced` line paramsync logged "
                f"in a {window:.0f} s window; the trainer's `candidate_sent` lines give the second row."),
        details_md=details,
    )
