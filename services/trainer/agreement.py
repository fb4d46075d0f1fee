"""What the trainer does at a loop pass, agreed with the other ranks or decided alone: one loop serves one trainer
and data-parallel ranks alike (``Trainer.run``), and this part is the only place where they differ.

Each pass the loop forms the batch this trainer holds and hands :meth:`Agreement.decide` a :class:`Proposal`
(a batch due, stopping, a rollback to follow); the agreement returns a :class:`Decision` and the loop acts on it:
follow a rollback, stop, train, or end the pass. Invariant: on ranks every rank gets the same decision at the same
pass (one vote each, an all-gather), so their collectives match; the agreement itself only decides and never
touches the trainer's state.

- :class:`Alone`: a single trainer. Stop when asked, else follow a pending rollback first, and train every due
  batch before polling again (``again``).
- :class:`Agreed`: ranks (``services.trainer.ranks``). One vote a pass; rank 0's rollback, hyperparameters and
  newest checkpoint are the group's (``adopt`` on the other ranks); any rank stopping stops all; any rank with a
  batch due makes every rank train, a rank with none due taking part with what it holds (``force``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from services.trainer.ranks import Ranks, Vote


@dataclasses.dataclass(frozen=True)
class Proposal:
    """This trainer's state at the pass."""

    ready: bool
    """A batch is due."""
    stopping: bool
    rollback: Any = None
    """A rollback announced and not yet followed (a ``PolicyMessage``)."""
    learner: Any = None
    """``(TrainerSettings, UpdateConfig)`` this trainer would update with."""
    checkpoint: int | None = None
    """The update of this trainer's newest checkpoint."""


@dataclasses.dataclass(frozen=True)
class Adopt:
    """Rank 0's settings and checkpoint, for the other ranks to take at this pass."""

    learner: Any
    checkpoint: int | None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the loop does at this pass, in this order: adopt, then one of rollback, stop, train; or nothing."""

    rollback: Any = None
    """Follow this rollback (the batch formed is released first: it was formed before the rollback)."""
    stop: bool = False
    train: bool = False
    force: bool = False
    """Train although this trainer has no batch due: it takes part with what it holds (ranks only)."""
    again: bool = False
    """Decide again in the same pass, without polling (one trainer trains every due batch in a pass)."""
    adopt: Adopt | None = None
    stopping_ranks: tuple[int, ...] = ()
    """With ``stop`` on ranks: the ranks that asked to stop."""


class Agreement(Protocol):
    async def decide(self, mine: Proposal) -> Decision: ...


class Alone:
    """A single trainer decides alone."""

    async def decide(self, mine: Proposal) -> Decision:
        if mine.stopping:
            return Decision(stop=True)
        if mine.rollback is not None:
            return Decision(rollback=mine.rollback, again=True)
        if mine.ready:
            return Decision(train=True, again=True)
        return Decision()


class Agreed:
    """Data-parallel ranks decide together: one vote a pass (a blocking collective, run in a worker thread)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    async def decide(self, mine: Proposal) -> Decision:
        leader = self.ranks.leader
        vote = Vote(ready=mine.ready, stop=mine.stopping, rollback=mine.rollback if leader else None,
                    learner=mine.learner if leader else None, checkpoint=mine.checkpoint if leader else None)
        votes = await asyncio.to_thread(self.ranks.vote, vote)
        return self.of(votes, mine)

    def of(self, votes: list[Vote], mine: Proposal) -> Decision:
        """The decision ``votes`` make for this rank (pure: the tests feed it votes)."""
        lead = votes[0]
        adopt = None if self.ranks.leader else Adopt(lead.learner, lead.checkpoint)
        if lead.rollback is not None:
            return Decision(rollback=lead.rollback, adopt=adopt)
        if any(v.stop for v in votes):
            return Decision(stop=True, adopt=adopt, stopping_ranks=tuple(r for r, v in enumerate(votes) if v.stop))
        if any(v.ready for v in votes):
            return Decision(train=True, force=not mine.ready, adopt=adopt)
        return Decision(adopt=adopt)
