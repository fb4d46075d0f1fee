"""The trainer service on the in-memory bus: its reaction to rebalances mid-batch, re-deliveries,
failing commits and stalls, without a broker. (Kafka's own semantics are proven in
tests/integration and tests/faults against a real one.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError

from services.trainer.service import Trainer
from shared.bus import MemoryBus, Record
from shared.fragment import Fragment, encode_fragment
from shared.kafka import Topics
from shared.marker import VersionRecord
from shared.messages import KEY_ANNOUNCE, KEY_CANDIDATE, PolicyMessage
from shared.settings import Settings, StoreSettings, TrainerSettings
from tests.fragments import blank_fragment

RUN = "r"
T = Topics.for_run(RUN)
TP0, TP1 = TopicPartition(T.samples, 0), TopicPartition(T.samples, 1)


def fragment(version: int = 0, sample_id: str | None = None) -> tuple[list[tuple[str, bytes]], bytes]:
    return encode_fragment(blank_fragment(version, steps=4, envs=2, sample_id=sample_id))


def make(tmp_path: Path, mem: MemoryBus | None = None, **trainer: Any) -> tuple[Trainer, MemoryBus]:
    """A trainer on ``mem`` (a new bus with a 2-partition samples topic by default) and a store in ``tmp_path``."""
    if mem is None:
        mem = MemoryBus()
        mem.create(T.samples, 2)
    cfg = {"batch_fragments": 2, "minibatches": 2, "epochs": 1, "checkpoint_every": 1000, "batch_timeout_s": 0.2,
           **trainer}
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(**cfg))
    return Trainer(settings, trainer_id="t", bus=mem.bus()), mem


def put(mem: MemoryBus, tp: TopicPartition, n: int = 1, version: int = 0, value: bytes | None = None) -> None:
    for _ in range(n):
        headers, payload = fragment(version)
        mem.append(tp.topic, payload if value is None else value, headers=headers, partition=tp.partition)


async def run_until(t: Trainer, done: Callable[[], bool], timeout_s: float = 30) -> None:
    stop = asyncio.Event()
    await t.start()
    task = asyncio.create_task(t.run(stop))
    try:
        async with asyncio.timeout(timeout_s):
            while not done():
                if task.done():
                    task.result()  # the trainer died: raise its error
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        try:
            await task
        finally:
            await t.stop()  # also when the trainer died: its clients and lease are released


def trained(t: Trainer) -> int:
    return t.learner.counters.fragments_trained


def dlq_reasons(mem: MemoryBus) -> list[str]:
    return [dict(r.headers)["dlq-reason"].decode() for r in mem.records(T.dlq)]


async def test_trains_then_commits_only_what_was_trained(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 3)
    put(mem, TP1, 3)
    await run_until(t, lambda: trained(t) == 6 and mem.committed.get(TP0) == 3 and mem.committed.get(TP1) == 3)
    # A fresh run checkpoints before its first commit: nothing counts as consumed without being in a checkpoint.
    marker = t.checkpoints.store.read_marker()
    assert marker is not None and marker[0].version >= 1


async def test_revoke_during_a_dead_letter_send_drops_the_rest_of_the_poll(tmp_path: Path) -> None:
    t, mem = make(tmp_path, batch_fragments=8, batch_timeout_s=0.1)
    put(mem, TP0, 1, value=b"not safetensors")  # poison first: its dead-letter send is where the revoke lands
    put(mem, TP0, 2)
    put(mem, TP1, 2)
    source: Any = t.source
    revoked: list[bool] = []

    async def revoke_all(topic: str, rec: Record) -> None:
        if topic == T.dlq and not revoked:
            revoked.append(True)
            # As aiokafka (eager rebalancing): the revoke callback gets every partition, and assignment()
            # still lists them until the rejoin completes.
            await source.revoke({TP0, TP1})
            assert {TP0, TP1} <= source.assignment()

    async def rejoin_later() -> None:
        while not revoked:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the trainer goes on meanwhile: it must take nothing more from them
        assert trained(t) == 0 and not mem.committed
        await source.assign({TP0})  # TP1 went to another member

    mem.send_hooks.append(revoke_all)
    rejoin = asyncio.create_task(rejoin_later())
    await run_until(t, lambda: rejoin.done() and trained(t) == 2 and mem.committed.get(TP0) == 3)
    await rejoin
    # The rest of the poll was not trained by this member; TP1 was never committed by it (committing a
    # partition it does not own raises IllegalStateError, which would have stopped it). The poison was
    # dead-lettered while its partition was leaving, so it came back once more: two copies in the DLQ.
    assert TP1 not in mem.committed
    assert trained(t) == 2 and dlq_reasons(mem) == ["undecodable", "undecodable"]


async def test_revoke_while_an_update_runs_commits_that_update_first(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 2)
    source: Any = t.source
    in_update, release = threading.Event(), threading.Event()
    real_update = t.learner.update

    def slow_update(frags: list[Fragment]) -> Any:
        in_update.set()
        release.wait(10)
        return real_update(frags)

    t.learner.update = slow_update  # type: ignore[method-assign]
    revoked: list[dict[TopicPartition, int]] = []

    async def driver() -> None:
        await asyncio.to_thread(in_update.wait, 10)
        rebalance = asyncio.create_task(source.rebalance(set()))  # lose everything mid-update
        await asyncio.sleep(0.1)
        assert not rebalance.done(), "the revoke did not wait for the update in progress"
        release.set()
        await rebalance
        revoked.append(dict(mem.committed))

    drive = asyncio.create_task(driver())
    await run_until(t, lambda: drive.done())
    await drive
    assert revoked == [{TP0: 2}]  # committed before the partition went: nobody trains them again
    assert trained(t) == 2


async def test_a_reassigned_partition_is_read_from_the_models_frontier(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 2)
    source: Any = t.source
    # Every commit fails (e.g. a coordinator that keeps moving): the group's offset stays at 0. After a revoke
    # and a re-assignment the member reads from where its model's ledger ends, not from the group's offset,
    # so nothing it trained comes again (before the ledger kept revoked partitions, both came back and were
    # dead-lettered as duplicates).
    mem.commit_errors.extend(CommitFailedError("rebalanced") for _ in range(1000))
    reassigned: list[bool] = []

    async def driver() -> None:
        while trained(t) < 2:
            await asyncio.sleep(0.01)
        await source.rebalance(set())
        await source.rebalance({TP0, TP1})
        reassigned.append(True)
        put(mem, TP0, 2)

    drive = asyncio.create_task(driver())
    await run_until(t, lambda: drive.done() and trained(t) == 4)
    assert reassigned and trained(t) == 4 and dlq_reasons(mem) == []
    assert t.group.ledger.state()[f"{T.samples}:0"]["digests"]["trained"]["count"] == 4


async def test_a_stall_is_reported_and_the_candidate_resent(tmp_path: Path) -> None:
    t, mem = make(tmp_path, stall_after_s=0.3, max_staleness=2)

    async def feed_stale() -> None:
        while True:
            put(mem, TP0, 1, version=0)
            await asyncio.sleep(0.05)

    feeder: asyncio.Task[None] | None = None

    def stalled_and_resent() -> bool:
        nonlocal feeder
        if feeder is None and t._started:
            # Published and trained far beyond what the samplers still send.
            t.learner.counters.policy_version = t.intake.model_version = 20
            rec = VersionRecord(version=20, blob="b", sha256="0" * 64, size=1, trainer_step=20)
            mem.append(T.policy, PolicyMessage.of("announce", rec).to_bytes(), key=KEY_ANNOUNCE)
            feeder = asyncio.get_event_loop().create_task(feed_stale())
        return t.health()["stalled"] is not None and t.publication.resent >= 1

    try:
        await run_until(t, stalled_and_resent)
    finally:
        if feeder is not None:
            feeder.cancel()
    assert "dropped as stale" in t.health()["stalled"]
    assert trained(t) == 0 and t.stats.dropped > 0


@pytest.mark.parametrize("error", [CommitFailedError("moved")])
async def test_a_failing_commit_never_stops_training(tmp_path: Path, error: Exception) -> None:
    t, mem = make(tmp_path)
    mem.commit_errors.extend([error, error])
    put(mem, TP0, 4)
    await run_until(t, lambda: trained(t) == 4 and mem.committed.get(TP0) == 4)


async def test_staleness_is_reported_per_sampler(tmp_path: Path) -> None:
    t, mem = make(tmp_path, max_staleness=1)
    put(mem, TP0, 4)
    await run_until(t, lambda: trained(t) == 4)
    report = t.stats.lags.report(time.monotonic())
    # Two updates of 2 fragments, all made by version 0: the second batch is one version old.
    assert report["s0"]["max"] == 1 and report["s0"]["dropped"] == 0 and report["s0"]["dropped_fraction"] == 0
    assert report["s0"]["mean"] == 0.5


async def test_a_restore_rewinds_the_group_before_anything_is_consumed(tmp_path: Path) -> None:
    # The crashed run committed up to 6, its last checkpoint reflects offset 2: a rebalance right after
    # the restart (before a record of the partition was polled) must not hand over offset 6.
    t, mem = make(tmp_path, batch_fragments=100, batch_timeout_s=30)
    put(mem, TP0, 6)
    mem.committed[TP0] = 6
    t.group.restore({}, {f"{T.samples}:0": 2})  # as after a restore
    t.checkpoints.last = 0
    source: Any = t.source

    async def driver() -> None:
        while not mem.committed or mem.committed.get(TP0) != 2:
            await asyncio.sleep(0.01)
        await source.rebalance(set())  # the partition leaves before this member trained anything

    drive = asyncio.create_task(driver())
    await run_until(t, lambda: drive.done())
    assert mem.committed[TP0] == 2 and trained(t) == 0


async def test_an_oversize_record_is_dead_lettered_as_headers(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    t.group.max_message_bytes = 65536
    t.spec = t.outcomes.spec = dataclasses.replace(t.spec, max_bytes=65536)
    headers, _ = fragment()
    mem.append(T.samples, b"\x00" * 70_000, headers=headers, partition=0)
    put(mem, TP0, 2)
    await run_until(t, lambda: trained(t) == 2 and mem.committed.get(TP0) == 3)
    (dead,) = mem.records(T.dlq)
    h = dict(dead.headers)
    assert h["dlq-reason"] == b"oversize" and b"70000 bytes not copied" in h["dlq-truncated"]
    assert dead.value == b"" and h["dlq-source"] == f"{T.samples}:0:0".encode()


async def test_grants_credits_for_what_it_consumed_and_reports_lag_per_sampler(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    from shared.messages import CreditGrant

    t, mem = make(tmp_path, flow_window=6)
    for n in range(1, 5):
        headers, payload = fragment(0)
        headers.append(("sampler-seq", f"inc1.{n}".encode()))
        mem.append(T.samples, payload, headers=headers, partition=n % 2)

    def grants() -> list[CreditGrant]:
        return [CreditGrant.model_validate_json(r.value or b"") for r in mem.records(T.credits)]

    await run_until(t, lambda: trained(t) == 4 and any(g.consumed.get("s0/inc1") == 4 for g in grants()))
    g = grants()[-1]
    assert g.consumed == {"s0/inc1": 4} and g.window == 6 and g.live_samplers == 1  # one live sampler: all of it
    report = t.stats.lags.report(time.monotonic())["s0"]
    assert report["max"] in (0, 1) and report["dropped"] == 0  # the second batch trains on version 0 from 1
    assert REGISTRY.get_sample_value("flywheel_trainer_sampler_staleness_versions",
                                     {"sampler": "s0", "stat": "max"}) == report["max"]
    assert REGISTRY.get_sample_value("flywheel_trainer_sampler_dropped_fraction", {"sampler": "s0"}) == 0


async def test_a_deferred_publish_is_retried_while_the_trainer_waits_for_publication(tmp_path: Path) -> None:
    # The store refuses blob writes (an S3 outage): candidates are deferred, the trainer trains until it is
    # max_staleness versions ahead of the published version and then waits. No further update will send a
    # newer candidate, so the deferred one must be retried from the loop once the store is back.
    t, mem = make(tmp_path, max_staleness=2, publish_every=1)
    real_put = t.policies.put_blob
    store_down = True

    def put_blob(data: bytes) -> Any:
        if store_down:
            raise ConnectionError("store endpoint refused the connection")
        return real_put(data)

    fed = False

    def waiting() -> bool:
        nonlocal fed
        if not fed and t._started:
            fed = True
            t.policies.put_blob = put_blob  # type: ignore[method-assign]
            rec = VersionRecord(version=0, blob="b", sha256="0" * 64, size=1, trainer_step=0)
            mem.append(T.policy, PolicyMessage.of("announce", rec).to_bytes(), key=KEY_ANNOUNCE)
            put(mem, TP0, 12, version=0)
        return (fed and t.intake.published == 0 and t.learner.counters.policy_version == 2
                and t.publication.deferred is not None)

    stop = asyncio.Event()
    await t.start()
    task = asyncio.create_task(t.run(stop))
    try:
        async with asyncio.timeout(30):
            while not waiting():
                assert not task.done()
                await asyncio.sleep(0.01)
            assert t.publication.candidate is None or t.publication.candidate[0].version < 2  # version 2 was never sent
            store_down = False
            # retried without a new update
            while t.publication.candidate is None or t.publication.candidate[0].version < 2:
                assert not task.done()
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
        await t.stop()
    assert t.learner.counters.policy_version == 2 and t.publication.deferred is None
    sent = [PolicyMessage.model_validate_json(r.value or b"").version for r in mem.records(T.policy)
            if r.key == KEY_CANDIDATE]
    assert 2 in sent


async def test_a_rollback_numbered_below_the_trainers_own_candidates_is_trained_on(tmp_path: Path) -> None:
    # The race seen in the fault suite: the trainer had sent candidates numbered past what paramsync then gave
    # the rollback (paramsync numbers it published + 1, and abandons those candidates). The trainer runs the
    # rollback's weights, so its model version is the rollback's: keeping its own higher number left it
    # max_staleness ahead of a published version nothing would ever move, waiting for publication for good.
    t, mem = make(tmp_path, max_staleness=2, publish_every=1)
    fed = rolled = False

    def ahead_then_rolled_back() -> bool:
        nonlocal fed, rolled
        if not fed and t._started:
            fed = True
            key, sha = t.policies.put_blob(t.learner.weights())
            t.learner.counters.policy_version = t.intake.model_version = 5  # candidates 1..5 sent, none published
            rec = VersionRecord(version=0, blob=key, sha256=sha, size=1, trainer_step=0)
            mem.append(T.policy, PolicyMessage.of("announce", rec).to_bytes(), key=KEY_ANNOUNCE)
            back = VersionRecord(version=1, blob=key, sha256=sha, size=len(t.learner.weights()), trainer_step=0,
                                 extra={"rollback_of": 0, "lineage": 1})
            mem.append(T.policy, PolicyMessage.of("announce", back).to_bytes(), key=KEY_ANNOUNCE)
        if fed and not rolled and t.lineage == 1:
            rolled = True
            put(mem, TP0, 2, version=1)  # samplers act on the rollback
        return rolled and trained(t) == 2

    await run_until(t, ahead_then_rolled_back)
    assert t.learner.counters.policy_version == 2
    sent = [PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy) if r.key == KEY_CANDIDATE]
    assert [(m.version, m.lineage) for m in sent] == [(0, 0), (2, 1)]  # its first publication, then on the rollback


async def test_ahead_of_the_published_version_with_nothing_sent_offers_the_current_weights(tmp_path: Path) -> None:
    # Ahead of the published version with no candidate sent for it (a rollback abandoned them, or a restart
    # from a checkpoint whose candidate was never sent): a resend has nothing to send, and max_staleness ahead
    # no update runs, so after candidate_resend_s the trainer offers the weights it runs now, at its version.
    t, mem = make(tmp_path, max_staleness=2, candidate_resend_s=0.5)
    fed = False

    def offered() -> bool:
        nonlocal fed
        if not fed and t._started:
            fed = True
            t.learner.counters.policy_version = t.intake.model_version = 5
            rec = VersionRecord(version=1, blob="b", sha256="0" * 64, size=1, trainer_step=1)
            mem.append(T.policy, PolicyMessage.of("announce", rec).to_bytes(), key=KEY_ANNOUNCE)
            t.publication.abandon()
        return any(PolicyMessage.model_validate_json(r.value or b"").version == 5
                   for r in mem.records(T.policy) if r.key == KEY_CANDIDATE)

    await run_until(t, offered)
    assert trained(t) == 0  # no update ran: the offer came from the watch
    (msg,) = [m for m in (PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy)
                          if r.key == KEY_CANDIDATE) if m.version == 5]
    assert t.policies.fetch(msg.record()) == t.learner.weights()


async def test_a_batch_formed_before_a_rollback_is_trained_after_it_not_lost(tmp_path: Path) -> None:
    """The agreement decides to follow a rollback just as a batch is due (it was formed first): the batch goes
    back to the buffer, is checked for staleness again after the rollback and trained, and every record is
    committed. Released instead, its records would stay pending in the ledger and hold the commit point."""
    from services.trainer.agreement import Alone, Decision
    from services.trainer.ranks import Vote

    msg = object()
    followed: list[object] = []

    class RollbackAtFirstBatch(Alone):
        async def decide(self, mine: Vote) -> Decision:
            if mine.ready and not followed:
                return Decision(rollback=msg, again=True)
            return await super().decide(mine)

    async def follow(m: Any) -> None:
        followed.append(m)

    t, mem = make(tmp_path)
    t.agreement = RollbackAtFirstBatch()
    t.follow_rollback = follow  # type: ignore[method-assign]
    put(mem, TP0, 2)
    put(mem, TP1, 2)
    await run_until(t, lambda: trained(t) == 4 and mem.committed.get(TP0) == 2 and mem.committed.get(TP1) == 2)
    assert followed == [msg]


async def test_the_twin_refuses_the_position_of_a_partition_revoked_meanwhile() -> None:
    """As aiokafka's consumer does (IllegalStateError, a KafkaError the trainer's readers skip): the trainer's
    find_lost awaits each position, and a rebalance can take the partition away in between (make test once failed
    on a KeyError from the twin here, under load)."""
    from aiokafka.errors import IllegalStateError, KafkaError

    from shared.bus import MemorySource

    async def noop(tps: set[TopicPartition]) -> None:
        return None

    mem = MemoryBus()
    mem.create(T.samples, 2)
    put(mem, TP1, 3)
    source = MemorySource(mem)
    source.subscribe(T.samples, noop, noop)
    await source.rebalance({TP0, TP1})
    assert await source.position(TP1) == 0
    await source.rebalance({TP0})
    with pytest.raises(IllegalStateError) as err:
        await source.position(TP1)
    assert isinstance(err.value, KafkaError)
