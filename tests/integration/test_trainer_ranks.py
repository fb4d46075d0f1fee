"""Data-parallel trainer ranks on the real test Kafka + S3, as processes of a local stack.

- Two ranks train CartPole together: ``/status`` lists both with equal weights digests at the same update,
  both ranks update, and ``flywheel verify`` proves every offset of every partition exactly once from
  rank 0's checkpoint (which holds both ranks' ledgers).
- ``up`` with another rank count re-forms the group from the checkpoint.
- A world larger than the samples topic's partitions is refused at start with an error naming both.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import InfraEndpoints, LocalStack
from tests.conftest import S3Endpoint
from tests.e2e.conftest import status

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.e2e, pytest.mark.timeout(420)]

ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT = 18580, 18501, 18502, 18510
RANK_BASE_PORT, RENDEZVOUS_PORT = 18560, 18599
TOKEN = "test-token-of-at-least-32-characters"
REPO = Path(__file__).resolve().parents[2]


def _infra(kafka_bootstrap: str, s3: S3Endpoint) -> InfraEndpoints:
    return InfraEndpoints(kafka_bootstrap=kafka_bootstrap, s3_endpoint=s3.endpoint_url, bucket=s3.bucket,
                          access_key=s3.access_key, secret_key=s3.secret_key, region=s3.region)


@pytest.fixture
def stack(kafka_bootstrap: str, s3_endpoint: S3Endpoint, run_name: str, tmp_path: Path) -> Iterator[LocalStack]:
    st = LocalStack(tmp_path / "stack", run=run_name, infra=_infra(kafka_bootstrap, s3_endpoint),
                    env={"FLYWHEEL_ADMIN_TOKEN": TOKEN, "FLYWHEEL_TRAINER_CHECKPOINT_EVERY": "10"},
                    admin_port=ADMIN_PORT, trainer_port=TRAINER_PORT, paramsync_port=PARAMSYNC_PORT,
                    sampler_base_port=SAMPLER_BASE_PORT, trainer_rank_base_port=RANK_BASE_PORT,
                    rendezvous_port=RENDEZVOUS_PORT, store_backend="s3")
    try:
        yield st
    finally:
        st.down(infra=False)


def _wait(what: str, check: Any, timeout_s: float, stack: LocalStack) -> Any:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except httpx.HTTPError as exc:
            last = repr(exc)
        if last and not isinstance(last, str):
            return last
        time.sleep(1.0)
    logs = ", ".join(str(st.log) for st in stack.status(infra=False))
    pytest.fail(f"no {what} within {timeout_s:.0f} s; last: {last!r}; logs: {logs}")


def _equal_digests(stack: LocalStack, after: int) -> list[dict[str, Any]] | None:
    ranks = status(stack)["trainer"]["ranks"]
    if len(ranks) != 2 or not all(r["alive"] for r in ranks):
        return None
    a, b = ranks
    if a["digest_update"] is None or a["digest_update"] != b["digest_update"] or a["digest_update"] <= after:
        return None
    return list(ranks)


def _verify(stack: LocalStack) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.admin.cli", "verify"], env=stack.service_env("admin"),
                          capture_output=True, text=True, timeout=180, cwd=REPO)


def test_two_ranks_train_with_identical_weights_and_verify(stack: LocalStack) -> None:
    stack.up(samplers=2, trainers=2, timeout_s=180, prometheus=False)
    assert {"trainer", "trainer-1"} <= set(stack.pids())
    ranks = _wait("two ranks with equal digests", lambda: _equal_digests(stack, 10), 180, stack)
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    # Both ranks trained (each on its own partitions), and rank 0 checkpointed both ledgers.
    for name in ("trainer", "trainer-1"):
        log = stack.log_path("trainer", 1 if name == "trainer-1" else 0).read_text()
        assert '"fragment_trained"' in log, f"{name} trained nothing"
    _wait("a checkpoint", lambda: '"checkpoint_written"' in stack.log_path("trainer").read_text(), 60, stack)
    out = _verify(stack)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every offset exactly once" in out.stdout

    # One rank again: the group stops together, rank 0 checkpoints, and a single trainer resumes from it.
    version = status(stack)["policy"]["version"]
    stack.up(samplers=2, trainers=1, timeout_s=180, prometheus=False)
    assert "trainer-1" not in stack.pids()
    _wait("training after re-forming", lambda: (status(stack)["policy"]["version"] or 0) > version + 3, 120, stack)
    assert "checkpoint_restored" in stack.log_path("trainer").read_text()
    out = _verify(stack)
    assert out.returncode == 0, out.stdout + out.stderr


def test_more_ranks_than_partitions_is_refused(kafka_bootstrap: str, s3_endpoint: S3Endpoint, run_name: str,
                                               tmp_path: Path) -> None:
    st = LocalStack(tmp_path / "stack", run=run_name, infra=_infra(kafka_bootstrap, s3_endpoint),
                    env={"FLYWHEEL_ADMIN_TOKEN": TOKEN, "FLYWHEEL_KAFKA_SAMPLES_PARTITIONS": "1"},
                    trainer_port=TRAINER_PORT + 40, store_backend="s3", trainers=2)
    env = st.service_env("trainer", 0)
    proc = subprocess.run([sys.executable, "-m", "services.trainer"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "trainer.world_size is 2" in proc.stdout + proc.stderr and "1 partitions" in proc.stdout + proc.stderr
