"""Footprint: what each service of a running stack takes in CPU and memory, the measurement behind the Kubernetes
requests and limits (docs/kubernetes.md, "Requests and limits").

The local stack with ``configs/cartpole.yaml`` and one sampler against the bench's Kafka and S3; after the first
update and a warm-up, every second for the window: each service process's CPU seconds (``/proc/<pid>/stat``) and
resident memory (``VmRSS``), and at the end its ``VmHWM`` (the peak since it started, start-up included). Per
service: the mean cores over the window, the busiest 5 s (the highest mean over any 5 consecutive seconds) and the
peak memory; and what the rule docs/kubernetes.md states gives from them (CPU request: the mean plus 20%; CPU limit:
the busiest 5 s plus 20%; memory request and limit: the peak plus 20%). The sampler runs the MLP in numpy
(``sampler.inference: auto``), as in the sampler image; whether a process has libtorch mapped is reported.
"""

from __future__ import annotations

import time
from typing import Any

from bench.context import Context, say
from bench.machine import cpu_seconds
from bench.proc import mapped, memory
from bench.report import FigureResult, Row
from bench.stack import stack

NAME = "footprint"
TITLE = ("Footprint: CPU (mean, busiest 5 s) and peak memory of each service on the CartPole stack with one sampler, "
         "and the Kubernetes requests and limits they give.")
TARGET = ("none here: tests/unit/test_doc_figures.py holds every request and limit of deploy/k8s/base at or above what "
          "the rule gives from this measurement")
SERVICES = ("trainer", "paramsync", "admin", "sampler-0")


def measure_window(pids: dict[str, int], window_s: float, busiest_s: int = 5) -> dict[str, Any]:
    """Sample every second for ``window_s``: per service the mean cores, the busiest ``busiest_s`` seconds, the
    largest VmRSS sampled and the VmHWM at the end."""
    cpu: dict[str, list[float]] = {name: [] for name in pids}
    rss: dict[str, list[float]] = {name: [] for name in pids}
    times: list[float] = []
    end = time.monotonic() + window_s
    while True:
        times.append(time.monotonic())
        for name, pid in pids.items():
            secs, status = cpu_seconds(pid), memory(pid)
            if secs is None or "VmRSS" not in status:
                raise RuntimeError(f"{NAME}: {name} (pid {pid}) exited during the window")
            cpu[name].append(secs)
            rss[name].append(status["VmRSS"])
        if times[-1] >= end:
            break
        time.sleep(1.0)
    out: dict[str, Any] = {}
    for name, pid in pids.items():
        c = cpu[name]
        rates = [(c[i + busiest_s] - c[i]) / (times[i + busiest_s] - times[i]) for i in range(len(c) - busiest_s)]
        out[name] = {"mean_cores": (c[-1] - c[0]) / (times[-1] - times[0]), "busiest_5s_cores": max(rates),
                     "rss_max_mib": max(rss[name]), "hwm_mib": memory(pid)["VmHWM"],
                     "torch_mapped": mapped(pid, "libtorch"), "samples": len(c)}
    return out


def rule(m: dict[str, Any]) -> dict[str, float]:
    """What docs/kubernetes.md's rule gives: CPU request mean + 20%, CPU limit busiest 5 s + 20%, memory the peak
    (VmHWM) + 20%; cores and MiB, unrounded."""
    return {"cpu_request": m["mean_cores"] * 1.2, "cpu_limit": m["busiest_5s_cores"] * 1.2,
            "memory_mib": m["hwm_mib"] * 1.2}


def run(ctx: Context) -> FigureResult:
    warmup, window = ctx.scale(20), ctx.scale(120)
    say(f"{NAME}: one sampler, {warmup:.0f} s warm-up, {window:.0f} s window")
    with stack(ctx, ctx.run_name(NAME)) as st:
        st.up(1, timeout_s=300)
        st.wait_trained(1, timeout_s=180)
        time.sleep(warmup)
        pids = {name: pid for name, pid in st.stack.pids().items() if name in SERVICES}
        missing = sorted(set(SERVICES) - set(pids))
        if missing:
            raise RuntimeError(f"{NAME}: no running process for {missing}")
        services = measure_window(pids, window)
    derived = {name: rule(m) for name, m in services.items()}
    lines = ["| service | mean cores | busiest 5 s | peak RSS sampled / VmHWM MiB | libtorch mapped "
             "| rule: CPU request, CPU limit, memory |", "|---|---|---|---|---|---|"]
    for name, m in services.items():
        d = derived[name]
        lines.append(f"| {name} | {m['mean_cores']:.2f} | {m['busiest_5s_cores']:.2f} | {m['rss_max_mib']:,.0f} / "
                     f"{m['hwm_mib']:,.0f} | {'yes' if m['torch_mapped'] else 'no'} | {d['cpu_request'] * 1000:.0f}m, "
                     f"{d['cpu_limit'] * 1000:.0f}m, {d['memory_mib']:,.0f} MiB |")
    return FigureResult(
        headline=[Row(f"{name}: mean / busiest 5 s cores, peak MiB",
                      f"{m['mean_cores']:.2f} / {m['busiest_5s_cores']:.2f}, {m['hwm_mib']:,.0f}")
                  for name, m in services.items()],
        numbers={"services": services, "rule": derived},
        settings={"samplers": 1, "warmup_s": warmup, "window_s": window},
        method=(f"The local stack (`configs/cartpole.yaml` unchanged, 1 sampler: `sampler.inference: auto` runs the "
                f"MLP in numpy) on the bench's Kafka and S3; after the first update and {warmup:.0f} s, every second "
                f"for {window:.0f} s each service's CPU seconds and VmRSS from /proc, VmHWM at the end."),
        details_md="\n".join(lines))
