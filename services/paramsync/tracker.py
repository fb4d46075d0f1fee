"""Sync latency: from a published candidate to every live sampler acting on it. Pure logic.

Both ends are read on paramsync's own clock (receipt of the candidate, receipt of the first
heartbeat showing the version), so clock skew between machines does not enter the figure.
A sampler is live while its heartbeats are younger than ``sampler_timeout_s``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.service import percentile


@dataclass
class SamplerState:
    version: int | None
    last_seen: float


class SyncTracker:
    def __init__(self, sampler_timeout_s: float, expire_after_s: float = 300.0, window: int = 200) -> None:
        self.timeout = sampler_timeout_s
        self.expire_after = expire_after_s
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
        return self._settle(at)

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
