"""Sampler inference: the time of one action batch (network + sampling) per backend, at each config's size.

What a sampler does once per vector step: ``policy.act(obs, rng)`` on its ``env.num_envs`` observations.
Measured for CartPole's MLP (``configs/cartpole.yaml``), MinAtar Breakout's CNN (``configs/minatar-breakout.yaml``)
and Pong's Nature CNN with 4 stacked frames (``configs/pong.yaml``), through the numpy MLP (the MLP only), torch
with 1 and 2 threads (``torch.set_num_threads``) and onnxruntime with 1 and 2 intra-op threads
(:class:`shared.rl.policy_onnx.OnnxPolicy`, the graph the samplers would run). The repeats are interleaved
(every backend once per round) so that a change in the machine's load hits all of them alike. No Kafka or S3.

    .venv/bin/python -m bench.figures.sampler_inference            # prints the table (about a minute)
    .venv/bin/python -m bench.figures.sampler_inference --quick    # a smoke run

``sampler.inference: auto`` (:func:`shared.rl.policy_onnx.resolve_inference`) should pick the fastest backend at
the configs' thread count (1), or one tied with it within the rounds' spread (the MLP's numpy and onnxruntime times
overlap; numpy keeps torch and onnxruntime out of the sampler process): the headline checks that it does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.report import FigureResult, Row, standalone_main

if TYPE_CHECKING:
    from shared.rl.arch import PolicyArch

NAME = "sampler_inference"
TITLE = ("Sampler inference: microseconds per action batch (network + sampling) at each config's num_envs, "
         "numpy / torch / onnxruntime, 1 and 2 threads.")
TARGET = ("sampler.inference: auto picks, at 1 thread, the fastest backend or one tied with it (its median within "
          "the fastest's range) for every config")
REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("configs/cartpole.yaml", "configs/minatar-breakout.yaml", "configs/pong.yaml")
THREADS = (1, 2)


@dataclass(frozen=True)
class Case:
    """One config's policy input: env, batch (``env.num_envs``), frame stack, and the network the trainer's
    settings give (:class:`shared.rl.arch.PolicyArch`), built as a sampler builds it."""

    config: str
    env_id: str
    num_envs: int
    frame_stack: int | None
    arch: PolicyArch


def cases() -> list[Case]:
    from shared.rl.arch import PolicyArch
    from shared.settings import load_settings

    out = []
    for path in CONFIGS:
        s = load_settings(REPO / path, environ={})
        out.append(Case(path, s.env.id, s.env.num_envs, s.env.frame_stack, PolicyArch.of(s.trainer)))
    return out


def _backends(case: Case) -> tuple[dict[str, Callable[[], Any]], np.ndarray, bool, dict[str, float]]:
    """Label -> one ``act`` call on a fixed batch, for every backend that can run ``case``; the observations;
    whether the model is a CNN; the one-off costs (export, session) in seconds."""
    import torch

    from shared.rl.arch import sampler_policy
    from shared.rl.envs import fragment_spec
    from shared.rl.model import ActorCritic, weights_to_bytes
    from shared.rl.policy_onnx import OnnxPolicy, example_batch

    spec = fragment_spec(case.env_id, 1 << 30, frame_stack=case.frame_stack)
    image, cnn = spec.obs_dtype == "uint8", case.arch.is_cnn(spec)
    torch.manual_seed(0)
    blob = weights_to_bytes(ActorCritic.for_arch(spec, case.arch))
    rng = np.random.default_rng(0)
    shape = example_batch(spec, case.num_envs).shape
    obs = (rng.integers(0, 256, shape, dtype=np.uint8) if image else rng.normal(size=shape).astype(np.float32))
    out: dict[str, Callable[[], Any]] = {}
    if not cnn:
        numpy_policy = sampler_policy(spec, case.arch, "numpy")
        numpy_policy.load(blob)
        out["numpy"] = lambda: numpy_policy.act(obs, rng)
    torch_policy = sampler_policy(spec, case.arch, "torch")
    torch_policy.load(blob)
    for threads in THREADS:
        def torch_act(n: int = threads) -> Any:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
            return torch_policy.act(obs, rng)
        out[f"torch, {threads} thread{'s' if threads > 1 else ''}"] = torch_act
    costs: dict[str, float] = {}
    t0 = time.perf_counter()
    onnx_policy = sampler_policy(spec, case.arch, "onnx")
    assert isinstance(onnx_policy, OnnxPolicy)
    costs["onnx_export_s"] = time.perf_counter() - t0
    for threads in THREADS:  # one session per thread count, built once: load() opens the session
        onnx_policy.threads = threads
        t0 = time.perf_counter()
        onnx_policy.load(blob)
        costs[f"onnx_session_{threads}_s"] = time.perf_counter() - t0
        session = onnx_policy._session  # bench-only: one exported graph, a session per thread count

        def onnx_act(s: Any = session) -> Any:
            onnx_policy._session = s
            return onnx_policy.act(obs, rng)
        out[f"onnxruntime, {threads} thread{'s' if threads > 1 else ''}"] = onnx_act
    return out, obs, cnn, costs


def _block(fn: Callable[[], Any], min_s: float) -> float:
    """Microseconds per call over calls filling at least ``min_s``."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s and n >= 3:
            return elapsed / n * 1e6


def measure(quick: bool = False) -> dict[str, Any]:
    """Every case's backends, ``repeats`` interleaved rounds each; medians, ranges and the one-off costs."""
    import torch

    from shared.rl.policy_onnx import resolve_inference

    repeats, min_s = (3, 0.05) if quick else (9, 0.25)
    results: dict[str, Any] = {"load_before": os.getloadavg()[0], "repeats": repeats, "block_s": min_s, "cases": {}}
    for case in cases():
        fns, obs, cnn, costs = _backends(case)
        for fn in fns.values():  # warm-up: first-call allocations, lazy initialisation
            _block(fn, min_s / 2)
        samples: dict[str, list[float]] = {label: [] for label in fns}
        for _ in range(repeats):
            for label, fn in fns.items():
                samples[label].append(_block(fn, min_s))
        torch.set_num_threads(1)
        med = {label: statistics.median(v) for label, v in samples.items()}
        one_thread = {label: m for label, m in med.items() if "2 threads" not in label}
        fastest = min(one_thread, key=lambda k: one_thread[k])
        pick = resolve_inference("auto", cnn)
        picked = next(label for label in one_thread
                      if label.startswith({"onnx": "onnxruntime", "numpy": "numpy", "torch": "torch"}[pick]))
        results["cases"][case.config] = {
            "env_id": case.env_id, "num_envs": case.num_envs, "obs_shape": list(obs.shape), "model": case.arch.model,
            "us_per_batch": {label: {"median": med[label], "min": min(v), "max": max(v), "values": v}
                             for label, v in samples.items()},
            "fastest_1_thread": fastest, "auto_picks": pick,
            "auto_is_fastest_or_tied": med[picked] <= max(samples[fastest]), **costs}
    results["load_after"] = os.getloadavg()[0]
    return results


def table(results: dict[str, Any]) -> str:
    labels: list[str] = []
    for c in results["cases"].values():
        labels += [label for label in c["us_per_batch"] if label not in labels]
    lines = ["| config (env, batch) | " + " | ".join(labels) + " | auto picks |",
             "|---|" + "---|" * (len(labels) + 1)]
    for path, c in results["cases"].items():
        cells = []
        for label in labels:
            x = c["us_per_batch"].get(label)
            cells.append("-" if x is None else f"{x['median']:,.0f} ({x['min']:,.0f}-{x['max']:,.0f})")
        name = f"{Path(path).name} ({c['env_id']}, {' x '.join(str(d) for d in c['obs_shape'])})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {c['auto_picks']} |")
    lines += ["", "Microseconds per `act` call: median (min-max) of the rounds. One-off costs: " + "; ".join(
        f"{Path(p).name} export {c['onnx_export_s']:.1f} s, session {c['onnx_session_1_s'] * 1e3:.0f} ms"
        for p, c in results["cases"].items()) + ".",
        f"Load average {results['load_before']:.1f} before, {results['load_after']:.1f} after."]
    return "\n".join(lines)


def run(ctx: Any) -> FigureResult:
    results = measure(quick=bool(getattr(ctx, "quick", False)))
    ok = all(c["auto_is_fastest_or_tied"] for c in results["cases"].values())
    rows = [Row("auto picks the fastest backend or a tie (1 thread), every config", "yes" if ok else "no", TARGET, ok)]
    for path, c in results["cases"].items():
        t1 = c["us_per_batch"]["torch, 1 thread"]["median"]
        o1 = c["us_per_batch"]["onnxruntime, 1 thread"]["median"]
        rows.append(Row(f"{Path(path).name}: onnxruntime / torch time (1 thread)", f"{o1 / t1:.2f}"))
    return FigureResult(
        headline=rows, numbers=results, settings={"repeats": results["repeats"], "block_s": results["block_s"]},
        method=("In one process, no services: per config a model of its size (seeded weights), a fixed batch of "
                "random observations shaped as the sampler's policy input, `act` (network + numpy sampling) "
                "called for at least the block time per measurement, every backend once per round, rounds "
                "repeated; median and range over the rounds."),
        details_md=table(results))


def main() -> None:
    standalone_main("python -m bench.figures.sampler_inference", measure, table)


if __name__ == "__main__":
    main()
