"""Order-independent digests of Kafka offsets: a count and a 64-bit multiset hash (the sum of each
offset's SplitMix64 hash mod 2^64). The trainer's ledger folds every record's outcome into one; ``flywheel
verify`` compares them with :func:`range_digest` of the offsets a checkpoint claims, and names offsets
from the stored ranges. Shared by the trainer and admin (services never import each other)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

Outcome = Literal["trained", "dropped", "dead", "gap", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("trained", "dropped", "dead", "gap", "lost")
"""Every offset of a partition since the run began on it ends in exactly one: ``trained`` (its gradient is in the
model), ``dropped`` (stale), ``dead`` (dead-lettered), ``gap`` (the log held no record there when the trainer read
past it) or ``lost`` (the record left the log, by retention or ``deleteRecords``, before the trainer read it)."""
_MASK = (1 << 64) - 1
ORIGIN = 0
"""Where a run begins on every partition of its samples topic (the topic is the run's own): the ledger's
``start``, which ``flywheel verify`` requires, so records that left the log before training cannot hide
below it."""


def mix64(offset: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of one offset."""
    z = (offset + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def range_digest(lo: int, hi: int) -> Digest:
    """The digest of every offset in ``[lo, hi)`` exactly once (vectorised: ~20 ms per million)."""
    d = Digest()
    with np.errstate(over="ignore"):
        for a in range(lo, hi, 1 << 20):
            z = np.arange(a, min(hi, a + (1 << 20)), dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            d.count += int(z.size)
            d.hash = (d.hash + int(z.sum(dtype=np.uint64))) & _MASK
    return d


@dataclasses.dataclass
class Digest:
    """A multiset of offsets: how many, and the sum of their hashes mod 2^64 (order-independent)."""

    count: int = 0
    hash: int = 0

    def add(self, offset: int) -> None:
        self.count += 1
        self.hash = (self.hash + mix64(offset)) & _MASK

    def __add__(self, other: Digest) -> Digest:
        return Digest(self.count + other.count, (self.hash + other.hash) & _MASK)

    def __sub__(self, other: Digest) -> Digest:
        return Digest(self.count - other.count, (self.hash - other.hash) & _MASK)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "hash": f"{self.hash:016x}"}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Digest:
        return cls(int(d["count"]), int(str(d["hash"]), 16))
