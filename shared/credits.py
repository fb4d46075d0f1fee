"""Credit-based flow control between samplers and the trainer: the pure logic (no I/O, clock passed in).

Why: a sampler that pauses on a measured backlog overshoots (it makes a fragment in ~10 ms and reads
the backlog every 0.2 s), so the trainer trains long stretches on data from one old version and the
lag at training time exceeds ``trainer.max_staleness``. With credits a sampler knows how
many of its fragments the trainer has not consumed yet, and sends only while that is below its window.

- Every fragment a sampler sends carries ``sampler-seq: <incarnation>.<n>``: ``n`` counts from 1 in
  this sampler process, ``incarnation`` is random per process (a restarted sampler with the same id
  starts a new count).
- The trainer (:class:`Consumption`) notes the highest ``n`` it has consumed per sampler process and
  sends a :class:`shared.messages.CreditGrant` on ``<run>.credits`` whenever that moves (and every
  second, so a lost grant heals): the consumed counts and the *window*, the fragments each live sampler
  may have in flight: ``trainer.flow_window`` (default: two versions' worth of batches) split evenly
  over the samplers consumed from recently (at least one each).
- A sampler (:class:`CreditGate`) sends while ``sent - consumed - lost < window``; otherwise it waits
  for the next grant (still adopting policies and sending heartbeats).

The count is the highest ``n`` consumed, not a set: a sampler's fragments spread over partitions, so one
still waiting on a slower partition counts as consumed once a later one was. In steady state that is
the skew between partitions (a fragment or two); while a partition has no consumer (a rebalance) the
sampler may overshoot by what sits there, and the batch-time staleness check still bounds the lag.

So the fragments in flight across all samplers stay at about ``flow_window``, the trainer's backlog at
about ``flow_window / batch_fragments`` updates, and the lag at training time near that: within the
bound by construction rather than by dropping. A trainer that is down grants nothing, so samplers stop
after one window instead of filling Kafka with fragments that would only be dropped as stale.
"""

from __future__ import annotations

import uuid

from shared.messages import CreditGrant
from shared.settings import Settings

H_SAMPLER_SEQ = "sampler-seq"


def auto_window(settings: Settings) -> int:
    """``trainer.flow_window``, or the default: two versions' worth of batches,
    ``batch_fragments * publish_every * min(2, max(1, max_staleness))``: one batch training, the next one
    waiting, so the learner is fed while the lag stays near two versions (less data per version in
    flight means fresher data; more would only add lag)."""
    t = settings.trainer
    if t.flow_window is not None:
        return t.flow_window
    # Every rank of a data-parallel trainer forms its own batch of batch_fragments per update.
    return t.batch_fragments * t.world_size * t.publish_every * min(2, max(1, t.max_staleness))


def new_incarnation() -> str:
    return uuid.uuid4().hex[:8]


def seq_value(incarnation: str, n: int) -> bytes:
    return f"{incarnation}.{n}".encode()


def parse_seq(value: str | None) -> tuple[str, int] | None:
    """``(incarnation, n)`` of a ``sampler-seq`` header, or None when absent or malformed."""
    if not value:
        return None
    inc, _, n = value.rpartition(".")
    if not inc or not (n.isascii() and n.isdigit()):
        return None
    return inc, int(n)


class Consumption:
    """The trainer's side: the highest sequence number consumed per sampler process; the grant."""

    def __init__(self, total_window: int, live_after_s: float = 10.0, forget_after_s: float = 600.0) -> None:
        self.total_window = total_window
        self.live_after_s = live_after_s
        self.forget_after_s = forget_after_s
        self._consumed: dict[str, int] = {}  # "<sampler>/<incarnation>" -> highest n
        self._seen: dict[str, float] = {}  # key -> when last consumed from
        self._sampler_seen: dict[str, float] = {}  # sampler id -> when last consumed from
        self.changed = False

    def saw(self, sampler_id: str, seq_header: str | None, now: float) -> None:
        """A record of ``sampler_id`` was consumed (whatever its outcome: trained, stale, dead letter)."""
        self._sampler_seen[sampler_id] = now
        seq = parse_seq(seq_header)
        if seq is None:
            return
        key = f"{sampler_id}/{seq[0]}"
        self._seen[key] = now
        if seq[1] > self._consumed.get(key, 0):
            self._consumed[key] = seq[1]
            self.changed = True

    def live(self, now: float) -> int:
        return sum(1 for t in self._sampler_seen.values() if now - t <= self.live_after_s)

    def window(self, now: float) -> int:
        """The total split over the live samplers; when none consumed recently (a trainer back from a
        pause), over every sampler it still remembers, so they do not each get the whole window."""
        return max(1, self.total_window // max(1, self.live(now) or len(self._sampler_seen)))

    def grant(self, trainer_id: str, now: float) -> CreditGrant:
        for key in [k for k, t in self._seen.items() if now - t > self.forget_after_s]:
            del self._seen[key]
            self._consumed.pop(key, None)  # a key seen only with n = 0 never got a count
        for sid in [s for s, t in self._sampler_seen.items() if now - t > self.forget_after_s]:
            del self._sampler_seen[sid]
        self.changed = False
        return CreditGrant(trainer=trainer_id, window=self.window(now), consumed=dict(self._consumed),
                           live_samplers=self.live(now))


class CreditGate:
    """A sampler's side: sequence numbers, what is in flight, whether it may send."""

    def __init__(self, sampler_id: str, initial_window: int = 1, incarnation: str | None = None) -> None:
        self.incarnation = incarnation or new_incarnation()
        self.key = f"{sampler_id}/{self.incarnation}"
        self.sent = 0
        self.consumed = 0
        self.window = initial_window
        self.granted_at: float | None = None
        self._lost: set[int] = set()  # sent but never acknowledged by Kafka: they will never be consumed

    def next_seq(self) -> int:
        self.sent += 1
        return self.sent

    def lost(self, n: int) -> None:
        if n > self.consumed:
            self._lost.add(n)

    def grant(self, g: CreditGrant, now: float) -> None:
        self.window = max(1, g.window)
        self.granted_at = now
        n = g.consumed.get(self.key)
        if n is not None and n > self.consumed:  # monotonic: a restarted trainer re-reading old records
            self.consumed = n
            self._lost = {m for m in self._lost if m > n}

    @property
    def in_flight(self) -> int:
        return max(0, self.sent - self.consumed - len(self._lost))

    def open(self) -> bool:
        return self.in_flight < self.window
