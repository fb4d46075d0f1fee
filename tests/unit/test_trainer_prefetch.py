"""The learner never waits for the poll: while an update runs in its thread, the trainer polls and decodes the
next batch's records (no more than that batch needs), so the next update starts on them at once. On the
in-memory bus (pure logic: what is consumed when, not Kafka's semantics)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from services.trainer.telemetry import BusyMeter
from tests.unit.test_trainer_bus import TP0, TP1, make, put, run_until, trained


async def test_the_next_batch_is_taken_while_the_update_runs(tmp_path: Path) -> None:
    t, mem = make(tmp_path, batch_fragments=2, poll_max_records=64)
    put(mem, TP0, 4)
    put(mem, TP1, 4)
    real = t.learner.update
    during: list[tuple[int, int]] = []  # (buffered, consumed records) seen at the end of each update
    gate = threading.Event()

    def slow_update(frags: list[Any], *a: Any) -> Any:
        gate.wait(5)  # the first update waits until the test saw the prefetch; the rest run at once
        out = real(frags, *a)
        during.append((len(t.intake.buffer), int(t.group.ledger.expected(TP0) or 0) + int(
            t.group.ledger.expected(TP1) or 0)))
        return out

    t.learner.update = slow_update  # type: ignore[method-assign]

    def prefetched() -> bool:
        if not gate.is_set() and t.stats.busy.fraction() is not None and len(t.intake.buffer) >= 2:
            gate.set()  # the second batch is buffered while the first update is still running
        return trained(t) == 8

    await run_until(t, prefetched)
    assert gate.is_set(), "the next batch was not taken while the update ran"
    assert during[0][0] == 2, during  # exactly the next batch: what it needs, not everything there is
    assert t.stats.busy.fraction() is not None


def test_busy_meter_counts_the_window_only() -> None:
    m = BusyMeter(window_s=10.0)
    m.started = 0.0
    assert m.fraction(now=0.0) is None
    m.add(2.0, now=2.0)
    m.add(3.0, now=6.0)
    assert m.fraction(now=10.0) == 0.5
    assert m.fraction(now=14.0) == 0.2  # the first update (0-2 s) left the window; of the second (3-6 s), 4-6 s
    m.add(10.0, now=24.0)  # one long update spanning the whole window: busy throughout
    assert m.fraction(now=24.0) == 1.0
    assert m.fraction(now=30.0) == 0.4  # 14-24 busy of the window 20-30



@pytest.mark.timeout(60)  # the regression is a hang (the trainer's stop waits on the deadlocked loop): fail instead
async def test_a_rebalance_during_an_update_completes_and_training_goes_on(tmp_path: Path) -> None:
    """aiokafka parks a poll made during a rebalance until the new assignment, and the assignment waits for the
    revoke callback, which waits for the update in progress: a prefetch poll left waiting would hold the update's
    lock for good. Here the in-memory source parks its poll the same way (no timeout) while a rebalance runs
    in the middle of an update; the rebalance must complete and the trainer train on."""
    import asyncio

    t, mem = make(tmp_path, batch_fragments=2, poll_max_records=64)
    put(mem, TP0, 1)
    put(mem, TP1, 1)  # one batch; the next is not there yet, so the prefetch polls during the update
    src: Any = t.source
    reassigning: list[asyncio.Future[None]] = []
    plain_poll = src.poll

    async def poll(max_records: int, timeout_ms: int) -> Any:
        if reassigning:
            await reassigning[0]  # as aiokafka's fetcher: wait for the next assignment, no timeout
        return await plain_poll(max_records, timeout_ms)

    src.poll = poll
    loop = asyncio.get_running_loop()
    done: list[Any] = []

    async def rebalance() -> None:
        reassigning.append(loop.create_future())  # the reassignment begins before the revoke callback
        await src.revoke(set(src.owned))
        await src.assign({TP0, TP1})
        reassigning.pop().set_result(None)

    real = t.learner.update

    def update(frags: list[Any], *a: Any) -> Any:
        if not done:
            done.append(asyncio.run_coroutine_threadsafe(rebalance(), loop))
            threading.Event().wait(0.3)  # the rebalance starts while this update runs
        return real(frags, *a)

    t.learner.update = update  # type: ignore[method-assign]

    def trained_after_rebalance() -> bool:
        if done and done[0].done() and trained(t) == 2:
            put(mem, TP0, 1)
            put(mem, TP1, 1)
            done.append("more")
        return trained(t) >= 4

    await run_until(t, trained_after_rebalance, timeout_s=20)
    assert done[0].done() and done[0].result() is None
