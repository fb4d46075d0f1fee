"""Under-replicated and offline partitions of the run's topics, as the cluster's metadata says: an operator signal
for a broker that is gone or cut off (its partitions' in-sync replica sets shrink when the controller fences it),
which the services themselves may ride out without ever looking degraded.

Every ``admin.refresh_interval_s`` admin describes the run's six topics (a Metadata request through an
``AIOKafkaAdminClient`` configured like ``shared.kafka``'s clients) and counts per topic:

- *under-replicated*: partitions with a leader whose ISR is smaller than their replica set;
- *offline*: partitions without a leader (no replica in sync is alive: nothing can be written or read).

They are exported as ``flywheel_kafka_under_replicated_partitions{topic}`` and
``flywheel_kafka_offline_partitions{topic}`` (alerts FlywheelKafkaUnderReplicated / FlywheelKafkaOffline) and
shown in ``/status`` as ``services.kafka`` (degraded, with a reason naming each topic and partition). A describe
that fails (a broker away, a timeout) is logged and tried again at the next refresh, never raised: the last
view is kept (gauges included), and ``/status`` says ``unknown`` once no describe succeeded for
:data:`STALE_AFTER_S`. The first half is pure (unit-tested), the second talks to Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

from shared.retry import describe
from shared.settings import Settings

UNDER_REPLICATED = Gauge("flywheel_kafka_under_replicated_partitions",
                         "Partitions of a run topic with a leader whose in-sync replicas are fewer than its replicas "
                         "(admin describes the run's topics)", ["topic"])
OFFLINE = Gauge("flywheel_kafka_offline_partitions",
                "Partitions of a run topic without a leader (admin describes the run's topics)", ["topic"])
STALE_AFTER_S = 30.0
"""``/status`` says ``unknown`` for the replication view when no describe succeeded for this long."""
DESCRIBE_TIMEOUT_S = 10.0
"""The admin client's request timeout (a broker that drops packets must not hold the check for 30 s)."""
NODE_TIMEOUT_S = 4.0
"""Longest one broker may take to answer the describe before the next is asked."""
REASON_PARTITIONS = 4
"""Partitions named in the ``/status`` reason; the rest are counted."""


# ---- pure ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartitionState:
    topic: str
    partition: int
    leader: int
    """-1: no leader (offline)."""
    replicas: tuple[int, ...]
    isr: tuple[int, ...]

    @property
    def offline(self) -> bool:
        return self.leader < 0

    @property
    def under_replicated(self) -> bool:
        return not self.offline and len(set(self.isr)) < len(set(self.replicas))

    def __str__(self) -> str:
        where = f"{self.topic}[{self.partition}]"
        replicas = ",".join(map(str, self.replicas))
        if self.offline:
            return f"{where} offline (no leader; replicas {replicas})"
        missing = ",".join(str(r) for r in self.replicas if r not in self.isr)
        return (f"{where} {len(set(self.isr))} of {len(set(self.replicas))} replicas in sync "
                f"(leader {self.leader}, out of sync {missing})")


@dataclass(frozen=True)
class Replication:
    """One describe of the run's topics, judged."""

    partitions: dict[str, int] = field(default_factory=dict)
    """Per topic described: its partition count."""
    problems: tuple[PartitionState, ...] = ()
    """Every partition under-replicated or offline, in topic and partition order."""
    missing: tuple[str, ...] = ()
    """Run topics the metadata did not describe (not created yet, or an error for the topic)."""

    def count(self, topic: str, *, offline: bool) -> int:
        return sum(1 for p in self.problems if p.topic == topic and p.offline == offline)

    @property
    def ok(self) -> bool:
        return not self.problems

    def reason(self, limit: int = REASON_PARTITIONS) -> str | None:
        """One line naming the partitions (offline first), or None when every partition is fully in sync."""
        if not self.problems:
            return None
        ordered = sorted(self.problems, key=lambda p: (not p.offline, p.topic, p.partition))
        more = len(ordered) - limit
        return "; ".join(map(str, ordered[:limit])) + (f"; and {more} more" if more > 0 else "")


def assess(described: Iterable[dict[str, Any]], topics: Sequence[str]) -> Replication:
    """Judge a ``describe_topics`` answer (Metadata response topics) for ``topics``: partitions with a leader whose
    ISR is smaller than their replica set are under-replicated, those without a leader (-1) offline. A topic
    answered with an error code and no partitions, or not answered, is ``missing``."""
    wanted = set(topics)
    counts: dict[str, int] = {}
    problems: list[PartitionState] = []
    for t in described:
        name = str(t.get("topic"))
        if name not in wanted or (t.get("error_code") and not t.get("partitions")):
            continue
        parts = t.get("partitions") or []
        counts[name] = len(parts)
        for p in parts:
            state = PartitionState(name, int(p["partition"]), int(p.get("leader", -1)),
                                   tuple(int(r) for r in p.get("replicas") or ()),
                                   tuple(int(r) for r in p.get("isr") or ()))
            if state.offline or state.under_replicated:
                problems.append(state)
    problems.sort(key=lambda p: (p.topic, p.partition))
    return Replication(counts, tuple(problems), tuple(sorted(wanted - set(counts))))


def health(view: Replication | None, checked_at: float | None, error: str | None, now: float,
           stale_after_s: float = STALE_AFTER_S) -> tuple[str, dict[str, str]]:
    """The ``services.kafka`` entry of ``/status``: (state, reasons). ``unknown`` until a describe succeeded or
    once none did for ``stale_after_s`` (the reason says why); ``degraded`` with the partitions while any is
    under-replicated or offline (from the last describe, however recent); else ``ok``."""
    reasons: dict[str, str] = {}
    if checked_at is None or now - checked_at > stale_after_s:
        since = "never" if checked_at is None else f"{now - checked_at:.0f} s ago"
        reasons["describe"] = f"last described {since}" + (f": {error}" if error else "")
        if view is not None and view.problems:
            reasons["replication"] = f"(as of then) {view.reason()}"
        return "unknown", reasons
    if view is not None and (why := view.reason()) is not None:
        reasons["replication"] = why
        return "degraded", reasons
    return "ok", reasons


# ---- Kafka --------------------------------------------------------------------------------------------------
class ReplicationWatch:
    """Describes the run's topics on :meth:`check` (admin's periodic task), exports the gauges, keeps the last
    view for ``/status``. :meth:`check` never raises but for cancellation: a failure is logged and counted."""

    def __init__(self, settings: Settings, topics: Sequence[str], log: Any) -> None:
        self.settings = settings
        self.topics = list(topics)
        self.log = log
        self.view: Replication | None = None
        self.checked_at: float | None = None
        self.error: str | None = None
        self.failures = 0
        self._admin: Any = None
        self._last_reason: str | None = None

    async def _client(self) -> Any:
        if self._admin is None:
            from shared.kafka import make_admin

            k = self.settings.kafka
            admin = make_admin(self.settings,
                               request_timeout_ms=min(k.request_timeout_ms, int(DESCRIBE_TIMEOUT_S * 1000)))
            try:
                await admin.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    await admin.close()
                raise
            self._admin = admin
        return self._admin

    async def _describe(self) -> list[dict[str, Any]]:
        """The run topics' metadata, asked of the brokers the client knows in random order until one answers within
        :data:`NODE_TIMEOUT_S` (a broker cut off must not stall the check: the others answer, and with the cluster's
        view, not a fenced broker's). Never creates a topic (``allow_auto_topic_creation`` off: aiokafka's
        ``describe_topics`` leaves it on, and a broker with ``auto.create.topics.enable`` would make one with the
        broker's defaults)."""
        from aiokafka.protocol.metadata import MetadataRequest

        admin = await self._client()
        nodes: list[int | None] = [b.nodeId for b in admin._client.cluster.brokers()]  # noqa: SLF001 - no public API
        random.shuffle(nodes)
        last: BaseException | None = None
        for node in nodes or [None]:
            try:
                response = await asyncio.wait_for(  # noqa: SLF001 - aiokafka's admin has no per-node describe
                    admin._send_request(MetadataRequest(self.topics, allow_auto_topic_creation=False), node_id=node),
                    NODE_TIMEOUT_S)
                return list(response.to_object()["topics"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next broker, then the check fails with the last error
                last = exc
        assert last is not None
        raise last

    async def check(self) -> None:
        try:
            described = await asyncio.wait_for(self._describe(), DESCRIBE_TIMEOUT_S * 2)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - transient or not, the next refresh tries again
            self.failures += 1
            self.error = describe(exc)
            self.log.warning("kafka_replication_check_failed", error=self.error, failures=self.failures)
            await self.stop()  # a fresh client next time (its metadata may name a broker that is gone)
            return
        view = assess(described, self.topics)
        for topic in self.topics:
            UNDER_REPLICATED.labels(topic=topic).set(view.count(topic, offline=False))
            OFFLINE.labels(topic=topic).set(view.count(topic, offline=True))
        self.view, self.checked_at, self.error = view, time.time(), None
        reason = view.reason(limit=50)
        if reason != self._last_reason:
            if reason is None:
                self.log.info("kafka_replication_restored")
            else:
                self.log.warning("kafka_under_replicated", partitions=reason,
                                 under_replicated=sum(not p.offline for p in view.problems),
                                 offline=sum(p.offline for p in view.problems))
            self._last_reason = reason

    def health(self, now: float | None = None) -> tuple[str, dict[str, str]]:
        return health(self.view, self.checked_at, self.error, time.time() if now is None else now)

    async def stop(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), 10.0)
