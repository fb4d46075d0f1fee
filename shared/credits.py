"""Credit-based flow control between samplers and the trainer: the pure logic (no I/O, clock passed in).

Why: a sampler that pauses on a measured backlog overshoots (it makes a fragment in ~10 ms and reads
the backlog every 0.2 s), so the trainer trains long stretches on data from one old version and the
lag at training time exceeds ``trainer.max_staleness``. With credits a sampler knows how
many of its fragments the trainer has not consumed yet, and sends only while that is below what it was granted.

- Every fragment a sampler sends carries ``sampler-seq: <incarnation>.<n>``: ``n`` counts from 1 in
  this sampler process, ``incarnation`` is random per process (a restarted sampler with the same id
  starts a new count).
- The trainer (:class:`Consumption`) notes the highest ``n`` it has consumed per sampler process and
  sends grants (:class:`shared.messages.CreditGrant`) on ``<run>.credits`` whenever that moves (and every
  second, so a lost grant heals). The topic has ``kafka.credits_partitions`` partitions; a sampler
  belongs to shard :func:`shard_of` (crc32 of its id), and partition ``s`` carries only shard ``s``'s
  grant: the consumed counts of that shard's samplers. A sampler reads only its own partition, so what
  it reads per grant is O(samplers per shard), not O(samplers).
- While the live samplers are no more than ``trainer.flow_window`` (default: two versions' worth of
  batches), the grant's *window* is that total split evenly over them: each may have ``window``
  fragments in flight (sent, not consumed).
- With more live samplers than the window they **take turns** (a fractional window): the grant's window
  is 0 and ``limits`` gives the samplers holding a turn an absolute limit, the count (lost sends not
  counted) up to which that sampler process may have sent. The trainer keeps the credits outstanding,
  ``sum(max(0, limit - consumed))``, at most ``flow_window`` and hands a freed credit to the live sampler
  that waited longest (round robin). A sampler holding a credit that it has not used for
  ``live_after_s`` (dead, paused, cut off) gives it back: the trainer stops counting it and moves on.
  A sampler process the trainer has not consumed from yet (not in its grant) may have one fragment in
  flight, to make itself known, whatever the window: a swarm that starts at once overshoots by one each.
- A sampler (:class:`CreditGate`) sends while ``sent - consumed - settled`` is below its window (or below
  ``limit - consumed`` when taking turns); otherwise it waits for the next grant (still adopting
  policies and sending heartbeats).
- Records that leave the log unread do not hold credits: a fragment Kafka never acknowledged is *lost* at
  once. One Kafka acknowledged at ``(partition, offset)`` is *settled* when a later grant's ``seen`` (the
  trainer's position on that partition: every record below it reached the trainer or left the log first)
  passes its offset while the consumed count has not reached it: it was removed before the trainer read it
  (retention, ``deleteRecords``), or it was unreadable (dead-lettered). Without this a sampler whose newest
  fragments were deleted waits for them for good. Offsets are taken to grow: an acknowledgement below the
  position already seen on its partition (the topic recreated, a log truncated) means they did not, and from
  then on that partition's fragments count until consumed (the sampler logs it), never settled by position.

The count is the highest ``n`` consumed, not a set: a sampler's fragments spread over partitions, so one
still waiting on a slower partition counts as consumed once a later one was. In steady state that is
the skew between partitions (a fragment or two); while a partition has no consumer (a rebalance) the
sampler may overshoot by what sits there, and the batch-time staleness check still bounds the lag.

So the fragments in flight across all samplers stay at about ``flow_window`` whatever the number of
samplers, the trainer's backlog at about ``flow_window / batch_fragments`` updates, and the lag at
training time near that: within the bound by construction rather than by dropping. A trainer that is
down grants nothing, so samplers stop after their window (or their turn) instead of filling Kafka with
fragments that would only be dropped as stale.

Data-parallel ranks each consume part of every sampler's fragments and each send grants; a sampler keeps
the highest consumed count any of them reported. Only the rank that ``allocates`` (rank 0) decides
windows and turns; it folds the other ranks' consumed counts in (:meth:`Consumption.merge`), read from
their grants, so its count of outstanding credits covers what every rank consumed.
"""

from __future__ import annotations

import uuid
import zlib

from shared.messages import CreditGrant
from shared.settings import Settings

H_SAMPLER_SEQ = "sampler-seq"
GRANT_SILENCE_S = 5.0
"""A sampler that heard no grant for this long says so (the trainer grants every second)."""
TURN = 1
"""Credits one turn gives a sampler when samplers take turns (the smallest share: the freshest data)."""


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


def shard_of(sampler_id: str, shards: int) -> int:
    """The credits partition of ``sampler_id``: crc32 of the id (stable across processes and Python
    versions, unlike ``hash``), modulo ``shards``. The trainer writes a sampler's grant there and the
    sampler reads only that partition."""
    return zlib.crc32(sampler_id.encode()) % max(1, shards)


def sampler_of(key: str) -> str:
    """The sampler id of a ``"<sampler id>/<incarnation>"`` key (an id may itself contain ``/``)."""
    return key.rpartition("/")[0]


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
    """The trainer's side: the highest sequence number consumed per sampler process; the grants."""

    def __init__(self, total_window: int, live_after_s: float = 10.0, forget_after_s: float = 600.0,
                 shards: int = 1, allocates: bool = True) -> None:
        self.total_window = total_window
        self.live_after_s = live_after_s
        self.forget_after_s = forget_after_s
        self.shards = max(1, shards)
        self.allocates = allocates
        """False on a data-parallel rank other than rank 0: its grants carry consumed counts only."""
        self._consumed: dict[str, int] = {}  # "<sampler>/<incarnation>" -> highest n
        self._seen: dict[str, float] = {}  # key -> when last consumed from
        self._sampler_seen: dict[str, float] = {}  # sampler id -> when last consumed from
        self._newest: dict[str, str] = {}  # sampler id -> the key of its newest incarnation
        # Turns: per key the limit last granted, when a turn was last given, and the order of turns.
        self._limit: dict[str, int] = {}
        self._given_at: dict[str, float] = {}
        self._reclaimed: set[str] = set()  # credits of these keys are no longer counted (silent too long)
        self._order: dict[str, None] = {}  # keys, the one that waited longest first
        self._turns = False  # the last grants said: take turns
        self.changed = False

    def saw(self, sampler_id: str, seq_header: str | None, now: float) -> None:
        """A record of ``sampler_id`` was consumed (whatever its outcome: trained, stale, dead letter)."""
        self._sampler_seen[sampler_id] = now
        seq = parse_seq(seq_header)
        if seq is None:
            return
        self._advance(sampler_id, f"{sampler_id}/{seq[0]}", seq[1], now)

    def merge(self, grant: CreditGrant, now: float) -> None:
        """Another rank's grant: its consumed counts count as consumed here (liveness too, when they moved)."""
        for key, n in grant.consumed.items():
            if n > self._consumed.get(key, 0):
                self._sampler_seen[sampler_of(key)] = now
                self._advance(sampler_of(key), key, n, now)

    def _advance(self, sampler_id: str, key: str, n: int, now: float) -> None:
        self._seen[key] = now
        if self._newest.get(sampler_id) != key and key not in self._consumed:
            self._newest[sampler_id] = key  # a new incarnation (a restart): the old one gets no more turns
        self._order.setdefault(key, None)
        if n > self._consumed.get(key, 0):
            self._consumed[key] = n
            self._reclaimed.discard(key)  # it is sending again: what it holds counts again
            self.changed = True

    def live(self, now: float) -> int:
        return sum(1 for t in self._sampler_seen.values() if now - t <= self.live_after_s)

    def contenders(self, now: float) -> int:
        """The live samplers; while taking turns also those waiting for one (a sampler waiting its turn is
        not consumed from, yet it is there): every sampler remembered, unless the credit it last held was
        reclaimed and it has not been heard from since."""
        live = {s for s, t in self._sampler_seen.items() if now - t <= self.live_after_s}
        if self._turns:
            live.update(sid for sid, key in self._newest.items() if key not in self._reclaimed and sid in
                        self._sampler_seen)
        return len(live)

    def window(self, now: float) -> int:
        """The total split over the live samplers; when none consumed recently (a trainer back from a
        pause), over every sampler it still remembers, so they do not each get the whole window.
        0 when the samplers are more than the total: they take turns (:meth:`outstanding`)."""
        n = self.contenders(now) or len(self._sampler_seen)
        if self.allocates and n > self.total_window:
            return 0
        return max(1, self.total_window // max(1, n))

    def outstanding(self, now: float) -> int:
        """Credits handed out in turns and not consumed yet (those of silent samplers no longer count)."""
        return sum(self._held(k) for k in self._limit if k not in self._reclaimed)

    def _held(self, key: str) -> int:
        return max(0, self._limit[key] - self._consumed.get(key, 0))

    def _take_turns(self, now: float) -> None:
        """Reclaim the credits of samplers silent for ``live_after_s``, then give the free credits, one
        turn each, to the samplers that waited longest."""
        for key in self._limit:
            if key not in self._reclaimed and self._held(key) > 0 and \
                    now - max(self._given_at.get(key, 0.0), self._seen.get(key, 0.0)) > self.live_after_s:
                self._reclaimed.add(key)
        free = self.total_window - self.outstanding(now)
        if free <= 0:
            return
        for key in list(self._order):
            if free <= 0:
                break
            sid = sampler_of(key)
            if self._newest.get(sid) != key or now - self._sampler_seen.get(sid, -1e18) > self.forget_after_s:
                continue  # an old incarnation, or a sampler about to be forgotten
            if key in self._limit and key not in self._reclaimed and self._held(key) > 0:
                continue  # still holds a turn
            if key in self._reclaimed and self._seen.get(key, 0.0) <= self._given_at.get(key, 0.0) and \
                    now - self._given_at.get(key, 0.0) <= 6 * self.live_after_s:
                continue  # did not use its last turn: it waits a while before it is tried again
            self._limit[key] = max(self._limit.get(key, 0), self._consumed.get(key, 0)) + TURN
            self._given_at[key] = now
            self._reclaimed.discard(key)
            del self._order[key]
            self._order[key] = None  # to the back of the queue
            free -= TURN

    def _forget(self, now: float) -> None:
        for key in [k for k, t in self._seen.items() if now - t > self.forget_after_s]:
            del self._seen[key]
            self._consumed.pop(key, None)  # a key seen only with n = 0 never got a count
            for d in (self._limit, self._given_at, self._order):
                d.pop(key, None)
            self._reclaimed.discard(key)
            if self._newest.get(sampler_of(key)) == key:
                del self._newest[sampler_of(key)]
        for sid in [s for s, t in self._sampler_seen.items() if now - t > self.forget_after_s]:
            del self._sampler_seen[sid]

    def grants(self, trainer_id: str, now: float) -> list[CreditGrant]:
        """One grant per shard (to be sent on credits partition ``grant.shard``): the consumed counts and
        limits of that shard's samplers only, and the window."""
        self._forget(now)
        self.changed = False
        window = self.window(now)
        self._turns = self.allocates and window == 0
        if self._turns:
            self._take_turns(now)
        live = self.live(now)
        out = [CreditGrant(trainer=trainer_id, window=window, consumed={}, live_samplers=live, shard=s,
                           shards=self.shards, allocates=self.allocates) for s in range(self.shards)]
        for key, n in self._consumed.items():
            out[shard_of(sampler_of(key), self.shards)].consumed[key] = n
        if self.allocates and window == 0:
            for key, limit in self._limit.items():
                if key not in self._reclaimed and self._held(key) > 0:  # a used-up limit says nothing new
                    out[shard_of(sampler_of(key), self.shards)].limits[key] = limit
        return out

    def grant(self, trainer_id: str, now: float) -> CreditGrant:
        """All shards in one grant (one shard, or a test's view of everything)."""
        gs = self.grants(trainer_id, now)
        g = gs[0]
        for other in gs[1:]:
            g.consumed.update(other.consumed)
            g.limits.update(other.limits)
        return g


class CreditGate:
    """A sampler's side: sequence numbers, what is in flight, whether it may send."""

    def __init__(self, sampler_id: str, initial_window: int = 1, incarnation: str | None = None) -> None:
        self.incarnation = incarnation or new_incarnation()
        self.key = f"{sampler_id}/{self.incarnation}"
        self.sent = 0
        self.consumed = 0
        self.window = initial_window
        self.limit: int | None = None  # taking turns: the count up to which it may have sent
        self.turns = False  # the last allocating grant said: take turns
        self.known = False  # the last allocating grant knew this sampler process
        self._allocated = False  # an allocating grant came (before one: ``initial_window``)
        self.granted_at: float | None = None
        self.consumed_at: float | None = None  # when the consumed count last moved
        self.live_samplers = 0  # the samplers the last allocating grant counted as live
        self._lost: set[int] = set()  # sent, never to be consumed: never acknowledged by Kafka, or settled
        self._placed: dict[int, tuple[int, int]] = {}  # acknowledged, not consumed yet: n -> (partition, offset)
        self._seen: dict[int, int] = {}  # samples partition -> the trainer's position (max over grants)
        self.settled = 0  # fragments the trainer's position passed unconsumed (released, never trained)
        self.newly_settled: list[tuple[int, int, int]] = []  # (n, partition, offset) not reported yet: the caller's
        self._regressed: set[int] = set()  # partitions whose offsets went backwards: positions not used there
        self.newly_regressed: list[tuple[int, int, int]] = []  # (partition, acked offset, position), to report

    def next_seq(self) -> int:
        self.sent += 1
        return self.sent

    def lost(self, n: int) -> None:
        """Fragment ``n`` was never acknowledged by Kafka: it will never be consumed."""
        if n > self.consumed:
            self._lost.add(n)

    def placed(self, n: int, partition: int, offset: int) -> None:
        """Kafka acknowledged fragment ``n`` at ``(partition, offset)``. Never settled here: an offset below what
        the trainer's position already passed on that partition means offsets went backwards there (see the
        module's doc), and that partition's positions are no longer used."""
        if n <= self.consumed or n in self._lost:
            return
        if offset < self._seen.get(partition, -1) and partition not in self._regressed:
            self._regressed.add(partition)
            self.newly_regressed.append((partition, offset, self._seen[partition]))
        self._placed[n] = (partition, offset)

    def _settle(self, n: int) -> None:
        self._lost.add(n)
        self.newly_settled.append((n, *self._placed.pop(n)))
        self.settled += 1

    def grant(self, g: CreditGrant, now: float) -> None:
        self.granted_at = now
        n = g.consumed.get(self.key)
        if n is not None and n > self.consumed:  # monotonic: a restarted trainer re-reading old records
            self.consumed = n
            self.consumed_at = now
            self._lost = {m for m in self._lost if m > n}
            self._placed = {m: at for m, at in self._placed.items() if m > n}
        for part, off in g.seen.items():  # monotonic per partition, whichever rank reads it now
            if off > self._seen.get(part, -1):
                self._seen[part] = off
        for m, (part, off) in list(self._placed.items()):
            if off < self._seen.get(part, -1) and part not in self._regressed:  # passed, never consumed: never will be
                self._settle(m)
        if not g.allocates:  # another rank's counts: what it consumed counts, the window is rank 0's
            return
        self._allocated = True
        self.live_samplers = g.live_samplers
        self.turns = g.window <= 0
        self.window = max(1, g.window)
        self.known = n is not None or self.key in g.limits
        limit = g.limits.get(self.key)
        if limit is not None and (self.limit is None or limit > self.limit):  # monotonic, as consumed
            self.limit = limit

    @property
    def in_flight(self) -> int:
        return max(0, self.sent - self.consumed - len(self._lost))

    @property
    def allowed(self) -> int:
        """Fragments it may have in flight now: one while the trainer has not consumed from this process
        yet (to make itself known: a window or a turn is for samplers the trainer counts), then its window,
        or while taking turns what its limit leaves."""
        if not self._allocated:
            return self.window
        if not self.known:
            return 1
        if not self.turns:
            return self.window
        return 0 if self.limit is None else max(0, self.limit - self.consumed)

    def open(self) -> bool:
        return self.in_flight < self.allowed

    def waiting_reason(self, now: float, waited: float, grant_silence_s: float = GRANT_SILENCE_S) -> str:
        """Why this sampler has waited ``waited`` s for credits, in terms of what it observed: no grants at
        all, grants but no turn, grants while the trainer consumes from no sampler, or grants while the trainer
        consumes from others and not from this one."""
        if self.granted_at is None:
            return (f"no credit grant received in {waited:.0f} s since this sampler started: the trainer is not "
                    f"running, or its grants do not reach this sampler")
        silent = now - self.granted_at
        if silent > grant_silence_s:
            return (f"no credit grant for {silent:.0f} s (the trainer grants every second): the trainer stopped, "
                    f"or it or this sampler is cut off from Kafka")
        if self.turns:
            return (f"waiting {waited:.0f} s for a turn: {self.live_samplers} live sampler(s) take turns with the "
                    f"trainer's window")
        if self.live_samplers == 0:
            return (f"grants arrive but the trainer consumes from no sampler: {self.in_flight} fragment(s) in "
                    f"flight for {waited:.0f} s (the trainer is paused, stalled, or reading a backlog)")
        moved = "never" if self.consumed_at is None else f"{now - self.consumed_at:.0f} s ago"
        return (f"grants arrive and the trainer consumes from {self.live_samplers} sampler(s), but not this "
                f"one's {self.in_flight} fragment(s) in flight for {waited:.0f} s (its consumed count last moved "
                f"{moved})")
