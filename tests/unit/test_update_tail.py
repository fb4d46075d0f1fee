"""The update's tail (services/trainer/tail.py) against twins of the group, the publication and the checkpoints:
what runs in which order after an update, and when commits are held."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.trainer.tail import UpdateTail


class GroupTwin:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.hold_commits = False

    async def commit(self) -> None:
        await asyncio.sleep(0)
        self.events.append("commit (held)" if self.hold_commits else "commit")


class PublicationTwin:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.deferred: Any = None
        self.due = False

    async def publish(self, version: int, data: bytes, update: int, extra: dict[str, Any]) -> None:
        self.events.append(f"publish v{version} {extra}")

    def retry_due(self, now: float) -> bool:
        return self.due

    async def retry_deferred(self) -> None:
        self.events.append("retry deferred")
        self.deferred = None


class CheckpointsTwin:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.last: int | None = None
        self.fail = False

    async def try_save(self, learner: Any, group: Any, extra: dict[str, Any], fence: Any) -> bool:
        await fence()
        if self.fail:
            self.events.append("checkpoint deferred")
            return False
        self.last = learner.counters.updates
        self.events.append(f"checkpoint {self.last}")
        return True


def rig() -> tuple[UpdateTail, list[str], Any]:
    events: list[str] = []
    fenced: list[int] = []

    async def fence() -> None:
        fenced.append(1)

    tail = UpdateTail(GroupTwin(events), PublicationTwin(events), CheckpointsTwin(events),  # type: ignore[arg-type]
                      publish_extra=lambda: {"checkpoint": tail.checkpoints.last}, checkpoint_extra=dict,
                      fence=fence)
    return tail, events, fenced


def learner(updates: int) -> Any:
    return SimpleNamespace(counters=SimpleNamespace(updates=updates))


async def test_a_fresh_run_checkpoints_its_first_update_before_committing_then_every_checkpoint_every() -> None:
    tail, events, fenced = rig()
    await tail.after_update(learner(1), (1, b"w", 1), leader=True, checkpoint_every=3)
    await tail.settle()
    assert events == ["checkpoint 1", "commit", "publish v1 {'checkpoint': 1}"] and fenced == [1]
    events.clear()
    await tail.after_update(learner(2), None, leader=True, checkpoint_every=3)
    await tail.settle()
    await tail.after_update(learner(3), (2, b"w", 3), leader=True, checkpoint_every=3)
    assert events == ["commit", "commit", "publish v2 {'checkpoint': 1}", "checkpoint 3"]


async def test_a_deferred_checkpoint_is_written_at_the_next_update() -> None:
    tail, events, _ = rig()
    tail.checkpoints.last = 1  # type: ignore[misc]
    tail.checkpoints.fail = True  # type: ignore[attr-defined]
    await tail.after_update(learner(3), None, leader=True, checkpoint_every=3)
    assert tail.checkpoint_due and events == ["commit", "checkpoint deferred"]
    tail.checkpoints.fail = False  # type: ignore[attr-defined]
    events.clear()
    await tail.after_update(learner(4), None, leader=True, checkpoint_every=3)
    assert not tail.checkpoint_due and events == ["commit", "checkpoint 4"]


async def test_a_ranks_commits_are_held_until_rank_0s_first_checkpoint() -> None:
    tail, events, _ = rig()
    await tail.after_update(learner(1), None, leader=False, checkpoint_every=1)
    await tail.settle()
    await tail.after_pass()  # with no commit running, the pass commits (dropped records' progress)
    assert events == ["commit (held)", "commit (held)"]  # and no checkpoint of its own
    tail.adopt_checkpoint(1)
    events.clear()
    await tail.after_update(learner(2), None, leader=False, checkpoint_every=1)
    await tail.settle()
    assert events == ["commit"] and tail.checkpoints.last == 1


async def test_a_deferred_candidate_is_retried_after_the_running_commit_in_its_slot() -> None:
    tail, events, _ = rig()
    tail.checkpoints.last = 1  # type: ignore[misc]
    tail.publication.deferred, tail.publication.due = object(), True  # type: ignore[attr-defined]
    await tail.after_update(learner(2), None, leader=True, checkpoint_every=100)
    await tail.retry_deferred(0.0)  # the commit still runs: nothing yet
    assert events == []
    await asyncio.sleep(0.01)
    await tail.retry_deferred(0.0)
    await tail.settle()
    assert events == ["commit", "retry deferred"]
