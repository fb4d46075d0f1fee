"""Sync latency: from a published candidate to every live sampler acting on it. Pure logic.

Both ends are read on paramsync's own clock (receipt of the candidate, receipt of the first
heartbeat showing the version), so clock skew between machines does not enter the figure.
A sampler is live while its heartbeats are younger than ``sampler_timeout_s``; one silent for
``FORGET_AFTER_TIMEOUTS`` x ``sampler_timeout_s`` is forgotten (:meth:`SyncTracker.forget`), so the
tracker's state, and the per-sampler label series the service keeps from it, stay bounded by the
samplers of the recent past however often samplers restart under new ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.service import percentile

FORGET_AFTER_TIMEOUTS = 10.0
"""A sampler silent for this many ``sampler_timeout_s`` is forgotten (not merely not live)."""


@dataclass
class SamplerState:
    version: int | None
    last_seen: float


class SyncTracker:
    """Invariants: every sampler in :attr:`samplers` was heard from within ``forget_after`` of the last
    :meth:`forget` (called on every heartbeat and by the service's beat loop); :attr:`pending` holds
    only versions younger than ``expire_after``; :attr:`latencies` holds at most ``window`` values."""

    def __init__(self, sampler_timeout_s: float, expire_after_s: float = 300.0, window: int = 200,
                 forget_after_s: float | None = None) -> None:
        self.timeout = sampler_timeout_s
        self.expire_after = expire_after_s
        self.forget_after = FORGET_AFTER_TIMEOUTS * sampler_timeout_s if forget_after_s is None else forget_after_s
        self.samplers: dict[str, SamplerState] = {}
        self.pending: dict[int, float] = {}
        self.latencies: deque[float] = deque(maxlen=window)

    def live(self, now: float) -> dict[str, SamplerState]:
        return {sid: s for sid, s in self.samplers.items() if now - s.last_seen <= self.timeout}

    def published(self, version: int, at: float) -> None:
        self.pending[version] = at

    def heartbeat(self, sampler_id: str, version: int | None, at: float) -> list[tuple[int, float]]:
        """Record a sampler's version; return the versions now synced, with their latency."""
        self.samplers[sampler_id] = SamplerState(version, at)
        self.forget(at)
        return self._settle(at)

    def forget(self, now: float) -> list[str]:
        """Drop the samplers silent for longer than ``forget_after``; return their ids (sorted), so the
        caller can remove their label series too."""
        gone = sorted(sid for sid, s in self.samplers.items() if now - s.last_seen > self.forget_after)
        for sid in gone:
            del self.samplers[sid]
        return gone

    def _settle(self, now: float) -> list[tuple[int, float]]:
        live = self.live(now)
        done: list[tuple[int, float]] = []
        for version, since in sorted(self.pending.items()):
            if now - since > self.expire_after:
                del self.pending[version]
                continue
            if live and all(s.version is not None and s.version >= version for s in live.values()):
                latency = max(0.0, now - since)
                done.append((version, latency))
                self.latencies.append(latency)
                del self.pending[version]
        return done

    def p(self, q: float) -> float | None:
        return percentile(list(self.latencies), q)
