"""Figure 1: what Kafka costs. Trained env-steps/s of the local stack (2 samplers, Kafka between
them and the trainer) divided by the same RolloutWorker + Learner code joined by a queue.Queue in
one process."""

from __future__ import annotations

import time

from bench.context import Context, say
from bench.inproc import inproc_windows
from bench.report import FigureResult, Row
from bench.stack import cpu_table, measure_windows, stack
from bench.stats import Spread
from shared.settings import load_settings

NAME = "pipeline"
TITLE = "Trained env-steps/s through Kafka (local stack, 2 samplers) / the same code joined in memory."
TARGET = ">= 0.9, learner busy >= 0.9, lag at training time max <= trainer.max_staleness"
SAMPLERS = 2
# Both sides without KL early stopping: with it, how much work an update does depends on its data (and
# staleness differs between the two transports), so trained env-steps/s would compare different work.
OVERRIDES = {"FLYWHEEL_TRAINER_TARGET_KL": "none"}


def run(ctx: Context) -> FigureResult:
    warmup, window, repeats = ctx.scale(8), ctx.scale(20), 3
    settings = load_settings("configs/cartpole.yaml", environ=OVERRIDES)

    say(f"{NAME}: in-process pipeline, {SAMPLERS} sampler threads -> queue.Queue -> Learner")
    mem = inproc_windows(settings, SAMPLERS, warmup, window, repeats)
    mem_rate = Spread.of(r for r, _ in mem)
    mem_busy = Spread.of(b for _, b in mem)

    say(f"{NAME}: local stack, {SAMPLERS} samplers")
    with stack(ctx, ctx.run_name(NAME), OVERRIDES) as st:
        up_s = st.up(SAMPLERS)
        st.wait_trained(1, timeout_s=60)
        time.sleep(warmup)
        c0 = st.counters()
        wins = measure_windows(st, window, repeats)
        c1 = st.counters()
        status = st.status()
    kafka_rate = Spread.of(w.trained_per_s for w in wins)
    kafka_busy = Spread.of(w.busy_fraction for w in wins)
    sampled = Spread.of(w.sampled_per_s for w in wins)
    bp = Spread.of(w.backpressure_fraction for w in wins)
    ratio = kafka_rate.median / mem_rate.median
    lag = status["staleness"]  # the trainer's last 1,000 trained fragments, versions behind at batch time
    consumed = c1["consumed"] - c0["consumed"]
    dropped_frac = (c1["dropped"] - c0["dropped"]) / consumed if consumed > 0 else float("nan")
    bound = settings.trainer.max_staleness

    details = "\n".join([
        "| | trained env-steps/s | learner busy fraction | notes |",
        "|---|---|---|---|",
        f"| Kafka pipeline (local stack) | {kafka_rate.fmt()} | {kafka_busy.fmt(2)} | sampled {sampled.fmt()} "
        f"env-steps/s; samplers held by flow control (credits) {bp.fmt(2)} of the time |",
        f"| in-memory (one process, threads) | {mem_rate.fmt()} | {mem_busy.fmt(2)} | "
        f"{SAMPLERS} sampler threads share the GIL with the learner |",
        "",
        f"Lag at training time (Kafka pipeline, the trainer's /status over its last 1,000 trained fragments, in "
        f"policy versions): mean {_num(lag['mean'], 2)}, p95 {_num(lag['p95'], 1)}, max {lag['max']} "
        f"(`trainer.max_staleness` {bound}); fragments dropped as stale over the windows: {dropped_frac:.3f} of "
        f"{consumed:.0f} consumed.",
        "",
        f"Ratio of medians: **{ratio:.2f}** (range over windows "
        f"{kafka_rate.lo / mem_rate.hi:.2f}-{kafka_rate.hi / mem_rate.lo:.2f}). Stack start-up took {up_s:.0f} s "
        "(not in the windows).",
        "",
        "Kafka pipeline, " + cpu_table(wins),
    ])
    return FigureResult(
        headline=[
            Row("Kafka / in-memory trained env-steps/s", f"{ratio:.2f}", ">= 0.9", ratio >= 0.9),
            Row("learner busy fraction, Kafka pipeline", kafka_busy.fmt(2), ">= 0.9", kafka_busy.median >= 0.9),
            Row("lag at training time (versions): mean / p95 / max; dropped as stale",
                f"{_num(lag['mean'], 2)} / {_num(lag['p95'], 1)} / {lag['max']}; {dropped_frac:.3f}",
                f"max <= {bound}", lag["max"] is not None and lag["max"] <= bound),
            Row("trained env-steps/s, Kafka pipeline", kafka_rate.fmt()),
            Row("trained env-steps/s, in-memory", mem_rate.fmt()),
        ],
        numbers={"ratio": ratio, "kafka_trained_per_s": kafka_rate, "inmem_trained_per_s": mem_rate,
                 "kafka_busy_fraction": kafka_busy, "inmem_busy_fraction": mem_busy,
                 "kafka_sampled_per_s": sampled, "kafka_backpressure_fraction": bp,
                 "staleness": status["staleness"], "dropped_fraction": dropped_frac, "stack_up_s": up_s,
                 "cpu_cores": [w.cpu for w in wins]},
        settings={"samplers": SAMPLERS, "warmup_s": warmup, "window_s": window, "windows": repeats,
                  **{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()}},
        method=(f"In-memory: {SAMPLERS} RolloutWorker threads put fragments on a queue.Queue bounded at the "
                "credit window (`trainer.flow_window`, default two batches); the Learner (calling thread) takes "
                "them through the trainer's own Intake (staleness checked when a batch is formed, the async "
                "batching strategy), trains on `batch_fragments` at a time and hands new weights (bytes) to the "
                "threads, which adopt them between fragments; torch 1 thread. Kafka: the local stack with the "
                f"same config. Both: {warmup:.0f} s warm-up after the first update, then {repeats} windows of "
                f"{window:.0f} s; rate = trained env steps / window (trainer counter "
                "`flywheel_trainer_env_steps_trained_total`). `trainer.target_kl` is off on both sides, so every "
                "update does the same work (all epochs) whatever its data."),
        details_md=details,
    )


def _num(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
