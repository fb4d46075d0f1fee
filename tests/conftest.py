"""Shared fixtures: a real Kafka broker, a real S3 endpoint, and a unique run name per test.

Where the endpoints come from, in order:
1. ``FLYWHEEL_KAFKA_BOOTSTRAP`` / ``FLYWHEEL_S3_ENDPOINT`` when set (plus ``FLYWHEEL_S3_BUCKET``,
   ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``);
2. testcontainers (``apache/kafka`` and MinIO) when a Docker engine answers;
3. the local process stack of ``devstack`` (Kafka + S3 only) in ``.flywheel/test-infra`` on ports 19092/19093/19000,
   apart from a ``make up`` stack; it is left running after the session so the next one starts fast.
Whatever the source, the fixture checks the endpoint really works (a produce/consume round trip, an
S3 put/get) before any test uses it, and fails the tests that need it with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from devstack import (
    TEST_CONTROLLER_PORT,
    TEST_HOME,
    TEST_KAFKA_PORT,
    TEST_S3_PORT,
    InfraEndpoints,
    InfraError,
    ensure_up,
    run_coro,
)
from devstack import kafka as infra_kafka
from devstack import s3 as infra_s3

KAFKA_IMAGE = "apache/kafka:4.1.1"
MINIO_IMAGE = "minio/minio:RELEASE.2025-09-07T16-13-09Z"
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class S3Endpoint:
    """An S3-compatible endpoint with an existing bucket and the credentials to use it."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client(self) -> Any:
        """A fresh boto3 S3 client (path-style addressing) for this endpoint."""
        return infra_s3.client(
            self.endpoint_url,
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            retries=3,
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point a Flywheel process at this endpoint."""
        return {
            "FLYWHEEL_S3_ENDPOINT": self.endpoint_url,
            "FLYWHEEL_S3_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }


def _show(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Print progress live, past pytest's output capture (bringing infra up can take a while)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def show(msg: str) -> None:
        if capman is None:  # capture plugin disabled (-p no:capture): output is live anyway
            print(f"[test-infra] {msg}", flush=True)
            return
        with capman.global_and_fixture_disabled():
            print(f"[test-infra] {msg}", flush=True)

    return show


def _docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _retry(what: str, check: Callable[[], None], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Call `check` until it passes; fail the requesting tests with the last error after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except Exception as exc:  # retried until the deadline, then reported
            last = exc
        if time.monotonic() > deadline:
            break
        time.sleep(1.0)
    pytest.fail(f"{what} did not work within {timeout_s:.0f} s: {last!r}", pytrace=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def docker_available() -> bool:
    """Whether a Docker engine answers (``docker info`` within 5 s)."""
    return _docker_engine_answers()


@pytest.fixture(scope="session")
def local_infra(request: pytest.FixtureRequest) -> InfraEndpoints:
    """The Docker-free stack in .flywheel/test-infra (started or reused; left running)."""
    try:
        return ensure_up(
            TEST_HOME,
            kafka_port=TEST_KAFKA_PORT,
            controller_port=TEST_CONTROLLER_PORT,
            s3_port=TEST_S3_PORT,
            timeout_s=READY_TIMEOUT_S,
            progress=_show(request),
        )
    except InfraError as exc:
        pytest.fail(f"the local test infrastructure did not come up:\n{exc}", pytrace=False)


@pytest.fixture(scope="session")
def _kafka_container(request: pytest.FixtureRequest) -> Iterator[str]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    port = _free_port()
    container = DockerContainer(KAFKA_IMAGE).with_bind_ports(9092, port)
    host = container.get_docker_client().host()
    for key, value in {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://0.0.0.0:9092,BROKER://0.0.0.0:29092,CONTROLLER://0.0.0.0:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{host}:{port},BROKER://localhost:29092",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    }.items():
        container.with_env(key, value)
    container.waiting_for(LogMessageWaitStrategy("Kafka Server started"))
    _show(request)(f"starting {KAFKA_IMAGE} with testcontainers ...")
    container.start()
    try:
        bootstrap = f"{host}:{port}"
        _retry(f"Kafka container at {bootstrap}", lambda: run_coro(infra_kafka.roundtrip(bootstrap, 30.0)))
        yield bootstrap
    finally:
        container.stop()


@pytest.fixture(scope="session")
def _minio_container(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HttpWaitStrategy

    user, password = "flywheel", "flywheel-secret"
    container = (
        DockerContainer(MINIO_IMAGE)
        .with_exposed_ports(9000)
        .with_env("MINIO_ROOT_USER", user)
        .with_env("MINIO_ROOT_PASSWORD", password)
        .with_command("server /data --address :9000")
        .waiting_for(HttpWaitStrategy(9000, "/minio/health/live"))
    )
    _show(request)(f"starting {MINIO_IMAGE} with testcontainers ...")
    container.start()
    try:
        url = f"http://{container.get_container_host_ip()}:{container.get_exposed_port(9000)}"
        yield S3Endpoint(url, "flywheel", user, password)
    finally:
        container.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest, docker_available: bool) -> str:
    """Bootstrap servers ("host:port") of a working Kafka broker."""
    env = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    if env:
        _retry(
            f"Kafka at FLYWHEEL_KAFKA_BOOTSTRAP={env}",
            lambda: run_coro(infra_kafka.roundtrip(env, 30.0)),
            timeout_s=30.0,
        )
        return env
    if docker_available:
        return str(request.getfixturevalue("_kafka_container"))
    local: InfraEndpoints = request.getfixturevalue("local_infra")
    return local.kafka_bootstrap


@pytest.fixture(scope="session")
def s3_endpoint(request: pytest.FixtureRequest, docker_available: bool) -> S3Endpoint:
    """A working S3 endpoint whose bucket exists."""
    url = os.environ.get("FLYWHEEL_S3_ENDPOINT")
    if url:
        ep = S3Endpoint(
            url,
            os.environ.get("FLYWHEEL_S3_BUCKET") or "flywheel",
            os.environ.get("AWS_ACCESS_KEY_ID") or "testing",
            os.environ.get("AWS_SECRET_ACCESS_KEY") or "testing",
            os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        )
        timeout_s = 30.0
    elif docker_available:
        ep = request.getfixturevalue("_minio_container")
        timeout_s = READY_TIMEOUT_S
    else:
        local: InfraEndpoints = request.getfixturevalue("local_infra")
        ep = S3Endpoint(local.s3_endpoint, local.bucket, local.access_key, local.secret_key, local.region)
        timeout_s = 30.0
    _retry(
        f"S3 at {ep.endpoint_url} (bucket {ep.bucket})",
        lambda: infra_s3.roundtrip(
            ep.endpoint_url, ep.bucket, access_key=ep.access_key, secret_key=ep.secret_key, region=ep.region
        ),
        timeout_s=timeout_s,
    )
    return ep


@pytest.fixture
def s3_client(s3_endpoint: S3Endpoint) -> Any:
    """A boto3 S3 client for ``s3_endpoint``."""
    return s3_endpoint.client()


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to this test (``t-<test name>-<8 hex>``): its topics and keys are its own."""
    short = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    return f"t-{short[:24].strip('-') or 'x'}-{uuid.uuid4().hex[:8]}"
