"""The callback every SB3 learning peer runs inside ``learn()`` (needs stable-baselines3: imported only by the
peers' child processes, never by the figure registry).

It prints ``{"event": "learn_start", "wall": ...}`` when ``learn()`` begins, records (seconds since then, env
steps so far, return) for every episode its Monitor wrappers finish, and stops ``learn()``:

- at the first env step that ends after ``max_s`` seconds (that step's episodes are not recorded, and
  ``steps_within`` keeps the env steps taken before it), or
- when :meth:`EpisodeWatch.done` says so after a step (a peer's own rule: solved, a step budget).

Invariant: ``curve`` is in finishing order and every entry finished within ``max_s``.
"""

from __future__ import annotations

import time

from stable_baselines3.common.callbacks import BaseCallback

from bench.peers.proc import emit


class EpisodeWatch(BaseCallback):
    def __init__(self, max_s: float = float("inf"), announce: bool = True) -> None:
        super().__init__()
        self.max_s = max_s
        self.announce = announce  # the learn_start line: for a peer's child process, not an in-process run
        self.t0 = 0.0
        self.curve: list[tuple[float, int, float]] = []
        self.steps_within = 0

    def done(self, t: float) -> bool:
        """Whether to stop after the step that ended ``t`` seconds in (its episodes recorded). Never, here."""
        return False

    def _on_training_start(self) -> None:
        self.t0 = time.monotonic()
        if self.announce:
            emit({"event": "learn_start", "wall": time.time()})

    def _on_step(self) -> bool:
        t = time.monotonic() - self.t0
        if t > self.max_s:
            return False
        self.steps_within = int(self.num_timesteps)
        for info in self.locals["infos"]:
            ep = info.get("episode")
            if ep is not None:
                self.curve.append((round(t, 3), self.steps_within, float(ep["r"])))
        return not self.done(t)


class SolvedWatch(EpisodeWatch):
    """Stops once the mean of the last ``window`` returns reaches ``threshold``; ``solved`` is (seconds, env
    steps) of that step, or None."""

    def __init__(self, threshold: float, max_s: float, window: int = 100, announce: bool = True) -> None:
        super().__init__(max_s, announce)
        self.threshold = threshold
        self.window = window
        self.solved: tuple[float, int] | None = None

    def done(self, t: float) -> bool:
        recent = [r for _, _, r in self.curve[-self.window:]]
        if self.solved is None and len(recent) == self.window and sum(recent) / self.window >= self.threshold:
            self.solved = (t, self.steps_within)
        return self.solved is not None


class StepBudgetWatch(EpisodeWatch):
    """Stops at the first step at or past ``steps`` env steps; ``budget_s`` is when that was (or None)."""

    def __init__(self, steps: int, max_s: float) -> None:
        super().__init__(max_s)
        self.steps = steps
        self.budget_s: float | None = None

    def done(self, t: float) -> bool:
        if self.budget_s is None and self.num_timesteps >= self.steps:
            self.budget_s = t
        return self.budget_s is not None
