"""Which policy a sampler adopts next, and from where (docs/policies.md): the functional core of adoption.

Announcements on ``<run>.policy`` may carry the weights inline (``PolicyMessage.inline``): those are
adopted without touching the store. Versions announced without them, or seen only behind the marker, are
fetched from the store, no more often than ``sampler.min_adoption_interval_s``: with a thousand samplers,
one GET per sampler per version on one prefix is what S3 throttles and bills. The sampler service reads
the topic and the marker and installs the weights; this class only decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import PolicyMessage


@dataclass(frozen=True)
class AdoptInline:
    """Adopt the weights carried by ``message`` (check them against its sha256 first)."""

    message: PolicyMessage


@dataclass(frozen=True)
class FetchFromStore:
    """Fetch the marker's version from the store; ``trigger`` says what made it known (for the metrics)."""

    trigger: str


Step = AdoptInline | FetchFromStore | None


class AdoptionPlan:
    """The newest version a sampler knows of, the inline payload it holds, and when it last fetched from the store.

    Pure: the clock is passed in (monotonic seconds). Invariants:

    - the newest known version wins: an inline payload is offered only while its version is the newest
      known, and a payload for an older version is never kept;
    - a store fetch is offered no sooner than ``min_interval_s`` after the previous one, and for a version
      seen only behind the marker (its announcement not read yet: it usually carries the weights inline and
      is milliseconds behind), no sooner than ``min_interval_s`` after it was first seen;
    - a version whose weights were refused (:meth:`weights_refused`) is not offered again, and an inline
      payload that failed its check (:meth:`inline_refused`) is dropped: that version comes from the store.
    """

    def __init__(self) -> None:
        self.wanted: int | None = None
        """The newest version announced or found behind the marker."""
        self.trigger = "announce"
        self._seen_at = 0.0  # when ``wanted`` became known
        self._announced = False  # ``wanted`` was announced (so no inline payload is on its way)
        self._inline: PolicyMessage | None = None  # an announcement of ``wanted`` with its weights
        self._last_store_fetch: float | None = None
        self._refused: int | None = None  # the last version whose weights were refused

    def _know(self, version: int, trigger: str, now: float) -> bool:
        if self.wanted is not None and version <= self.wanted:
            return False
        self.wanted, self.trigger, self._seen_at, self._announced = version, trigger, now, False
        if self._inline is not None and self._inline.version < version:
            self._inline = None
        return True

    def announced(self, msg: PolicyMessage, now: float) -> bool:
        """An announcement was read; True when it names a version newer than any known (wake the loop)."""
        newer = self._know(msg.version, "announce", now)
        if msg.version == self.wanted:
            self._announced = True
            if msg.inline is not None and msg.version != self._refused:
                self._inline = msg
            return newer or self._inline is msg
        return False

    def found_behind_marker(self, version: int, now: float, trigger: str = "poll") -> bool:
        """The marker names ``version``; True when it is newer than any known."""
        return self._know(version, trigger, now)

    def next(self, current: int | None, now: float, min_interval_s: float) -> Step:
        """What to do now, the sampler acting with ``current``: adopt inline weights, fetch from the store, or
        nothing yet (nothing newer, a refused version, or the store interval has not passed)."""
        wanted = self.wanted
        if wanted is None or (current is not None and wanted <= current) or wanted == self._refused:
            return None
        if self._inline is not None and self._inline.version == wanted:
            return AdoptInline(self._inline)
        if self._last_store_fetch is not None and now - self._last_store_fetch < min_interval_s:
            return None
        if not self._announced and now - self._seen_at < min_interval_s:
            return None  # seen only behind the marker: its announcement (inline, likely) may be on its way
        return FetchFromStore(self.trigger)

    def fetched_from_store(self, now: float) -> None:
        self._last_store_fetch = now

    def inline_refused(self, version: int) -> None:
        """The inline weights of ``version`` failed their sha256 check: fetch that version from the store."""
        if self._inline is not None and self._inline.version == version:
            self._inline = None
        if self.wanted == version:
            self._announced = True  # the announcement came; only its payload was bad

    def weights_refused(self, version: int) -> None:
        """``version``'s weights do not load into this sampler's policy: not offered again (a newer one is)."""
        self._refused = version
        if self._inline is not None and self._inline.version == version:
            self._inline = None
