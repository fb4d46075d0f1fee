"""Local infrastructure for machines without a Docker engine: Apache Kafka (KRaft) and an S3 server.

Command line: ``python -m shared.infra up|down|status`` (see ``__main__``). Python API::

    from shared.infra import ensure_up, down, status
    ep = ensure_up(home=".flywheel/test-infra", kafka_port=19092, controller_port=19093, s3_port=19000)
    ep.kafka_bootstrap, ep.s3_endpoint, ep.bucket
"""

from shared.infra.config import InfraConfig, InfraEndpoints, InfraError
from shared.infra.stack import ServiceState, down, ensure_up, status

__all__ = ["InfraConfig", "InfraEndpoints", "InfraError", "ServiceState", "down", "ensure_up", "status"]
