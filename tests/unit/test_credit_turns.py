"""Credit flow control at a thousand samplers (shared.credits, issue 32): grants sharded over the credits
partitions (each sampler reads only its own, O(shard) bytes), and samplers taking turns when they outnumber
``flow_window``, so the fragments in flight stay within the window whatever the number of samplers."""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections import Counter, deque
from pathlib import Path

from aiokafka import TopicPartition

from shared.bus import MemoryBus
from shared.credits import Consumption, CreditGate, sampler_of, shard_of
from shared.kafka import Topics, topic_specs
from shared.messages import CreditGrant
from shared.settings import KafkaSettings, Settings, StoreSettings, TrainerSettings

RUN = "r"
T = Topics.for_run(RUN)


def _ids(n: int) -> list[str]:
    return [f"sampler-{i:04d}-{zlib.crc32(str(i).encode()):08x}" for i in range(n)]


class Swarm:
    """``n`` sampler gates and one trainer, exchanging grants and fragments in rounds (no I/O).

    Each round: the trainer grants (one grant per shard); each gate applies only its own shard's grant; every
    open gate sends one fragment (into a FIFO, as on the samples topic); the trainer consumes ``consume_per_round``
    fragments from the head. ``silent`` samplers send nothing (dead, paused)."""

    def __init__(self, n: int, window: int, shards: int, consume_per_round: int = 8, live_after_s: float = 10.0):
        self.ids = _ids(n)
        self.gates = {sid: CreditGate(sid, incarnation=f"{i:08x}") for i, sid in enumerate(self.ids)}
        self.trainer = Consumption(window, live_after_s=live_after_s, shards=shards)
        self.shards = shards
        self.queue: deque[tuple[str, int]] = deque()
        self.consume_per_round = consume_per_round
        self.sent: Counter[str] = Counter()
        self.silent: set[str] = set()
        self.now = 0.0
        self.max_grant_bytes = 0
        self.read_bytes: Counter[str] = Counter()  # what each sampler read of the credits topic

    def round(self, dt: float = 0.1) -> None:
        self.now += dt
        grants = self.trainer.grants("t", self.now)
        assert [g.shard for g in grants] == list(range(self.shards))
        sizes = [len(g.to_bytes()) for g in grants]
        self.max_grant_bytes = max(self.max_grant_bytes, *sizes)
        for sid, gate in self.gates.items():
            s = shard_of(sid, self.shards)
            gate.grant(grants[s], self.now)  # its own partition only
            self.read_bytes[sid] += sizes[s]
        for sid, gate in self.gates.items():
            if sid not in self.silent and gate.open():
                self.queue.append((sid, gate.next_seq()))
                self.sent[sid] += 1
        for _ in range(min(self.consume_per_round, len(self.queue))):
            sid, n = self.queue.popleft()
            self.trainer.saw(sid, f"{self.gates[sid].incarnation}.{n}", self.now)

    @property
    def in_flight(self) -> int:
        return len(self.queue)


def test_shard_of_is_crc32_of_the_id_and_the_same_everywhere() -> None:
    assert shard_of("s-1", 16) == zlib.crc32(b"s-1") % 16 == shard_of("s-1", 16)
    assert shard_of("anything", 1) == 0
    assert sampler_of("host/with/slash/ab12cd34") == "host/with/slash"
    spread = Counter(shard_of(sid, 64) for sid in _ids(1000))
    assert len(spread) == 64 and max(spread.values()) <= 2 * 1000 // 64  # no shard holds much more than its share


def test_each_grant_holds_only_its_shards_samplers() -> None:
    c = Consumption(total_window=10_000, shards=8)
    for sid in _ids(100):
        c.saw(sid, "i.3", now=0.0)
    grants = c.grants("t", now=0.0)
    assert len(grants) == 8 and {g.shards for g in grants} == {8}
    for g in grants:
        assert g.consumed and all(shard_of(sampler_of(k), 8) == g.shard for k in g.consumed)
    assert sum(len(g.consumed) for g in grants) == 100


def test_a_grant_costs_o_of_its_shard_not_of_the_swarm() -> None:
    """1,000 samplers: one unsharded grant is ~40 KB; with 64 shards (samplers / 16) each is ~1-2 KB, and
    what one sampler reads per grant round is that, not the whole swarm's counts."""
    one = Swarm(1000, window=64, shards=1)
    many = Swarm(1000, window=64, shards=64)
    for _ in range(200):
        one.round()
        many.round()
    assert one.max_grant_bytes > 35_000
    assert many.max_grant_bytes < 3_000
    per_sampler = max(many.read_bytes.values()) / 200
    assert per_sampler < 3_000 and per_sampler * 20 < max(one.read_bytes.values()) / 200


def test_a_thousand_samplers_keep_at_most_flow_window_in_flight() -> None:
    """Old rule: max(1, 64 // 1000) = 1 each, so 1,000 fragments in flight. Now: after each new process's one
    fragment to make itself known, never more than the window, and the trainer's count agrees."""
    swarm = Swarm(1000, window=64, shards=64)
    for _ in range(200):  # the first fragments (one per process) drain: 1,000 / 8 per round
        swarm.round()
    assert all(g.known for g in swarm.gates.values())
    peak = 0
    for _ in range(500):
        swarm.round()
        peak = max(peak, swarm.in_flight)
        assert swarm.in_flight <= 64
        assert swarm.trainer.outstanding(swarm.now) <= 64
    assert peak >= 32  # the window is used, not just respected (the trainer consumes 8 a round)
    assert all(g.window == 1 and g.turns for g in swarm.gates.values())


def test_below_the_window_nothing_changes_each_sampler_gets_its_share() -> None:
    swarm = Swarm(8, window=64, shards=4, consume_per_round=100)
    for _ in range(20):
        swarm.round()
    assert all(not g.turns and g.allowed == 8 for g in swarm.gates.values())
    assert all(not g.limits for g in swarm.trainer.grants("t", swarm.now))


def test_turns_are_fair() -> None:
    swarm = Swarm(300, window=16, shards=16, consume_per_round=4)
    for _ in range(100):
        swarm.round()
    before = dict(swarm.sent)
    for _ in range(3000):
        swarm.round()
    got = [swarm.sent[sid] - before.get(sid, 0) for sid in swarm.ids]
    # 3,000 rounds x 4 consumed = 12,000 fragments over 300 samplers: 40 each, round robin within one or two
    assert sum(got) >= 11_000
    assert max(got) - min(got) <= 2, (min(got), max(got))


def test_credits_of_a_silent_sampler_are_reclaimed_after_the_liveness_timeout() -> None:
    swarm = Swarm(200, window=16, shards=8, consume_per_round=4, live_after_s=10.0)
    for _ in range(100):
        swarm.round()
    holders = [sid for sid, g in swarm.gates.items() if g.limit is not None and g.limit > g.consumed]
    assert holders
    swarm.silent = set(holders)  # they die holding credits
    stalled = 0
    for _ in range(150):  # the living use what the dead do not hold; once the dead hold every credit, nothing
        before = sum(swarm.sent.values())
        swarm.round()
        stalled += sum(swarm.sent.values()) == before
        assert swarm.trainer.outstanding(swarm.now) <= 16
    assert 0 < stalled <= 10 / 0.1 + 2  # at most the liveness timeout (10 s = 100 rounds) without a credit
    progress_at = dict(swarm.sent)
    for _ in range(100):  # reclaimed, handed to the living: full speed (4 consumed a round)
        swarm.round()
        assert swarm.trainer.outstanding(swarm.now) <= 16
    living = sum(swarm.sent[s] - progress_at.get(s, 0) for s in swarm.ids if s not in swarm.silent)
    assert living >= 100 * 4 * 0.95
    # The dead are not given a turn again at once (they did not use the last one).
    again = [sid for sid in holders if swarm.trainer.grant("t", swarm.now).limits.get(swarm.gates[sid].key, 0) >
             (swarm.gates[sid].limit or 0)]
    assert not again


def test_a_silent_sampler_is_tried_again_later_and_one_that_speaks_again_counts_again() -> None:
    c = Consumption(total_window=1, live_after_s=10.0)
    for sid in ("a", "b", "c"):
        c.saw(sid, f"{sid}.1", now=0.0)
    g = c.grant("t", now=0.0)
    assert g.window == 0 and g.limits == {"a/a": 2}  # consumed 1, one more
    assert c.grant("t", now=5.0).limits == {"a/a": 2}  # still a's
    g = c.grant("t", now=10.5)  # a silent for 10.5 s: reclaimed, b's turn
    assert g.limits == {"b/b": 2} and c.outstanding(10.5) == 1
    assert c.contenders(10.5) == 2  # b holds a turn, c waits for one (neither consumed from for 10 s)
    c.saw("b", "b.2", now=11.0)
    assert c.grant("t", now=11.0).limits == {"c/c": 2}  # a did not use its turn: skipped for a while
    c.saw("c", "c.2", now=11.5)
    assert c.grant("t", now=11.5).limits == {"b/b": 3}
    c.saw("a", "a.2", now=12.0)  # a was only slow: it sends again, and counts again
    c.saw("b", "b.3", now=12.0)
    assert c.grant("t", now=12.0).limits == {"a/a": 3}  # a waited longest


def test_a_restarted_sampler_gets_turns_and_its_old_incarnation_none() -> None:
    c = Consumption(total_window=1, live_after_s=10.0)
    c.saw("b", "j.1", now=0.0)
    c.saw("a", "old.5", now=0.0)
    c.saw("a", "new.1", now=1.0)  # a restarted
    keys: set[str] = set()
    for t in range(2, 40):
        g = c.grant("t", now=float(t))
        keys.update(g.limits)
        for key, limit in g.limits.items():  # the holder sends and is consumed at once
            c.saw(sampler_of(key), f"{key.rpartition('/')[2]}.{limit}", now=float(t))
    assert keys == {"b/j", "a/new"}


def test_a_new_process_makes_itself_known_with_one_fragment_then_waits_its_turn() -> None:
    gate = CreditGate("s0", incarnation="i")
    gate.grant(CreditGrant(trainer="t", window=0, consumed={"x/y": 1}), now=0.0)
    assert gate.turns and not gate.known and gate.allowed == 1 and gate.open()
    gate.next_seq()
    assert not gate.open()
    gate.grant(CreditGrant(trainer="t", window=0, consumed={"s0/i": 1}), now=1.0)
    assert gate.known and gate.in_flight == 0 and not gate.open()  # known: waits for its turn
    gate.grant(CreditGrant(trainer="t", window=0, consumed={"s0/i": 1}, limits={"s0/i": 3}), now=2.0)
    assert gate.allowed == 2 and gate.open()
    gate.next_seq()
    gate.next_seq()
    assert not gate.open()
    gate.lost(gate.sent)  # the last one sent was never acknowledged
    assert gate.in_flight == 1 and gate.open()  # a lost send gives its credit back, as in a window
    gate.grant(CreditGrant(trainer="t", window=0, consumed={"s0/i": 1}, limits={"s0/i": 2}), now=3.0)
    assert gate.limit == 3  # limits only grow (an older grant, a restarted rank 0)
    gate.grant(CreditGrant(trainer="t", window=4, consumed={"s0/i": 1}), now=4.0)
    assert not gate.turns and gate.allowed == 4  # back below the window: a share each again


def test_a_trainer_that_is_down_stops_the_swarm_after_its_turns() -> None:
    swarm = Swarm(500, window=32, shards=16)
    for _ in range(200):
        swarm.round()
    sent = sum(swarm.sent.values())
    for _ in range(100):  # no more grants, nothing consumed
        for sid, gate in swarm.gates.items():
            if gate.open():
                gate.next_seq()
                swarm.sent[sid] += 1
    assert sum(swarm.sent.values()) - sent <= 32


def test_rank_zero_counts_what_the_other_ranks_consumed() -> None:
    """Two data-parallel ranks each consume half of every sampler's fragments; only rank 0 gives turns. Without
    the other rank's counts (merge) rank 0 would see credits outstanding that were consumed, and stall."""
    lead = Consumption(total_window=4, shards=2)
    other = Consumption(total_window=4, shards=2, allocates=False)
    gates = {sid: CreditGate(sid, incarnation="i") for sid in _ids(20)}
    rng = random.Random(7)
    sent = 0
    in_flight: list[tuple[str, int]] = []
    for r in range(400):
        now = r * 0.1
        for g in other.grants("t1", now):
            lead.merge(g, now)
            for sid, gate in gates.items():
                if shard_of(sid, 2) == g.shard:
                    gate.grant(g, now)
        for g in lead.grants("t0", now):
            assert all(shard_of(sampler_of(k), 2) == g.shard for k in g.limits)
            for sid, gate in gates.items():
                if shard_of(sid, 2) == g.shard:
                    gate.grant(g, now)
        for sid, gate in gates.items():
            if gate.open():
                in_flight.append((sid, gate.next_seq()))
                sent += 1
        rng.shuffle(in_flight)
        for sid, n in in_flight[:2]:  # each fragment lands on a random rank's partition
            (lead if rng.random() < 0.5 else other).saw(sid, f"i.{n}", now)
        del in_flight[:2]
        if r > 100:
            assert len(in_flight) <= 4 and lead.outstanding(now) <= 4
    assert sent >= 700  # ~2 a round: no stall


def test_the_credits_topic_has_the_configured_partitions() -> None:
    specs = {s.name: s for s in topic_specs(Settings(run=RUN, kafka=KafkaSettings(credits_partitions=64)))}
    assert specs[T.credits].num_partitions == 64
    assert {s.name: s for s in topic_specs(Settings(run=RUN))}[T.credits].num_partitions == 1


async def test_a_sampler_reads_only_its_own_credits_partition(tmp_path: Path) -> None:
    from services.sampler.service import Sampler

    settings = Settings.model_validate({"run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
                                        "kafka": {"credits_partitions": 8}})
    mem = MemoryBus()
    sampler = Sampler(settings, "s-1", bus=mem.bus())
    own = shard_of("s-1", 8)
    await sampler.inbox.start()
    assert set(sampler.inbox.tps) == {TopicPartition(T.credits, own)}  # type: ignore[attr-defined]
    assert set(sampler.commands.tps) == {TopicPartition(T.control, 0)}  # type: ignore[attr-defined]
    key = sampler.credits.key
    for p in range(8):
        if p != own:  # a grant for another shard (it would not even name this sampler): never read
            mem.append(T.credits, CreditGrant(trainer="t", window=7, consumed={}).to_bytes(), partition=p)
    mem.append(T.credits, CreditGrant(trainer="t", window=5, consumed={key: 0}, shard=own, shards=8).to_bytes(),
               partition=own)
    records = await sampler.inbox.poll(timeout_ms=10)
    assert [r.partition for r in records if r.topic == T.credits] == [own]
    for rec in records:
        sampler._on_inbox(rec)
    assert sampler.credits.window == 5


async def test_the_trainer_sends_each_shards_grant_on_its_partition(tmp_path: Path) -> None:
    from services.trainer.service import Trainer

    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        kafka=KafkaSettings(credits_partitions=4),
                        trainer=TrainerSettings(batch_fragments=2, minibatches=2, epochs=1, checkpoint_every=1000))
    mem = MemoryBus()
    t = Trainer(settings, trainer_id="t", bus=mem.bus())
    for sid in _ids(12):
        t.consumption.saw(sid, "i.2", now=time.monotonic())
    await t.grants.send()
    await asyncio.sleep(0)
    by_partition = {p: [CreditGrant.model_validate_json(r.value or b"") for r in mem.logs[TopicPartition(T.credits, p)]]
                    for p in range(4)}
    assert all(len(gs) == 1 for gs in by_partition.values())
    for p, (g,) in by_partition.items():
        assert g.shard == p and all(shard_of(sampler_of(k), 4) == p for k in g.consumed)
    assert sum(len(g.consumed) for (g,) in by_partition.values()) == 12
