from aiokafka import TopicPartition

from services.trainer.ledger import Digest, OffsetLedger, mix64, range_digest

P0 = TopicPartition("r.samples", 0)
P1 = TopicPartition("r.samples", 1)


def consume(led: OffsetLedger, tp: TopicPartition, offset: int, outcome: str | None = None) -> None:
    assert led.consumed(tp, offset)
    if outcome is not None:
        led.finished(tp, offset, outcome)  # type: ignore[arg-type]


def test_commits_stop_at_the_first_unfinished_record() -> None:
    led = OffsetLedger()
    consume(led, P0, 10)
    consume(led, P0, 11, "dropped")
    consume(led, P0, 12)
    assert led.committable() == {}  # nothing finished at the frontier yet
    led.finished(P0, 10, "trained")
    assert led.committable() == {P0: 12}
    led.finished(P0, 12, "trained")
    assert led.committable() == {P0: 13}


def test_only_moved_partitions_are_committed() -> None:
    led = OffsetLedger()
    consume(led, P0, 0, "dead")
    consume(led, P1, 5, "dead")
    first = led.committable()
    assert first == {P0: 1, P1: 6}
    led.mark_committed(first)
    assert led.committable() == {}
    consume(led, P1, 6, "dropped")
    assert led.committable() == {P1: 7}


def test_a_revoked_partition_stays_in_what_the_model_reflects() -> None:
    # A checkpoint after a rebalance must still name the partitions the model trained (it used to forget
    # them, and a kill before the next checkpoint lost their records from the model).
    led = OffsetLedger()
    consume(led, P0, 3, "trained")
    consume(led, P0, 4)
    consume(led, P1, 3)
    led.forget({P0})
    assert led.snapshot() == {"r.samples:0": 4, "r.samples:1": 3}
    assert led.resume_offset(P0) == 4  # re-assigned: read again from the frontier
    assert led.consumed(P0, 4)  # the unfinished record comes again and is taken
    assert not led.consumed(P0, 3)  # a re-delivery of a record with an outcome is refused


def test_digests_cover_the_range_exactly_once() -> None:
    led = OffsetLedger()
    for off in range(100, 150):
        consume(led, P0, off, "trained" if off % 7 else ("dead" if off % 2 else "dropped"))
    st = led.state()["r.samples:0"]
    assert (st["start"], st["end"]) == (100, 150)
    total = Digest()
    for d in st["digests"].values():
        total = total + Digest.from_json(d)
    assert total == range_digest(100, 150)
    assert Digest.from_json(st["digests"]["dead"]).count == sum(1 for o in range(100, 150) if o % 7 == 0 and o % 2)
    # One offset doubled and another missing changes the hash even though the count is the same.
    forged = range_digest(100, 150) - Digest(1, mix64(120)) + Digest(1, mix64(121))
    assert forged.count == 50 and forged != range_digest(100, 150)


def test_a_gap_in_the_log_is_folded_as_gap() -> None:
    led = OffsetLedger()
    consume(led, P0, 0, "trained")
    consume(led, P0, 3, "trained")  # offsets 1 and 2 never came (the log has none there)
    st = led.state()["r.samples:0"]
    assert st["end"] == 4 and st["ranges"]["gap"] == [[1, 3]]


def test_restore_round_trip_and_older_checkpoints() -> None:
    led = OffsetLedger()
    for off in range(5):
        consume(led, P0, off, "trained")
    again = OffsetLedger()
    again.restore(led.state(), {"r.samples:0": 5, "r.samples:1": 9})
    assert again.state()["r.samples:0"] == led.state()["r.samples:0"]
    assert again.resume_offset(P1) == 9 and again.committable() == {P0: 5, P1: 9}  # rewinds the group
    assert range_digest(0, 5) == Digest.from_json(again.state()["r.samples:0"]["digests"]["trained"])


def test_range_digest_matches_the_scalar_hash() -> None:
    d = Digest()
    for off in range(7, 3000):
        d.add(off)
    assert range_digest(7, 3000) == d
