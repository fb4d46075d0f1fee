"""The same sampler and trainer code (RolloutWorker + Learner) joined in one process by a
``queue.Queue``: the yardstick the Kafka pipeline is divided by, and the bare loops of
``service_efficiency``.

The in-memory pipeline uses the trainer's own batcher (services/trainer/intake.py): the same admission
(future versions, duplicate ids), the staleness bound checked when a batch is formed, and the batching
strategy of ``settings.mode``. Sampler threads adopt the newest policy between fragments and put
fragments on a bounded queue (the flow control: ``trainer.flow_window`` fragments, as the credits
allow the Kafka pipeline); a new version is published every ``trainer.publish_every`` updates (weights
serialised to bytes, as the trainer does), and in-memory publication is immediate.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from aiokafka import TopicPartition

from services.sampler.rollout import RolloutWorker
from services.trainer.compute import choose_threads
from services.trainer.intake import Intake, Pending, strategy_for
from services.trainer.learner import Learner
from shared.credits import auto_window
from shared.fragment import Fragment
from shared.rl.envs import fragment_spec
from shared.settings import Settings

_TP = TopicPartition("inproc.samples", 0)


@dataclass
class _PolicyBox:
    version: int
    weights: bytes
    lock: threading.Lock


def _worker(settings: Settings, i: int, seed: int) -> RolloutWorker:
    return RolloutWorker.from_settings(settings, f"inproc-{i}", seed)


class InProcessPipeline:
    """``samplers`` sampler threads -> queue.Queue -> the Learner in the calling thread."""

    def __init__(self, settings: Settings, samplers: int = 2, seed: int = 0) -> None:
        torch.set_num_threads(choose_threads(settings.trainer)[0])
        self.s = settings
        self.learner = Learner(fragment_spec(settings.env.id, settings.kafka.max_message_bytes), settings.trainer)
        self.box = _PolicyBox(0, self.learner.weights(), threading.Lock())
        self.q: queue.Queue[Fragment] = queue.Queue(maxsize=auto_window(settings))
        t = settings.trainer
        self.intake = Intake(max_staleness=t.max_staleness, batch_timeout_s=t.batch_timeout_s,
                             strategy=strategy_for(settings.mode, t.batch_fragments, t.poll_max_records))
        self.staleness: list[int] = []  # lag of every trained fragment, at batch time
        self._offset = 0
        self.workers = [_worker(settings, i, seed + i) for i in range(samplers)]
        self.stop_event = threading.Event()
        self.trained = 0
        self.dropped = 0
        self.busy_s = 0.0
        self._threads = [threading.Thread(target=self._sample, args=(w,), daemon=True) for w in self.workers]

    def _sample(self, w: RolloutWorker) -> None:
        while not self.stop_event.is_set():
            with self.box.lock:
                version, weights = self.box.version, self.box.weights
            if w.policy_version != version:
                w.set_policy(version, weights)
            frag = w.collect()
            while not self.stop_event.is_set():
                try:
                    self.q.put(frag, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def run_for(self, seconds: float) -> None:
        """Train for ``seconds`` (in the calling thread)."""
        cfg = self.s.trainer
        end = time.monotonic() + seconds
        c = self.learner.counters
        live = {w.sampler_id for w in self.workers}
        while time.monotonic() < end:
            for _ in range(self.intake.wants()):
                try:
                    frag = self.q.get(timeout=0.1)
                except queue.Empty:
                    break
                self.learner.record_returns(frag)
                self._offset += 1
                rejected = self.intake.admit(Pending(_TP, self._offset, frag, time.monotonic()))
                if rejected is not None:
                    raise RuntimeError(f"in-memory pipeline: {rejected.message}")  # cannot happen here
            batch = self.intake.form_batch(time.monotonic(), live)
            self.dropped += len(batch.stale)
            if not batch.train:
                continue
            t0 = time.perf_counter()
            stats = self.learner.update([p.frag for p in batch.train])
            self.busy_s += time.perf_counter() - t0
            self.trained += stats.env_steps
            self.staleness.extend(batch.staleness)
            if c.updates % cfg.publish_every == 0:
                weights = self.learner.weights()
                with self.box.lock:
                    self.box.version, self.box.weights = c.policy_version + 1, weights
                c.policy_version += 1
                self.intake.model_version = c.policy_version
                self.intake.saw_published(c.policy_version)

    def close(self) -> None:
        self.stop_event.set()
        for t in self._threads:
            t.join(timeout=10)
        for w in self.workers:
            w.close()


def inproc_windows(settings: Settings, samplers: int, warmup_s: float, window_s: float,
                   repeats: int) -> list[tuple[float, float]]:
    """(trained env steps/s, learner busy fraction) for each window after a warm-up."""
    pipe = InProcessPipeline(settings, samplers)
    pipe.start()
    try:
        pipe.run_for(warmup_s)
        out = []
        for _ in range(repeats):
            steps0, busy0, t0 = pipe.trained, pipe.busy_s, time.monotonic()
            pipe.run_for(window_s)
            dt = time.monotonic() - t0
            out.append(((pipe.trained - steps0) / dt, (pipe.busy_s - busy0) / dt))
        return out
    finally:
        pipe.close()


def bare_rollout_rate(settings: Settings, seconds: float, warmup_s: float = 2.0) -> float:
    """Env steps/s of one RolloutWorker stepped in a bare loop (policy loaded once, never changed)."""
    learner = Learner(fragment_spec(settings.env.id, settings.kafka.max_message_bytes), settings.trainer)
    w = _worker(settings, 0, 0)
    w.set_policy(0, learner.weights())
    try:
        end = time.monotonic() + warmup_s
        while time.monotonic() < end:
            w.collect()
        steps, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            steps += w.collect().steps
        return steps / (time.monotonic() - t0)
    finally:
        w.close()


def bare_learner_rate(settings: Settings, seconds: float, warmup_s: float = 2.0) -> tuple[float, float]:
    """Env steps trained/s and sample passes/s (samples through a gradient step) of Learner.update in a
    bare loop on batches of ``batch_fragments`` fragments (collected beforehand with the initial policy,
    reused round robin). With ``target_kl`` an update's work depends on the data, so sample passes are
    the comparable measure."""
    torch.set_num_threads(choose_threads(settings.trainer)[0])
    learner = Learner(fragment_spec(settings.env.id, settings.kafka.max_message_bytes), settings.trainer)
    w = _worker(settings, 0, 0)
    w.set_policy(0, learner.weights())
    frags = [w.collect() for _ in range(16)]
    w.close()
    b = settings.trainer.batch_fragments
    k = 0

    def step() -> tuple[int, int]:
        nonlocal k
        batch = [frags[(k + j) % len(frags)] for j in range(b)]
        k += b
        stats = learner.update(batch)
        return stats.env_steps, stats.sample_passes

    end = time.monotonic() + warmup_s
    while time.monotonic() < end:
        step()
    steps, passes, t0 = 0, 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        s, p = step()
        steps, passes = steps + s, passes + p
    dt = time.monotonic() - t0
    return steps / dt, passes / dt


def lockstep(settings: Settings, seed: int, samplers: int = 2,
             lag: int = 0) -> Generator[tuple[float, int, list[float]], None, None]:
    """The same RolloutWorkers + Learner in one loop, no queue: collect ``batch_fragments`` fragments
    (round robin over ``samplers`` workers) acting with the policy of ``lag`` updates ago (0: the
    current one, zero staleness), yield (seconds so far, env steps so far, the returns of the episodes
    that ended in them), update, repeat. The caller stops iterating when it has what it wants."""
    torch.set_num_threads(choose_threads(settings.trainer)[0])
    learner = Learner(fragment_spec(settings.env.id, settings.kafka.max_message_bytes), settings.trainer)
    workers = [_worker(settings, i, seed * 1000 + i) for i in range(samplers)]
    blobs = deque([learner.weights()], maxlen=lag + 1)  # blobs[0]: the version ``lag`` updates ago (or 0)
    version, steps, k = 0, 0, 0
    t0 = time.monotonic()
    try:
        while True:
            behaviour = max(0, version - lag)
            for w in workers:
                if w.policy_version != behaviour:
                    w.set_policy(behaviour, blobs[0])
            frags = []
            for _ in range(settings.trainer.batch_fragments):
                frags.append(workers[k % samplers].collect())
                k += 1
            steps += sum(f.steps for f in frags)
            yield time.monotonic() - t0, steps, [float(r) for f in frags for r in f.episode_returns]
            learner.update(frags)
            version += 1
            blobs.append(learner.weights())
    finally:
        for w in workers:
            w.close()


Curve = list[tuple[float, int, float]]
"""(seconds so far, env steps so far, return) of every episode, in the order they ended."""


def lockstep_curve(settings: Settings, seed: int, samplers: int, lag: int,
                   done: Callable[[Curve, int], bool]) -> Curve:
    """:func:`lockstep` into an episode curve until ``done(curve, env steps so far)``."""
    curve: Curve = []
    loop = lockstep(settings, seed, samplers, lag)
    try:
        for seconds, steps, returns in loop:
            curve.extend((seconds, steps, r) for r in returns)
            if done(curve, steps):
                break
    finally:
        loop.close()
    return curve


T = TypeVar("T")


def bench_jobs() -> int:
    """Independent in-process runs at once: ``FLYWHEEL_BENCH_JOBS``, else one per core. Each run uses
    ``trainer.torch_threads`` (1) thread, and these figures measure return against env steps, which
    does not depend on how many run beside it (their wall times do, and are not reported as figures)."""
    return max(1, int(os.environ.get("FLYWHEEL_BENCH_JOBS", os.cpu_count() or 1)))


def parallel_map(fn: Callable[..., T], calls: Iterable[tuple[Any, ...]], jobs: int | None = None) -> list[T]:
    """``[fn(*args) for args in calls]`` in up to ``jobs`` worker processes (spawned, so no forked torch
    state), results in the order of ``calls``. ``fn`` must be a module-level function."""
    calls = list(calls)
    jobs = min(jobs or bench_jobs(), len(calls))
    if jobs <= 1:
        return [fn(*args) for args in calls]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:  # fail now, not after every queued run
                pool.shutdown(wait=False, cancel_futures=True)
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def sequential_solve(settings: Settings, seed: int, samplers: int = 2, max_s: float = 60.0,
                     threshold: float = 475.0) -> dict[str, float | None]:
    """:func:`lockstep` at zero staleness until the last-20 / last-100 mean return reaches ``threshold``:
    wall seconds and env steps of each (None when not within ``max_s``)."""
    returns: list[float] = []
    out: dict[str, float | None] = {"last20_s": None, "last20_steps": None, "last100_s": None, "last100_steps": None}
    loop = lockstep(settings, seed, samplers)
    try:
        for seconds, steps, batch_returns in loop:
            for r in batch_returns:
                returns.append(r)
                for n in (20, 100):
                    if out[f"last{n}_s"] is None and len(returns) >= n and sum(returns[-n:]) / n >= threshold:
                        out[f"last{n}_s"], out[f"last{n}_steps"] = seconds, steps
            if out["last100_s"] is not None or seconds >= max_s:
                break
    finally:
        loop.close()
    return out
