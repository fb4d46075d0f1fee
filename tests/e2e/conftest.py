"""A LocalStack per test on the session's real Kafka + S3 (store backend: real S3)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import InfraEndpoints, LocalStack
from tests.faults.accounting import read_events


@pytest.fixture
def make_stack(
    kafka_bootstrap: str, s3_endpoint: Any, run_name: str, tmp_path: Path
) -> Iterator[Callable[..., LocalStack]]:
    stacks: list[LocalStack] = []
    infra = InfraEndpoints(kafka_bootstrap=kafka_bootstrap, s3_endpoint=s3_endpoint.endpoint_url,
                           bucket=s3_endpoint.bucket, access_key=s3_endpoint.access_key,
                           secret_key=s3_endpoint.secret_key, region=s3_endpoint.region)

    def make(base_port: int, env: dict[str, str] | None = None) -> LocalStack:
        stack = LocalStack(tmp_path / f"home-{len(stacks)}", run=run_name, infra=infra, env=env,
                           admin_port=base_port, trainer_port=base_port + 1, paramsync_port=base_port + 2,
                           sampler_base_port=base_port + 10, store_backend="s3", progress=lambda _m: None)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.down(infra=False)


def status(stack: LocalStack) -> dict[str, Any]:
    r = httpx.get(f"{stack.admin_url}/status", timeout=10)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def log_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON records of a service's log (rotated copies included), optionally one event's."""
    return [e for e in read_events(path) if event is None or e.get("event") == event]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval: float = 1.0) -> Any:
    """``check()``'s first truthy value, polled every ``interval`` s; fails naming ``what`` (and the last value)
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}")

