"""The learner against this machine's own ceiling: its achieved FLOP/s over the peak the same operations reach.

For Pong's Nature CNN and MinAtar's CNN (the shapes of ``configs/pong.yaml`` and ``configs/minatar-breakout.yaml``;
random data, so no Atari or MinAtar install is needed), in each precision (float32, and bf16 autocast) with the
threads ``trainer.torch_threads: auto`` gives this process and with one thread:

- **achieved**: one epoch of the trainer's own update (``ppo_update``: the proximal evaluation of the batch, the
  bootstrap values, then each minibatch's forward, backward and Adam step) on one batch of the config's shapes,
  timed (median of the runs after a warm-up, ``services.trainer.compute.time_epoch``), its floating-point
  operations counted from the operators' shapes (``torch.utils.flop_counter.FlopCounterMode``: convolutions and
  matrix products, forward and backward) while one epoch runs;
- **peak**: each convolution and linear layer of the same model run alone, forward and backward, at the shapes the
  update gives it (a minibatch), in the same precision and threads, back to back in a tight loop (the fastest of
  ``PEAK_BURSTS`` bursts): the FLOP/s this machine reaches on exactly these operations with nothing else in the way
  (counted the same way);
- **fraction** = achieved / peak: how much of the attainable rate the learner keeps (the rest goes to the data's
  way into the model, the loss and the optimizer);
- the learner alone in env steps and frames per second (Pong's frame skip 4), and the ceiling that puts on a
  Flywheel run over EnvPool stepping Pong alone on the same cores (``peers_pong``'s stored ``envpool_raw`` figure,
  named with its date: it is not re-measured here).

    .venv/bin/python -m bench.figures.learner_roofline [--quick]

Every run records the CPU model and its ISA flags (bench.machine).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.report import FigureResult, Row, standalone_main

NAME = "learner_roofline"
TITLE = ("Learner roofline: the update's achieved FLOP/s over the peak the same convolutions and matmuls reach "
         "alone, per precision and threads, for Pong's Nature CNN and MinAtar's CNN")
TARGET = ("achieved / peak >= 0.6 at the precision and threads the trainer chooses "
          "(trainer.precision/torch_threads auto)")
REPO = Path(__file__).resolve().parents[2]
PEAK_BURSTS = 5
"""Timed bursts per layer for the peak; the fastest counts."""
FRAME_SKIP = 4  # Pong's env steps are 4 frames each (configs/pong.yaml, the ALE's frameskip)
MODELS = {
    "pong": {"config": "configs/pong.yaml", "obs_shape": (84, 84), "num_actions": 6, "env_id": "ALE/Pong-v5",
             "frame_stack": 4},
    "minatar": {"config": "configs/minatar-breakout.yaml", "obs_shape": (10, 10, 4), "num_actions": 3,
                "env_id": "MinAtar/Breakout-v1", "frame_stack": 1},
}


def _flops(fn: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def layer_peak(model: Any, obs: Any, bf16: bool, seconds: float) -> dict[str, Any]:
    """Each Conv2d and Linear of ``model`` alone, forward + backward at the input shapes the model's forward gives
    it on ``obs`` (a minibatch), under the precision: total counted FLOPs over total time."""
    import torch
    from torch import nn

    inputs: dict[nn.Module, torch.Tensor] = {}

    def keep(mod: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        inputs.setdefault(mod, args[0].detach())  # returns None: a hook's return value would replace the output

    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model.evaluate(obs, torch.zeros(obs.shape[0], dtype=torch.long))
    for h in hooks:
        h.remove()
    first = next(iter(inputs))  # the first layer's input needs no gradient (the data)
    total_flops, total_s, layers = 0, 0.0, []
    for mod, x in inputs.items():
        x = x.clone().float().requires_grad_(mod is not first)

        def step(mod: Any = mod, x: Any = x) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = mod(x)
            y.float().sum().backward()

        flops = _flops(step)
        step()  # warm-up
        bursts = []  # a peak is the best the machine does: the fastest of several short bursts (noise only slows)
        for _ in range(PEAK_BURSTS):
            n, t0 = 0, time.perf_counter()
            while n < 2 or time.perf_counter() - t0 < seconds / PEAK_BURSTS:
                step()
                n += 1
            bursts.append((time.perf_counter() - t0) / n)
        dt = min(bursts)
        total_flops += flops
        total_s += dt
        layers.append({"layer": str(mod), "input_shape": list(x.shape), "gflop": flops / 1e9,
                       "gflop_per_s": flops / dt / 1e9})
        mod.zero_grad(set_to_none=True)
    return {"flops": total_flops, "seconds": total_s, "flop_per_s": total_flops / total_s, "layers": layers}


def measure_model(name: str, threads: int, bf16: bool, runs: int, peak_s: float) -> dict[str, Any]:
    import torch

    from services.trainer.compute import probe_fragments, time_epoch
    from services.trainer.learner import Learner
    from services.trainer.update import ppo_update
    from shared.fragment import FragmentSpec
    from shared.rl.frames import stack_frames
    from shared.settings import load_settings

    m = MODELS[name]
    s = load_settings(REPO / m["config"], environ={})
    spec = FragmentSpec(obs_shape=m["obs_shape"], num_actions=m["num_actions"], env_id=m["env_id"],
                        obs_dtype="uint8", frame_stack=m["frame_stack"], max_bytes=s.kafka.max_message_bytes)
    torch.set_num_threads(threads)
    learner = Learner(spec, s.trainer.model_copy(update={"device": "cpu", "precision": "bf16" if bf16 else "fp32"}))
    frags = probe_fragments(spec, s.trainer.batch_fragments, s.env.fragment_steps, s.env.num_envs)
    # FLOPs of one epoch, exactly as time_epoch runs it (a copy: the counted run trains nothing that is kept).
    import copy
    import dataclasses

    model = copy.deepcopy(learner.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-5)
    cfg = dataclasses.replace(learner.update_cfg, epochs=1, target_kl=None, bf16=bf16)
    stacked = [stack_frames(f, learner.frame_stack) for f in frags] if learner.frame_stack > 1 else frags
    epoch_flops = _flops(lambda: ppo_update(model, opt, stacked, cfg, learner.device, torch.Generator().manual_seed(0)))
    rates = [time_epoch(learner, frags, bf16, runs=runs) for _ in range(2)]
    steps_per_s = statistics.median(rates)
    steps = sum(f.steps for f in frags)
    achieved = epoch_flops / (steps / steps_per_s)
    mb = steps // s.trainer.minibatches
    obs = torch.as_tensor(stacked[0].obs.reshape(-1, *stacked[0].obs.shape[2:])[:mb]).float()
    peak = layer_peak(copy.deepcopy(learner.model), obs, bf16, peak_s)
    return {"model": getattr(learner.model, "kind", "mlp"), "threads": threads, "precision": "bf16" if bf16 else "fp32",
            "env_steps_per_epoch": steps, "minibatch": mb, "epoch_gflop": epoch_flops / 1e9,
            "epoch_env_steps_per_s": steps_per_s, "epoch_rates": rates,
            "update_env_steps_per_s": steps_per_s / s.trainer.epochs,
            "achieved_gflop_per_s": achieved / 1e9, "peak_gflop_per_s": peak["flop_per_s"] / 1e9,
            "fraction": achieved / peak["flop_per_s"], "peak_layers": peak["layers"]}


def _envpool_raw() -> dict[str, Any] | None:
    """EnvPool stepping Pong alone on this machine's cores, as peers_pong stored it (not re-measured here)."""
    try:
        fig = json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["peers_pong"]
        fps = fig["numbers"]["peers"]["EnvPool (raw)"]["frames_per_s"]["median"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"frames_per_s": fps, "date": fig.get("date"), "commit": (fig.get("machine") or {}).get("commit")}


def measure(quick: bool = False) -> dict[str, Any]:
    from services.trainer.compute import choose_threads, cpu_info
    from shared.settings import TrainerSettings

    auto_threads, why = choose_threads(TrainerSettings(torch_threads="auto"))
    model_name, flags = cpu_info()
    runs, peak_s = (1, 0.2) if quick else (3, 1.0)
    thread_counts = sorted({1, auto_threads})
    out: dict[str, Any] = {"cpu_model": model_name,
                           "cpu_isa": sorted(f for f in flags if f.startswith(("avx512", "amx"))
                                             or f in ("avx2", "fma", "avx_vnni")),
                           "auto_threads": auto_threads, "auto_threads_reason": why, "runs": runs, "peak_s": peak_s,
                           "results": []}
    for name in MODELS:
        for threads in thread_counts:
            for bf16 in (False, True):
                out["results"].append({"name": name, **measure_model(name, threads, bf16, runs, peak_s)})
    broken = [f"{x['name']} {x['precision']} {x['threads']} thread(s): {x['fraction']:.2f}" for x in out["results"]
              if x["fraction"] > 1.05]
    if broken:  # the peak probe ran slower than the update itself: something else took the cores meanwhile
        raise RuntimeError(f"achieved above the measured peak ({'; '.join(broken)}): the machine was not quiet, "
                           "run again with nothing else running")
    raw = _envpool_raw()
    out["envpool_raw"] = raw
    pong = [r for r in out["results"] if r["name"] == "pong"]
    best = max(pong, key=lambda r: r["update_env_steps_per_s"])
    out["pong_best"] = {"threads": best["threads"], "precision": best["precision"],
                        "learner_frames_per_s": best["update_env_steps_per_s"] * FRAME_SKIP}
    if raw:
        out["pong_best"]["learner_over_envpool_raw"] = out["pong_best"]["learner_frames_per_s"] / raw["frames_per_s"]
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"CPU: {r['cpu_model']}; ISA: {', '.join(r['cpu_isa']) or '-'}; auto threads: {r['auto_threads']} "
             f"({r['auto_threads_reason']})", "",
             "| model | threads | precision | epoch GFLOP | learner env steps/s (update, all epochs) "
             "| achieved GFLOP/s | peak GFLOP/s (same ops alone) | achieved / peak |",
             "|---|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        lines.append(f"| {x['name']} ({x['model']}) | {x['threads']} | {x['precision']} | {x['epoch_gflop']:.1f} | "
                     f"{x['update_env_steps_per_s']:,.0f} | {x['achieved_gflop_per_s']:.1f} | "
                     f"{x['peak_gflop_per_s']:.1f} | {x['fraction']:.2f} |")
    picks = ", ".join(f"{x['name']} {x['precision']} at {x['threads']} thread(s)" for x in chosen(r))
    lines += ["", f"What `trainer.precision: auto` and `torch_threads: auto` pick here from these figures: {picks}; "
              "the target is judged on those rows."]
    b = r["pong_best"]
    lines += ["", f"Pong, the learner alone at its best here ({b['threads']} thread(s), {b['precision']}): "
              f"{b['learner_frames_per_s']:,.0f} frames/s trained (env steps x {FRAME_SKIP})"]
    if r.get("envpool_raw"):
        e = r["envpool_raw"]
        lines.append(f"EnvPool stepping Pong alone (peers_pong's figure of {e['date']}, not re-measured): "
                     f"{e['frames_per_s']:,.0f} frames/s: the learner alone is {b['learner_over_envpool_raw']:.2f} "
                     "of it, the ceiling of a run's trained frames/s over EnvPool's on these cores")
    return "\n".join(lines)


def chosen(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model, the row the trainer would run: ``torch_threads: auto``'s threads, and bf16 only where it timed at
    least ``BF16_SPEEDUP`` times float32's rate there (``trainer.precision: auto`` on a CPU with native bf16)."""
    from services.trainer.compute import BF16_SPEEDUP, NATIVE_BF16_FLAGS

    native = any(f in r["cpu_isa"] for f in NATIVE_BF16_FLAGS)
    out = []
    for name in MODELS:
        at = {x["precision"]: x for x in r["results"] if x["name"] == name and x["threads"] == r["auto_threads"]}
        bf16 = native and at["bf16"]["epoch_env_steps_per_s"] >= BF16_SPEEDUP * at["fp32"]["epoch_env_steps_per_s"]
        out.append(at["bf16" if bf16 else "fp32"])
    return out


def run(ctx: Any) -> FigureResult:
    r = measure(quick=bool(getattr(ctx, "quick", False)))
    rows = []
    chosen_rows = chosen(r)
    for x in r["results"]:
        is_chosen = any(x is c for c in chosen_rows)
        rows.append(Row(f"{x['name']} {x['precision']} {x['threads']} thread(s): achieved / peak",
                        f"{x['fraction']:.2f} ({x['achieved_gflop_per_s']:.0f} of {x['peak_gflop_per_s']:.0f} GFLOP/s)",
                        TARGET if is_chosen else "", (x["fraction"] >= 0.6) if is_chosen else None))
    b = r["pong_best"]
    rows.append(Row("Pong learner alone, frames/s", f"{b['learner_frames_per_s']:,.0f} ({b['precision']}, "
                                                    f"{b['threads']} thread(s))"))
    if "learner_over_envpool_raw" in b:
        rows.append(Row("Pong learner alone / EnvPool alone (stored figure)", f"{b['learner_over_envpool_raw']:.2f}"))
    return FigureResult(
        headline=rows, numbers=r, settings={"models": MODELS, "runs": r["runs"], "peak_s": r["peak_s"]},
        method=("In one process, no services, random data in the configs' shapes: per model, precision and threads, "
                "one epoch of ppo_update timed (median of runs after a warm-up, twice) and its FLOPs counted with "
                "torch's FlopCounterMode; the peak is each Conv2d and Linear of the same model alone, forward and "
                "backward at a minibatch's shapes, same precision and threads, counted the same way."),
        details_md=table(r))


def main() -> None:
    standalone_main("python -m bench.figures.learner_roofline", measure, table)


if __name__ == "__main__":
    main()
