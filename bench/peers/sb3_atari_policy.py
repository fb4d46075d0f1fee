"""The part of the SB3 Pong peer that needs stable-baselines3 (the ``bench`` extra): the callback that reports each
update and stops ``learn()`` at the wall budget. Kept apart so that importing ``bench.peers.sb3_atari`` (and the
figure registry) needs no SB3; the features extractor is ``bench.peers.sb3_minatar_policy.FlywheelTorso``."""

from __future__ import annotations

import time
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback

from bench.peers.proc import emit
from bench.peers.throughput import UpdateClock


class UpdateWatch(BaseCallback):
    """Emits ``learn_start``, then a ``progress`` line after each update (``UpdateClock``), and stops ``learn()``
    at the first env step that ends after ``run_s`` seconds of learning (that rollout is not trained). Records
    the env steps trained, the seconds learned and the cores used while learning (process CPU over wall)."""

    def __init__(self, run_s: float) -> None:
        super().__init__()
        self.run_s = run_s
        self.clock = UpdateClock()
        self.t0 = 0.0
        self.cpu0 = 0.0
        self.trained = 0
        self.learn_s = 0.0
        self.cores: float | None = None

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _report(self, line: dict[str, Any] | None) -> None:
        if line is not None:
            self.trained = int(line["trained"])
            emit(line)

    def _on_training_start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = time.process_time()
        emit({"event": "learn_start", "wall": time.time()})

    def _on_rollout_start(self) -> None:
        self._report(self.clock.rollout_start(self._now()))

    def _on_step(self) -> bool:
        return self._now() <= self.run_s

    def _on_rollout_end(self) -> None:
        self.clock.rollout_end(self._now(), int(self.num_timesteps))

    def _on_training_end(self) -> None:
        now = self._now()
        self._report(self.clock.learn_end(now))
        self.learn_s = now
        self.cores = (time.process_time() - self.cpu0) / now if now > 0 else None
