"""A sampler's policy alone in a fresh process, and its memory at each stage (``bench.figures.policy_load``).

Run as ``python -m bench.memory_probe BACKEND CASE_JSON BLOB_PATH LOADS``: it builds the sampler's policy for the
case (``sampler_policy(spec, PolicyArch(model='nature_cnn'), BACKEND, 1)``), loads the blob LOADS times and
prints one JSON line: VmRSS and VmHWM (MiB, from /proc/self/status) after Python with the blob read, the
imports, the build and loads 1, 2, LOADS // 2 and LOADS; each load's seconds; whether torch got imported. Kept out of
``bench.figures``, whose package imports every figure (and torch) before the first stage could be read.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.proc import memory


def spec(case: dict[str, Any]) -> Any:
    """The FragmentSpec of an image case: ``obs_shape``, ``actions``, ``frame_stack``; uint8 frames."""
    from shared.fragment import FragmentSpec

    return FragmentSpec(tuple(case["obs_shape"]), case["actions"], obs_dtype="uint8", frame_stack=case["frame_stack"])


def probe(backend: str, case: dict[str, Any], blob: bytes, loads: int) -> dict[str, Any]:
    if loads < 2:
        raise ValueError(f"loads={loads}: at least 2 (the stages compare the 2nd load with the last)")
    stages: dict[str, dict[str, float]] = {"python": memory("self")}
    from shared.rl.arch import PolicyArch, sampler_policy

    stages["imports"] = memory("self")
    policy = sampler_policy(spec(case), PolicyArch(model="nature_cnn"), backend, 1)
    stages["built"] = memory("self")
    times = []
    for i in range(1, loads + 1):
        t0 = time.perf_counter()
        policy.load(blob)
        times.append(time.perf_counter() - t0)
        if i in (1, 2, loads // 2, loads):
            stages[f"load {i}"] = memory("self")
    return {"stages": stages, "load_s": times, "torch_imported": "torch" in sys.modules}


if __name__ == "__main__":
    backend, case_json, blob_path, loads = sys.argv[1:5]
    print(json.dumps(probe(backend, json.loads(case_json), Path(blob_path).read_bytes(), int(loads))))
