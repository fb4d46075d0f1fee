"""The local stack's supervisor against real services: a service killed with SIGKILL comes back and is
counted; a held one stays down until it is released; a stopped one is not taken for dead.

One stack without samplers (trainer, paramsync, admin) on the test Kafka + S3, shared by the tests of
this module; ports apart from the other stacks of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from devstack import REPO_ROOT, InfraEndpoints, LocalStack
from tests.conftest import S3Endpoint

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.e2e, pytest.mark.timeout(240)]

ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT = 18460, 18461, 18462, 18463
TOKEN = "test-token-of-at-least-32-characters"


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, s3_endpoint: S3Endpoint, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LocalStack]:
    infra = InfraEndpoints(kafka_bootstrap=kafka_bootstrap, s3_endpoint=s3_endpoint.endpoint_url,
                           bucket=s3_endpoint.bucket, access_key=s3_endpoint.access_key,
                           secret_key=s3_endpoint.secret_key, region=s3_endpoint.region)
    st = LocalStack(tmp_path_factory.mktemp("supervised"), run=f"t-supervisor-{uuid.uuid4().hex[:8]}", infra=infra,
                    env={"FLYWHEEL_ADMIN_TOKEN": TOKEN}, admin_port=ADMIN_PORT, trainer_port=TRAINER_PORT,
                    paramsync_port=PARAMSYNC_PORT, sampler_base_port=SAMPLER_BASE_PORT, store_backend="s3")
    try:
        st.up(samplers=0, timeout_s=150, prometheus=False)
        assert st.supervisor_pid() is not None
        yield st
    finally:
        st.down(infra=False)
    assert st.supervisor_pid() is None


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if last := check():
            return last
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout_s:.0f} s")


def _restarted_events(stack: LocalStack, process: str) -> list[dict[str, Any]]:
    lines = (stack.home / "logs" / "supervisor.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in events if e["event"] == "restarted" and e["process"] == process]


def _cli(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devstack", *args, "--home", str(stack.home)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_a_killed_service_is_restarted_and_counted(stack: LocalStack) -> None:
    before = stack.pids()
    stack.kill("admin")  # SIGKILL
    pid = _wait_for("restarted admin", lambda: stack.pid("admin") not in (None, before["admin"]), 30)
    assert pid
    stack.wait_healthy("admin", timeout_s=60)
    assert stack.restarts()["admin"] == 1
    after = stack.pids()
    assert after["admin"] != before["admin"]
    assert {k: v for k, v in after.items() if k != "admin"} == {k: v for k, v in before.items() if k != "admin"}
    status = {st.name: st for st in stack.status(infra=False)}
    assert status["admin"].alive and status["admin"].restarts == 1 and status["trainer"].restarts == 0

    [event] = _restarted_events(stack, "admin")
    assert event["attempt"] == 1 and 1.0 <= event["delay_s"] <= 2.0, event
    assert event["pid"] == after["admin"] and str(before["admin"]) in event["exit"], event

    out = _cli(stack, "status")
    admin_line = next(line for line in out.stdout.splitlines() if line.strip().startswith("admin "))
    assert "alive" in admin_line and "restarts 1" in admin_line, out.stdout


def test_a_held_service_stays_down_until_released(stack: LocalStack) -> None:
    restarts = stack.restarts().get("paramsync", 0)
    held = _cli(stack, "hold", "paramsync")
    assert held.returncode == 0, held.stderr
    stack.kill("paramsync")
    time.sleep(5)  # longer than any first backoff (<= 2 s) plus a few supervisor ticks
    assert stack.pid("paramsync") is None
    assert stack.restarts().get("paramsync", 0) == restarts
    assert {st.name: st for st in stack.status(infra=False)}["paramsync"].held

    stack.release("paramsync")
    stack.wait_healthy("paramsync", timeout_s=90)  # waits for the supervisor's restart first
    assert stack.restarts()["paramsync"] == restarts + 1
    assert not {st.name: st for st in stack.status(infra=False)}["paramsync"].held


def test_a_stopped_service_is_not_taken_for_dead(stack: LocalStack) -> None:
    restarts = stack.restarts().get("trainer", 0)
    stack.stop("trainer")
    time.sleep(4)
    assert stack.pid("trainer") is None and stack.restarts().get("trainer", 0) == restarts
    stack.start("trainer")
    stack.wait_healthy("trainer", timeout_s=90)
    assert stack.restarts().get("trainer", 0) == restarts
