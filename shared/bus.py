"""Every service's view of Kafka behind small interfaces, with an in-memory twin (docs/architecture.md,
"The bus").

- :class:`RecordSource`: pull records of one topic as a member of a consumer group, with
  rebalance callbacks, commits of chosen offsets, seek and position (the trainer, paramsync's candidates).
- :class:`Publisher`: send a record and wait for the acknowledgement, or send without waiting.
- :class:`TopicTail`: read what is appended to partition 0 (or the partitions named) of one or more topics
  from now on, or from ``history`` records before the end (announcements, control commands, credit grants,
  heartbeats).
- :class:`LagReader`: a consumer group's lag per partition of a topic (end offset - committed).

A :class:`Bus` bundles them, plus ``create_topics`` (the run's topics, idempotent). :func:`kafka_bus`
gives the real ones (aiokafka, ``shared.kafka``'s factories). :class:`MemoryBus` is an in-memory twin
for unit tests of *the services' reaction* to a rebalance in the middle of a batch, a commit or a send
that fails, a re-delivered record, a grant or a command: its offsets and commits are simple and
deterministic, and a test drives rebalances by hand. Kafka's own semantics (group protocol, lag,
retention) are proven against a real broker in ``tests/integration`` and ``tests/faults``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError

Headers = list[tuple[str, bytes]]
OnPartitions = Callable[[set[TopicPartition]], Awaitable[None]]


@dataclass(frozen=True)
class Record:
    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp_ms: int = 0

    @property
    def topic(self) -> str:
        return str(self.tp.topic)

    @property
    def partition(self) -> int:
        """As on aiokafka's ``RecordMetadata``: a :meth:`Publisher.send` acknowledgement has both."""
        return int(self.tp.partition)


class RecordSource(Protocol):
    async def start(self) -> None: ...

    def subscribe(self, topic: str, on_revoke: OnPartitions, on_assign: OnPartitions) -> None: ...

    async def poll(self, max_records: int, timeout_ms: int) -> dict[TopicPartition, list[Record]]: ...

    def assignment(self) -> set[TopicPartition]: ...

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Raises (e.g. ``IllegalStateError``) for a partition this member does not own."""
        ...

    def seek(self, tp: TopicPartition, offset: int) -> None: ...

    async def position(self, tp: TopicPartition) -> int: ...

    async def log_start(self, tp: TopicPartition) -> int:
        """The partition's log start offset: records below it left the log (retention, ``deleteRecords``)."""
        ...

    async def stop(self) -> None: ...


class Publisher(Protocol):
    async def start(self) -> None: ...

    async def send_and_wait(self, topic: str, value: bytes | None, key: bytes | None = None,
                            headers: Headers | None = None) -> Any: ...

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None,
                   headers: Headers | None = None, partition: int | None = None) -> Any:
        """Queue a record (on ``partition``, or where the partitioner puts it); returns a future of its
        acknowledgement (``.partition``, ``.offset``)."""
        ...

    async def stop(self) -> None:
        """Flushes what is queued, then closes."""
        ...


class TopicTail(Protocol):
    async def start(self) -> None:
        """Position at the end of each topic (or ``history`` records before it). Safe to call again after
        it failed part-way (it is retried while the broker is down)."""
        ...

    async def poll(self, timeout_ms: int) -> list[Record]: ...

    async def stop(self) -> None: ...


class TailFactory(Protocol):
    def __call__(self, *topics: str, history: int = 0, partitions: Mapping[str, Sequence[int]] | None = None
                 ) -> TopicTail:
        """A tail of partition 0 of each topic (all of a run's tailed topics have one; ``partitions``
        names others per topic: a sampler's own credits partition), from its end, or from ``history``
        records before the end (no further back than the log start)."""
        ...


class LagReader(Protocol):
    async def start(self) -> None: ...

    async def lag(self, group: str, topic: str) -> dict[int, int]:
        """Records of ``topic`` not yet committed by ``group``, per partition (a partition the group never
        committed counts from the log start)."""
        ...

    async def stop(self) -> None: ...


@dataclass
class Bus:
    """What a service needs of Kafka. Each service takes one in its constructor (``kafka_bus`` by default,
    ``MemoryBus().bus()`` in unit tests) and reaches Kafka through nothing else."""

    source: RecordSource
    """The group member (``kafka_bus(..., group=...)``); a bus made without a group refuses to consume."""
    publisher: Publisher
    tail: TailFactory
    lag: Callable[[], LagReader]
    """A new lag reader (long-lived connections: start it once, ask it every second)."""
    create_topics: Callable[[], Awaitable[object]]
    """Create the run's topics if absent (idempotent, safe when several services race)."""


def _tail_partitions(topics: Sequence[str], partitions: Mapping[str, Sequence[int]] | None) -> list[TopicPartition]:
    return [TopicPartition(t, p) for t in topics for p in (partitions or {}).get(t, (0,))]


# ---- Kafka ------------------------------------------------------------------------------------
def _record(rec: Any) -> Record:
    return Record(TopicPartition(rec.topic, rec.partition), rec.offset, rec.key, rec.value, list(rec.headers or []),
                  rec.timestamp)


class KafkaSource:
    """A :class:`RecordSource` on an ``AIOKafkaConsumer`` (manual commits, see ``shared.kafka``)."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer

    async def start(self) -> None:
        await self.consumer.start()

    def subscribe(self, topic: str, on_revoke: OnPartitions, on_assign: OnPartitions) -> None:
        from shared.kafka import CommitOnRevoke

        self.consumer.subscribe([topic], listener=CommitOnRevoke(on_revoke, on_assign))

    async def poll(self, max_records: int, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        polled = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        return {tp: [_record(r) for r in recs] for tp, recs in polled.items()}

    def assignment(self) -> set[TopicPartition]:
        return set(self.consumer.assignment())

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        await self.consumer.commit(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.consumer.seek(tp, offset)

    async def position(self, tp: TopicPartition) -> int:
        return int(await self.consumer.position(tp))

    async def log_start(self, tp: TopicPartition) -> int:
        return int((await self.consumer.beginning_offsets([tp]))[tp])

    async def stop(self) -> None:
        await self.consumer.stop()


class NoSource:
    """The :class:`RecordSource` of a bus made without a consumer group: consuming is a wiring error."""

    def _refuse(self) -> RuntimeError:
        return RuntimeError("this bus has no consumer group: make it with kafka_bus(settings, group=...)")

    async def start(self) -> None:
        raise self._refuse()

    def subscribe(self, topic: str, on_revoke: OnPartitions, on_assign: OnPartitions) -> None:
        raise self._refuse()

    async def poll(self, max_records: int, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        raise self._refuse()

    def assignment(self) -> set[TopicPartition]:
        return set()

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        raise self._refuse()

    def seek(self, tp: TopicPartition, offset: int) -> None:
        raise self._refuse()

    async def position(self, tp: TopicPartition) -> int:
        raise self._refuse()

    async def log_start(self, tp: TopicPartition) -> int:
        raise self._refuse()

    async def stop(self) -> None:
        pass


class KafkaTail:
    """A :class:`TopicTail` on a group-less consumer (it commits nothing)."""

    def __init__(self, consumer: Any, topics: Sequence[str], history: int = 0,
                 partitions: Mapping[str, Sequence[int]] | None = None) -> None:
        self.consumer = consumer
        self.tps = _tail_partitions(topics, partitions)
        self.history = history
        self._started = False

    async def start(self) -> None:
        if not self._started:  # a consumer must not be started twice (a retried start after a failed seek)
            await self.consumer.start()
            self._started = True
        self.consumer.assign(self.tps)
        if self.history <= 0:
            await self.consumer.seek_to_end(*self.tps)
            return
        ends = await self.consumer.end_offsets(self.tps)
        begins = await self.consumer.beginning_offsets(self.tps)
        for tp in self.tps:
            self.consumer.seek(tp, max(begins[tp], ends[tp] - self.history))

    async def poll(self, timeout_ms: int) -> list[Record]:
        polled = await self.consumer.getmany(timeout_ms=timeout_ms)
        return [_record(r) for recs in polled.values() for r in recs]

    async def stop(self) -> None:
        await self.consumer.stop()


def kafka_bus(settings: Any, group: str | None = None, group_instance_id: str | None = None) -> Bus:
    """The real bus of one service: a member of ``group`` (None: this service consumes in no group), an
    idempotent producer, group-less tails and lag readers; every client from ``shared.kafka``."""
    from shared.kafka import LagProbe, ensure_topics, make_consumer, make_producer

    def tail(*topics: str, history: int = 0, partitions: Mapping[str, Sequence[int]] | None = None) -> TopicTail:
        tps = _tail_partitions(topics, partitions)
        k = settings.kafka  # one partition: the broker answers the moment a record comes (kafka.tail_fetch_max_wait_ms)
        wait = k.tail_fetch_max_wait_ms if len(tps) == 1 else k.fetch_max_wait_ms
        return KafkaTail(make_consumer(settings, group_id=None, fetch_max_wait_ms=wait), topics, history, partitions)

    source: RecordSource = NoSource() if group is None else KafkaSource(
        make_consumer(settings, group_id=group, group_instance_id=group_instance_id))
    return Bus(source=source, publisher=make_producer(settings), tail=tail, lag=lambda: LagProbe(settings),
               create_topics=lambda: ensure_topics(settings))


# ---- in memory --------------------------------------------------------------------------------
@dataclass
class MemoryBus:
    """Topics as lists in memory; one group's committed offsets; rebalances driven by the test."""

    partitions: dict[str, int] = field(default_factory=dict)
    logs: dict[TopicPartition, list[Record]] = field(default_factory=dict)
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    send_hooks: list[Callable[[str, Record], Awaitable[None]]] = field(default_factory=list)
    """Awaited inside every acknowledged send (a test can rebalance or fail there)."""
    commit_errors: list[BaseException] = field(default_factory=list)
    """Raised by the next commits, in order."""
    log_starts: dict[TopicPartition, int] = field(default_factory=dict)
    """Per partition, the first offset still in the log (:meth:`delete_records` moves it)."""

    def delete_records(self, tp: TopicPartition, before: int) -> None:
        """Kafka's ``deleteRecords``: offsets below ``before`` leave the log (offsets are never reused)."""
        self.log_starts[tp] = max(self.log_starts.get(tp, 0), min(before, len(self.logs.get(tp, []))))

    def create(self, topic: str, partitions: int = 1) -> None:
        self.partitions[topic] = partitions
        for p in range(partitions):
            self.logs.setdefault(TopicPartition(topic, p), [])

    def append(self, topic: str, value: bytes | None, key: bytes | None = None, headers: Headers | None = None,
               partition: int | None = None) -> Record:
        if topic not in self.partitions:
            self.create(topic)
        if partition is not None and partition >= self.partitions[topic]:
            self.create(topic, partition + 1)
        n = self.partitions[topic]
        tp = TopicPartition(topic, partition if partition is not None else sum(len(self.logs[TopicPartition(
            topic, i)]) for i in range(n)) % n)
        log = self.logs[tp]
        rec = Record(tp, len(log), key, value, list(headers or []), int(time.time() * 1000))
        log.append(rec)
        return rec

    def records(self, topic: str) -> list[Record]:
        return [r for tp, log in sorted(self.logs.items()) if tp.topic == topic for r in log]

    def tail(self, *topics: str, history: int = 0, partitions: Mapping[str, Sequence[int]] | None = None
             ) -> MemoryTail:
        return MemoryTail(self, topics, history, partitions)

    def lag_reader(self) -> MemoryLag:
        return MemoryLag(self)

    async def create_topics(self) -> None:
        """Nothing to do: a topic exists from its first record (or its first tail)."""

    def bus(self) -> Bus:
        return Bus(source=MemorySource(self), publisher=MemoryPublisher(self), tail=self.tail, lag=self.lag_reader,
                   create_topics=self.create_topics)


class MemorySource:
    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self.topic: str | None = None
        self.owned: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}
        self._on_revoke: OnPartitions | None = None
        self._on_assign: OnPartitions | None = None

    async def start(self) -> None:
        pass

    def subscribe(self, topic: str, on_revoke: OnPartitions, on_assign: OnPartitions) -> None:
        self.topic, self._on_revoke, self._on_assign = topic, on_revoke, on_assign

    async def rebalance(self, owned: set[TopicPartition]) -> None:
        """:meth:`revoke` what is not in ``owned``, then :meth:`assign` ``owned``."""
        await self.revoke(self.owned - owned)
        await self.assign(owned)

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        """The revoke callback, as aiokafka runs it when a rebalance starts: the assignment still lists
        these partitions afterwards, until :meth:`assign` (the rejoin) completes."""
        assert self._on_revoke is not None
        if revoked:
            await self._on_revoke(set(revoked))

    async def assign(self, owned: set[TopicPartition]) -> None:
        """The rejoin completes: the assignment becomes ``owned`` (every partition, revoked or not,
        starts again at the group's committed offset, as after a real rebalance) and the assign
        callback runs with all of them."""
        assert self._on_assign is not None
        self.owned = set(owned)
        self.positions = {tp: self.bus.committed.get(tp, 0) for tp in owned}
        if owned:
            await self._on_assign(set(owned))  # eager rebalancing: the whole new assignment

    async def poll(self, max_records: int, timeout_ms: int) -> dict[TopicPartition, list[Record]]:
        if self.topic is not None and not self.owned:  # the first poll joins: everything is ours
            await self.rebalance({tp for tp in self.bus.logs if tp.topic == self.topic})
        out: dict[TopicPartition, list[Record]] = {}
        n = 0
        for tp in sorted(self.owned):
            log = self.bus.logs.get(tp, [])
            # Below the log start: reset to it, as a consumer with auto_offset_reset=earliest does.
            self.positions[tp] = max(self.positions[tp], self.bus.log_starts.get(tp, 0))
            while self.positions[tp] < len(log) and n < max_records:
                out.setdefault(tp, []).append(log[self.positions[tp]])
                self.positions[tp] += 1
                n += 1
        if not out:
            await asyncio.sleep(min(timeout_ms, 5) / 1000)
        return out

    def assignment(self) -> set[TopicPartition]:
        return set(self.owned)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.bus.commit_errors:
            raise self.bus.commit_errors.pop(0)
        for tp in offsets:
            if tp not in self.owned:
                raise IllegalStateError(f"partition {tp} is not assigned")
        self.bus.committed.update(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    async def position(self, tp: TopicPartition) -> int:
        if tp not in self.owned:  # as aiokafka: a partition revoked meanwhile (a caller awaited across a rebalance)
            raise IllegalStateError(f"partition {tp} is not assigned")
        return self.positions[tp]

    async def log_start(self, tp: TopicPartition) -> int:
        return self.bus.log_starts.get(tp, 0)

    async def stop(self) -> None:
        pass


class MemoryPublisher:
    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus

    async def start(self) -> None:
        pass

    async def send_and_wait(self, topic: str, value: bytes | None, key: bytes | None = None,
                            headers: Headers | None = None) -> Record:
        rec = self.bus.append(topic, value, key, headers)
        for hook in list(self.bus.send_hooks):
            await hook(topic, rec)
        return rec

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None,
                   headers: Headers | None = None, partition: int | None = None) -> asyncio.Future[Record]:
        fut: asyncio.Future[Record] = asyncio.get_running_loop().create_future()
        fut.set_result(self.bus.append(topic, value, key, headers, partition))
        return fut

    async def stop(self) -> None:
        pass


class MemoryTail:
    """Partition 0 (or those named) of each topic, from its end (or ``history`` records before it) at
    :meth:`start`."""

    def __init__(self, bus: MemoryBus, topics: Sequence[str], history: int = 0,
                 partitions: Mapping[str, Sequence[int]] | None = None) -> None:
        self.bus, self.tps, self.history = bus, _tail_partitions(topics, partitions), history
        self.pos: dict[TopicPartition, int] = {}

    async def start(self) -> None:
        for tp in self.tps:
            if tp.topic not in self.bus.partitions or tp.partition >= self.bus.partitions[tp.topic]:
                self.bus.create(tp.topic, max(tp.partition + 1, self.bus.partitions.get(tp.topic, 1)))
            self.pos[tp] = max(0, len(self.bus.logs[tp]) - max(0, self.history))

    async def poll(self, timeout_ms: int) -> list[Record]:
        out: list[Record] = []
        for tp in self.tps:
            log = self.bus.logs.get(tp, [])
            out.extend(log[self.pos.get(tp, 0):])
            self.pos[tp] = len(log)
        if not out:
            await asyncio.sleep(min(timeout_ms, 5) / 1000)
        return out

    async def stop(self) -> None:
        pass


class MemoryLag:
    """Lag of the bus's one group (``committed``), whatever group is named."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus

    async def start(self) -> None:
        pass

    async def lag(self, group: str, topic: str) -> dict[int, int]:
        return {tp.partition: max(0, len(log) - self.bus.committed.get(tp, 0))
                for tp, log in sorted(self.bus.logs.items()) if tp.topic == topic}

    async def stop(self) -> None:
        pass
