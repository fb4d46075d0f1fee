"""Backlog flow control: the trainer group's lag on the samples topic, measured by a named task, and a
gate the sampling loop waits at while it is above ``sampler.max_backlog`` (a runtime setting; 0: off).

Explicit inputs only: the lag reader, the settings (read each time: runtime changes apply at once), and
the sampler's wake event and "while waiting" step passed in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter, Histogram

from shared.bus import LagReader
from shared.kafka import trainer_group
from shared.retry import describe
from shared.settings import Settings

BACKPRESSURE = Counter("flywheel_sampler_backpressure_seconds_total", "Seconds paused because the backlog was full",
                       ["sampler"])
LAG_PROBE = Histogram("flywheel_sampler_lag_probe_seconds", "Time of one trainer-backlog (consumer lag) query",
                      ["sampler"], buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
BACKLOG_MAX_AGE_INTERVALS = 25
"""A backlog reading older than this many check intervals no longer pauses the sampler."""


class BacklogGate:
    def __init__(self, lag_probe: LagReader, topic: str, settings: Callable[[], Settings], wake: asyncio.Event,
                 *, log: Any, labels: dict[str, str]) -> None:
        self.lag_probe = lag_probe
        self.topic = topic
        self.settings = settings
        self._wake = wake
        self.log = log
        self._labels = labels
        self._backlog: int | None = None  # last measured trainer backlog; None until the first measurement
        self._backlog_at = 0.0  # monotonic time of that measurement
        self._lag_failures = 0  # consecutive failed backlog measurements

    async def measure(self) -> None:
        """One measurement of the trainer's backlog into ``_backlog`` (the ``backlog`` task). A failed
        query is logged and the last value kept; it never stops the sampler. With ``max_backlog`` 0 (off,
        the default: credits do the flow control) nothing is asked of Kafka: two admin requests per
        sampler every ``backlog_check_interval_s`` cost the samplers and the brokers CPU for a reading
        nobody uses, and the reading is forgotten so that turning the gate on acts on a fresh one."""
        interval = self.settings().sampler.backlog_check_interval_s
        limit = self.settings().sampler.max_backlog  # a runtime setting
        if limit == 0:
            self._backlog = None
            return
        started = time.monotonic()
        try:
            lag = await self.lag_probe.lag(trainer_group(self.settings().run), self.topic)
        except Exception as exc:  # transient Kafka trouble: keep the last value, try again
            LAG_PROBE.labels(**self._labels).observe(time.monotonic() - started)
            self._lag_failures += 1
            # A reading older than BACKLOG_MAX_AGE_INTERVALS intervals is no longer a reason to pause:
            # a probe that keeps failing must not park the sampler (it would look alive, doing nothing).
            if self._backlog is not None and time.monotonic() - self._backlog_at > BACKLOG_MAX_AGE_INTERVALS * interval:
                self._backlog = None
                self._wake.set()
            if self._lag_failures == 1 or self._lag_failures % 100 == 0:
                self.log.warning("lag_probe_failed", failures=self._lag_failures, kept_backlog=self._backlog,
                                 error=describe(exc))
            return
        LAG_PROBE.labels(**self._labels).observe(time.monotonic() - started)
        self._backlog_at = time.monotonic()
        if self._lag_failures:
            self.log.info("lag_probe_recovered", failures=self._lag_failures)
            self._lag_failures = 0
        self._backlog = sum(lag.values())
        if self._backlog <= limit:
            self._wake.set()

    async def respect(self, stop_event: asyncio.Event, wait: Callable[[], Awaitable[None]]) -> None:
        """Flow control: wait while the trainer's backlog is above ``max_backlog`` fragments.

        The backlog comes from :meth:`measure` (no Kafka request here); unknown (before the
        first measurement) counts as not full. While paused the loop keeps adopting policies and
        sending heartbeats, in ``wait`` (the sampler's wake-up step)."""
        limit = self.settings().sampler.max_backlog
        if limit == 0:
            return
        backlog = self._backlog
        if backlog is None or backlog <= limit:
            return
        paused_at = time.monotonic()
        self.log.debug("backpressure_pause", backlog=backlog, max_backlog=limit)
        try:
            while not stop_event.is_set():
                backlog = self._backlog
                if backlog is None or backlog <= limit:
                    break
                await wait()
        finally:
            BACKPRESSURE.labels(**self._labels).inc(time.monotonic() - paused_at)
