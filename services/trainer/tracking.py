"""Training curves: one scalar writer for TensorBoard and, optionally, MLflow.

The trainer calls :meth:`Tracker.scalars` once per update with the keys of :func:`update_scalars`
(``rollout/return_mean``, ``loss/policy``, ``policy/approx_kl``, ...) and :meth:`Tracker.close` at
shutdown. TensorBoard event files go to ``tracking.tensorboard_dir`` (default
``<FLYWHEEL_HOME or .flywheel>/tb/<run>``; ``tensorboard --logdir`` that directory's parent to compare
runs); MLflow gets the same scalars when ``tracking.mlflow_uri`` is set.

Invariants: a disabled tracker imports nothing and writes nothing; a failing backend (disk full, the MLflow
server down) never raises into the trainer: the failure is logged (the first, then every
``FAILURE_LOG_EVERY``-th) and the next call tries again. MLflow is written from a thread of its own, so a
slow or unreachable server never blocks the trainer either: its steps queue (bounded) and are sent once it
answers. Curves are for people; training goes on without them.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from shared.logging import get_logger
from shared.settings import Settings

FAILURE_LOG_EVERY = 100
"""A backend that keeps failing is logged at its first failure and then once every this many."""
MLFLOW_QUEUE_STEPS = 10_000
"""Updates' scalars kept for an MLflow server that cannot be reached (the oldest dropped beyond)."""
MLFLOW_RETRY_MIN_S, MLFLOW_RETRY_MAX_S = 1.0, 60.0
MLFLOW_BATCH_METRICS = 1000
"""MLflow's limit of metrics per ``log_batch`` request."""


class _Backend(Protocol):
    name: str

    def write(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    """``torch.utils.tensorboard.SummaryWriter``: one event file per trainer process in ``log_dir``."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, config: Mapping[str, Any] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)
        if config is not None:
            import json

            self._writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", 0)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _MLflow:
    """An MLflow run named after the Flywheel run, in the experiment of the same name, written by a thread of
    its own: :meth:`write` only queues, so a slow or unreachable server never holds the trainer (MLflow's
    client retries a request for minutes). The server is first contacted by that thread; while it cannot be
    reached the steps wait in a bounded queue (the oldest dropped past ``MLFLOW_QUEUE_STEPS``, counted) and
    are sent, in order, once it answers."""

    name = "mlflow"

    def __init__(self, uri: str, run: str, config: Mapping[str, Any] | None) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError("tracking.mlflow_uri is set but mlflow is not installed "
                               "(pip install -e '.[mlflow]', or unset tracking.mlflow_uri)") from None
        # A request to a server that is down is retried by MLflow with backoff for ~4 minutes by default; the
        # writer thread retries on its own schedule, so each attempt may fail fast (an operator's own
        # settings of these win).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self._client: Any = MlflowClient(tracking_uri=uri)
        self._run_name = run
        self._run_id: str | None = None
        self._params = [Param(k, v) for k, v in _flatten(config)] if config is not None else []  # not yet sent
        self._pending: collections.deque[tuple[int, int, int, dict[str, float]]] = collections.deque()  # seq, step, ms
        self._seq = 0
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._log = get_logger(component="tracking")
        self._thread = threading.Thread(target=self._loop, name="mlflow-writer", daemon=True)
        self._thread.start()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        with self._cond:
            if len(self._pending) >= MLFLOW_QUEUE_STEPS:
                self._pending.popleft()
                self.dropped += 1
            self._seq += 1
            self._pending.append((self._seq, step, int(time.time() * 1000), dict(values)))
            self._cond.notify()

    def _send(self, batch: list[tuple[int, int, int, dict[str, float]]]) -> None:
        """The run first (once: a failure after it is made retries only what is left), then the settings,
        then ``batch``'s scalars in requests of whole steps, each step leaving the queue once its request
        succeeded: a failure part-way resends only the steps not yet sent (MLflow would keep a point twice)."""
        from mlflow.entities import Metric

        c = self._client
        if self._run_id is None:
            exp = c.get_experiment_by_name(self._run_name)
            exp_id = exp.experiment_id if exp is not None else c.create_experiment(self._run_name)
            self._run_id = c.create_run(exp_id, run_name=self._run_name).info.run_id
        while self._params:
            c.log_batch(self._run_id, params=self._params[:100])  # MLflow's limit per batch
            del self._params[:100]
        chunk: list[Any] = []
        through = 0
        for seq, step, ts, values in batch:
            metrics = [Metric(k, v, ts, step) for k, v in values.items()]
            if chunk and len(chunk) + len(metrics) > MLFLOW_BATCH_METRICS:
                self._log_metrics(chunk, through)
                chunk = []
            chunk.extend(metrics)
            through = seq
        if chunk:
            self._log_metrics(chunk, through)

    def _log_metrics(self, metrics: list[Any], through_seq: int) -> None:
        """Send ``metrics`` (one step of more than MLflow's limit goes in several requests), then take the
        steps up to ``through_seq`` off the queue."""
        for i in range(0, len(metrics), MLFLOW_BATCH_METRICS):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + MLFLOW_BATCH_METRICS])
        with self._cond:
            while self._pending and self._pending[0][0] <= through_seq:  # (drops may have taken some first)
                self._pending.popleft()

    def _loop(self) -> None:
        backoff = MLFLOW_RETRY_MIN_S
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                batch = list(self._pending)
            try:
                self._send(batch)
            except Exception as exc:  # the server is down or refused: keep the steps, try again later
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if self.failures == 1 or self.failures % FAILURE_LOG_EVERY == 0:
                    self._log.warning("tracking_write_failed", backend=self.name, failures=self.failures,
                                      queued=len(batch), dropped=self.dropped, retry_in_s=backoff,
                                      error=self.last_error)
                with self._cond:
                    if self._closing:
                        return
                    self._cond.wait(backoff)
                backoff = min(MLFLOW_RETRY_MAX_S, backoff * 2)
                continue
            if self.failures and backoff > MLFLOW_RETRY_MIN_S:
                self._log.info("tracking_recovered", backend=self.name, sent_steps=len(batch), dropped=self.dropped)
            backoff = MLFLOW_RETRY_MIN_S

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (up to ``timeout_s``), then end the run."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive() or self._pending:  # the server did not answer in time: leave the run open
            self._log.warning("tracking_not_flushed", backend=self.name, queued=len(self._pending),
                              error=self.last_error)
        elif self._run_id is not None:
            self._client.set_terminated(self._run_id)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """``{"trainer": {"gamma": 0.99}}`` -> ``[("trainer.gamma", "0.99")]`` (MLflow params are flat strings)."""
    out: list[tuple[str, str]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_flatten(value, name + "."))
        else:
            out.append((name, str(value)[:500]))
    return out


class Tracker:
    """Writes named scalars per step to every enabled backend (none: every call is a no-op).

    Keys are ``group/name`` (TensorBoard groups them in panels); values that are not finite are left
    out (TensorBoard would draw them as gaps anyway, MLflow refuses them)."""

    def __init__(self, tensorboard_dir: Path | None = None, *, mlflow_uri: str | None = None, run: str = "default",
                 config: Mapping[str, Any] | None = None) -> None:
        """``tensorboard_dir`` None: no TensorBoard; ``mlflow_uri`` None: no MLflow. ``config`` (the redacted
        settings) is written once: TensorBoard text ``config``, MLflow params. Raises ``RuntimeError`` when
        MLflow is asked for but not installed (a config error, reported at start-up)."""
        self._log = get_logger(component="tracking")
        self._failures: dict[str, int] = {}
        self._backends: list[_Backend] = []
        if tensorboard_dir is not None:
            self._backends.append(_TensorBoard(tensorboard_dir, config))
        if mlflow_uri is not None:
            self._backends.append(_MLflow(mlflow_uri, run, config))
        self.tensorboard_dir = tensorboard_dir

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] | None = None) -> Tracker:
        """The tracker ``settings.tracking`` asks for; ``environ`` (default ``os.environ``) gives ``FLYWHEEL_HOME``."""
        t = settings.tracking
        environ = os.environ if environ is None else environ
        tb = t.log_dir(settings.run, environ.get("FLYWHEEL_HOME")) if t.tensorboard else None
        return cls(tb, mlflow_uri=t.mlflow_uri, run=settings.run, config=settings.redacted())

    @property
    def enabled(self) -> bool:
        return bool(self._backends)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Record ``values`` at ``step`` (the update number); None and non-finite values are skipped."""
        if not self._backends:
            return
        clean = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if not clean:
            return
        for backend in self._backends:
            try:
                backend.write(step, clean)
            except Exception as exc:  # never into the trainer: the curves are not the training
                self._failed(backend.name, step, exc)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        backends, self._backends = self._backends, []
        for backend in backends:
            try:
                backend.close()
            except Exception as exc:
                self._failed(backend.name, None, exc)

    def _failed(self, name: str, step: int | None, exc: Exception) -> None:
        n = self._failures[name] = self._failures.get(name, 0) + 1
        if n == 1 or n % FAILURE_LOG_EVERY == 0:
            self._log.warning("tracking_write_failed", backend=name, step=step, failures=n,
                              error=f"{type(exc).__name__}: {exc}"[:300])


def update_scalars(*, return_mean: float | None, length_mean: float | None, policy_loss: float,
                   value_loss: float, entropy: float, approx_kl: float, clip_fraction: float,
                   explained_variance: float | None, lag_mean: float | None, lag_max: float | None,
                   env_steps_per_s: float | None, env_steps: int, learning_rate: float) -> dict[str, float | None]:
    """The scalars of one update under their TensorBoard names (one place for the names; None: not known yet,
    skipped by :meth:`Tracker.scalars`). ``return_mean``/``length_mean`` are over the last
    ``trainer.return_window`` episodes, ``lag_*`` over the update's fragments (versions behind), ``env_steps``
    is the total trained so far (a second x-axis)."""
    return {
        "rollout/return_mean": return_mean,
        "rollout/length_mean": length_mean,
        "loss/policy": policy_loss,
        "loss/value": value_loss,
        "policy/entropy": entropy,
        "policy/approx_kl": approx_kl,
        "policy/clip_fraction": clip_fraction,
        "value/explained_variance": explained_variance,
        "lag/mean_versions": lag_mean,
        "lag/max_versions": lag_max,
        "throughput/env_steps_per_s": env_steps_per_s,
        "progress/env_steps": float(env_steps),
        "optim/learning_rate": learning_rate,
    }
