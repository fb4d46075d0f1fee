"""The trainer's scalar writer: what it writes TensorBoard reads back; switched off it writes nothing; a failing
backend never raises into the trainer; the settings section resolves the default directory."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.trainer.tracking import Tracker, update_scalars
from shared.settings import ConfigError, Settings, TrackingSettings, load_settings


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_read_back_by_tensorboard(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "tb" / "run1", run="run1", config={"trainer": {"gamma": 0.99}})
    assert tracker.enabled
    for step in (1, 2, 3):
        tracker.scalars(step, {"loss/policy": 0.5 * step, "rollout/return_mean": 10.0 * step})
    tracker.scalars(4, {"loss/policy": float("nan"), "rollout/return_mean": None, "policy/entropy": 0.25})
    tracker.close()
    tracker.close()  # idempotent
    got = read_scalars(tmp_path / "tb" / "run1")
    assert got["loss/policy"] == [(1, 0.5), (2, 1.0), (3, 1.5)]  # the NaN at step 4 is left out
    assert got["rollout/return_mean"] == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert got["policy/entropy"] == [(4, 0.25)]


def test_disabled_tracker_writes_nothing(tmp_path: Path) -> None:
    settings = Settings.model_validate({"run": "quiet", "tracking": {"tensorboard": False}})
    tracker = Tracker.from_settings(settings, environ={"FLYWHEEL_HOME": str(tmp_path)})
    assert not tracker.enabled and tracker.tensorboard_dir is None
    tracker.scalars(1, {"loss/policy": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_default_directory_is_home_tb_run(tmp_path: Path) -> None:
    settings = Settings.model_validate({"run": "cartpole-7"})
    assert settings.tracking.tensorboard and settings.tracking.mlflow_uri is None
    tracker = Tracker.from_settings(settings, environ={"FLYWHEEL_HOME": str(tmp_path)})
    assert tracker.tensorboard_dir == tmp_path / "tb" / "cartpole-7"
    tracker.scalars(7, {"lag/mean_versions": 2.0})
    tracker.close()
    assert read_scalars(tmp_path / "tb" / "cartpole-7") == {"lag/mean_versions": [(7, 2.0)]}
    assert TrackingSettings().log_dir("r", None) == Path(".flywheel/tb/r")
    assert TrackingSettings(tensorboard_dir=tmp_path / "x").log_dir("r", "/elsewhere") == tmp_path / "x"


def test_tracking_settings_from_environment(tmp_path: Path) -> None:
    s = load_settings(environ={"FLYWHEEL_TRACKING_TENSORBOARD": "false",
                               "FLYWHEEL_TRACKING_TENSORBOARD_DIR": str(tmp_path),
                               "FLYWHEEL_TRACKING_MLFLOW_URI": "file:./mlruns"})
    assert s.tracking == TrackingSettings(tensorboard=False, tensorboard_dir=tmp_path, mlflow_uri="file:./mlruns")
    assert load_settings(environ={"FLYWHEEL_TRACKING_MLFLOW_URI": "none"}).tracking.mlflow_uri is None
    with pytest.raises(ConfigError, match="tracking.nope"):
        load_settings(environ={"FLYWHEEL_TRACKING_NOPE": "1"})


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self.calls += 1
        raise OSError("No space left on device")

    def close(self) -> None:
        raise OSError("still no space")


def test_a_failing_backend_never_raises(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "tb")
    broken = _Broken()
    tracker._backends.insert(0, broken)  # an in-memory twin of a full disk / an MLflow server that is down
    for step in range(3):
        tracker.scalars(step, {"loss/value": 1.0})
    tracker.close()
    assert broken.calls == 3  # tried again every time
    assert read_scalars(tmp_path / "tb") == {"loss/value": [(0, 1.0), (1, 1.0), (2, 1.0)]}  # the other still wrote


def test_mlflow_without_the_package_is_a_clear_error(tmp_path: Path) -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("mlflow is installed")
    with pytest.raises(RuntimeError, match=r"mlflow is not installed .*\[mlflow\]"):
        Tracker(None, mlflow_uri="file:./mlruns")


def test_update_scalars_names_every_curve() -> None:
    values = update_scalars(return_mean=400.0, length_mean=400.0, policy_loss=-0.01, value_loss=3.0, entropy=0.6,
                            approx_kl=0.01, clip_fraction=0.1, explained_variance=None, lag_mean=2.1, lag_max=5,
                            env_steps_per_s=3000.0, env_steps=70_000, learning_rate=2.5e-4)
    assert {k.split("/")[0] for k in values} == {"rollout", "loss", "policy", "value", "lag", "throughput", "progress",
                                                 "optim"}
    assert values["value/explained_variance"] is None and values["progress/env_steps"] == 70_000.0
    assert all(v is None or math.isfinite(v) for v in values.values())


class _FakeMlflowClient:
    """An in-memory twin of the few ``MlflowClient`` calls the writer makes; its second metrics request fails once
    (a server that went away part-way through a batch)."""

    def __init__(self) -> None:
        self.points: list[tuple[str, int]] = []
        self.metric_requests = 0

    def get_experiment_by_name(self, name: str) -> None:
        return None

    def create_experiment(self, name: str) -> str:
        return "1"

    def create_run(self, experiment_id: str, run_name: str) -> Any:
        return SimpleNamespace(info=SimpleNamespace(run_id="r1"))

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
        if metrics:
            self.metric_requests += 1
            if self.metric_requests == 2:
                raise ConnectionError("server went away")
            self.points += [(m.key, m.step) for m in metrics]

    def set_terminated(self, run_id: str) -> None:
        pass


def test_mlflow_resends_only_the_steps_a_failed_request_did_not_deliver() -> None:
    pytest.importorskip("mlflow")
    from services.trainer.tracking import MLFLOW_BATCH_METRICS, _MLflow

    writer = _MLflow("http://127.0.0.1:9", "run", None)
    client = writer._client = _FakeMlflowClient()  # before the first write: the thread has not called it yet
    wide = {f"m{i}": 1.0 for i in range(MLFLOW_BATCH_METRICS * 6 // 10)}  # two steps do not fit one request
    for step in range(3):
        writer.write(step, wide)
    deadline = time.monotonic() + 30
    while writer._pending and time.monotonic() < deadline:
        time.sleep(0.05)
    writer.close()
    assert writer.failures == 1 and not writer._pending
    assert sorted(client.points) == sorted((k, step) for step in range(3) for k in wide)  # each point once
