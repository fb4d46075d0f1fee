"""Sample Factory 2.1.1's own console reports, read line by line as they arrive.

Every 5 s (``Runner.report_interval_sec``) SF's runner prints

    ... Fps is (10 sec: ..., 60 sec: ..., 300 sec: ...). Total num frames: 40960. Throughput: ...
    ... Avg episode reward: [(0, '487.250')]

``Total num frames`` is the env steps the learner has been sent (``sum(runner.env_steps)``); the reward is the
mean over the last ``stats_avg`` (default 100) finished episodes of policy 0, raw env rewards (``reward_scale``
applies to training only). The first env step is taken at ``All inference workers are ready! Signal rollout
workers to start!``: before it no rollout worker steps an env (``decorrelate_experience_max_seconds`` is 0).
Times are when the bench read each line (seconds since the process was started), not SF's own stamps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

READY = "All inference workers are ready! Signal rollout workers to start!"
_FRAMES = re.compile(r"Total num frames: (\d+)")
_REWARD = re.compile(r"Avg episode reward: \[\(0, '([-+0-9.eEinfa]+)'\)")


@dataclass(frozen=True)
class Report:
    """One of SF's periodic reports: when it was read, env steps so far, last-100 mean (None before any)."""

    t: float
    env_steps: int
    last100: float | None


@dataclass
class SfLog:
    """Folds SF's console lines into reports. Invariant: ``reports`` are in arrival order and each carries
    the ``Total num frames`` printed just before its reward line (a report without a reward line keeps
    ``last100`` None)."""

    ready_t: float | None = None
    reports: list[Report] = field(default_factory=list)
    _frames: tuple[float, int] | None = None

    def feed(self, t: float, line: str) -> Report | None:
        """Take one line read at ``t``; return the report it completed, if any."""
        if self.ready_t is None and READY in line:
            self.ready_t = t
            return None
        m = _FRAMES.search(line)
        if m:
            self._flush()
            self._frames = (t, int(m.group(1)))
            return None
        m = _REWARD.search(line)
        if m and self._frames is not None:
            rep = Report(self._frames[0], self._frames[1], float(m.group(1)))
            self.reports.append(rep)
            self._frames = None
            return rep
        return None

    def close(self) -> None:
        """End of input: keep a trailing frames line that had no reward line."""
        self._flush()

    def _flush(self) -> None:
        if self._frames is not None:  # a frames line with no reward line after it (no episode finished yet)
            self.reports.append(Report(self._frames[0], self._frames[1], None))
            self._frames = None

    def first_reaching(self, threshold: float) -> Report | None:
        """The first report whose last-100 mean is >= ``threshold``."""
        for r in self.reports:
            if r.last100 is not None and r.last100 >= threshold:
                return r
        return None


def parse(lines: Iterable[tuple[float, str]]) -> SfLog:
    """All of a run's (time read, line) pairs at once."""
    log = SfLog()
    for t, line in lines:
        log.feed(t, line)
    log.close()
    return log
