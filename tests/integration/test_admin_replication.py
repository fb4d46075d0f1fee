"""Admin's view of the run topics' replication against the real test Kafka (services/admin/replication.py).

The test Kafka of ``make test`` is one broker unless ``FLYWHEEL_INFRA_BROKERS=3``: every partition is then fully in
sync, and so must admin say (``/status`` ``services.kafka`` ok, both gauges 0 for every run topic). The
under-replicated case needs a broker cut off from a cluster: the partition suite's leader-isolation row
(``tests/hosts/test_partitions.py``) shows the gauge, ``/status`` and the alert reacting on a 3-node cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

pytestmark = [pytest.mark.kafka, pytest.mark.s3]


async def test_a_healthy_cluster_has_no_under_replicated_partition(api: Any, kafka_bootstrap: str) -> None:
    client, state = api
    topics = sorted(vars(state.topics).values())
    deadline = time.monotonic() + 30
    kafka: dict[str, Any] = {}
    while time.monotonic() < deadline:
        kafka = (await client.get("/status")).json()["services"].get("kafka") or {}
        if kafka.get("state") == "ok" and state.replication.view is not None \
                and not state.replication.view.missing:
            break
        await asyncio.sleep(0.3)
    assert kafka == {"alive": True, "state": "ok", "reasons": {}, "restarts": 0}, kafka
    view = state.replication.view
    assert view is not None and view.missing == () and set(view.partitions) == set(topics)
    # The same topics described directly: the judgement is the metadata's (replicas == ISR for each partition).
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
        brokers = len((await admin.describe_cluster())["brokers"])
    finally:
        await admin.close()
    for t in described:
        assert t["partitions"], t
        for p in t["partitions"]:
            assert p["leader"] >= 0 and sorted(p["isr"]) == sorted(p["replicas"]), (t["topic"], p)
    assert view.partitions == {t["topic"]: len(t["partitions"]) for t in described}
    metrics = (await client.get("/metrics")).text
    for topic in topics:
        assert f'flywheel_kafka_under_replicated_partitions{{topic="{topic}"}} 0.0' in metrics, topic
        assert f'flywheel_kafka_offline_partitions{{topic="{topic}"}} 0.0' in metrics, topic
    assert state.replication.failures == 0, state.replication.error
    print(f"{brokers} broker(s), {sum(view.partitions.values())} partitions of {len(topics)} run topics in sync")
