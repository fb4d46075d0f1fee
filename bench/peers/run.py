"""What one peer run measured, the same fields for every peer.

Clocks: ``startup_s`` is from starting the peer (process or stack) to its first env step; ``train_s`` from
that first env step to the point where the last-100 mean return first reached the threshold; ``end_to_end_s``
is their sum. A run that did not reach it has ``train_s`` None (counted as inf in the medians) and says why in
``error``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PeerRun:
    peer: str  # "Sample Factory APPO", "SB3 PPO", "Flywheel"
    settings: str  # "rl-zoo", "flywheel", "SF example"
    seed: int
    startup_s: float | None
    train_s: float | None
    env_steps: int | None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def end_to_end_s(self) -> float | None:
        if self.startup_s is None or self.train_s is None:
            return None
        return self.startup_s + self.train_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"end_to_end_s": self.end_to_end_s}
