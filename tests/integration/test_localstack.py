"""The local process stack (devstack.LocalStack) end to end: four services against the test Kafka + S3.

Ports are apart from a ``make up`` stack (8080, 8101, 8102, 8110+), so both can run at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import InfraEndpoints, LocalStack
from devstack.procs import BANNER, is_running
from tests.conftest import S3Endpoint

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.e2e, pytest.mark.timeout(240)]

ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT = 18480, 18401, 18402, 18410
TOKEN = "test-token-of-at-least-32-characters"  # admin refuses shorter ones


@pytest.fixture
def stack(
    kafka_bootstrap: str, s3_endpoint: S3Endpoint, run_name: str, tmp_path: Path
) -> Iterator[LocalStack]:
    infra = InfraEndpoints(
        kafka_bootstrap=kafka_bootstrap,
        s3_endpoint=s3_endpoint.endpoint_url,
        bucket=s3_endpoint.bucket,
        access_key=s3_endpoint.access_key,
        secret_key=s3_endpoint.secret_key,
        region=s3_endpoint.region,
    )
    st = LocalStack(
        tmp_path / "stack",
        run=run_name,
        infra=infra,
        env={"FLYWHEEL_ADMIN_TOKEN": TOKEN, "FLYWHEEL_LOG_LEVEL": "INFO"},
        admin_port=ADMIN_PORT,
        trainer_port=TRAINER_PORT,
        paramsync_port=PARAMSYNC_PORT,
        sampler_base_port=SAMPLER_BASE_PORT,
        store_backend="s3",
    )
    try:
        yield st
    finally:
        st.down(infra=False)


def _wait_for(what: str, check: Any, timeout_s: float, stack: LocalStack) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(1.0)
    logs = ", ".join(str(st.log) for st in stack.status(infra=False))
    pytest.fail(f"no {what} within {timeout_s:.0f} s; last: {last!r}; logs: {logs}")


def test_up_status_restart_sampler_down(stack: LocalStack, run_name: str) -> None:
    stack.up(samplers=1, timeout_s=120, prometheus=False)
    pids = stack.pids()
    assert set(pids) == {"trainer", "paramsync", "admin", "sampler-0"}, pids
    for port in (ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT):
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200, port

    # The run is live: a policy is published and the sampler reports in.
    def status() -> dict[str, Any]:
        r = httpx.get(f"{stack.admin_url}/status", timeout=5)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    assert status()["run"] == run_name
    _wait_for(
        "a published policy and a live sampler-0",
        lambda: (s := status())["policy"]["version"] is not None
        and any(x["id"] == "sampler-0" and x["alive"] for x in s["samplers"]),
        60,
        stack,
    )

    # The token the stack gave the admin is the one mutations need.
    r = httpx.post(f"{stack.admin_url}/policy/sync", headers={"Authorization": "Bearer wrong"}, timeout=5)
    assert r.status_code == 403

    # Idempotent: a second up() reuses every process.
    stack.up(samplers=1, timeout_s=30, prometheus=False)
    assert stack.pids() == pids

    # Stop and start one sampler.
    stack.stop("sampler", 0)
    assert not is_running(pids["sampler-0"])
    assert "sampler-0" not in stack.pids()
    new_pid = stack.start("sampler", 0)
    assert new_pid != pids["sampler-0"]
    stack.wait_healthy("sampler", 0, timeout_s=60)
    assert stack.log_path("sampler", 0).with_suffix(".out").read_text().count(BANNER) == 2  # stdout: banners

    stack.down(infra=False)
    everything = [*pids.values(), new_pid]
    assert not [pid for pid in everything if is_running(pid)]
    assert stack.pids() == {}
    assert all(not st.alive for st in stack.status(infra=False))
