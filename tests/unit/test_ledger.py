from aiokafka import TopicPartition

from services.trainer.ledger import OffsetLedger

P0 = TopicPartition("r.samples", 0)
P1 = TopicPartition("r.samples", 1)


def test_commits_stop_at_the_first_unfinished_record() -> None:
    led = OffsetLedger()
    led.consumed(P0, 10, pending=True)
    led.consumed(P0, 11, pending=False)  # dropped as stale
    led.consumed(P0, 12, pending=True)
    assert led.committable() == {P0: 10}
    led.finished(P0, 10)
    assert led.committable() == {P0: 12}
    led.finished(P0, 12)
    assert led.committable() == {P0: 13}


def test_only_moved_partitions_are_committed() -> None:
    led = OffsetLedger()
    led.consumed(P0, 0, pending=False)
    led.consumed(P1, 5, pending=False)
    first = led.committable()
    assert first == {P0: 1, P1: 6}
    led.mark_committed(first)
    assert led.committable() == {}
    led.consumed(P1, 6, pending=False)
    assert led.committable() == {P1: 7}


def test_forget_revoked_partitions() -> None:
    led = OffsetLedger()
    led.consumed(P0, 3, pending=True)
    led.consumed(P1, 3, pending=True)
    led.forget({P0})
    assert led.committable() == {P1: 3}
    assert led.snapshot() == {"r.samples:1": 3}
