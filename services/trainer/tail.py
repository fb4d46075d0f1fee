"""The update's tail, with one owner: what follows an optimizer step (commit its offsets, publish its candidate,
checkpoint) and the commits held until the run's first checkpoint exists.

Commit and publish run in one background task at a time: the next update runs meanwhile instead of waiting for
two Kafka round trips and a store write, and commits and candidates stay in order. Whatever needs the previous
one done (the next update, a revoke, a rollback, a runtime-triggered republish, the stop) calls :meth:`settle`,
where that task's error surfaces. A deferred candidate is retried in the same slot. Explicit inputs only: the
trainer hands in its learner, the candidate, and how to read the lineage extras and the lease fence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from services.trainer.checkpoints import Checkpoints
from services.trainer.group import ConsumerGroup
from services.trainer.learner import Learner
from services.trainer.publication import Publication

Candidate = tuple[int, bytes, int]
"""(policy version, weights, update) of a candidate, as of the update that made it."""


class UpdateTail:
    def __init__(self, group: ConsumerGroup, publication: Publication, checkpoints: Checkpoints, *,
                 publish_extra: Callable[[], dict[str, Any]], checkpoint_extra: Callable[[], dict[str, Any]],
                 fence: Callable[[], Awaitable[None]]) -> None:
        self.group = group
        self.publication = publication
        self.checkpoints = checkpoints
        self.publish_extra = publish_extra  # the lineage and checkpoint a candidate descends from, read when sent
        self.checkpoint_extra = checkpoint_extra
        self.fence = fence  # the lease check before every checkpoint
        self.checkpoint_due = False  # the last checkpoint failed, or a rollback was followed: write one next time
        self._task: asyncio.Task[None] | None = None  # the last update's commit + publish, or a publish retry

    async def settle(self) -> None:
        """Wait for the previous update's commit and publish; their errors surface here."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def after_update(self, learner: Learner, candidate: Candidate | None, *, leader: bool,
                           checkpoint_every: int) -> None:
        """After an update (the caller settled the previous tail): commit and publish in the background; rank 0
        (or a single trainer) checkpoints a fresh run's first update before committing anything, so no record
        ever counts as consumed while its gradient is in no checkpoint, then every ``checkpoint_every``
        updates. The other ranks' commits wait for rank 0's first checkpoint (:meth:`adopt_checkpoint`)."""
        first = self.checkpoints.last is None
        self.group.hold_commits = first
        if not leader:
            self._task = asyncio.create_task(self._commit_and_publish(None), name="trainer-commit")
            return
        if first:
            await self.checkpoint(learner)
        self._task = asyncio.create_task(self._commit_and_publish(candidate), name="trainer-commit-publish")
        if not first and (self.checkpoint_due or learner.counters.updates % checkpoint_every == 0):
            await self.settle()
            await self.checkpoint(learner)

    async def _commit_and_publish(self, candidate: Candidate | None) -> None:
        await self.group.commit()
        if candidate is not None:
            await self.publication.publish(*candidate, self.publish_extra())

    async def after_pass(self) -> None:
        """Once a loop pass: a finished commit or publish is settled (a fatal error in it stops the trainer
        here); with none running, what was dropped or dead-lettered is committed."""
        if self._task is not None and self._task.done():
            await self.settle()
        if self._task is None:  # else that task commits; this one would only run first
            await self.group.commit()

    async def retry_deferred(self, now: float) -> None:
        """A deferred candidate whose retry is due, once no commit or publish runs: the last update's first (it
        may have sent a newer one), then the retry in the background slot, so the loop is not held by a slow
        store and the next update's publish waits for it (candidates stay in order)."""
        if not self.publication.retry_due(now) or (self._task is not None and not self._task.done()):
            return
        await self.settle()
        if self.publication.deferred is not None:
            self._task = asyncio.create_task(self.publication.retry_deferred(), name="trainer-publish-retry")

    async def checkpoint(self, learner: Learner) -> None:
        """Checkpoint behind the lease fence; a transient store fault leaves it due for the next update. Once
        written, held commits may go: the checkpoint holds what was trained."""
        saved = await self.checkpoints.try_save(learner, self.group, self.checkpoint_extra(), self.fence)
        self.checkpoint_due = not saved
        if saved:
            self.group.hold_commits = False

    def adopt_checkpoint(self, last: int | None) -> None:
        """A rank other than 0: rank 0's newest checkpoint (sent with the vote) is the group's; once one exists,
        this rank's commits may go."""
        self.checkpoints.last = last
        if last is not None:
            self.group.hold_commits = False
