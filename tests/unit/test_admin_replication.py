"""The pure half of services/admin/replication.py: a describe of the run's topics judged (ISR smaller than the
replica set: under-replicated; no leader: offline), the ``services.kafka`` entry of ``/status``, and a describe that
fails being kept from admin (no broker on the port: logged, counted, never raised)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from prometheus_client import REGISTRY

from services.admin.replication import Replication, ReplicationWatch, assess, health
from shared.settings import load_settings

TOPICS = ["r.samples", "r.policy", "r.heartbeats"]


def part(p: int, leader: int, replicas: list[int], isr: list[int], error_code: int = 0) -> dict[str, Any]:
    return {"error_code": error_code, "partition": p, "leader": leader, "replicas": replicas, "isr": isr}


def described(*parts_of: tuple[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [{"error_code": 0, "topic": t, "is_internal": False, "partitions": ps} for t, ps in parts_of]


def test_all_in_sync_is_ok() -> None:
    view = assess(described(("r.samples", [part(0, 1, [1, 2, 3], [3, 1, 2]), part(1, 2, [2, 3, 1], [2, 3, 1])]),
                            ("r.policy", [part(0, 3, [3, 1, 2], [3, 1, 2])]),
                            ("r.heartbeats", [part(0, 1, [1], [1])])), TOPICS)
    assert view.ok and view.reason() is None and view.missing == ()
    assert view.partitions == {"r.samples": 2, "r.policy": 1, "r.heartbeats": 1}
    assert all(view.count(t, offline=o) == 0 for t in TOPICS for o in (False, True))


def test_isr_smaller_than_replicas_is_under_replicated_and_no_leader_is_offline() -> None:
    view = assess(described(("r.samples", [part(0, 3, [2, 3, 1], [3, 1]), part(1, 1, [1, 2, 3], [1, 2, 3]),
                                           part(2, 1, [1, 2, 3], [1])]),
                            ("r.policy", [part(0, -1, [2, 3, 1], [2], error_code=5)]),
                            ("other.samples", [part(0, 1, [1, 2], [1])])), TOPICS)
    assert not view.ok
    assert view.count("r.samples", offline=False) == 2 and view.count("r.samples", offline=True) == 0
    assert view.count("r.policy", offline=True) == 1 and view.count("r.policy", offline=False) == 0
    assert view.missing == ("r.heartbeats",), "a run topic not described"
    assert [(p.topic, p.partition) for p in view.problems] == [("r.policy", 0), ("r.samples", 0), ("r.samples", 2)]
    reason = view.reason()
    assert reason is not None
    # offline first, then the under-replicated ones, each naming topic, partition and what is out of sync
    assert reason.startswith("r.policy[0] offline (no leader; replicas 2,3,1)")
    assert "r.samples[0] 2 of 3 replicas in sync (leader 3, out of sync 2)" in reason
    assert "r.samples[2] 1 of 3 replicas in sync (leader 1, out of sync 2,3)" in reason
    assert "other.samples" not in reason, "only the run's topics"


def test_reason_names_a_few_and_counts_the_rest() -> None:
    view = assess(described(("r.samples", [part(i, 1, [1, 2, 3], [1, 2]) for i in range(7)])), TOPICS)
    reason = view.reason(limit=3)
    assert reason is not None and reason.count("r.samples[") == 3 and reason.endswith("and 4 more")


def test_topic_with_an_error_and_no_partitions_is_missing_not_ok() -> None:
    view = assess([{"error_code": 3, "topic": "r.samples", "partitions": []}], TOPICS)
    assert view.ok and set(view.missing) == set(TOPICS) and view.partitions == {}


def test_status_entry() -> None:
    now = 1000.0
    bad = assess(described(("r.samples", [part(0, 3, [2, 3, 1], [3, 1])])), TOPICS)
    assert health(Replication(), now - 1, None, now) == ("ok", {})
    state, reasons = health(bad, now - 1, None, now)
    assert state == "degraded" and reasons["replication"].startswith("r.samples[0] 2 of 3 replicas in sync")
    state, reasons = health(None, None, "KafkaConnectionError: no broker", now)
    assert state == "unknown" and reasons == {"describe": "last described never: KafkaConnectionError: no broker"}
    state, reasons = health(bad, now - 45, "KafkaTimeoutError", now, stale_after_s=30)
    assert state == "unknown" and reasons["describe"] == "last described 45 s ago: KafkaTimeoutError"
    assert reasons["replication"].startswith("(as of then) r.samples[0]")
    # within the staleness bound a failed describe keeps the last view (a blip is not "unknown")
    assert health(bad, now - 10, "KafkaTimeoutError", now)[0] == "degraded"


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning


def test_a_describe_that_fails_is_logged_and_kept_from_admin() -> None:
    with socket.socket() as s:  # a port nobody listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = load_settings(None, environ={"FLYWHEEL_RUN": "r", "FLYWHEEL_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
                                            "FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS": "2000"})
    log = _Log()
    watch = ReplicationWatch(settings, TOPICS, log)

    async def twice() -> None:
        await watch.check()
        await watch.check()
        await watch.stop()

    asyncio.run(twice())
    assert watch.failures == 2 and watch.view is None and watch.error
    assert [e for e, _ in log.events] == ["kafka_replication_check_failed"] * 2
    assert watch.health()[0] == "unknown"
    assert REGISTRY.get_sample_value("flywheel_kafka_under_replicated_partitions", {"topic": "r.samples"}) is None
