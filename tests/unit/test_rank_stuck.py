"""A collective that waits on a rank gone or cut off marks the trainer degraded within seconds (not only when
``trainer.rank_timeout_s`` ends the group), naming the collective, and clears once it returns."""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.ranks import STUCK_AFTER_S, Ranks
from shared.retry import Health


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))


def _ranks(timeout_s: float = 60.0) -> Ranks:
    return Ranks(world_size=2, rank=1, rendezvous="10.77.0.30:29500", timeout_s=timeout_s,
                 device=torch.device("cpu"))


def test_a_collective_waiting_past_the_bound_degrades_then_recovers() -> None:
    r, health, log = _ranks(), Health(service="trainer"), _Log()
    r.report(health, log, 100.0)
    assert health.state == "ok"
    r.waiting = ("all_gather", 100.0)
    r.report(health, log, 100.0 + STUCK_AFTER_S - 0.5)  # an update's length: normal lock step
    assert health.state == "ok" and not log.lines
    r.report(health, log, 100.0 + STUCK_AFTER_S + 1)
    assert health.state == "degraded"
    why = health.reasons["ranks"]
    assert "all_gather" in why and "rank 1" in why and "10.77.0.30:29500" in why and "rank_timeout_s=60" in why
    r.report(health, log, 100.0 + STUCK_AFTER_S + 5)  # logged once, not every heartbeat
    assert [e for _, e, _ in log.lines] == ["rank_collective_stuck"]
    r.waiting = None
    r.report(health, log, 130.0)
    assert health.state == "ok" and "ranks" not in health.reasons
    assert [e for _, e, _ in log.lines] == ["rank_collective_stuck", "rank_collective_recovered"]


def test_a_short_rank_timeout_reports_at_half_of_it() -> None:
    r, health = _ranks(timeout_s=6.0), Health(service="trainer")
    r.waiting = ("broadcast", 0.0)
    r.report(health, _Log(), 2.9)
    assert health.state == "ok"
    r.report(health, _Log(), 3.1)
    assert "broadcast" in health.reasons["ranks"]


def test_the_collective_marks_itself_while_it_runs_and_clears_after_an_error() -> None:
    r = _ranks()
    seen: list[Any] = []
    assert r._collective("all_reduce (gradients)", lambda: seen.append(r.waiting) or 7) == 7
    assert seen[0][0] == "all_reduce (gradients)" and r.waiting is None

    def boom() -> None:
        raise RuntimeError("Connection closed by peer")

    try:
        r._collective("all_gather", boom)
    except RuntimeError:
        pass
    assert r.waiting is None
