"""services/trainer/lease.py at its edges (``make test-mutation``): unreadable leases, the exact watch (how long,
in what steps), a release or a takeover during the watch, the retry bound, renewals whose write raced, and the
fencing check in each of its cases. A fake clock; the local-directory store, with conflicts injected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.trainer.lease import RENEW_S, WATCH_S, LeaseHeld, LeaseLost, TrainerLease
from shared.store import LocalDirStore, PreconditionFailed

RUN = "r"
KEY = f"{RUN}/trainer/lease.json"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.sleeps: list[float] = []
        self.on_sleep: list[Any] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps.append(s)
        for hook in list(self.on_sleep):
            hook()


class Store(LocalDirStore):
    """The local store, whose next ``conflicts`` puts of the lease raise PreconditionFailed (after writing, when
    ``write_anyway``: a write that landed though its answer was lost, then retried)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.conflicts = 0
        self.write_anyway = False
        self.puts = 0

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        self.puts += 1
        if self.conflicts:
            self.conflicts -= 1
            if self.write_anyway:
                super().put(key, data)
            raise PreconditionFailed("injected")
        return super().put(key, data, if_none_match=if_none_match, if_match=if_match)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lease(store: Store, clock: Clock, holder: str, renew_s: float = 2.0, watch_s: float = 5.0) -> TrainerLease:
    return TrainerLease(store, RUN, holder, renew_s=renew_s, watch_s=watch_s, clock=clock, sleep=clock.sleep)


def put_raw(store: Store, body: Any) -> None:
    LocalDirStore.put(store, KEY, body if isinstance(body, bytes) else json.dumps(body).encode())


def stored(store: Store) -> dict[str, Any]:
    obj = store.get(KEY)
    assert obj is not None
    data: dict[str, Any] = json.loads(obj.data)
    return data


def test_the_documented_intervals() -> None:
    """docs/reliability.md: the lease is renewed every 2 s; a restart waits a few renewals (5 s) for a dead
    holder's lease."""
    assert (RENEW_S, WATCH_S) == (2.0, 5.0)
    t = TrainerLease(None, RUN, "a")  # type: ignore[arg-type]  # the store is not touched until used
    assert (t.renew_s, t.watch_s, t.token, t.key) == (2.0, 5.0, None, KEY)


def test_a_fresh_lease_is_token_one_and_written_unreleased(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    assert a.acquire() == 1 and a.token == 1
    assert stored(store) == {"holder": "a", "token": 1, "renewed_at": 1000.0, "released": False}
    assert clock.sleeps == []


@pytest.mark.parametrize("body", [b"\x00not json", b"[1, 2]", b"\"a string\""])
def test_an_unreadable_lease_is_taken_at_once_as_token_one(store: Store, clock: Clock, body: bytes) -> None:
    put_raw(store, body)
    a = lease(store, clock, "a")
    assert a.acquire() == 1
    assert clock.sleeps == []
    assert stored(store)["holder"] == "a"


def test_a_lease_this_holder_wrote_is_taken_at_once(store: Store, clock: Clock) -> None:
    """The same holder id restarting: its own old lease is not a live rival."""
    put_raw(store, {"holder": "a", "token": 7, "renewed_at": 999.0, "released": False})
    assert lease(store, clock, "a").acquire() == 8
    assert clock.sleeps == []


def test_a_released_lease_is_taken_at_once_with_the_next_token(store: Store, clock: Clock) -> None:
    put_raw(store, {"holder": "b", "token": 4, "renewed_at": 999.0, "released": True})
    assert lease(store, clock, "a").acquire() == 5
    assert clock.sleeps == []


def test_a_lease_without_a_token_counts_as_token_zero(store: Store, clock: Clock) -> None:
    put_raw(store, {"holder": "b", "released": True})
    assert lease(store, clock, "a").acquire() == 1


def test_a_silent_holder_is_watched_exactly_watch_s_in_half_renewals(store: Store, clock: Clock) -> None:
    put_raw(store, {"holder": "b", "token": 4, "renewed_at": 990.0, "released": False})
    a = lease(store, clock, "a", renew_s=0.4, watch_s=1.0)
    assert a.acquire() == 5
    assert clock.sleeps == pytest.approx([0.2] * 5)
    assert clock.now == pytest.approx(1001.0)


def test_the_watch_step_is_at_most_half_a_second(store: Store, clock: Clock) -> None:
    put_raw(store, {"holder": "b", "token": 1, "renewed_at": 990.0, "released": False})
    a = lease(store, clock, "a", renew_s=2.0, watch_s=5.0)
    assert a.acquire() == 2
    assert clock.sleeps == [0.5] * 10
    assert clock.now == 1005.0


def test_a_renewing_holder_is_named_with_how_long_ago_it_renewed(store: Store, clock: Clock) -> None:
    b = lease(store, clock, "b")
    b.acquire()
    clock.on_sleep.append(lambda: (b.renew(), setattr(clock, "now", clock.now + 0.25)))
    with pytest.raises(LeaseHeld) as err:
        lease(store, clock, "a").acquire()
    assert "trainer 'b' is running" in str(err.value)
    assert "renewed its lease 0.2 s ago" in str(err.value)  # renewed 0.25 s before the read
    assert clock.sleeps == [0.5]


def test_a_release_during_the_watch_ends_it(store: Store, clock: Clock) -> None:
    b = lease(store, clock, "b")
    b.acquire()
    clock.on_sleep.append(lambda: b.release() if len(clock.sleeps) == 2 else None)
    assert lease(store, clock, "a").acquire() == 2
    assert clock.sleeps == [0.5, 0.5]


def test_a_change_that_is_not_a_renewal_ends_the_watch(store: Store, clock: Clock) -> None:
    """The lease changed but its renewal time did not (another starter took it at that instant): look again."""
    put_raw(store, {"holder": "b", "token": 1, "renewed_at": 990.0, "released": False})

    def replace() -> None:
        if len(clock.sleeps) == 1:
            put_raw(store, {"holder": "c", "token": 2, "renewed_at": 990.0, "released": False})

    clock.on_sleep.append(replace)
    assert lease(store, clock, "a", renew_s=2.0, watch_s=5.0).acquire() == 3
    assert clock.sleeps == [0.5] + [0.5] * 10  # one step of the first watch, then a whole watch of c's


def test_a_lease_that_keeps_changing_is_given_up_after_ten_tries(store: Store, clock: Clock) -> None:
    store.conflicts = 100
    with pytest.raises(LeaseHeld, match="keeps changing"):
        lease(store, clock, "a").acquire()
    assert store.puts == 10


def test_a_lost_race_is_tried_again(store: Store, clock: Clock) -> None:
    store.conflicts = 9
    a = lease(store, clock, "a")
    assert a.acquire() == 1
    assert store.puts == 10


def test_renew_rewrites_the_time_and_keeps_the_token(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    clock.now = 1010.0
    a.renew()
    assert stored(store) == {"holder": "a", "token": 1, "renewed_at": 1010.0, "released": False}


def test_a_renewal_whose_answer_was_lost_adopts_the_stored_etag(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    store.conflicts, store.write_anyway = 1, True
    clock.now = 1003.0
    a.renew()  # our write landed, its answer did not: still ours
    store.write_anyway = False
    clock.now = 1006.0
    a.renew()  # with the adopted etag the conditional write succeeds
    assert stored(store)["renewed_at"] == 1006.0


def test_check_before_acquire_is_lost(store: Store, clock: Clock) -> None:
    with pytest.raises(LeaseLost, match="ours None"):
        lease(store, clock, "a").check()


def test_check_after_the_lease_vanished_is_lost(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    store.delete(KEY)
    with pytest.raises(LeaseLost, match="belongs to None"):
        a.check()


def test_check_with_another_holder_is_lost(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    put_raw(store, {"holder": "b", "token": 1, "renewed_at": 1000.0, "released": False})
    with pytest.raises(LeaseLost, match=r"belongs to 'b' \(token 1, ours 1\)"):
        a.check()


def test_check_with_the_same_holder_and_another_token_is_lost(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    put_raw(store, {"holder": "a", "token": 2, "renewed_at": 1000.0, "released": False})
    with pytest.raises(LeaseLost, match=r"token 2, ours 1"):
        a.check()
    with pytest.raises(LeaseLost):
        a.renew()


def test_release_marks_it_released_and_forgets_the_token(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    a.release()
    assert a.token is None
    assert stored(store) == {"holder": "a", "token": 1, "renewed_at": 1000.0, "released": True}
    a.release()  # not held: nothing to do
    assert stored(store)["released"] is True


def test_release_after_a_takeover_leaves_the_new_holder_alone(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    put_raw(store, {"holder": "b", "token": 2, "renewed_at": 1000.0, "released": False})
    a.release()
    assert a.token is None
    assert stored(store) == {"holder": "b", "token": 2, "renewed_at": 1000.0, "released": False}


def test_release_whose_write_races_gives_up_quietly(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    store.conflicts = 1
    a.release()
    assert a.token is None
    assert stored(store)["released"] is False


def test_the_intervals_and_clock_are_keyword_only(store: Store, clock: Clock) -> None:
    """``TrainerLease(store, run, holder, 2.0)`` is refused: a positional interval could be taken for another."""
    with pytest.raises(TypeError):
        TrainerLease(store, RUN, "a", 2.0)  # type: ignore[misc]
    assert TrainerLease(store, RUN, holder="a", renew_s=1.0).renew_s == 1.0


class CountingEtags(Store):
    """Etags that count down with every write: a changed lease's etag sorts before the old one (S3 etags are
    opaque; only equality means anything)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.etags: dict[str, str] = {}
        self.n = 10**6

    def get(self, key: str) -> Any:
        obj = super().get(key)
        return None if obj is None else type(obj)(obj.data, self.etags.get(key, "x"))

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        super().put(key, data, if_none_match=if_none_match, if_match=if_match)
        self.n -= 1
        self.etags[key] = f"{self.n:08d}"
        return self.etags[key]


def test_a_renewal_is_seen_whatever_its_etag_looks_like(tmp_path: Path, clock: Clock) -> None:
    store = CountingEtags(tmp_path / "s")
    b = lease(store, clock, "b")
    b.acquire()
    clock.on_sleep.append(b.renew)
    with pytest.raises(LeaseHeld):
        lease(store, clock, "a").acquire()
    assert clock.sleeps == [0.5]


def test_check_with_a_lower_token_is_lost(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    put_raw(store, {"holder": "z", "token": 5, "renewed_at": 1.0, "released": True})
    assert a.acquire() == 6
    put_raw(store, {"holder": "a", "token": 2, "renewed_at": 1000.0, "released": False})
    with pytest.raises(LeaseLost, match=r"token 2, ours 6"):
        a.check()


def test_a_starter_that_loses_the_first_write_watches_the_winner(store: Store, clock: Clock) -> None:
    """Two starters see no lease; the other one writes first: this one's conditional first write fails and it
    treats the winner like any live holder."""
    real_put = store.put

    def racing_put(key: str, data: bytes, **kw: Any) -> str:
        if key == KEY and store.get(KEY) is None:
            put_raw(store, {"holder": "b", "token": 1, "renewed_at": clock.now, "released": False})
        return real_put(key, data, **kw)

    store.put = racing_put  # type: ignore[method-assign]
    assert lease(store, clock, "a").acquire() == 2
    assert clock.sleeps == [0.5] * 10  # watched b's lease for the whole watch before taking it


def test_a_renewal_with_an_earlier_time_is_still_a_renewal(store: Store, clock: Clock) -> None:
    """Another host's clock may be behind: any change of renewed_at proves the holder alive."""
    put_raw(store, {"holder": "b", "token": 1, "renewed_at": 1000.0, "released": False})
    clock.on_sleep.append(lambda: put_raw(store, {"holder": "b", "token": 1, "renewed_at": 2000.0 - clock.now,
                                                  "released": False}))  # earlier with every renewal
    with pytest.raises(LeaseHeld, match="trainer 'b' is running"):
        lease(store, clock, "a").acquire()
    assert clock.sleeps == [0.5]


def test_how_long_ago_is_the_plain_difference(store: Store) -> None:
    clock = Clock(now=0.0)
    b = lease(store, clock, "b")
    b.acquire()
    clock.on_sleep.append(lambda: (b.renew(), setattr(clock, "now", clock.now + 0.75)))
    with pytest.raises(LeaseHeld, match=r"renewed its lease 0\.8 s ago"):  # 1.25 - 0.5
        lease(store, clock, "a").acquire()


def test_how_long_ago_for_a_lease_renewed_at_time_zero(store: Store) -> None:
    clock = Clock(now=-1.0)
    b = lease(store, clock, "b")
    b.acquire()  # renewed_at -1.0
    clock.on_sleep.append(lambda: (setattr(clock, "now", 0.0), b.renew(), setattr(clock, "now", 3.0)))
    with pytest.raises(LeaseHeld, match=r"renewed its lease 3\.0 s ago"):
        lease(store, clock, "a").acquire()


def test_check_with_a_holder_that_sorts_first_is_lost(store: Store, clock: Clock) -> None:
    a = lease(store, clock, "a")
    a.acquire()
    put_raw(store, {"holder": "0", "token": 1, "renewed_at": 1000.0, "released": False})
    with pytest.raises(LeaseLost, match="belongs to '0'"):
        a.check()


def test_large_tokens_compare_by_value(store: Store, clock: Clock) -> None:
    put_raw(store, {"holder": "z", "token": 1000, "renewed_at": 1.0, "released": True})
    a = lease(store, clock, "a")
    assert a.acquire() == 1001
    a.check()
    a.renew()
    a.check()
