"""The local stack, without Docker: Kafka (KRaft, Maven Central jars), an S3 server (moto), Flywheel's
four services and Prometheus as processes on 127.0.0.1, with a supervisor that restarts what dies.

Tooling, not runtime: the services never import it (docs/architecture.md, "Code layout"). Command line:
``python -m devstack up|down|status|restart|infra-up|infra-down|hold|release|supervise`` (see
``__main__`` and docs/local-stack.md). Python API, e.g. for tests and the benchmarks::

    from devstack import LocalStack, ensure_up
    ep = ensure_up(TEST_HOME, kafka_port=TEST_KAFKA_PORT, controller_port=TEST_CONTROLLER_PORT, s3_port=TEST_S3_PORT)
    stack = LocalStack(tmp_path, run="t-e2e", infra=ep, store_backend="s3", admin_port=18480)
    stack.up(samplers=1, prometheus=False)
    stack.kill("trainer"); stack.wait_healthy("trainer")     # the supervisor restarts it
    stack.down(infra=False)
"""

from devstack.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    TEST_CONTROLLER_PORT,
    TEST_HOME,
    TEST_KAFKA_PORT,
    TEST_S3_PORT,
    InfraConfig,
    InfraEndpoints,
    InfraError,
    LocalStackError,
    StackError,
)
from devstack.infra import down, ensure_up, status
from devstack.procs import ProcStatus
from devstack.readiness import run_coro
from devstack.services import SERVICES
from devstack.stack import LocalStack

__all__ = [
    "DEFAULT_CONFIG",
    "REPO_ROOT",
    "SERVICES",
    "TEST_CONTROLLER_PORT",
    "TEST_HOME",
    "TEST_KAFKA_PORT",
    "TEST_S3_PORT",
    "InfraConfig",
    "InfraEndpoints",
    "InfraError",
    "LocalStack",
    "LocalStackError",
    "ProcStatus",
    "StackError",
    "down",
    "ensure_up",
    "run_coro",
    "status",
]
