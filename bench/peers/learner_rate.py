"""How fast Flywheel's learner alone trains a config's batches: the ceiling of any trained-throughput figure on
this machine, with nothing else running in the process (no Kafka, no samplers, no decode).

A ``RolloutWorker`` makes one update's fragments with the config's env and the learner's initial weights; then
``Learner.update`` runs on them ``updates`` times (after one untimed warm-up update) with ``--threads`` torch
threads. Run as ``python -m bench.peers.learner_rate --config configs/pong.yaml --threads 1 --updates 3``: one
JSON line ``{"env_steps_per_update", "seconds", "env_steps_per_s"}`` (the rate over the median update).
``--precision fp32`` or ``bf16`` overrides the config's ``trainer.precision`` (which ``auto`` leaves float32 on a
CPU here: the trainer's start-up probe, ``services.trainer.compute``, is not run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def measure(config: Path, threads: int, updates: int, precision: str | None = None) -> dict[str, Any]:
    import torch

    from services.sampler.rollout import RolloutWorker
    from services.trainer.learner import Learner
    from shared.rl.envs import fragment_spec
    from shared.settings import load_settings

    if updates < 1 or threads < 1:
        raise ValueError(f"want updates >= 1 and threads >= 1, got {updates=} {threads=}")
    torch.set_num_threads(threads)
    settings = load_settings(config, environ={})
    spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes, settings.env.frame_stack)
    trainer = settings.trainer.model_copy(update={"device": "cpu", **({"precision": precision} if precision else {})})
    learner = Learner(spec, trainer)
    worker = RolloutWorker.from_settings(settings, "learner-rate", seed=0)
    try:
        worker.set_policy(0, learner.weights())
        frags = [worker.collect() for _ in range(settings.trainer.batch_fragments)]
    finally:
        worker.close()
    learner.update(frags)  # warm-up: first-call allocations and torch's lazy imports
    seconds = []
    for _ in range(updates):
        t0 = time.perf_counter()
        learner.update(frags)
        seconds.append(time.perf_counter() - t0)
    steps = sum(f.steps for f in frags)
    return {"config": str(config), "threads": threads, "precision": trainer.precision,
            "bf16": learner.update_cfg.bf16, "env_steps_per_update": steps,
            "epochs": settings.trainer.epochs, "minibatches": settings.trainer.minibatches, "seconds": seconds,
            "env_steps_per_s": steps / statistics.median(seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="override trainer.precision (default: the config's)")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.config, a.threads, a.updates, a.precision)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
