"""What the trainer tells the world: Prometheus metrics, per-sampler lag, heartbeats, audit records.

Pure bookkeeping with explicit inputs: nothing here reads Kafka or steers training. The heartbeat is
built from a :class:`TrainerStats` and the parts' own state, and sent by the service's heartbeat task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from shared.service import RateMeter, percentile

CONSUMED = Counter("flywheel_trainer_fragments_consumed_total", "Records pulled from the samples topic")
TRAINED = Counter("flywheel_trainer_fragments_trained_total", "Fragments used in an update")
STEPS_TRAINED = Counter("flywheel_trainer_env_steps_trained_total", "Env steps used in updates")
DROPPED = Counter("flywheel_trainer_fragments_dropped_stale_total", "Fragments older than max_staleness")
DEAD = Counter("flywheel_trainer_fragments_dead_lettered_total", "Invalid records sent to the DLQ", ["reason"])
UPDATES = Counter("flywheel_trainer_updates_total", "Optimizer updates")
SAMPLE_PASSES = Counter("flywheel_trainer_sample_passes_total",
                        "Samples through a gradient step (sgd steps x minibatch size): the update work done")
BUSY = Counter("flywheel_trainer_busy_seconds_total", "Seconds spent in updates")
UPDATE_SECONDS = Histogram("flywheel_trainer_update_seconds", "Duration of one update",
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
STALENESS = Histogram("flywheel_trainer_fragment_staleness_versions", "Policy lag of trained fragments, at batch time",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
VERSION = Gauge("flywheel_trainer_policy_version", "Latest policy version the trainer sent")
RETURN_MEAN = Gauge("flywheel_trainer_episode_return_mean", "Mean return of the recent episodes")
COMMIT_FAILURES = Counter("flywheel_trainer_commit_failures_total",
                          "Offset commits that failed retriably (retried with the next commit)")
CHECKPOINTS = Counter("flywheel_trainer_checkpoints_total", "Checkpoints written")
RECORDS_LOST = Counter("flywheel_trainer_records_lost_total",
                       "Samples records that left the log (retention, deleteRecords) before the trainer read them")
NONFINITE = Counter("flywheel_trainer_nonfinite_steps_skipped_total",
                    "Gradient steps refused because the loss or gradient was not finite")
STALLED = Gauge("flywheel_trainer_stalled", "1 while records arrive but no update happens (see /status for why)")
RECOVERIES = Counter("flywheel_trainer_recovery_actions_total", "Automatic recovery actions", ["action"])
DEFERRED = Counter("flywheel_trainer_deferred_total", "Publishes or checkpoints deferred by a transient fault",
                   ["what"])
LEARNING_RATE = Gauge("flywheel_trainer_learning_rate",
                      "Learning rate of the last update (schedule and runtime settings)")
PUBLICATION_WAITS = Counter("flywheel_trainer_publication_waits_total",
                            "Loop passes that held a batch because the trainer was max_staleness versions ahead "
                            "of the published policy")
SAMPLER_LAG = Gauge("flywheel_trainer_sampler_staleness_versions",
                    "Per sampler: lag at training time of its last 200 trained fragments", ["sampler", "stat"])
SAMPLER_DROPPED = Gauge("flywheel_trainer_sampler_dropped_fraction",
                        "Per sampler: its fragments dropped as stale / (trained + dropped)", ["sampler"])
GRANTS = Counter("flywheel_trainer_credit_grants_total", "Flow-control grants sent to the samplers")
CREDIT_WINDOW = Gauge("flywheel_trainer_credit_window",
                      "Fragments each live sampler may have in flight (0: the samplers take turns)")
CREDITS_OUTSTANDING = Gauge("flywheel_trainer_credits_outstanding",
                            "Credits handed out in turns and not consumed yet (at most the flow window)")
AUTO_ROLLBACKS = Counter("flywheel_trainer_auto_rollbacks_total",
                         "Rollbacks the guard made by itself after a collapse", ["reason"])
GUARD_EXHAUSTED = Gauge("flywheel_trainer_guard_exhausted",
                        "1 while the rollback guard has used up its rollbacks for the hour (a human is needed)")

TORCH_THREADS = Gauge("flywheel_trainer_torch_threads", "Threads of the update's torch kernels (trainer.torch_threads)")
PRECISION = Gauge("flywheel_trainer_precision", "1 for the precision the update runs in (trainer.precision)",
                  ["precision"])
PROBE_RATE = Gauge("flywheel_trainer_precision_probe_env_steps_per_second",
                   "Env steps per second of one update epoch timed at start, per precision (trainer.precision auto on "
                   "a CPU with native bf16)", ["precision"])


def report_compute(c: Any) -> None:
    """The threads and precision the trainer chose (services/trainer/compute.py) as metrics."""
    TORCH_THREADS.set(c.threads)
    for p in ("fp32", "bf16"):
        PRECISION.labels(precision=p).set(1 if c.precision == p else 0)
        rate = c.fp32_samples_per_s if p == "fp32" else c.bf16_samples_per_s
        if rate is not None:
            PROBE_RATE.labels(precision=p).set(rate)


SAMPLER_LAG_FORGET_S = 600.0


@dataclasses.dataclass
class SamplerLag:
    trained: deque[int] = dataclasses.field(default_factory=lambda: deque(maxlen=200))
    trained_count: int = 0
    dropped: int = 0
    seen: float = 0.0


class SamplerLags:
    """Per sampler: staleness of its last trained fragments and its dropped fraction; samplers silent for
    ``forget_s`` are forgotten with their metric series (restarts add ids)."""

    def __init__(self, forget_s: float = SAMPLER_LAG_FORGET_S) -> None:
        self.forget_s = forget_s
        self.by_sampler: dict[str, SamplerLag] = {}

    def of(self, sampler_id: str, now: float) -> SamplerLag:
        lag = self.by_sampler.get(sampler_id)
        if lag is None:
            lag = self.by_sampler[sampler_id] = SamplerLag()
        lag.seen = now
        return lag

    def trained(self, sampler_id: str, staleness: int, now: float) -> None:
        lag = self.of(sampler_id, now)
        lag.trained.append(staleness)
        lag.trained_count += 1

    def dropped(self, sampler_id: str, now: float) -> None:
        self.of(sampler_id, now).dropped += 1

    def report(self, now: float) -> dict[str, dict[str, Any]]:
        for sid in [sid for sid, lag in self.by_sampler.items() if now - lag.seen > self.forget_s]:
            del self.by_sampler[sid]
            for stat in ("mean", "p95", "max"):
                with contextlib.suppress(KeyError):
                    SAMPLER_LAG.remove(sid, stat)
            with contextlib.suppress(KeyError):
                SAMPLER_DROPPED.remove(sid)
        out = {}
        for sid, lag in sorted(self.by_sampler.items()):
            st = list(lag.trained)
            total = lag.dropped + lag.trained_count
            out[sid] = {"mean": round(sum(st) / len(st), 3) if st else None,
                        "p95": percentile(st, 0.95) if st else None, "max": max(st) if st else None,
                        "dropped": lag.dropped,
                        "dropped_fraction": round(lag.dropped / total, 4) if total else None}
            if st:
                SAMPLER_LAG.labels(sid, "mean").set(sum(st) / len(st))
                SAMPLER_LAG.labels(sid, "p95").set(percentile(st, 0.95) or 0.0)
                SAMPLER_LAG.labels(sid, "max").set(max(st))
            if total:
                SAMPLER_DROPPED.labels(sid).set(lag.dropped / total)
        return out


class BusyMeter:
    """The fraction of wall time spent in updates over the last ``window_s`` (how often the learner waits: 1.0
    means it never does)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self._spans: deque[tuple[float, float]] = deque()  # (end, seconds), oldest first

    def add(self, seconds: float, now: float | None = None) -> None:
        self._spans.append((time.monotonic() if now is None else now, seconds))

    def fraction(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        while self._spans and self._spans[0][0] < now - self.window_s:
            self._spans.popleft()
        span = min(self.window_s, now - self.started)
        if span <= 0:
            return None
        lo = now - span
        busy = sum(min(sec, end - lo) for end, sec in self._spans)  # an update that began before the window: its part
        return round(min(1.0, busy / span), 4)


@dataclasses.dataclass
class TrainerStats:
    """This process's counts (the checkpointed ones live in ``LearnerCounters``)."""

    started_at: float = dataclasses.field(default_factory=time.time)
    staleness: deque[int] = dataclasses.field(default_factory=lambda: deque(maxlen=1000))
    lags: SamplerLags = dataclasses.field(default_factory=SamplerLags)
    rate: RateMeter = dataclasses.field(default_factory=RateMeter)
    dropped: int = 0
    trained_run: int = 0  # fragments trained by this process (the dropped fraction's denominator)
    dead_lettered: int = 0
    nonfinite_skipped: int = 0
    last_update_at: float | None = None
    config_revision: int = 0
    busy: BusyMeter = dataclasses.field(default_factory=lambda: BusyMeter())

    def staleness_summary(self) -> dict[str, Any]:
        st = list(self.staleness)
        return {"staleness_mean": sum(st) / len(st) if st else None, "staleness_max": max(st) if st else None,
                "staleness_p95": percentile(st, 0.95) if st else None}

    def dropped_fraction(self) -> float | None:
        total = self.dropped + self.trained_run
        return round(self.dropped / total, 4) if total else None
