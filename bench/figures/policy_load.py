"""Policy load: what adopting a large policy costs a sampler, in time and in memory, per inference backend.

docs/scaling.md ("Policy fan-out") sizes samplers for a 50 MB CNN policy: the Nature CNN on full 210x160 Atari
frames, 4 stacked, 6 actions (46.5 MB of weights), beside Pong's Nature CNN (84x84, 6.75 MB). For each:

- time, in this process: the blob's sha256 (what ``VersionedStore.fetch`` checks), ``validate_weights``
  (safetensors decode and shape check), the trainer's ``load_weights`` (torch ``load_state_dict``), and a
  sampler's ``load`` with the onnx backend (``auto`` for CNNs) and the torch backend, first and later loads;
- memory, in a fresh process per backend (``bench.memory_probe``), as a sampler holds it: VmRSS and VmHWM from
  ``/proc/self/status`` after the imports, after the policy is built, and after 1, 2 and ``loads`` loads of the
  blob; whether torch was imported (the onnx path must not import it: the sampler image has none).

    .venv/bin/python -m bench.figures.policy_load           # prints the table (about a minute)
    .venv/bin/python -m bench.figures.policy_load --quick   # fewer loads
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.memory_probe import spec as probe_spec
from bench.report import FigureResult, Row, standalone_main
from bench.stats import timed_median

NAME = "policy_load"
TITLE = ("Policy load: time and sampler memory to adopt a large CNN policy (the 50 MB stand-in and Pong), onnx "
         "and torch backends.")
TARGET = ("the onnx backend's memory levels off over repeated loads (over the second half of the loads its resident "
          "memory grows less than 1 MiB per load; a leak of one blob per load, as before a fix, grows 6-44 MiB) and it "
          "never imports torch")
REPO = Path(__file__).resolve().parents[2]
CASES = {
    "50 MB stand-in (Nature CNN, 210x160 frames)": {"obs_shape": [210, 160], "frame_stack": 4, "actions": 6},
    "Pong (Nature CNN, 84x84 frames)": {"obs_shape": [84, 84], "frame_stack": 4, "actions": 6},
}
BACKENDS = ("onnx", "torch")


def _run_child(backend: str, case: dict[str, Any], blob_path: str, loads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.memory_probe", backend, json.dumps(case), blob_path, str(loads)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        raise RuntimeError(f"{backend} child failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(quick: bool = False) -> dict[str, Any]:
    import onnxruntime
    import torch

    from shared.rl.arch import PolicyArch, sampler_policy
    from shared.rl.model import ActorCritic, load_weights, weights_to_bytes
    from shared.rl.policy_np import validate_weights

    repeats, loads = (2, 6) if quick else (5, 20)
    results: dict[str, Any] = {"repeats": repeats, "loads": loads, "cases": {},
                               "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__}}
    torch.set_num_threads(1)
    for label, case in CASES.items():
        spec = probe_spec(case)
        torch.manual_seed(0)
        model = ActorCritic.for_spec(spec, 64, model="nature_cnn")
        blob = weights_to_bytes(model)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        onnx_policy = sampler_policy(spec, PolicyArch(model="nature_cnn"), "onnx", 1)
        torch_policy = sampler_policy(spec, PolicyArch(model="nature_cnn"), "torch", 1)
        torch_first = timed_median(lambda b=blob, p=torch_policy: p.load(b), 1)
        onnx_first = timed_median(lambda b=blob, p=onnx_policy: p.load(b), 1)
        row: dict[str, Any] = {
            **case, "parameters": sum(p.numel() for p in model.parameters()), "blob_bytes": len(blob),
            "sha256_s": timed_median(lambda b=blob: hashlib.sha256(b).hexdigest(), repeats),
            "validate_weights_s": timed_median(lambda b=blob, s=shapes: validate_weights(b, s), repeats),
            "load_weights_s": timed_median(lambda m=model, b=blob: load_weights(m, b), repeats),
            "onnx_load_first_s": onnx_first,
            "onnx_load_s": timed_median(lambda b=blob, p=onnx_policy: p.load(b), repeats),
            "torch_load_first_s": torch_first,
            "torch_load_s": timed_median(lambda b=blob, p=torch_policy: p.load(b), repeats),
            "memory": {},
        }
        del onnx_policy, torch_policy
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
            f.write(blob)
            f.flush()
            for backend in BACKENDS:
                row["memory"][backend] = _run_child(backend, case, f.name, loads)
        onnx = row["memory"]["onnx"]["stages"]
        row["onnx_growth_mib"] = onnx[f"load {loads}"]["VmRSS"] - onnx["load 2"]["VmRSS"]
        half = onnx[f"load {loads}"]["VmRSS"] - onnx[f"load {loads // 2}"]["VmRSS"]
        row["onnx_growth_second_half_per_load_mib"] = half / (loads - loads // 2)
        row["onnx_levels_off"] = row["onnx_growth_second_half_per_load_mib"] < 1.0
        results["cases"][label] = row
    return results


def table(results: dict[str, Any]) -> str:
    n = results["loads"]
    lines = ["| policy | blob | sha256 | validate_weights | load_weights (torch) | onnx load: first / after "
             "| torch load: first / after |", "|---|---|---|---|---|---|---|"]
    for label, c in results["cases"].items():
        lines.append(
            f"| {label} | {c['blob_bytes'] / 1e6:.1f} MB ({c['parameters']:,} parameters) | {c['sha256_s']:.3f} s "
            f"| {c['validate_weights_s']:.3f} s | {c['load_weights_s']:.3f} s "
            f"| {c['onnx_load_first_s']:.2f} / {c['onnx_load_s']:.2f} s "
            f"| {c['torch_load_first_s']:.2f} / {c['torch_load_s']:.2f} s |")
    lines += ["", f"Memory of the policy alone in a fresh process, VmRSS / VmHWM MiB (loads: {n}):", "",
              f"| policy, backend | python | imports | built | after 1st load | after 2nd | after {n // 2} | after {n} "
              "| torch imported |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, c in results["cases"].items():
        for backend, m in c["memory"].items():
            s = m["stages"]
            cells = [f"{s[k]['VmRSS']:,.0f} / {s[k]['VmHWM']:,.0f}" for k in
                     ("python", "imports", "built", "load 1", "load 2", f"load {n // 2}", f"load {n}")]
            imported = "yes" if m["torch_imported"] else "no"
            lines.append(f"| {label}, {backend} | " + " | ".join(cells) + f" | {imported} |")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    return "\n".join(lines)


def run(ctx: Any) -> FigureResult:
    results = measure(quick=bool(getattr(ctx, "quick", False)))
    ok = all(c["onnx_levels_off"] and not c["memory"]["onnx"]["torch_imported"] for c in results["cases"].values())
    rows = [Row("onnx backend: levels off over repeated loads and never imports torch", "yes" if ok else "no",
                TARGET, ok)]
    for label, c in results["cases"].items():
        peak = c["memory"]["onnx"]["stages"][f"load {results['loads']}"]["VmHWM"]
        rows.append(Row(f"{label}: onnx load (after the first) / the onnx policy's peak over {results['loads']} loads",
                        f"{c['onnx_load_s']:.2f} s / {peak:,.0f} MiB"))
    return FigureResult(
        headline=rows, numbers=results, settings={"repeats": results["repeats"], "loads": results["loads"],
                                                  "cases": CASES},
        method=("In one process, no services: per policy a seeded model's blob; each step timed `repeats` times "
                "(median), a sampler policy's first load timed once. Memory: a fresh Python process per backend "
                "builds the sampler's policy (`sampler_policy(spec, PolicyArch(model='nature_cnn'), backend, 1)`) "
                "and loads the blob `loads` times, reading VmRSS and VmHWM from /proc/self/status."),
        details_md=table(results))


def main() -> None:
    standalone_main("python -m bench.figures.policy_load", measure, table)


if __name__ == "__main__":
    main()
