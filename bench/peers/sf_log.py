"""Sample Factory 2.1.1's own console reports, read line by line as they arrive.

Every 5 s (``Runner.report_interval_sec``) SF's runner prints

    ... Fps is (10 sec: 5120.0, 60 sec: nan, 300 sec: nan). Total num frames: 40960. Throughput: {0: 511.9}.
        Samples: 41216. Policy #0 lag: (...)
    ... Avg episode reward: [(0, '487.250')]

``Total num frames`` is ``sum(runner.env_steps)``: the samples each learner has TRAINED on. ``Learner.train``
(``sample_factory/algo/learning/learner.py``, v2.1.1 lines 1046-1053) adds a batch's size after its epochs of
SGD, times ``env_frameskip`` when ``summaries_use_frameskip`` is set (the Atari example's default: there it
counts emulator frames, 4 per env step). The ``Fps is`` values are that count's rate over the last 10, 60
and 300 s. ``Samples`` is the observations the inference workers have COLLECTED (``samples_collected``, no
frame skip). The reward is the mean over the last ``stats_avg`` (default 100) finished episodes of policy 0,
raw env rewards (``reward_scale`` applies to training only). The first env step is taken at ``All inference
workers are ready! Signal rollout workers to start!``: before it no rollout worker steps an env
(``decorrelate_experience_max_seconds`` is 0).
Times are when the bench read each line (seconds since the process was started), not SF's own stamps.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

READY = "All inference workers are ready! Signal rollout workers to start!"
_FRAMES = re.compile(r"Total num frames: (\d+)")
_SAMPLES = re.compile(r"Samples: (\d+)")
_FPS = re.compile(r"Fps is \(10 sec: ([-+0-9.eEinfa]+), 60 sec: ([-+0-9.eEinfa]+), 300 sec: ([-+0-9.eEinfa]+)\)")
_REWARD = re.compile(r"Avg episode reward: \[\(0, '([-+0-9.eEinfa]+)'\)")


@dataclass(frozen=True)
class Report:
    """One of SF's periodic reports: when it was read, ``Total num frames`` so far, last-100 mean (None before
    any), and when the line has them the collected ``Samples`` and the ``Fps is`` 10/60/300-s rates (nan
    until SF has enough history)."""

    t: float
    env_steps: int
    last100: float | None
    samples: int | None = None
    fps: tuple[float, float, float] | None = None


@dataclass
class SfLog:
    """Folds SF's console lines into reports. Invariant: ``reports`` are in arrival order and each carries
    the ``Total num frames`` printed just before its reward line (a report without a reward line keeps
    ``last100`` None)."""

    ready_t: float | None = None
    reports: list[Report] = field(default_factory=list)
    _frames: Report | None = None  # the frames line's report, waiting for its reward line

    def feed(self, t: float, line: str) -> Report | None:
        """Take one line read at ``t``; return the report it completed, if any."""
        if self.ready_t is None and READY in line:
            self.ready_t = t
            return None
        m = _FRAMES.search(line)
        if m:
            self._flush()
            samples, fps = _SAMPLES.search(line), _FPS.search(line)
            self._frames = Report(t, int(m.group(1)), None, None if samples is None else int(samples.group(1)),
                                  None if fps is None else (float(fps[1]), float(fps[2]), float(fps[3])))
            return None
        m = _REWARD.search(line)
        if m and self._frames is not None:
            rep = dataclasses.replace(self._frames, last100=float(m.group(1)))
            self.reports.append(rep)
            self._frames = None
            return rep
        return None

    def close(self) -> None:
        """End of input: keep a trailing frames line that had no reward line."""
        self._flush()

    def _flush(self) -> None:
        if self._frames is not None:  # a frames line with no reward line after it (no episode finished yet)
            self.reports.append(self._frames)
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
