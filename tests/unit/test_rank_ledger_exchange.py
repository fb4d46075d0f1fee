"""The data-parallel ranks' ledger exchange (issue 29: a proof that can fail).

After every update each rank sends the ledger entries of the partitions it owns to every rank
(``OffsetLedger.export``, ``Trainer._exchange_ledgers``), and each rank takes the others' entries for the
partitions it does not own (``OffsetLedger.adopt``): rank 0's checkpoint then holds what every rank trained,
and a partition assigned to a rank later is read from where the model ends. These tests drive the real
ledger, the real ``ConsumerGroup`` and the trainer's merge with a stand-in for ``Ranks.gather``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from services.trainer.group import ConsumerGroup
from services.trainer.ledger import Digest, OffsetLedger, range_digest, tp_key
from services.trainer.service import Trainer
from shared.logging import get_logger
from shared.retry import Health

TOPIC = "r.samples"
P0 = TopicPartition(TOPIC, 0)
P1 = TopicPartition(TOPIC, 1)
P2 = TopicPartition(TOPIC, 2)


class Source:
    """What the group and the exchange read from the consumer: the assignment, seeks, positions."""

    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = set(assigned)
        self.seeks: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    async def position(self, tp: TopicPartition) -> int:
        return self.seeks.get(tp, 0)


class Gather:
    """``Ranks.gather`` for one rank: every rank's object in rank order, this rank's being what it sends."""

    def __init__(self, rank: int, others: dict[int, Any]) -> None:
        self.rank = rank
        self.others = others
        self.sent: Any = None

    def gather(self, obj: Any) -> list[Any]:
        self.sent = obj
        world = max([self.rank, *self.others]) + 1
        return [obj if r == self.rank else self.others.get(r, {}) for r in range(world)]


async def no_audit(action: str, params: dict[str, Any], outcome: str) -> None:
    return None


def rank_group(assigned: set[TopicPartition]) -> ConsumerGroup:
    return ConsumerGroup(Source(assigned), producer=None, samples_topic=TOPIC,  # type: ignore[arg-type]
                         dlq_topic="r.dlq", max_message_bytes=1 << 20, kafka_timeout_s=1.0, health=Health("trainer"),
                         retry=None, audit=no_audit, log=get_logger())  # type: ignore[arg-type]


async def exchange(group: ConsumerGroup, gather: Gather) -> None:
    """The trainer's merge and adopt, on this rank's group (``Trainer._exchange_ledgers`` reads only these)."""
    fake = SimpleNamespace(ranks=gather, source=group.source, group=group)
    await Trainer._exchange_ledgers(fake)  # type: ignore[arg-type]


def train(led: OffsetLedger, tp: TopicPartition, offsets: range, outcome: str = "trained") -> None:
    for off in offsets:
        assert led.consumed(tp, off)
        led.finished(tp, off, outcome)  # type: ignore[arg-type]


def entry(start: int, end: int) -> dict[str, Any]:
    """A ledger entry whose every offset in ``[start, end)`` was trained."""
    led = OffsetLedger()
    train(led, P2, range(start, end))
    return led.state()[tp_key(P2)]


def two_ranks() -> tuple[ConsumerGroup, ConsumerGroup]:
    """Rank 0 owns P0 (trained 0..8, 9 dead-lettered), rank 1 owns P1 (trained 0..14)."""
    a, b = rank_group({P0}), rank_group({P1})
    train(a.ledger, P0, range(0, 9))
    train(a.ledger, P0, range(9, 10), "dead")
    train(b.ledger, P1, range(0, 15))
    return a, b


async def exchange_both(a: ConsumerGroup, b: ConsumerGroup) -> tuple[Gather, Gather]:
    sent_a, sent_b = a.ledger.export({P0}), b.ledger.export({P1})
    ga, gb = Gather(0, {1: sent_b}), Gather(1, {0: sent_a})
    await exchange(a, ga)
    await exchange(b, gb)
    return ga, gb


async def test_after_an_exchange_every_rank_holds_what_every_rank_trained() -> None:
    a, b = two_ranks()
    own_a, own_b = a.ledger.state()[tp_key(P0)], b.ledger.state()[tp_key(P1)]
    ga, gb = await exchange_both(a, b)
    # Each rank sends only the entries of the partitions it owns.
    assert set(ga.sent) == {tp_key(P0)} and set(gb.sent) == {tp_key(P1)}
    # Both ledgers now hold both entries, unchanged: rank 0's checkpoint names what rank 1 trained.
    assert a.ledger.state() == b.ledger.state() == {tp_key(P0): own_a, tp_key(P1): own_b}
    assert a.ledger.snapshot() == {tp_key(P0): 10, tp_key(P1): 15}
    offsets, ledger = await a.checkpoint_state()
    assert offsets[tp_key(P1)] == 15
    assert Digest.from_json(ledger[tp_key(P1)]["digests"]["trained"]) == range_digest(0, 15)
    assert ledger[tp_key(P1)]["start"] == 0


async def test_adopt_never_overwrites_a_partition_this_rank_owns() -> None:
    a = rank_group({P0})
    train(a.ledger, P0, range(0, 10))
    assert a.ledger.consumed(P0, 10)  # in flight on this rank
    mine = a.ledger.state()[tp_key(P0)]
    # Another rank names P0 too (e.g. it still listed it during a rebalance), further on than this rank.
    theirs = entry(0, 50)
    a.ledger.adopt({tp_key(P0): theirs}, owned={P0})
    assert a.ledger.state()[tp_key(P0)] == mine and a.ledger.resume_offset(P0) == 10
    a.ledger.finished(P0, 10, "trained")  # the record in flight keeps its place
    assert a.ledger.snapshot()[tp_key(P0)] == 11
    # Through the trainer's merge too: the owner's entry stays whatever another rank sends for it.
    await exchange(a, Gather(0, {1: {tp_key(P0): theirs}}))
    assert a.ledger.snapshot()[tp_key(P0)] == 11
    assert Digest.from_json(a.ledger.state()[tp_key(P0)]["digests"]["trained"]) == range_digest(0, 11)


def test_the_owners_entry_is_the_truth_even_behind_this_ranks_older_one() -> None:
    # This rank owned P1 until a revoke (its frontier stays at 30); the new owner's entry ends at 25 (it reads
    # again what this rank had only dropped after the last exchange). adopt takes the owner's entry.
    a = rank_group({P0})
    train(a.ledger, P1, range(0, 30))
    a.ledger.forget({P1})
    a.ledger.adopt({tp_key(P1): entry(0, 25)}, owned={P0})
    assert a.ledger.resume_offset(P1) == 25 and a.ledger.state()[tp_key(P1)]["end"] == 25


async def test_a_rank_sends_only_what_it_owns_and_takes_the_owners_entry() -> None:
    # Through the trainer's merge: rank 0's own entry for P1 (revoked from it, frontier 30) is not sent, so it
    # cannot outbid the new owner's (25) in the merge, on this rank or on any other.
    a = rank_group({P0})
    train(a.ledger, P0, range(0, 3))
    train(a.ledger, P1, range(0, 30))
    a.forget({P1})
    ga = Gather(0, {1: {tp_key(P1): entry(0, 25)}})
    await exchange(a, ga)
    assert set(ga.sent) == {tp_key(P0)}
    assert a.ledger.resume_offset(P1) == 25 and a.ledger.resume_offset(P0) == 3


async def test_an_adopted_partition_is_read_from_the_adopted_frontier() -> None:
    a, b = two_ranks()
    await exchange_both(a, b)
    # Rank 1 gives up P1 and rank 0 is assigned it: it reads from where the model ends (15), not from the
    # group's committed offset nor from the start.
    b.forget({P1})
    a.source.assigned.add(P1)  # type: ignore[attr-defined]
    a.assigned({P1})
    assert a.source.seeks == {P1: 15}  # type: ignore[attr-defined]
    assert not a.ledger.consumed(P1, 14)  # trained by rank 1: a re-delivery is refused
    assert a.ledger.consumed(P1, 15)
    a.ledger.finished(P1, 15, "trained")
    st = a.ledger.state()[tp_key(P1)]
    # One ledger entry from rank 1's first record on: every offset exactly once.
    assert (st["start"], st["end"]) == (0, 16)
    assert Digest.from_json(st["digests"]["trained"]) == range_digest(0, 16)


@pytest.mark.parametrize("order", [(5, 9, 7), (9, 5, 7), (7, 5, 9)])
async def test_the_merge_keeps_the_entry_with_the_highest_end(order: tuple[int, int, int]) -> None:
    # Two ranks may both name a partition around a rebalance: the one further on wins, whichever rank sent it.
    a = rank_group({P0})
    train(a.ledger, P0, range(0, 3))
    others = {r + 1: {tp_key(P2): entry(0, end)} for r, end in enumerate(order)}
    await exchange(a, Gather(0, others))
    assert a.ledger.resume_offset(P2) == 9
    assert Digest.from_json(a.ledger.state()[tp_key(P2)]["digests"]["trained"]) == range_digest(0, 9)
    assert a.ledger.snapshot()[tp_key(P0)] == 3


async def test_records_trained_while_a_revoke_waits_reach_the_next_owner() -> None:
    a, b = rank_group({P0, P1}), rank_group({P2})
    train(a.ledger, P1, range(0, 10))
    await exchange(a, Gather(0, {1: b.ledger.export({P2})}))
    await exchange(b, Gather(1, {0: a.ledger.export({P0, P1})}))
    assert b.ledger.resume_offset(P1) == 10
    # The revoke of P1 begins while rank 0's next update runs (the callback marks it first, then waits for the
    # update lock); that update trained P1's records 10..19, and its _on_revoke commits them (include=revoked).
    a.revoking.add(P1)
    train(a.ledger, P1, range(10, 20))
    ga = Gather(0, {1: b.ledger.export({P2})})
    await exchange(a, ga)
    await exchange(b, Gather(1, {0: ga.sent}))
    a.forget({P1})
    a.source.assigned.discard(P1)  # type: ignore[attr-defined]
    b.source.assigned.add(P1)  # type: ignore[attr-defined]
    b.assigned({P1})
    # Records 10..19 are in the model (rank 0 trained them): the next owner must read from 20.
    assert b.source.seeks[P1] == 20  # type: ignore[attr-defined]
