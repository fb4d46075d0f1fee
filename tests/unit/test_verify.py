"""``flywheel verify``'s checks on a ledger (pure); the fault suite runs it against the real topics."""

from __future__ import annotations

import copy
from typing import Any

from aiokafka import TopicPartition

from services.admin.verify import check_ledger, check_topics
from services.trainer.ledger import OffsetLedger
from shared.digest import Digest, mix64

TP = TopicPartition("r.samples", 0)


def ledger() -> dict[str, Any]:
    led = OffsetLedger()
    for off in range(40):
        assert led.consumed(TP, off)
        led.finished(TP, off, "dead" if off == 7 else ("dropped" if off in (11, 12) else "trained"))
    return led.state()["r.samples:0"]


def test_an_honest_ledger_checks() -> None:
    rep = check_ledger("r.samples:0", ledger())
    assert rep.ok, rep.problems
    assert rep.counts == {"trained": 37, "dropped": 2, "dead": 1, "gap": 0}


def test_a_range_that_claims_more_than_its_outcomes_names_the_missing_offsets() -> None:
    part = ledger()
    part["end"] = 45  # the checkpoint claims five offsets it has no outcome for
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert any("missing (no outcome): 40, 41, 42, 43, 44" in p for p in rep.problems), rep.problems


def test_a_doubled_offset_is_named_from_the_digest() -> None:
    part = copy.deepcopy(ledger())
    d = Digest.from_json(part["digests"]["trained"])
    d.add(20)  # one record trained twice, the ranges unchanged
    part["digests"]["trained"] = d.to_json()
    rep = check_ledger("r.samples:0", part)
    assert not rep.ok
    assert any("offset 20 doubled" in p for p in rep.problems), rep.problems


def test_a_swapped_offset_is_caught_though_the_count_matches() -> None:
    part = copy.deepcopy(ledger())
    d = Digest.from_json(part["digests"]["trained"])
    d.hash = (d.hash - mix64(30) + mix64(7)) & ((1 << 64) - 1)  # 30 missing, 7 (dead-lettered) trained too
    part["digests"]["trained"] = d.to_json()
    assert not check_ledger("r.samples:0", part).ok


def test_the_topics_must_agree() -> None:
    part = ledger()
    rep = check_ledger("r.samples:0", part)
    check_topics(rep, part, present=set(range(40)), dlq_sources={7}, log_start=0)
    assert rep.ok, rep.problems
    rep = check_ledger("r.samples:0", part)
    check_topics(rep, part, present=set(range(40)) - {5}, dlq_sources=set(), log_start=0)
    assert any("not on the DLQ: 7" in p for p in rep.problems)
    assert any("does not hold: 5" in p for p in rep.problems)
