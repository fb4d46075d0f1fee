"""shared/credits.py at its boundaries (``make test-mutation``): the defaults, the exact comparisons, integer
arithmetic of the window, and the sampler gate's bookkeeping of lost sends."""

from __future__ import annotations

from shared.credits import Consumption, CreditGate, auto_window, new_incarnation, parse_seq
from shared.messages import CreditGrant
from shared.settings import load_settings


def _settings(**trainer: object) -> object:
    env = {f"FLYWHEEL_TRAINER_{k.upper()}": str(v) for k, v in trainer.items()}
    return load_settings(None, env)


def _grant(window: int, consumed: dict[str, int] | None = None) -> CreditGrant:
    return CreditGrant(trainer="t", window=window, consumed=consumed or {})


def test_auto_window_multiplies_every_factor_as_integers() -> None:
    w = auto_window(_settings(batch_fragments=3, world_size=2, publish_every=5, max_staleness=8))
    assert w == 60 and isinstance(w, int)  # 3 fragments x 2 ranks x 5 updates a version x 2 versions
    assert auto_window(_settings(batch_fragments=3, world_size=2, publish_every=5, max_staleness=1)) == 30


def test_incarnation_is_eight_hex_digits() -> None:
    inc = new_incarnation()
    assert len(inc) == 8 and int(inc, 16) >= 0
    assert new_incarnation() != new_incarnation()
    assert CreditGate("s").incarnation != CreditGate("s").incarnation


def test_parse_seq_keeps_dots_in_the_incarnation() -> None:
    assert parse_seq("a.b.12") == ("a.b", 12)
    assert parse_seq("x.0") == ("x", 0)


def test_a_fresh_consumption_has_nothing_to_send() -> None:
    c = Consumption(total_window=8)
    assert c.changed is False
    c.saw("s0", "i.0", now=0.0)  # n = 0: nothing consumed yet
    assert c.changed is False
    assert c.grant("t", now=0.0).consumed == {}


def test_the_same_count_again_is_no_change() -> None:
    c = Consumption(total_window=8)
    c.saw("s0", "i.5", now=0.0)
    assert c.changed
    c.grant("t", now=0.0)
    assert c.changed is False
    c.saw("s0", "i.5", now=0.1)
    assert c.changed is False
    c.saw("s0", "i.6", now=0.2)
    assert c.changed is True


def test_default_liveness_is_ten_seconds_inclusive() -> None:
    c = Consumption(total_window=8)
    c.saw("s0", "i.1", now=100.0)
    assert c.live(now=110.0) == 1
    assert c.live(now=110.5) == 0
    assert c.live(now=109.5) == 1


def test_liveness_bound_is_inclusive() -> None:
    c = Consumption(total_window=8, live_after_s=5.0)
    c.saw("s0", "i.1", now=0.0)
    c.saw("s1", "j.1", now=0.0)
    assert c.live(now=5.0) == 2 and c.live(now=5.01) == 0


def test_default_forgetting_is_after_ten_minutes_exclusive() -> None:
    c = Consumption(total_window=8)
    c.saw("s0", "i.3", now=0.0)
    c.saw("s1", "j.4", now=0.0)
    g = c.grant("t", now=600.0)  # exactly 600 s: still remembered
    assert g.consumed == {"s0/i": 3, "s1/j": 4}
    assert c.window(now=600.0) == 4  # both still known (none live): half each
    g = c.grant("t", now=600.5)
    assert g.consumed == {} and c.window(now=600.5) == 8


def test_forgetting_bound_is_exclusive_for_counts_and_samplers() -> None:
    c = Consumption(total_window=8, live_after_s=1.0, forget_after_s=50.0)
    c.saw("s0", "i.3", now=0.0)
    c.saw("s1", None, now=0.0)
    assert c.grant("t", now=50.0).consumed == {"s0/i": 3}
    assert c.window(now=50.0) == 4  # two samplers remembered
    assert c.grant("t", now=50.01).consumed == {}
    assert c.window(now=50.01) == 8


def test_the_window_is_an_integer_share_and_at_least_one() -> None:
    c = Consumption(total_window=10)
    for s in ("a", "b", "c"):
        c.saw(s, f"{s}.1", now=0.0)
    assert c.window(now=0.0) == 3
    assert c.grant("t", now=0.0).window == 3
    c.saw("d", "d.1", now=0.0)
    c.saw("e", "e.1", now=0.0)
    assert c.window(now=0.0) == 2
    small = Consumption(total_window=3)
    for s in ("a", "b", "c", "d"):
        small.saw(s, f"{s}.1", now=0.0)
    assert small.window(now=0.0) == 0  # more samplers than credits: they take turns (test_credit_turns.py)
    three = Consumption(total_window=3)
    for s in ("a", "b", "c"):
        three.saw(s, f"{s}.1", now=0.0)
    assert three.window(now=0.0) == 1  # as many as credits: one each, no turns
    rank = Consumption(total_window=3, allocates=False)  # a rank other than 0 decides nothing: at least one
    for s in ("a", "b", "c", "d"):
        rank.saw(s, f"{s}.1", now=0.0)
    assert rank.window(now=0.0) == 1
    one = Consumption(total_window=1)
    one.saw("a", "a.1", now=0.0)
    assert one.window(now=0.0) == 1


def test_a_gate_starts_with_a_window_of_one_and_nothing_sent() -> None:
    gate = CreditGate("s0", incarnation="i")
    assert gate.key == "s0/i"
    assert (gate.window, gate.sent, gate.consumed, gate.in_flight, gate.granted_at) == (1, 0, 0, 0, None)
    assert gate.open()
    assert gate.next_seq() == 1 and gate.next_seq() == 2
    assert gate.sent == 2


def test_a_grant_of_zero_or_one_still_lets_one_through() -> None:
    gate = CreditGate("s0", initial_window=5, incarnation="i")
    gate.grant(_grant(0), now=1.0)
    assert gate.window == 1 and gate.granted_at == 1.0
    gate.grant(_grant(1), now=2.0)
    assert gate.window == 1 and gate.granted_at == 2.0
    gate.grant(_grant(3), now=3.0)
    assert gate.window == 3


def test_a_lost_send_at_or_below_the_consumed_count_is_ignored() -> None:
    gate = CreditGate("s0", initial_window=10, incarnation="i")
    for _ in range(5):
        gate.next_seq()
    gate.grant(_grant(10, {"s0/i": 3}), now=0.0)
    assert gate.in_flight == 2
    gate.lost(3)  # already consumed: it was not lost after all
    gate.lost(1)
    assert gate.in_flight == 2
    gate.lost(4)
    assert gate.in_flight == 1


def test_a_lost_send_later_consumed_counts_once() -> None:
    """A send reported lost that the trainer consumed all the same (the error came after the write): once the
    consumed count reaches it, it leaves the lost set, so it is not subtracted twice."""
    gate = CreditGate("s0", initial_window=10, incarnation="i")
    for _ in range(4):
        gate.next_seq()
    gate.lost(2)
    gate.lost(4)
    assert gate.in_flight == 2
    gate.grant(_grant(10, {"s0/i": 2}), now=0.0)
    assert gate.in_flight == 1  # 3 in flight; 4 lost
    gate.grant(_grant(10, {"s0/i": 4}), now=0.0)
    assert gate.in_flight == 0


def test_in_flight_never_goes_negative() -> None:
    gate = CreditGate("s0", incarnation="i")
    gate.grant(_grant(2, {"s0/i": 5}), now=0.0)  # a count from before (same incarnation re-used)
    assert gate.in_flight == 0 and gate.open()
    gate.grant(_grant(2, {"other/i": 9}), now=0.0)
    assert gate.consumed == 5


def test_the_gate_is_open_strictly_below_the_window() -> None:
    gate = CreditGate("s0", initial_window=2, incarnation="i")
    gate.next_seq()
    assert gate.open()
    gate.next_seq()
    assert not gate.open()


def test_forgetting_measures_the_time_since_last_seen() -> None:
    c = Consumption(total_window=8, live_after_s=1.0, forget_after_s=50.0)
    c.saw("s0", "i.3", now=100.0)
    assert c.grant("t", now=140.0).consumed == {"s0/i": 3}  # 40 s since: kept
    assert c.window(now=140.0) == 8
    c.saw("s1", "j.1", now=100.0)
    assert c.grant("t", now=149.0).consumed == {"s0/i": 3, "s1/j": 1}
    assert c.window(now=149.0) == 4  # both remembered, neither live


def test_an_older_grant_never_lowers_the_consumed_count() -> None:
    gate = CreditGate("s0", initial_window=10, incarnation="i")
    for _ in range(6):
        gate.next_seq()
    gate.grant(_grant(10, {"s0/i": 5}), now=0.0)
    gate.grant(_grant(10, {"s0/i": 3}), now=1.0)  # a restarted trainer re-reading older records
    assert gate.consumed == 5 and gate.in_flight == 1


def test_a_grant_clears_exactly_the_lost_sends_it_covers() -> None:
    gate = CreditGate("s0", initial_window=10, incarnation="i")
    for _ in range(6):
        gate.next_seq()
    gate.lost(3)
    gate.lost(4)
    gate.grant(_grant(10, {"s0/i": 2}), now=0.0)  # consumed 1-2; 3 and 4 still lost; 5, 6 in flight
    assert gate.in_flight == 2
    gate2 = CreditGate("s0", initial_window=10, incarnation="i")
    for _ in range(4):
        gate2.next_seq()
    gate2.lost(1)
    gate2.lost(4)
    gate2.grant(_grant(10, {"s0/i": 2}), now=0.0)  # 1 is consumed after all; 4 stays lost; 3 in flight
    assert gate2.in_flight == 1


def test_a_shrunk_window_closes_the_gate_while_over_it() -> None:
    gate = CreditGate("s0", initial_window=4, incarnation="i")
    for _ in range(4):
        gate.next_seq()
    gate.grant(_grant(2), now=0.0)
    assert gate.in_flight == 4 and not gate.open()
    gate.grant(_grant(2, {"s0/i": 2}), now=0.0)
    assert gate.in_flight == 2 and not gate.open()
    gate.grant(_grant(2, {"s0/i": 3}), now=0.0)
    assert gate.open()
