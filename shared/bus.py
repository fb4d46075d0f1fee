"""The trainer's view of Kafka behind small interfaces (STYLE.md 5), with an in-memory twin.

- :class:`RecordSource`: pull records of one topic as a member of a consumer group, with
  rebalance callbacks, commits of chosen offsets, seek and position.
- :class:`Publisher`: send a record and wait for the acknowledgement, or send without waiting.
- :class:`TopicTail`: read what is appended to one partition from now on (announcements).

:func:`kafka_bus` gives the real ones (aiokafka, ``shared.kafka``'s factories). :class:`MemoryBus`
is an in-memory twin for unit tests of *the services' reaction* to a rebalance in the middle of a
batch, a commit or a send that fails, a re-delivered record: its offsets and commits are simple
and deterministic, and a test drives rebalances by hand. Kafka's own semantics (group protocol,
lag, retention) are proven against a real broker in ``tests/integration`` and ``tests/faults``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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

    async def stop(self) -> None: ...


class Publisher(Protocol):
    async def start(self) -> None: ...

    async def send_and_wait(self, topic: str, value: bytes | None, key: bytes | None = None,
                            headers: Headers | None = None) -> Any: ...

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None,
                   headers: Headers | None = None) -> Any:
        """Queue a record; returns a future of its acknowledgement."""
        ...

    async def stop(self) -> None: ...


class TopicTail(Protocol):
    async def start(self) -> None: ...

    async def poll(self, timeout_ms: int) -> list[Record]: ...

    async def stop(self) -> None: ...


@dataclass
class Bus:
    """What a trainer needs: its group's source of samples, a publisher, a tail of the policy topic."""

    source: RecordSource
    publisher: Publisher
    tail: Callable[[str], TopicTail]
    """A tail of partition 0 of a topic, from its current end."""


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

    async def stop(self) -> None:
        await self.consumer.stop()


class KafkaTail:
    def __init__(self, consumer: Any, topic: str) -> None:
        self.consumer, self.tp = consumer, TopicPartition(topic, 0)

    async def start(self) -> None:
        await self.consumer.start()
        self.consumer.assign([self.tp])
        await self.consumer.seek_to_end(self.tp)

    async def poll(self, timeout_ms: int) -> list[Record]:
        polled = await self.consumer.getmany(timeout_ms=timeout_ms)
        return [_record(r) for recs in polled.values() for r in recs]

    async def stop(self) -> None:
        await self.consumer.stop()


def kafka_bus(settings: Any, group: str, group_instance_id: str | None) -> Bus:
    from shared.kafka import make_consumer, make_producer

    return Bus(source=KafkaSource(make_consumer(settings, group_id=group, group_instance_id=group_instance_id)),
               publisher=make_producer(settings),
               tail=lambda topic: KafkaTail(make_consumer(settings, group_id=None), topic))


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

    def create(self, topic: str, partitions: int = 1) -> None:
        self.partitions[topic] = partitions
        for p in range(partitions):
            self.logs.setdefault(TopicPartition(topic, p), [])

    def append(self, topic: str, value: bytes | None, key: bytes | None = None, headers: Headers | None = None,
               partition: int | None = None) -> Record:
        if topic not in self.partitions:
            self.create(topic)
        n = self.partitions[topic]
        tp = TopicPartition(topic, partition if partition is not None else sum(len(self.logs[TopicPartition(
            topic, i)]) for i in range(n)) % n)
        log = self.logs[tp]
        rec = Record(tp, len(log), key, value, list(headers or []), int(time.time() * 1000))
        log.append(rec)
        return rec

    def records(self, topic: str) -> list[Record]:
        return [r for tp, log in sorted(self.logs.items()) if tp.topic == topic for r in log]

    def bus(self) -> Bus:
        return Bus(source=MemorySource(self), publisher=MemoryPublisher(self), tail=lambda t: MemoryTail(self, t))


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
        return self.positions[tp]

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
                   headers: Headers | None = None) -> asyncio.Future[Record]:
        fut: asyncio.Future[Record] = asyncio.get_running_loop().create_future()
        fut.set_result(self.bus.append(topic, value, key, headers))
        return fut

    async def stop(self) -> None:
        pass


class MemoryTail:
    def __init__(self, bus: MemoryBus, topic: str) -> None:
        self.bus, self.tp = bus, TopicPartition(topic, 0)
        self.pos = 0

    async def start(self) -> None:
        self.bus.logs.setdefault(self.tp, [])
        self.pos = len(self.bus.logs[self.tp])

    async def poll(self, timeout_ms: int) -> list[Record]:
        log = self.bus.logs.get(self.tp, [])
        out, self.pos = log[self.pos:], len(log)
        if not out:
            await asyncio.sleep(min(timeout_ms, 5) / 1000)
        return out

    async def stop(self) -> None:
        pass
