"""Does the samplers' lag cost return on this config? One look, not a figure.

Runs the services' own RolloutWorkers and Learner in lockstep (:func:`bench.inproc.lockstep`): the workers act
with the policy of exactly ``--lag`` updates ago (0: the current one, as a synchronous PPO), every other setting
from the config, seeded by ``--seed`` (the trainer's initial weights and the workers' envs), until ``--steps``
env steps. Run the same seeds at lag 0 and at the lag the stack shows (its ``lag/mean_versions`` TensorBoard
scalar, about 2 on the 2-core machine) and compare return at equal env steps: wall time does not enter. Prints
one JSON line per run (the last-``--last`` return every ``--every`` env steps and at the end, the best rolling
value, wall seconds)::

    .venv/bin/python -m bench.lag_look --config configs/halfcheetah.yaml --seed 4 --lag 0 --steps 300000
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.inproc import lockstep_curve
from bench.samples import return_at_steps, rolling_mean
from shared.settings import load_settings


def look(config: str, seed: int, lag: int, steps: int, every: int, last: int, samplers: int = 2) -> dict[str, Any]:
    """One lockstep run of ``config`` at ``lag``; the return of the last ``last`` episodes at each multiple of
    ``every`` env steps and at ``steps``."""
    if lag < 0 or steps < 1 or every < 1 or last < 1 or samplers < 1:
        raise ValueError("lag must be >= 0; steps, every, last and samplers >= 1")
    base = load_settings(config, environ={})
    settings = base.model_copy(update={"trainer": base.trainer.model_copy(update={"seed": seed})})
    t0 = time.monotonic()
    curve = lockstep_curve(settings, seed, samplers, lag, lambda _curve, done: done >= steps)
    rolled = rolling_mean(curve, last)
    marks = [*range(every, steps, every), steps]
    return {"config": config, "seed": seed, "lag": lag, "samplers": samplers, "steps": steps, "last": last,
            "wall_s": round(time.monotonic() - t0, 1), "episodes": len(curve),
            "at_end": round(return_at_steps(curve, steps, last), 2),
            "best_rolling": round(max(v for _, _, v in rolled), 2) if rolled else None,
            "at": {str(m): round(return_at_steps(curve, m, last), 2) for m in marks}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lag_look", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a Flywheel config (YAML)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lag", type=int, default=0, help="versions the behaviour policy is behind (0: current)")
    p.add_argument("--steps", type=int, default=300_000, help="env steps to run")
    p.add_argument("--every", type=int, default=25_000, help="report the return every this many env steps")
    p.add_argument("--last", type=int, default=10, help="episodes averaged")
    p.add_argument("--samplers", type=int, default=2, help="RolloutWorkers, round robin (the stack's samplers)")
    a = p.parse_args(argv)
    print(json.dumps(look(a.config, a.seed, a.lag, a.steps, a.every, a.last, a.samplers)))


if __name__ == "__main__":
    main()
