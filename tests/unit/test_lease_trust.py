"""The trainer's lease (services/trainer/lease.py) on the local-directory store with a fake clock: a live
holder keeps it, a stale one is taken over, and the holder that lost it is fenced out of checkpoint
writes (``Checkpoints.try_save`` with the lease check as its fence, as ``UpdateTail.checkpoint`` passes
``HeldLease.check``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from services.trainer.checkpoints import Checkpoints
from services.trainer.lease import LeaseHeld, LeaseLost, TrainerLease
from services.trainer.service import Trainer
from shared.bus import MemoryBus
from shared.fragment import encode_fragment
from shared.kafka import Topics
from shared.logging import get_logger
from shared.marker import VersionedStore
from shared.retry import Health, Retrier
from shared.settings import Settings, StoreSettings, TrainerSettings
from shared.store import LocalDirStore
from tests.fragments import blank_fragment

RUN = "r"
KEY = f"{RUN}/trainer/lease.json"


class FakeClock:
    """``time.time`` and ``time.sleep`` for the lease: sleeping advances the clock and runs ``on_sleep`` (what
    the other processes do meanwhile, e.g. the live holder's renew task)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now
        self.slept = 0.0
        self.on_sleep: list[Any] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s
        for hook in list(self.on_sleep):
            hook()


@pytest.fixture
def store(tmp_path: Path) -> LocalDirStore:
    return LocalDirStore(tmp_path / "store")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def lease(store: LocalDirStore, clock: FakeClock, holder: str) -> TrainerLease:
    return TrainerLease(store, RUN, holder, renew_s=2.0, watch_s=5.0, clock=clock, sleep=clock.sleep)


def stored(store: LocalDirStore) -> dict[str, Any]:
    obj = store.get(KEY)
    assert obj is not None
    data = json.loads(obj.data)
    assert isinstance(data, dict)
    return data


def test_a_second_trainer_is_refused_while_the_holder_renews(store: LocalDirStore, clock: FakeClock) -> None:
    a, b = lease(store, clock, "a"), lease(store, clock, "b")
    assert a.acquire() == 1
    renewed_at: list[float] = []

    def a_renews() -> None:  # a's renew task, every renew_s of the fake clock
        if not renewed_at or clock.now - renewed_at[-1] >= a.renew_s:
            a.renew()
            renewed_at.append(clock.now)

    clock.on_sleep.append(a_renews)
    with pytest.raises(LeaseHeld, match="'a' is running"):
        b.acquire()
    assert b.token is None
    assert clock.slept <= b.watch_s  # refused within the watch, not after it
    now = stored(store)
    assert (now["holder"], now["token"], now["released"]) == ("a", 1, False)
    a.check()  # a still holds it: its next checkpoint is allowed


def test_a_stale_lease_is_taken_over_after_the_watch(store: LocalDirStore, clock: FakeClock) -> None:
    a, b = lease(store, clock, "a"), lease(store, clock, "b")
    assert a.acquire() == 1
    clock.now += 60  # a died: it stopped renewing (it never released)
    assert b.acquire() == 2  # the fencing token goes up by one
    assert clock.slept >= b.watch_s  # b watched the lease for a whole watch before taking it
    now = stored(store)
    assert (now["holder"], now["token"], now["released"]) == ("b", 2, False)
    b.check()


def test_a_released_lease_is_taken_at_once(store: LocalDirStore, clock: FakeClock) -> None:
    a, b = lease(store, clock, "a"), lease(store, clock, "b")
    a.acquire()
    a.release()
    assert b.acquire() == 2
    assert clock.slept == 0


def test_the_old_holder_is_fenced_out_after_a_takeover(store: LocalDirStore, clock: FakeClock) -> None:
    a, b = lease(store, clock, "a"), lease(store, clock, "b")
    a.acquire()
    a.check()
    clock.now += 60  # a stalled (a long GC pause, a partition) and b presumed it dead
    b.acquire()
    with pytest.raises(LeaseLost, match="now belongs to 'b'"):
        a.check()
    with pytest.raises(LeaseLost):
        a.renew()  # its renew task stops it too, and does not take the lease back
    a.release()  # a clean stop of the fenced-out trainer leaves the new holder's lease alone
    now = stored(store)
    assert (now["holder"], now["token"], now["released"]) == ("b", 2, False)
    b.check()
    b.renew()


# ---- the fence in front of checkpoint writes ---------------------------------------------------------
@dataclass
class Counters:
    updates: int
    policy_version: int = 0


@dataclass
class LearnerTwin:
    """What ``Checkpoints.save`` reads of a learner: its counters and its state blob."""

    name: str
    updates: int
    counters: Counters = field(init=False)

    def __post_init__(self) -> None:
        self.counters = Counters(self.updates)

    def state_bytes(self, offsets: dict[str, int], ledger: dict[str, Any]) -> bytes:
        return json.dumps({"by": self.name, "updates": self.updates, "offsets": offsets}).encode()


class GroupTwin:
    """What ``Checkpoints.save`` reads of the consumer group: its checkpoint state and the commit hold."""

    def __init__(self, offsets: dict[str, int]) -> None:
        self.offsets = offsets
        self.hold_commits = True

    async def checkpoint_state(self) -> tuple[dict[str, int], dict[str, Any]]:
        return dict(self.offsets), {}


def checkpoints(store: LocalDirStore) -> Checkpoints:
    health = Health("trainer")
    log = get_logger()
    return Checkpoints(VersionedStore(store, RUN, "checkpoints"), keep=3, health=health,
                       retry=Retrier(health, log), audit=None, log=log)  # type: ignore[arg-type]


def fence(held: TrainerLease) -> Any:
    async def check() -> None:  # as HeldLease.check
        await asyncio.to_thread(held.check)

    return check


async def test_a_checkpoint_write_by_the_fenced_out_holder_is_refused(store: LocalDirStore, clock: FakeClock) -> None:
    a, b = lease(store, clock, "a"), lease(store, clock, "b")
    a_ckpt, b_ckpt = checkpoints(store), checkpoints(store)
    a.acquire()
    assert await a_ckpt.try_save(LearnerTwin("a", 5), GroupTwin({"r.samples:0": 10}),  # type: ignore[arg-type]
                                 {"lease": a.token}, fence(a))
    clock.now += 60
    b.acquire()  # b restores a's checkpoint of update 5 and trains on
    assert await b_ckpt.try_save(LearnerTwin("b", 6), GroupTwin({"r.samples:0": 12}),  # type: ignore[arg-type]
                                 {"lease": b.token}, fence(b))
    before = b_ckpt.store.read_marker()
    assert before is not None and before[0].version == 6 and before[0].extra["lease"] == 2

    # a wakes up and reaches its next checkpoint (its update 7, trained on records b trains too)
    stale_group = GroupTwin({"r.samples:0": 14})
    with pytest.raises(LeaseLost):
        await a_ckpt.try_save(LearnerTwin("a", 7), stale_group, {"lease": a.token}, fence(a))  # type: ignore[arg-type]
    after = b_ckpt.store.read_marker()
    assert after is not None and after == before  # the marker still names b's checkpoint, untouched
    assert [r.version for r in b_ckpt.store.records()] == [5, 6]  # nothing of a's update 7 was stored
    assert not any("/7/" in k for k in store.list(f"{RUN}/checkpoints/"))
    assert stale_group.hold_commits  # and its commits stay held: nothing it trained since counts as consumed
    assert a_ckpt.last == 5


async def test_a_trainer_that_lost_its_lease_writes_no_checkpoint_when_it_stops(tmp_path: Path) -> None:
    topics = Topics.for_run(RUN)
    mem = MemoryBus()
    mem.create(topics.samples, 2)
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(batch_fragments=2, minibatches=2, epochs=1, checkpoint_every=1000,
                                                batch_timeout_s=0.2))
    t = Trainer(settings, trainer_id="a", bus=mem.bus())
    for _ in range(4):  # two updates: the first is checkpointed (a fresh run's first), the second is not
        headers, payload = encode_fragment(blank_fragment(0, steps=4, envs=2))
        mem.append(topics.samples, payload, headers=headers, partition=0)
    stop = asyncio.Event()
    await t.start()
    task = asyncio.create_task(t.run(stop))
    try:
        async with asyncio.timeout(30):
            while t.learner.counters.updates < 2 or mem.committed.get(TopicPartition(topics.samples, 0)) != 4:
                assert not task.done()
                await asyncio.sleep(0.01)
        assert t.checkpoints.last == 1
        # Another trainer presumed this one dead and took the lease (watch_s=0: at once); it restores the
        # checkpoint of update 1 and trains on. This one's renew task finds out and stops it with LeaseLost.
        assert TrainerLease(t.store, RUN, "b", watch_s=0).acquire() == 2
        with pytest.raises(LeaseLost):
            async with asyncio.timeout(30):
                await task
    finally:
        stop.set()
        if not task.done():
            task.cancel()
        await t.stop()  # as shared.service.serve does after run() raised
    marker = t.checkpoints.store.read_marker()
    assert marker is not None
    assert (marker[0].version, marker[0].extra["trainer_id"]) == (1, "a"), "the fenced-out trainer wrote a checkpoint"
