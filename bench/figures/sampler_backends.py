"""Sampler env backends: CPU time per env step of Pong on gymnasium and on EnvPool (``env.backend``).

In one process, no Kafka or S3, ``configs/pong.yaml``'s sampler (``env.num_envs`` envs, ``env.fragment_steps``
steps a fragment, the Nature CNN in onnxruntime at ``sampler.torch_threads``), per backend:

- ``step``: the vector env alone, ``env.step`` with uniformly random actions (a seeded sequence);
- ``collect``: ``RolloutWorker.collect()``, one fragment: the env steps plus the policy, the frame stacks and the
  fragment's arrays.

CPU time is ``time.process_time()`` (every thread of the process: EnvPool's worker thread included) over the block,
divided by the env steps in it (``num_envs`` per vector step); wall time alongside. The backends alternate within
each round, rounds repeated; median and range over the rounds. Needs the ``atari`` and ``envpool`` extras.

    .venv/bin/python -m bench.figures.sampler_backends            # the table (about a minute)
    .venv/bin/python -m bench.figures.sampler_backends --quick    # a smoke run
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import FigureResult, Row, standalone_main

NAME = "sampler_backends"
TITLE = "Sampler env backends: CPU microseconds per Pong env step, gymnasium against EnvPool (env.backend)."
TARGET = "EnvPool at most half gymnasium's sampler CPU per env step (collect, configs/pong.yaml's sampler)"
REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/pong.yaml"
BACKENDS = ("gymnasium", "envpool")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _timed(fn: Any, calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``calls`` calls of ``fn``."""
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return time.process_time() - c0, time.perf_counter() - w0


def measure(quick: bool = False) -> dict[str, Any]:
    import torch

    from services.sampler.rollout import RolloutWorker
    from shared.rl.arch import PolicyArch
    from shared.rl.model import ActorCritic, weights_to_bytes
    from shared.settings import load_settings

    s = load_settings(REPO / CONFIG, environ={})
    e, arch = s.env, PolicyArch.of(s.trainer)
    rounds, step_calls, fragments = (2, 100, 1) if quick else (7, 500, 2)
    workers = {b: RolloutWorker(e.id, e.num_envs, e.fragment_steps, "bench", arch, seed=0, frame_stack=e.frame_stack,
                                torch_threads=s.sampler.torch_threads, inference=s.sampler.inference, backend=b)
               for b in BACKENDS}
    torch.manual_seed(0)
    blob = weights_to_bytes(ActorCritic.for_arch(workers["gymnasium"].spec, arch))
    rng = np.random.default_rng(0)
    n = e.num_envs
    for w in workers.values():
        w.set_policy(0, blob)
        w.collect()  # warm-up: the policy session, first allocations

    def step(w: RolloutWorker) -> None:
        w.envs.step(rng.integers(0, w.spec.num_actions, n))

    out: dict[str, Any] = {b: {"step": [], "collect": [], "step_wall": [], "collect_wall": []} for b in BACKENDS}
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        for b, w in workers.items():
            cpu, wall = _timed(lambda w=w: step(w), step_calls)
            out[b]["step"].append(cpu / (step_calls * n) * 1e6)
            out[b]["step_wall"].append(wall / (step_calls * n) * 1e6)
            cpu, wall = _timed(w.collect, fragments)
            out[b]["collect"].append(cpu / (fragments * e.fragment_steps * n) * 1e6)
            out[b]["collect_wall"].append(wall / (fragments * e.fragment_steps * n) * 1e6)
    for w in workers.values():
        w.close()
    import envpool

    summary = {b: {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
                   for k, v in m.items()} for b, m in out.items()}
    ratio = {k: summary["envpool"][k]["median"] / summary["gymnasium"][k]["median"] for k in ("step", "collect")}
    return {"config": CONFIG, "env_id": e.id, "num_envs": n, "fragment_steps": e.fragment_steps,
            "rounds": rounds, "step_calls": step_calls, "fragments": fragments, "cpu": cpu_model(),
            "cores": os.cpu_count(), "envpool": envpool.__version__, "us_per_env_step": summary,
            "envpool_over_gymnasium": ratio, "load_before": load_before, "load_after": os.getloadavg()[0]}


def table(r: dict[str, Any]) -> str:
    lines = ["| backend | step: CPU µs / env step | step: wall | collect: CPU µs / env step | collect: wall |",
             "|---|---|---|---|---|"]
    for b in BACKENDS:
        m = r["us_per_env_step"][b]
        cells = [f"{m[k]['median']:,.0f} ({m[k]['min']:,.0f}-{m[k]['max']:,.0f})"
                 for k in ("step", "step_wall", "collect", "collect_wall")]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    q = r["envpool_over_gymnasium"]
    lines += ["", f"EnvPool / gymnasium CPU per env step (medians): step {q['step']:.2f}, collect {q['collect']:.2f}.",
              f"{r['env_id']}, {r['num_envs']} envs, {r['rounds']} rounds of {r['step_calls']} vector steps and "
              f"{r['fragments']} fragment(s) of {r['fragment_steps']} steps; median (min-max) over rounds. "
              f"{r['cpu']}, {r['cores']} cores, EnvPool {r['envpool']}. "
              f"Load average {r['load_before']:.1f} before, {r['load_after']:.1f} after."]
    return "\n".join(lines)


def run(ctx: Any) -> FigureResult:
    r = measure(quick=bool(getattr(ctx, "quick", False)))
    q = r["envpool_over_gymnasium"]
    ok = q["collect"] <= 0.5
    rows = [Row("EnvPool / gymnasium sampler CPU per env step (collect)", f"{q['collect']:.2f}", TARGET, ok),
            Row("EnvPool / gymnasium CPU per env step (env step alone)", f"{q['step']:.2f}")]
    return FigureResult(headline=rows, numbers=r, settings={"rounds": r["rounds"], "config": CONFIG},
                        method=("One process, no services: configs/pong.yaml's RolloutWorker on each backend, "
                                "process CPU time over blocks of env steps alone and of whole collect() calls, the "
                                "backends alternating, rounds repeated; median and range over the rounds."),
                        details_md=table(r))


def main() -> None:
    standalone_main("python -m bench.figures.sampler_backends", measure, table)


if __name__ == "__main__":
    main()
