"""Training curves: one scalar writer for TensorBoard and, optionally, MLflow.

The trainer calls :meth:`Tracker.scalars` once per update with the keys of :func:`update_scalars`
(``rollout/return_mean``, ``loss/policy``, ``policy/approx_kl``, ...) and :meth:`Tracker.close` at
shutdown. TensorBoard event files go to ``tracking.tensorboard_dir`` (default
``<FLYWHEEL_HOME or .flywheel>/tb/<run>``; ``tensorboard --logdir`` that directory's parent to compare
runs); MLflow gets the same scalars when ``tracking.mlflow_uri`` is set.

Invariants: a disabled tracker imports nothing and writes nothing; a failing backend (disk full, the MLflow
server down) never raises into the trainer: the failure is logged (the first, then every
``FAILURE_LOG_EVERY``-th) and the next call tries again. Curves are for people; training goes on without them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from shared.logging import get_logger
from shared.settings import Settings

FAILURE_LOG_EVERY = 100
"""A backend that keeps failing is logged at its first failure and then once every this many."""


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
    """An MLflow run named after the Flywheel run, in the experiment of the same name. The server is first
    contacted at the first write (and again at the next one while it cannot be reached), so an MLflow
    outage at start-up does not stop the trainer."""

    name = "mlflow"

    def __init__(self, uri: str, run: str, config: Mapping[str, Any] | None) -> None:
        try:
            import mlflow
        except ImportError:
            raise RuntimeError("tracking.mlflow_uri is set but mlflow is not installed "
                               "(pip install -e '.[mlflow]', or unset tracking.mlflow_uri)") from None
        self._mlflow: Any = mlflow
        self._uri, self._run_name, self._config = uri, run, config
        self._started = False

    def _start(self) -> None:
        mlflow = self._mlflow
        mlflow.set_tracking_uri(self._uri)
        mlflow.set_experiment(self._run_name)
        mlflow.start_run(run_name=self._run_name)
        self._started = True
        if self._config is not None:
            mlflow.log_params(dict(_flatten(self._config)))

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if not self._started:
            self._start()
        self._mlflow.log_metrics(dict(values), step=step)

    def close(self) -> None:
        if self._started:
            self._mlflow.end_run()


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
