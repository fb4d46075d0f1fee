"""Records that leave the log before the trainer reads them (retention, ``deleteRecords``) are recorded as
``lost`` in the ledger, counted, logged and audited, and ``flywheel verify``'s checks then fail naming the
partition and range; gaps the log itself never held stay gaps. The in-memory bus stands in for Kafka's log
start only (pure logic); tests/integration/test_verify_topics.py and the fault suite use a real broker."""

from __future__ import annotations

import json
from pathlib import Path

from aiokafka import TopicPartition

from services.admin.verify import check_ledger
from services.trainer import telemetry as m
from services.trainer.ledger import OffsetLedger, range_digest
from shared.digest import Digest
from shared.runtime import AuditLog
from tests.unit.test_trainer_bus import TP0, TP1, make, put, run_until, trained

P0 = TopicPartition("r.samples", 0)


def test_a_lost_range_folds_at_the_frontier_once_the_records_below_it_finish() -> None:
    led = OffsetLedger()
    led.begin(P0, 0)
    assert led.consumed(P0, 0) and led.consumed(P0, 1)
    led.lost(P0, 2, 7)  # the consumer jumped from 2 to 7: five records left the log unread
    assert led.consumed(P0, 7)
    assert led.committable() == {}  # 0 and 1 are still pending: nothing may be committed past them
    led.finished(P0, 0, "trained")
    led.finished(P0, 1, "trained")
    led.finished(P0, 7, "trained")
    st = led.state()["r.samples:0"]
    assert st["end"] == 8 and st["ranges"]["lost"] == [[2, 7]] and st["ranges"]["trained"] == [[0, 2], [7, 8]]
    assert Digest.from_json(st["digests"]["lost"]) == range_digest(2, 7)
    assert check_ledger("r.samples:0", st).problems == [
        "lost before training (left the log untrained): 5 record(s) at [2, 7)"]


def test_a_lost_range_must_start_where_the_ledger_expects() -> None:
    led = OffsetLedger()
    led.begin(P0, 0)
    assert led.consumed(P0, 0)
    try:
        led.lost(P0, 3, 5)  # 1 and 2 would have no outcome
    except ValueError as exc:
        assert "next expected offset 1" in str(exc)
    else:
        raise AssertionError("a lost range away from the expected offset was accepted")


def test_a_revoke_forgets_unfolded_lost_ranges_for_the_next_reader() -> None:
    led = OffsetLedger()
    led.begin(P0, 0)
    assert led.consumed(P0, 0)
    led.lost(P0, 1, 4)
    led.forget([P0])
    assert led.resume_offset(P0) == 0 and led.expected(P0) == 0
    assert led.state()["r.samples:0"]["ranges"]["lost"] == []


def _lost_total() -> float:
    return m.RECORDS_LOST._value.get()


async def test_records_deleted_before_training_are_lost_audited_and_counted(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 6)
    put(mem, TP1, 3)
    mem.delete_records(TP0, 4)  # deleteRecords before the trainer ever read them: 0-3 are gone
    before = _lost_total()
    await run_until(t, lambda: trained(t) == 5 and mem.committed.get(TP0) == 6 and mem.committed.get(TP1) == 3)
    st = t.group.ledger.state()
    assert st["r.samples:0"]["start"] == 0 and st["r.samples:0"]["ranges"]["lost"] == [[0, 4]]
    assert st["r.samples:0"]["ranges"]["trained"] == [[4, 6]]
    assert st["r.samples:1"]["ranges"]["lost"] == []
    assert _lost_total() - before == 4
    entries = [e for e in AuditLog(t.store, "r").entries() if e.action == "records_lost_before_training"]
    assert len(entries) == 1, entries
    assert entries[0].params["partition"] == 0 and entries[0].params["from_offset"] == 0
    assert entries[0].params["to_offset"] == 4 and entries[0].params["count"] == 4
    # The checkpoint the trainer wrote carries the loss: verify's checks fail on it, naming the range.
    marker = t.checkpoints.store.read_marker()
    assert marker is not None
    part = marker[0].extra["ledger"]["r.samples:0"]
    assert "lost before training (left the log untrained): 4 record(s) at [0, 4)" in check_ledger(
        "r.samples:0", part).problems
    assert check_ledger("r.samples:1", marker[0].extra["ledger"]["r.samples:1"]).ok


async def test_a_restarted_trainer_finds_records_deleted_while_it_was_down(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 2)
    put(mem, TP1, 2)
    await run_until(t, lambda: trained(t) == 4 and mem.committed.get(TP0) == 2)
    put(mem, TP0, 5)  # offsets 2-6, untrained
    mem.delete_records(TP0, 5)  # 2-4 removed while the trainer was stopped
    t2, _ = make(tmp_path, mem)  # the same log and store
    await run_until(t2, lambda: trained(t2) == 6 and mem.committed.get(TP0) == 7)  # counters restored: 4 + 2
    st = t2.group.ledger.state()["r.samples:0"]
    assert st["start"] == 0 and st["ranges"]["lost"] == [[2, 5]]
    assert st["ranges"]["trained"] == [[0, 2], [5, 7]]


async def test_an_untouched_log_loses_nothing(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, TP0, 4)
    before = _lost_total()
    await run_until(t, lambda: trained(t) == 4 and mem.committed.get(TP0) == 4)
    st = t.group.ledger.state()["r.samples:0"]
    assert st["start"] == 0 and st["ranges"]["lost"] == [] and st["ranges"]["gap"] == []
    assert _lost_total() == before
    assert not [e for e in AuditLog(t.store, "r").entries() if e.action == "records_lost_before_training"]
    assert json.dumps(st)  # serialisable as the checkpoint stores it


async def test_every_untrained_record_deleted_is_found_without_a_later_record_and_granted_past(
        tmp_path: Path) -> None:
    # Nothing newer arrives to show the jump (the samplers wait for credits those records held): the consumer's
    # position past the ledger is enough, and the grants carry the position so the samplers stop waiting.
    from shared.messages import CreditGrant
    from tests.unit.test_trainer_bus import T

    t, mem = make(tmp_path)
    put(mem, TP0, 2)
    put(mem, TP1, 2)
    await run_until(t, lambda: trained(t) == 4 and mem.committed.get(TP0) == 2 and mem.committed.get(TP1) == 2)
    put(mem, TP0, 3)  # offsets 2-4, untrained
    mem.delete_records(TP0, 5)  # all of them removed while the trainer was stopped
    t2, _ = make(tmp_path, mem)

    def granted_past() -> bool:
        grants = [CreditGrant.model_validate_json(r.value or b"") for r in mem.records(T.credits)]
        return any(g.seen.get(0) == 5 and g.trainer == "t" and g.seen.get(1) == 2 for g in grants)

    await run_until(t2, lambda: t2.group.lost() == (3, [0]) and granted_past())
    st = t2.group.ledger.state()["r.samples:0"]
    assert st["ranges"]["lost"] == [[2, 5]]
    entries = [e for e in AuditLog(t2.store, "r").entries() if e.action == "records_lost_before_training"]
    assert [(e.params["from_offset"], e.params["to_offset"]) for e in entries] == [(2, 5)]


async def test_records_in_hand_are_never_counted_lost_by_the_position(tmp_path: Path) -> None:
    # A poll returns offsets 0-3; the first one's dead-letter send is slow (longer than two looks of find_lost),
    # and meanwhile the log start passes 1-3. The consumer's position (4) is past them, but they are in hand: they
    # are trained, not recorded as lost.
    import asyncio

    from tests.unit.test_trainer_bus import T

    t, mem = make(tmp_path, batch_fragments=4, poll_max_records=64, batch_timeout_s=0.2)  # one poll takes all 4
    put(mem, TP0, 1, value=b"poison")
    put(mem, TP0, 3)

    async def slow_dead_letter(topic: str, _rec: object) -> None:
        if topic == T.dlq:
            mem.delete_records(TP0, 4)
            await asyncio.sleep(2.5)

    mem.send_hooks.append(slow_dead_letter)
    await run_until(t, lambda: trained(t) == 3)
    st = t.group.ledger.state()["r.samples:0"]
    assert st["ranges"]["lost"] == [] and st["ranges"]["trained"] == [[1, 4]] and st["ranges"]["dead"] == [[0, 1]]
    assert t.group.lost() == (0, [])
