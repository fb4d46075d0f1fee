"""Flywheel's four services as local processes, next to ``shared.infra``'s Kafka + S3 (no Docker).

Command line: ``python -m shared.localstack up|down|status|restart`` (see ``__main__`` and
docs/local-stack.md). Python API, e.g. for end-to-end tests::

    from shared.localstack import LocalStack
    stack = LocalStack(tmp_path, run="t-e2e", infra=endpoints, store_backend="s3", admin_port=18480)
    stack.up(samplers=1, prometheus=False)
    stack.kill("trainer"); stack.start("trainer"); stack.wait_healthy("trainer")
    stack.down(infra=False)
"""

from shared.localstack.process import SERVICES, LocalStackError
from shared.localstack.stack import DEFAULT_CONFIG, LocalStack
from shared.localstack.state import ProcStatus

__all__ = ["DEFAULT_CONFIG", "SERVICES", "LocalStack", "LocalStackError", "ProcStatus"]
