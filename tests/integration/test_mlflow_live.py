"""The trainer's MLflow writer against a real MLflow tracking server (``mlflow server``, SQLite store):
every update's scalars and the settings arrive; a server that is down never holds the trainer, and what
was written meanwhile arrives once it is up.

Needs the ``mlflow`` extra (the client) and a full ``mlflow`` installation for the server, which the
project does not install: set ``TEST_MLFLOW_SERVER`` to its ``mlflow`` executable (e.g. from
``python3.11 -m venv /tmp/mlflow-srv && /tmp/mlflow-srv/bin/pip install mlflow``), else this is skipped."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from services.trainer.tracking import Tracker  # noqa: E402

SERVER = os.environ.get("TEST_MLFLOW_SERVER") or shutil.which("mlflow-server") or ""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port, self.url = root, port, f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen([SERVER, "server", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                                      "--default-artifact-root", str(self.root / "artifacts")],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("mlflow server did not answer /health within 120 s")

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(30)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    if not SERVER or not Path(SERVER).exists():
        pytest.skip("no MLflow server executable: set TEST_MLFLOW_SERVER (see the module docstring)")
    srv = Server(tmp_path, _port())
    yield srv
    srv.stop()


def _history(url: str, run: str, key: str) -> list[tuple[int, float]]:
    c = MlflowClient(url)
    exp = c.get_experiment_by_name(run)
    assert exp is not None, f"no experiment {run}"
    (r,) = c.search_runs([exp.experiment_id])
    return sorted((m.step, m.value) for m in c.get_metric_history(r.info.run_id, key))


def test_scalars_and_settings_arrive(server: Server) -> None:
    server.start()
    t = Tracker(None, mlflow_uri=server.url, run="live-1", config={"trainer": {"gamma": 0.99}, "run": "live-1"})
    for step in (1, 2, 3):
        t.scalars(step, {"rollout/return_mean": 10.0 * step, "loss/policy": 0.5, "lag/mean_versions": math.nan})
    t.close()
    c = MlflowClient(server.url)
    exp = c.get_experiment_by_name("live-1")
    assert exp is not None
    (r,) = c.search_runs([exp.experiment_id])
    assert r.info.status == "FINISHED" and r.info.run_name == "live-1"
    assert r.data.params == {"trainer.gamma": "0.99", "run": "live-1"}
    assert _history(server.url, "live-1", "rollout/return_mean") == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert "lag/mean_versions" not in r.data.metrics  # not finite: left out


def test_a_server_that_is_down_never_holds_the_trainer_and_gets_the_steps_later(server: Server) -> None:
    t = Tracker(None, mlflow_uri=server.url, run="live-2")
    t0 = time.monotonic()
    for step in (1, 2, 3):
        t.scalars(step, {"rollout/return_mean": float(step)})
    held = time.monotonic() - t0
    assert held < 1.0, f"writing 3 steps to a server that is down held the caller {held:.1f} s"
    server.start()  # up later: the queued steps arrive, in order, with those written since
    t.scalars(4, {"rollout/return_mean": 4.0})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if len(_history(server.url, "live-2", "rollout/return_mean")) == 4:
                break
        except (AssertionError, ValueError):
            pass
        time.sleep(1)
    t.close()
    assert _history(server.url, "live-2", "rollout/return_mean") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
