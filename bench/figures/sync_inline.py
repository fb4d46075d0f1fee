"""Policies on Kafka (docs/policies.md): store GETs of policy weights per published version, and sync latency,
with policies inline on their announcements against every sampler fetching them from the store
(``paramsync.inline_max_bytes: 0``); 32 samplers, ``configs/cartpole.yaml`` otherwise unchanged.

GETs are the samplers' own count (``flywheel_sampler_policy_fetches_total{source="store"}``: one GET of the blob
each); the marker polls every sampler makes anyway (one small GET per ``sampler.sync_interval_s``, whatever the
mode) are stated beside them, computed from the setting.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.context import Context, say
from bench.report import FigureResult, Row
from bench.stack import _HTTP, BenchStack, stack
from bench.stats import percentile

NAME = "sync_inline"
TITLE = ("Policies on Kafka: store GETs of policy weights per published version and sync p99, inline against "
         "the store, 32 samplers.")
TARGET = "inline: 0 GETs per version; sync p99 no worse than through the store"
MODES = {"inline": {}, "store": {"FLYWHEEL_PARAMSYNC_INLINE_MAX_BYTES": "0"}}


def samplers() -> int:
    """``FLYWHEEL_BENCH_SYNC_INLINE_SAMPLERS`` (default 32): fewer where a machine cannot run 32."""
    return int(os.environ.get("FLYWHEEL_BENCH_SYNC_INLINE_SAMPLERS", "32"))


def _fetches(st: BenchStack, n: int) -> dict[str, float]:
    """``flywheel_sampler_policy_fetches_total`` by source, summed over the samplers that answered."""
    out = {"inline": 0.0, "store": 0.0}
    for r in range(n):
        try:
            text = _HTTP.get(st.metrics_url("sampler", r)).text
        except Exception:  # a sampler too busy to answer: counted as missing, its fetches are not
            continue
        for fam in text_string_to_metric_families(text):
            if fam.name != "flywheel_sampler_policy_fetches":
                continue
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get("source", "?")] = out.get(s.labels.get("source", "?"), 0.0) + float(s.value)
    return out


def _mode(ctx: Context, mode: str, n: int, warmup: float, window: float) -> dict[str, Any]:
    with stack(ctx, ctx.run_name(NAME, mode), MODES[mode]) as st:
        up_s = st.up(n, timeout_s=600)
        st.wait_trained(1, timeout_s=180)
        time.sleep(warmup)
        f0, t0 = _fetches(st, n), time.time()
        time.sleep(window)
        f1, t1 = _fetches(st, n), time.time()
        published = [e for e in st.events("paramsync", "policy_published", since=t0) if e["_t"] <= t1]
        synced = [float(e["latency_s"]) for e in st.events("paramsync", "policy_synced", since=t0) if e["_t"] <= t1]
        refused = st.events("sampler", "inline_policy_refused")
    versions = len(published)
    store, inline = f1["store"] - f0["store"], f1["inline"] - f0["inline"]
    return {"samplers": n, "up_s": up_s, "versions": versions, "store_gets": store, "inline_adoptions": inline,
            "gets_per_version": store / versions if versions else float("nan"),
            "gets_per_s": store / window, "inline_refused": len(refused),
            "sync_p50": percentile(synced, 0.5), "sync_p95": percentile(synced, 0.95),
            "sync_p99": percentile(synced, 0.99), "synced": len(synced)}


def run(ctx: Context) -> FigureResult:
    n, warmup, window = samplers(), ctx.scale(10), ctx.scale(60)
    results: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        say(f"{NAME}: {mode}, {n} samplers, {window:.0f} s")
        results[mode] = _mode(ctx, mode, n, warmup, window)
    i, s = results["inline"], results["store"]
    rows = [f"| {m} | {r['versions']} | {r['store_gets']:.0f} | {r['gets_per_version']:.2f} | {r['gets_per_s']:.1f} "
            f"| {r['inline_adoptions']:.0f} | {r['sync_p50']:.3f} | {r['sync_p95']:.3f} | {r['sync_p99']:.3f} "
            f"| {r['synced']} |" for m, r in results.items()]
    details = "\n".join([
        "| mode | versions published | store GETs of weights | per version | per s | inline adoptions "
        "| sync p50 s | p95 s | p99 s | versions synced |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Sync latency is paramsync's `policy_synced.latency_s` (candidate received -> every live sampler's "
        f"heartbeat shows it or a newer one). Through the store a sampler fetches at most once per "
        f"`sampler.min_adoption_interval_s` (1 s) and then the newest version, so it skips versions: GETs per "
        f"version are below the sampler count when versions come faster than one a second. Besides these, every "
        f"sampler reads the marker every `sampler.sync_interval_s` (2 s) in both modes: {n / 2:.0f} small GETs/s "
        f"here. Inline weights refused by their sha256 check: {i['inline_refused']}.",
    ])
    return FigureResult(
        headline=[
            Row("store GETs of weights per version, inline", f"{i['gets_per_version']:.2f}", "0",
                i["store_gets"] == 0),
            Row("store GETs of weights per version, store", f"{s['gets_per_version']:.2f}"),
            Row("sync p99 inline / store", f"{i['sync_p99']:.3f} / {s['sync_p99']:.3f} s", "inline <= store",
                i["sync_p99"] <= s["sync_p99"]),
        ],
        numbers=results,
        settings={"samplers": n, "warmup_s": warmup, "window_s": window, "modes": MODES},
        method=(f"Two fresh stacks, one after the other, {n} samplers each, `configs/cartpole.yaml` unchanged (the "
                f"policy is ~37 KB: inline under the default 1 MiB), the second with `paramsync.inline_max_bytes: 0`; "
                f"after the first update and {warmup:.0f} s warm-up, a {window:.0f} s window: the samplers' "
                f"`flywheel_sampler_policy_fetches_total` by source before and after, paramsync's `policy_published` "
                f"and `policy_synced` lines in it."),
        details_md=details,
    )
