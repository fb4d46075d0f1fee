"""Kafka plumbing: a run's topics, the idempotent producer, the manual-commit consumer, lag.

Topics are prefixed by the run name so several runs share one cluster (docs/architecture.md, "Kafka
topics"). Every client is made here, with the security settings of :func:`client_security` (TLS, SASL;
docs/security.md); services reach them through ``shared.bus`` (``kafka_bus``), never directly.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import InvalidPartitionsError, KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from aiokafka.helpers import create_ssl_context

from shared.logging import get_logger
from shared.settings import SASL_PROTOCOLS, SSL_PROTOCOLS, Settings

log = get_logger(component="kafka")


@dataclass(frozen=True)
class Topics:
    """The six topics of one run."""

    samples: str
    dlq: str
    policy: str
    control: str
    heartbeats: str
    credits: str

    @classmethod
    def for_run(cls, run: str) -> Topics:
        return cls(
            samples=f"{run}.samples",
            dlq=f"{run}.samples.dlq",
            policy=f"{run}.policy",
            control=f"{run}.control",
            heartbeats=f"{run}.heartbeats",
            credits=f"{run}.credits",
        )


def trainer_group(run: str) -> str:
    """The consumer group whose committed offsets say what has been trained."""
    return f"{run}.trainer"


def client_security(settings: Settings) -> dict[str, Any]:
    """The security keyword arguments of every aiokafka client (producer, consumer, admin), from settings.

    ``PLAINTEXT`` gives ``{"security_protocol": "PLAINTEXT"}``; the ``SASL_*`` protocols add the mechanism,
    user and password; ``SSL`` and ``SASL_SSL`` add an ``ssl_context`` built by aiokafka's
    ``create_ssl_context`` (host names verified; ``kafka.ssl_cafile`` or the system CAs; the client
    certificate when ``kafka.ssl_certfile`` is set). The result holds the password in clear: pass it to
    a client, never log it.
    """
    k = settings.kafka
    out: dict[str, Any] = {"security_protocol": k.security_protocol}
    if k.security_protocol in SASL_PROTOCOLS:
        assert k.sasl_username is not None and k.sasl_password is not None  # KafkaSettings validated both
        out["sasl_mechanism"] = k.sasl_mechanism
        out["sasl_plain_username"] = k.sasl_username
        out["sasl_plain_password"] = k.sasl_password.get_secret_value()
    if k.security_protocol in SSL_PROTOCOLS:
        out["ssl_context"] = create_ssl_context(cafile=k.ssl_cafile, certfile=k.ssl_certfile, keyfile=k.ssl_keyfile)
    return out


async def check_credentials(settings: Settings, timeout_s: float = 10.0) -> None:
    """Connect to a bootstrap server, authenticate (TLS handshake, SASL), disconnect.

    A client's ``start()`` reports a rejected password as ``KafkaConnectionError("Unable to bootstrap
    ...")``: it looks like a broker that is down, and is retried as one. This raises the broker's answer
    instead (``SaslAuthenticationFailed``, ``UnsupportedSaslMechanismError``, an ``ssl.SSLError``), so
    a start-up check can fail fast and say why. ``KafkaConnectionError`` when no bootstrap server can be
    reached at all; ``TimeoutError`` after ``timeout_s``.
    """
    security = client_security(settings)

    async def _check() -> None:
        last: BaseException | None = None
        for host, port, _family in collect_hosts(settings.kafka.bootstrap, randomize=False):
            try:
                conn = await create_conn(host, port, request_timeout_ms=settings.kafka.request_timeout_ms, **security)
            except ssl.SSLError:
                raise  # the TLS handshake failed: an answer, not an unreachable server
            except (OSError, TimeoutError) as exc:  # unreachable: try the next server
                last = exc
                continue
            conn.close()
            return
        raise KafkaConnectionError(f"no bootstrap server of {settings.kafka.bootstrap!r} could be reached: {last!r}")

    await asyncio.wait_for(_check(), timeout_s)


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of the run topics on a cluster of ``brokers``: min(3, n), min(2, n).

    One broker keeps (1, 1). Three give (3, 2): with the producers' acks=all a write is on two replicas before it is
    acknowledged, so one broker may die without losing or refusing anything; with a second one down the partitions
    fall below the minimum ISR and producers are refused (NotEnoughReplicas, retried) rather than lose data.
    """
    if brokers < 1:
        raise ValueError(f"a Kafka cluster has at least one broker, got {brokers=}")
    return min(3, brokers), min(2, brokers)


POLICY_SEGMENT_MS = 10 * 60 * 1000
"""The policy topic's active segment rolls at least this often (Kafka never compacts the active segment)."""


def policy_segments(max_message_bytes: int) -> dict[str, str]:
    """Segment configs of the compacted policy topic: 16 MiB segments (at least 4 of the largest message, which
    Kafka requires to fit in one), rolled every :data:`POLICY_SEGMENT_MS`, so inline weights of superseded
    announcements are compacted away within minutes instead of after the 1 GiB / 7 day defaults."""
    return {"segment.bytes": str(max(16 * 1024 * 1024, 4 * max_message_bytes)), "segment.ms": str(POLICY_SEGMENT_MS)}


BROKER_DEFAULT_MESSAGE_BYTES = 1_048_588
"""Kafka's default ``message.max.bytes``: what a topic without its own ``max.message.bytes`` accepts."""


async def topic_max_message_bytes(settings: Settings, topic: str) -> int | None:
    """The ``max.message.bytes`` in force on ``topic`` (its own, else the broker's), or None when it cannot be
    read (no such topic, not authorized to describe it). paramsync caps inline policies by it: a policy topic
    created before they existed keeps the broker's default, and a record the broker refuses as too large
    leaves the idempotent producer out of sequence (``OutOfOrderSequenceNumber`` on every later send)."""
    admin = make_admin(settings)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": None})])
    finally:
        await admin.close()
    for response in responses:
        for error_code, _message, _type, _name, entries in response.resources:
            if error_code != 0:
                log.warning("topic_config_unreadable", topic=topic, error_code=error_code)
                return None
            for name, value, *_ in entries:
                if name == "max.message.bytes" and value is not None:
                    return int(value)
    return None


def topic_specs(settings: Settings, brokers: int | None = None) -> list[NewTopic]:
    """Partitions and configs of every run topic, from settings and the cluster's size.

    ``brokers`` None (a declaration made without a cluster, e.g. the Kubernetes overlay's KafkaTopics): replication
    factor ``kafka.replication_factor``, the brokers' own min.insync.replicas. With ``brokers``: the larger of
    ``kafka.replication_factor`` and :func:`replication_for`'s factor, and its min.insync.replicas on every topic
    (a factor above ``brokers`` is refused by the broker with InvalidReplicationFactor, which names it).
    """
    k = settings.kafka
    t = Topics.for_run(settings.run)
    rf = k.replication_factor
    isr: dict[str, str] = {}
    if brokers is not None:
        cluster_rf, min_isr = replication_for(brokers)
        rf = max(rf, cluster_rf)
        isr = {"min.insync.replicas": str(min(min_isr, rf))}
    big = str(k.max_message_bytes + 64 * 1024)
    return [
        NewTopic(t.samples, k.samples_partitions, rf,
                 topic_configs={"retention.ms": str(k.samples_retention_ms), "max.message.bytes": big, **isr}),
        NewTopic(t.dlq, 1, rf,
                 topic_configs={"retention.ms": str(k.dlq_retention_ms), "max.message.bytes": big, **isr}),
        # Compacted: the latest candidate and the latest announcement (with its inline weights) survive
        # forever; segments roll so that older announcements, and the weights on them, are compacted away.
        NewTopic(t.policy, 1, rf,
                 topic_configs={"cleanup.policy": "compact", "min.compaction.lag.ms": "60000",
                                "max.message.bytes": big, **policy_segments(int(big)), **isr}),
        NewTopic(t.control, 1, rf, topic_configs={"retention.ms": str(24 * 3600 * 1000), **isr}),
        NewTopic(t.heartbeats, 1, rf, topic_configs={"retention.ms": str(k.heartbeats_retention_ms), **isr}),
        # Flow-control grants: only the newest matters, and readers start at the end. One partition per
        # shard of samplers (shared.credits.shard_of): each sampler reads only its own.
        NewTopic(t.credits, k.credits_partitions, rf,
                 topic_configs={"retention.ms": str(k.heartbeats_retention_ms), **isr}),
    ]


async def ensure_topics(settings: Settings) -> Topics:
    """Create the run's topics if absent (idempotent; safe when several services race), replicated for the
    cluster's size (:func:`topic_specs` with the brokers the cluster's metadata lists now). Topics that exist are
    left as they are, except the credits topic: with fewer partitions than ``kafka.credits_partitions`` it is
    grown (grants for a shard it lacks would have nowhere to go); where that is refused, a ``ValueError`` says
    what to change."""
    admin = make_admin(settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [s.name for s in topic_specs(settings)]
        missing_names = [name for name in wanted if name not in existing]
        brokers = len((await admin.describe_cluster())["brokers"]) if missing_names else 1
        missing = [s for s in topic_specs(settings, brokers) if s.name in missing_names]
        for spec in missing:  # one at a time: a race on one must not hide the others
            try:
                await admin.create_topics([spec])
                log.info("topic_created", topic=spec.name, partitions=spec.num_partitions,
                         replication_factor=spec.replication_factor, brokers=brokers)
            except TopicAlreadyExistsError:
                pass
        await _grow_credits(admin, settings)
    finally:
        await admin.close()
    return Topics.for_run(settings.run)


async def _grow_credits(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    topic, wanted = Topics.for_run(settings.run).credits, settings.kafka.credits_partitions
    have = 0
    for desc in await admin.describe_topics([topic]):
        if desc.get("topic") == topic and not desc.get("error_code"):
            have = len(desc.get("partitions") or [])
    if have == 0 or have >= wanted:
        return
    try:
        await admin.create_partitions({topic: NewPartitions(wanted)})
        log.info("topic_partitions_raised", topic=topic, partitions=wanted, were=have)
    except InvalidPartitionsError:  # another service raised them first
        return
    except KafkaError as exc:
        if exc.retriable or isinstance(exc, KafkaConnectionError):
            raise
        raise ValueError(f"{topic} has {have} partitions but kafka.credits_partitions is {wanted}, and raising them "
                         f"failed ({exc!r}): raise the topic's partitions or set kafka.credits_partitions: {have}"
                         ) from exc


def make_admin(settings: Settings, **overrides: Any) -> AIOKafkaAdminClient:
    """Admin client of the run's cluster (bootstrap, security, ``kafka.request_timeout_ms``; ``overrides`` win)."""
    k = settings.kafka
    kwargs: dict[str, Any] = {"bootstrap_servers": k.bootstrap, "request_timeout_ms": k.request_timeout_ms,
                              **client_security(settings)}
    kwargs.update(overrides)
    return AIOKafkaAdminClient(**kwargs)


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """Idempotent (acks=all), compressed producer."""
    k = settings.kafka
    kwargs: dict[str, Any] = {
        "bootstrap_servers": k.bootstrap,
        "enable_idempotence": True,
        "acks": "all",
        "compression_type": None if k.compression == "none" else k.compression,
        "max_request_size": k.max_message_bytes + 64 * 1024,
        "request_timeout_ms": k.request_timeout_ms,
        "linger_ms": 2,
        **client_security(settings),
    }
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


def make_consumer(settings: Settings, *topics: str, group_id: str | None, **overrides: Any) -> AIOKafkaConsumer:
    """Pull consumer with auto-commit off: callers commit what they have processed."""
    k = settings.kafka
    kwargs: dict[str, Any] = {
        "bootstrap_servers": k.bootstrap,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": k.max_message_bytes + 64 * 1024,
        "fetch_max_bytes": max(50 * 1024 * 1024, k.max_message_bytes * 2),
        "request_timeout_ms": k.request_timeout_ms,
        "fetch_max_wait_ms": k.fetch_max_wait_ms,
        # A killed member holds its partitions until its session expires: keep that short (the
        # broker's group.min.session.timeout.ms is 6 s) so a restarted trainer resumes quickly.
        "session_timeout_ms": 6_000,
        "heartbeat_interval_ms": 2_000,
        "max_poll_interval_ms": 300_000,
        **client_security(settings),
    }
    kwargs.update(overrides)
    return AIOKafkaConsumer(*topics, **kwargs)


class CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    """Rebalance listener: before partitions leave, commit what was finished on them.

    ``on_revoke`` is awaited by aiokafka before the group rejoins, so a caller's commit of
    trained offsets lands before another member takes the partitions over.
    """

    def __init__(
        self,
        on_revoke: Callable[[set[TopicPartition]], Awaitable[None]],
        on_assign: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
    ) -> None:
        self._on_revoke = on_revoke
        self._on_assign = on_assign

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        parts = set(revoked)
        log.info("partitions_revoked", partitions=sorted(f"{tp.topic}[{tp.partition}]" for tp in parts))
        await self._on_revoke(parts)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        parts = set(assigned)
        log.info("partitions_assigned", partitions=sorted(f"{tp.topic}[{tp.partition}]" for tp in parts))
        if self._on_assign is not None:
            await self._on_assign(parts)


class LagProbe:
    """Consumer lag of a group, with long-lived connections (cheap to call every second)."""

    def __init__(self, settings: Settings) -> None:
        k = settings.kafka
        self._admin = make_admin(settings)
        self._probe = AIOKafkaConsumer(bootstrap_servers=k.bootstrap, enable_auto_commit=False,
                                       request_timeout_ms=k.request_timeout_ms, **client_security(settings))

    async def start(self) -> None:
        await self._admin.start()
        await self._probe.start()

    async def stop(self) -> None:
        await self._probe.stop()
        await self._admin.close()

    async def lag(self, group: str, topic: str) -> dict[int, int]:
        """Records not yet committed by ``group`` on each partition of ``topic`` (end - committed).

        A partition the group never committed counts from the log start offset.
        """
        parts = self._probe.partitions_for_topic(topic)
        if parts is None:
            await self._probe._client.force_metadata_update()  # noqa: SLF001 - aiokafka offers no public refresh
            parts = self._probe.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return {}
        ends, starts = await asyncio.gather(self._probe.end_offsets(tps), self._probe.beginning_offsets(tps))
        committed = await self._admin.list_consumer_group_offsets(group, partitions=tps)
        lag = {}
        for tp in tps:
            meta = committed.get(tp)
            pos = meta.offset if meta is not None and meta.offset >= 0 else starts[tp]
            lag[tp.partition] = max(0, ends[tp] - pos)
        return lag


async def consumer_lag(settings: Settings, group: str, topic: str) -> dict[int, int]:
    """One-shot :meth:`LagProbe.lag`."""
    probe = LagProbe(settings)
    try:  # start inside: a start that fails half-way (broker down) must still close what it opened
        await probe.start()
        return await probe.lag(group, topic)
    finally:
        await probe.stop()
