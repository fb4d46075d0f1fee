"""The learner never waits for the poll: while an update runs in its thread, the trainer polls and decodes the
next batch's records (no more than that batch needs), so the next update starts on them at once. On the
in-memory bus (pure logic: what is consumed when, not Kafka's semantics)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

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

