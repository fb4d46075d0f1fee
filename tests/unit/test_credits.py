"""Credit flow control (shared.credits): the trainer's consumption record and the sampler's gate."""

from __future__ import annotations

from shared.credits import Consumption, CreditGate, auto_window, parse_seq, seq_value
from shared.settings import load_settings


def _settings(**trainer: object) -> object:
    env = {f"FLYWHEEL_TRAINER_{k.upper()}": str(v) for k, v in trainer.items()}
    return load_settings(None, env)


def test_auto_window_follows_the_bound_and_keeps_a_batch_waiting() -> None:
    assert auto_window(_settings(batch_fragments=2, max_staleness=8)) == 4  # two batches: one trains, one waits
    assert auto_window(_settings(batch_fragments=4, max_staleness=1)) == 4  # a bound of 1: one batch
    assert auto_window(_settings(batch_fragments=4, max_staleness=0)) == 4
    assert auto_window(_settings(batch_fragments=4, max_staleness=8, publish_every=2)) == 16
    assert auto_window(_settings(flow_window=5)) == 5


def test_seq_header_round_trip_and_garbage() -> None:
    assert parse_seq(seq_value("ab12", 7).decode()) == ("ab12", 7)
    for bad in (None, "", "7", "ab.", ".3", "ab.x", "ab.-1", "ab.\u00b2", "ab.\u0663"):  # no non-ASCII digits
        assert parse_seq(bad) is None


def test_gate_sends_a_window_then_waits_for_consumption() -> None:
    gate = CreditGate("s0", initial_window=1, incarnation="i1")
    assert gate.open()
    gate.next_seq()
    assert not gate.open()  # one in flight, window 1
    trainer = Consumption(total_window=8)
    trainer.saw("s0", "i1.1", now=0.0)
    trainer.saw("s1", "j9.1", now=0.0)
    g = trainer.grant("t", now=0.0)
    assert g.window == 4 and g.live_samplers == 2  # 8 split over two live samplers
    gate.grant(g, now=0.0)
    assert gate.in_flight == 0 and gate.window == 4
    for _ in range(4):
        assert gate.open()
        gate.next_seq()
    assert not gate.open() and gate.in_flight == 4


def test_consumption_is_monotonic_per_incarnation_and_a_restart_starts_over() -> None:
    trainer = Consumption(total_window=4)
    trainer.saw("s0", "old.10", now=0.0)
    trainer.saw("s0", "old.3", now=0.1)  # re-delivered: does not move back
    g = trainer.grant("t", now=0.2)
    assert g.consumed == {"s0/old": 10}
    gate = CreditGate("s0", incarnation="new")  # the sampler restarted with the same id
    gate.grant(g, now=0.2)
    assert gate.consumed == 0  # the old process's count is not this one's
    gate.next_seq()
    trainer.saw("s0", "new.1", now=0.3)
    assert trainer.changed
    gate.grant(trainer.grant("t", now=0.3), now=0.3)
    assert gate.in_flight == 0
    # An older grant (a restarted trainer still re-reading) never lowers what was consumed.
    gate.next_seq()
    gate.next_seq()
    gate.grant(trainer.grant("t", now=0.4), now=0.4)  # still says new.1
    assert gate.consumed == 1 and gate.in_flight == 2


def test_a_lost_send_does_not_hold_a_credit_forever() -> None:
    gate = CreditGate("s0", initial_window=2, incarnation="i")
    gate.next_seq()
    n = gate.next_seq()
    gate.lost(n)  # Kafka never acknowledged it: the trainer will never consume it
    assert gate.in_flight == 1 and gate.open()


def test_samplers_that_went_quiet_stop_counting_and_are_forgotten() -> None:
    trainer = Consumption(total_window=8, live_after_s=10, forget_after_s=60)
    trainer.saw("s0", "a.1", now=0.0)
    trainer.saw("s1", "b.1", now=0.0)
    assert trainer.window(now=5.0) == 4
    trainer.saw("s0", "a.2", now=15.0)
    assert trainer.window(now=15.0) == 8  # s1 silent for 15 s: no longer live
    g = trainer.grant("t", now=100.0)
    assert g.consumed == {} and g.window == 8
    assert not trainer.changed
    trainer.saw("s2", None, now=101.0)  # no sequence header (an old sampler): live, nothing to count
    assert trainer.live(now=101.0) == 1 and not trainer.changed


def test_a_trainer_back_from_a_pause_splits_the_window_over_the_samplers_it_knows() -> None:
    trainer = Consumption(total_window=8, live_after_s=10, forget_after_s=600)
    trainer.saw("s0", "a.1", now=0.0)
    trainer.saw("s1", "b.1", now=0.0)
    # 30 s without consuming (the trainer was paused): nobody is live, but both are remembered, so each
    # gets half the window rather than all of it.
    assert trainer.live(now=30.0) == 0 and trainer.window(now=30.0) == 4
    assert Consumption(total_window=8).window(now=0.0) == 8  # a fresh trainer knows nobody yet


def test_a_sequence_of_zero_is_forgotten_without_error() -> None:
    trainer = Consumption(total_window=4, forget_after_s=60)
    trainer.saw("s0", "i.0", now=0.0)  # n = 0: seen, but no count moves
    assert trainer.grant("t", now=100.0).consumed == {}


def _grant(window: int = 2, consumed: dict[str, int] | None = None, seen: dict[int, int] | None = None,
           live: int = 2) -> object:
    from shared.messages import CreditGrant

    return CreditGrant(trainer="t", window=window, consumed={"s0/i": 0} if consumed is None else consumed,
                       seen=seen or {}, live_samplers=live)


def test_fragments_the_trainers_position_passed_unconsumed_stop_counting() -> None:
    # Records deleted before the trainer read them (retention, deleteRecords) are never consumed: without the
    # trainer's position in the grant the sampler would wait for them for good (a window of 2, both gone).
    gate = CreditGate("s0", initial_window=2, incarnation="i")
    a, b = gate.next_seq(), gate.next_seq()
    gate.placed(a, 0, 5)
    gate.placed(b, 1, 7)
    gate.grant(_grant(seen={0: 3, 1: 7}), now=1.0)  # neither passed yet (offset 7 is the next one on partition 1)
    assert gate.in_flight == 2 and not gate.open() and gate.settled == 0
    gate.grant(_grant(seen={0: 6}), now=2.0)  # partition 0's position passed offset 5 and nothing was consumed
    assert gate.in_flight == 1 and gate.open() and gate.settled == 1
    assert gate.newly_settled == [(a, 0, 5)]
    gate.grant(_grant(seen={0: 2, 1: 3}), now=3.0)  # an older position (a restarted trainer) takes nothing back
    assert gate.in_flight == 1
    gate.grant(_grant(seen={1: 9}), now=4.0)
    assert gate.in_flight == 0 and gate.settled == 2


def test_a_consumed_fragment_is_never_counted_as_settled() -> None:
    gate = CreditGate("s0", initial_window=2, incarnation="i")
    a, b = gate.next_seq(), gate.next_seq()
    gate.placed(a, 0, 5)
    gate.placed(b, 0, 6)
    gate.grant(_grant(consumed={"s0/i": 2}, seen={0: 7}), now=1.0)  # both consumed: the count covers them
    assert gate.in_flight == 0 and gate.settled == 0 and gate.newly_settled == []
    gate.next_seq()
    gate.grant(_grant(consumed={"s0/i": 2}, seen={0: 9}), now=2.0)  # not acknowledged yet: still in flight
    assert gate.in_flight == 1


def test_offsets_that_go_backwards_stop_settling_on_that_partition() -> None:
    # The topic recreated (or a log truncated): acknowledgements come below the position the trainer had passed.
    # Settling by position there would let the sampler send without any window; it counts them until consumed.
    gate = CreditGate("s0", initial_window=2, incarnation="i")
    gate.grant(_grant(seen={0: 100, 1: 5}), now=1.0)
    a, b = gate.next_seq(), gate.next_seq()
    gate.placed(a, 0, 3)
    gate.placed(b, 1, 7)
    assert gate.newly_regressed == [(0, 3, 100)] and gate.settled == 0
    gate.grant(_grant(seen={0: 100, 1: 9}), now=2.0)
    assert gate.in_flight == 1 and gate.settled == 1  # partition 1 still settles by position; 0 no longer
    gate.grant(_grant(consumed={"s0/i": 1}, seen={0: 100}), now=3.0)  # consumed: the count covers it
    assert gate.in_flight == 0


def test_an_unacknowledged_send_stays_lost_once_and_settling_counts_it_once() -> None:
    gate = CreditGate("s0", initial_window=3, incarnation="i")
    a, b = gate.next_seq(), gate.next_seq()
    gate.lost(a)
    gate.placed(b, 0, 1)
    gate.placed(a, 0, 0)  # a late acknowledgement of a send counted lost is ignored
    gate.grant(_grant(seen={0: 5}), now=1.0)
    assert gate.in_flight == 0 and gate.settled == 1


def test_the_waiting_reason_names_what_was_observed() -> None:
    gate = CreditGate("s0", initial_window=1, incarnation="i")
    gate.next_seq()
    assert "no credit grant received in 40 s since this sampler started" in gate.waiting_reason(40.0, 40.0)
    gate.grant(_grant(window=1, live=1), now=10.0)
    assert "no credit grant for 30 s" in gate.waiting_reason(40.0, 31.0)
    why = gate.waiting_reason(11.0, 31.0)  # grants arrive; the trainer consumes from another sampler
    assert "consumes from 1 sampler(s), but not this one's 1 fragment(s)" in why and "last moved never" in why
    gate.grant(_grant(window=1, live=0), now=11.0)
    assert "consumes from no sampler" in gate.waiting_reason(12.0, 32.0)
    gate.grant(_grant(window=0, live=3), now=12.0)
    assert "waiting 33 s for a turn: 3 live sampler(s)" in gate.waiting_reason(13.0, 33.0)
