"""The sampler's backlog gate (pure flow-control logic; the lag reading itself is Kafka's and is read by
``LagProbe`` against the broker in the integration tests)."""

from __future__ import annotations

import asyncio

from services.sampler.backlog import BacklogGate
from shared.logging import get_logger
from shared.settings import Settings


class Lag:
    """A lag reader twin: returns the lag it is told, or raises."""

    def __init__(self) -> None:
        self.value = 0
        self.error: Exception | None = None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def lag(self, group: str, topic: str) -> dict[int, int]:
        if self.error is not None:
            raise self.error
        return {0: self.value}


def gate(max_backlog: int, lag: Lag) -> tuple[BacklogGate, asyncio.Event]:
    settings = Settings.model_validate({"sampler": {"max_backlog": max_backlog, "backlog_check_interval_s": 0.01}})
    wake = asyncio.Event()
    return BacklogGate(lag, "r.samples", lambda: settings, wake, log=get_logger(), labels={"sampler": "s"}), wake


async def test_the_loop_waits_while_the_backlog_is_above_the_limit() -> None:
    lag = Lag()
    g, wake = gate(5, lag)
    lag.value = 10
    await g.measure()
    waits = 0

    async def wait() -> None:
        nonlocal waits
        waits += 1
        if waits == 3:  # the trainer caught up meanwhile
            lag.value = 2
            await g.measure()
        await asyncio.sleep(0)

    await asyncio.wait_for(g.respect(asyncio.Event(), wait), 5)
    assert waits == 3 and wake.is_set()


async def test_no_wait_when_off_unknown_or_below() -> None:
    lag = Lag()
    for limit, value, measured in ((0, 99, True), (5, 99, False), (5, 3, True)):
        g, _ = gate(limit, lag)
        lag.value = value
        if measured:
            await g.measure()

        async def never() -> None:
            raise AssertionError("waited")

        await g.respect(asyncio.Event(), never)


async def test_a_probe_that_keeps_failing_stops_pausing_the_sampler() -> None:
    lag = Lag()
    g, wake = gate(5, lag)
    lag.value = 10
    await g.measure()
    lag.error = ConnectionError("broker away")
    await asyncio.sleep(0.3)  # more than 25 check intervals: the last reading is too old to act on
    await g.measure()
    assert wake.is_set()

    async def never() -> None:
        raise AssertionError("waited on a stale reading")

    await g.respect(asyncio.Event(), never)


class CountingLag(Lag):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def lag(self, group: str, topic: str) -> dict[int, int]:
        self.calls += 1
        return await super().lag(group, topic)


async def test_kafka_is_not_asked_while_the_gate_is_off() -> None:
    """``max_backlog`` 0 (credits do the flow control): no lag query at all; a limit set at runtime starts the
    measurements, and a reading taken while it was on is forgotten when it goes off again."""
    lag = CountingLag()
    settings = Settings.model_validate({"sampler": {"max_backlog": 0, "backlog_check_interval_s": 0.01}})
    current = {"s": settings}
    g = BacklogGate(lag, "r.samples", lambda: current["s"], asyncio.Event(), log=get_logger(),
                    labels={"sampler": "s"})
    for _ in range(5):
        await g.measure()
    assert lag.calls == 0
    current["s"] = settings.model_copy(update={"sampler": settings.sampler.model_copy(update={"max_backlog": 5})})
    lag.value = 10
    await g.measure()
    assert lag.calls == 1
    current["s"] = settings
    await g.measure()
    assert lag.calls == 1
    current["s"] = settings.model_copy(update={"sampler": settings.sampler.model_copy(update={"max_backlog": 5})})

    async def never() -> None:
        raise AssertionError("waited on a reading taken before the gate went off")

    await g.respect(asyncio.Event(), never)
