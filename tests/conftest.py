"""Shared fixtures: a real Kafka broker, a real S3 endpoint, and a unique run name per test.

Where the endpoints come from, in order:
1. ``FLYWHEEL_KAFKA_BOOTSTRAP`` / ``FLYWHEEL_S3_ENDPOINT`` when set (plus ``FLYWHEEL_S3_BUCKET``,
   ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``);
2. testcontainers (``apache/kafka`` and MinIO) when a Docker engine answers;
3. the local process stack of ``devstack`` (Kafka + S3 only) in ``.flywheel/test-infra`` on ports 19092/19093/19000,
   apart from a ``make up`` stack. It stops at the end of the session, unless ``FLYWHEEL_TEST_INFRA_REUSE=1``
   asks to keep it for the next one (which then starts in seconds) or another test session still uses it
   (the last one out stops it).
Whatever the source, the fixture checks the endpoint really works (a produce/consume round trip, an
S3 put/get) before any test uses it, and fails the tests that need it with the reason otherwise.

A test session leaves no process behind: every process it starts inherits ``FLYWHEEL_TEST_SESSION`` (a
random value per session), and at the end any still running with this session's value (apart from the test
infra kept for reuse) is named, stopped, and fails the session.
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
from devstack import infra as test_infra
from devstack import kafka as infra_kafka
from devstack import s3 as infra_s3
from devstack.procs import file_lock, is_running, marked, read_cmdline, terminate

KAFKA_IMAGE = "apache/kafka:4.1.1"
MINIO_IMAGE = "minio/minio:RELEASE.2025-09-07T16-13-09Z"
READY_TIMEOUT_S = 240.0  # a guard: a cold Kafka takes ~20 s alone, minutes on a loaded 2-core machine
REUSE_VAR = "FLYWHEEL_TEST_INFRA_REUSE"
"""Set to 1 to keep the test Kafka + S3 running after the session (the next session reuses them)."""
SESSION_MARK = "FLYWHEEL_TEST_SESSION"
"""Every process a test session starts inherits this variable with the session's own value."""
LEFTOVER_GRACE_S = 15.0
"""How long processes stopped in teardown may take to exit before they count as left behind."""
BY_DESIGN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers of Python's multiprocessing that exit with the interpreter that started them."""


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


def _reuse_infra() -> bool:
    return os.environ.get(REUSE_VAR, "").strip().lower() in ("1", "true", "yes")


def _test_sessions_using_infra() -> list[int]:
    """The live test sessions (pytest processes) registered as users of the test infra; stale entries removed."""
    users = TEST_HOME / "users"
    live = []
    for entry in users.glob("*") if users.is_dir() else []:
        pid = int(entry.name) if entry.name.isdigit() else 0
        if pid and is_running(pid) and any("pytest" in arg for arg in read_cmdline(pid) or []):
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return live


@pytest.fixture(scope="session")
def local_infra(request: pytest.FixtureRequest) -> Iterator[InfraEndpoints]:
    """The Docker-free stack in .flywheel/test-infra: started (or reused), then stopped at the end of the session
    unless ``FLYWHEEL_TEST_INFRA_REUSE=1`` or another live test session uses it."""
    show = _show(request)
    me = TEST_HOME / "users" / str(os.getpid())
    with file_lock(TEST_HOME / ".users.lock"):
        me.parent.mkdir(parents=True, exist_ok=True)
        me.touch()
    try:
        try:
            ep = ensure_up(
                TEST_HOME,
                kafka_port=TEST_KAFKA_PORT,
                controller_port=TEST_CONTROLLER_PORT,
                s3_port=TEST_S3_PORT,
                timeout_s=READY_TIMEOUT_S,
                progress=show,
            )
        except InfraError as exc:
            pytest.fail(f"the local test infrastructure did not come up:\n{exc}", pytrace=False)
        yield ep
    finally:
        with file_lock(TEST_HOME / ".users.lock"):
            me.unlink(missing_ok=True)
            others = _test_sessions_using_infra()
            if _reuse_infra():
                show(f"left running for the next session ({REUSE_VAR}=1); stop it with "
                     f"`python -m devstack infra-down --home {TEST_HOME}`")
            elif others:
                show(f"left running: test session(s) {others} still use it (the last one out stops it)")
            else:
                test_infra.down(TEST_HOME, progress=show)


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_MARK] = uuid.uuid4().hex  # a session of its own, also for pytest run by a test


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail a session that leaves a process behind, naming it (and stop it, so the machine is clean)."""
    mark = os.environ.get(SESSION_MARK)
    if mark is None:
        return
    keep = {os.getpid()}
    if _reuse_infra():
        keep |= {s.pid for s in test_infra.status(TEST_HOME) if s.alive and s.pid}

    def leftovers() -> list[int]:
        return [pid for pid in marked(SESSION_MARK, mark, exclude=keep)
                if not any(name in arg for arg in read_cmdline(pid) or [] for name in BY_DESIGN)]

    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    described = [f"  pid {pid}: {' '.join(read_cmdline(pid) or ['?'])[:300]}" for pid in left]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = "\n".join([f"\nthis test session left {len(left)} process(es) behind (stopped now):", *described])
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(text, red=True, bold=True)
    else:
        print(text, flush=True)
    for pid in left:
        terminate(pid, 5.0)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
