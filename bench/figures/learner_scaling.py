"""Learner scaling: trained env-steps/s with 1 and 2 data-parallel trainer ranks, measured in one run.

The same stack and samplers both ways (CartPole, 4 samplers, no KL stop so every update does the same work);
first one rank, then the group re-formed as two. Each rank forms its own batch, so two ranks train twice
the env steps per update; what the ratio shows is whether the machine has the cores for the second rank.
"""

from __future__ import annotations

import time

from bench.context import Context, say
from bench.report import FigureResult, Row
from bench.stack import cpu_table, measure_windows, stack
from bench.stats import Spread

NAME = "learner_scaling"
TITLE = ("Trained env-steps/s with 2 data-parallel trainer ranks / 1 rank (CartPole, 4 samplers, same stack, "
         "one run).")
TARGET = ">= 1.6x (where the machine has a core per rank beyond the samplers and Kafka)"
SAMPLERS = 4
OVERRIDES = {"FLYWHEEL_TRAINER_TARGET_KL": "none"}


def run(ctx: Context) -> FigureResult:
    warmup, window, repeats = ctx.scale(10), ctx.scale(20), 3
    res: dict[int, dict[str, Spread]] = {}
    cpu: dict[int, str] = {}
    per_update: dict[int, float] = {}
    with stack(ctx, ctx.run_name(NAME), OVERRIDES) as st:
        for ranks in (1, 2):
            say(f"{NAME}: {ranks} rank(s), {SAMPLERS} samplers")
            up_s = st.up(SAMPLERS, trainers=ranks)
            st.wait_for("an update", lambda: st.counters()["updates"] > 0, 120)
            time.sleep(warmup)
            wins = measure_windows(st, window, repeats)
            res[ranks] = {"trained": Spread.of(w.trained_per_s for w in wins),
                          "busy": Spread.of(w.busy_fraction for w in wins),
                          "updates": Spread.of(w.updates_per_s for w in wins),
                          "sampled": Spread.of(w.sampled_per_s for w in wins)}
            per_update[ranks] = res[ranks]["trained"].median / max(res[ranks]["updates"].median, 1e-9)
            cpu[ranks] = cpu_table(wins)
            say(f"{NAME}: {ranks} rank(s): {res[ranks]['trained'].fmt()} trained env-steps/s (up {up_s:.0f} s)")
    ratio = res[2]["trained"].median / res[1]["trained"].median
    lines = ["| ranks | trained env-steps/s | updates/s | env steps / update | learner busy (rank 0) "
             "| sampled env-steps/s |", "|---|---|---|---|---|---|"]
    for r in (1, 2):
        x = res[r]
        lines.append(f"| {r} | {x['trained'].fmt()} | {x['updates'].fmt(1)} | {per_update[r]:.0f} | "
                     f"{x['busy'].fmt(2)} | {x['sampled'].fmt()} |")
    lines += ["", f"1 rank: {cpu[1]}", "", f"2 ranks: {cpu[2]}"]
    return FigureResult(
        headline=[Row("trained env-steps/s, 2 ranks / 1 rank", f"{ratio:.2f}", TARGET, ratio >= 1.6),
                  Row("trained env-steps/s, 1 rank", res[1]["trained"].fmt()),
                  Row("trained env-steps/s, 2 ranks", res[2]["trained"].fmt())],
        numbers={"ratio": ratio, **{f"ranks_{r}": {k: v.as_dict() for k, v in res[r].items()} for r in (1, 2)}},
        settings={"samplers": SAMPLERS, "warmup_s": warmup, "window_s": window, "windows": repeats,
                  **{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()}},
        method=(f"One local stack (configs/cartpole.yaml, {SAMPLERS} samplers); `up(trainers=1)`, {warmup:.0f} s "
                f"warm-up after the first update, {repeats} windows of {window:.0f} s; then `up(trainers=2)` "
                "re-forms the trainer as two ranks from its checkpoint, same warm-up and windows. Rate = trained "
                "env steps / window from rank 0's `flywheel_trainer_env_steps_trained_total` (every rank counts "
                "the group's steps). `trainer.target_kl` off so every update does the same work."),
        details_md="\n".join(lines),
    )
