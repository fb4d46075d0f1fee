"""shared/digest.py pinned down exactly (``make test-mutation``: every arithmetic and constant matters, since a
checkpoint's digest and ``flywheel verify``'s recomputation must agree bit for bit)."""

from __future__ import annotations

import random

import pytest

from shared.digest import Digest, mix64, range_digest

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def test_mix64_is_splitmix64() -> None:
    """The published SplitMix64 outputs: seed 0, and the first three of seed 1234567 (mix64 of the state after
    each increment is SplitMix64's next())."""
    assert mix64(0) == 0xE220A8397B1DCDAF
    assert [mix64((1234567 + k * GOLDEN) & MASK) for k in range(3)] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_mix64_wraps_the_state_mod_2_64() -> None:
    """The state is ``offset + golden`` mod 2^64: the offset 2^64 - golden hashes like state 0, which mixes to 0."""
    assert mix64((1 << 64) - GOLDEN) == 0
    for offset in (MASK, (1 << 63) + 12345, 2**62 + 1):
        assert 0 <= mix64(offset) <= MASK


def _slow(offsets: list[int]) -> Digest:
    d = Digest()
    for o in offsets:
        d.add(o)
    return d


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 1000), (5, 6), (2**40, 2**40 + 777), (2**63 - 300, 2**63 + 300)])
def test_range_digest_equals_adding_each_offset(lo: int, hi: int) -> None:
    want = _slow(list(range(lo, hi)))
    got = range_digest(lo, hi)
    assert (got.count, got.hash) == (want.count, want.hash) == (hi - lo, sum(mix64(o) for o in range(lo, hi)) & MASK)


def test_range_digest_of_an_empty_range() -> None:
    assert range_digest(10, 10) == Digest(0, 0)
    assert range_digest(10, 3) == Digest(0, 0)


def test_range_digest_over_several_chunks() -> None:
    """Chunks of 2^20: a range over three of them, split at and off the chunk bounds, adds up."""
    lo, hi = 1000, 1000 + 3 * (1 << 20) + 17
    whole = range_digest(lo, hi)
    assert whole.count == hi - lo
    cuts = [lo, lo + 1, lo + (1 << 20) - 1, lo + (1 << 20) + 5, lo + (1 << 21) + 3, hi]
    parts = Digest()
    for a, b in zip(cuts, cuts[1:], strict=False):
        parts = parts + range_digest(a, b)
    assert parts == whole
    tail = range_digest(hi - 50, hi)
    assert tail == _slow(list(range(hi - 50, hi)))
    # The chunk bound itself (offset lo + 2^20) is hashed once.
    assert whole - range_digest(lo, lo + (1 << 20)) - range_digest(lo + (1 << 20) + 1, hi) == _slow([lo + (1 << 20)])


def test_add_counts_and_hashes_one_offset() -> None:
    d = Digest()
    d.add(7)
    assert (d.count, d.hash) == (1, mix64(7))
    d.add(7)
    assert (d.count, d.hash) == (2, (2 * mix64(7)) & MASK)


def test_add_wraps_mod_2_64() -> None:
    d = Digest(3, MASK - 1)
    d.add(0)
    assert d == Digest(4, (MASK - 1 + 0xE220A8397B1DCDAF) & MASK)
    assert d.hash < MASK - 1


def test_sum_and_difference_wrap_mod_2_64() -> None:
    a, b = Digest(5, MASK - 10), Digest(2, 30)
    assert a + b == Digest(7, 19)
    assert b + a == Digest(7, 19)
    assert b - a == Digest(-3, 41)
    assert a - b == Digest(3, MASK - 40)
    assert (a + b) - b == a
    assert Digest(4, 100) - Digest(1, 100) == Digest(3, 0)


def test_order_does_not_matter() -> None:
    rng = random.Random(3)
    offsets = [rng.randrange(1 << 62) for _ in range(200)]
    shuffled = offsets[:]
    rng.shuffle(shuffled)
    assert _slow(offsets) == _slow(shuffled)


def test_json_round_trip_is_exact() -> None:
    for d in (Digest(0, 0), Digest(12, 0xFEDCBA9876543210), Digest(1, MASK), Digest(3, 0xABC)):
        j = d.to_json()
        assert j == {"count": d.count, "hash": f"{d.hash:016x}"}
        assert Digest.from_json(j) == d
    assert Digest.from_json({"count": "7", "hash": "00000000000000ff"}) == Digest(7, 255)
    assert Digest.to_json(Digest(2, 0xAF)) == {"count": 2, "hash": "00000000000000af"}
