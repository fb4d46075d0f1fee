"""What the trainer does at a loop pass, agreed with the other ranks or decided alone: one loop serves one trainer
and data-parallel ranks alike (``Trainer.run``), and this part is the only place where they differ.

Each pass the loop forms the batch this trainer holds and hands :meth:`Agreement.decide` its
:class:`~services.trainer.ranks.Vote` (a batch due, stopping, a rollback to follow, its settings and newest
checkpoint: what a rank sends the others); the agreement returns a :class:`Decision` and the loop acts on it:
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
class Adopt:
    """Rank 0's settings and checkpoint, for the other ranks to take at this pass."""

    learner: Any
    checkpoint: int | None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the loop does at this pass, in this order: adopt, then one of rollback, stop, train; or nothing."""

    rollback: Any = None
    """Follow this rollback (the batch formed goes back to the buffer first: it was formed before the rollback)."""
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
    async def decide(self, mine: Vote) -> Decision: ...


class Alone:
    """A single trainer decides alone."""

    async def decide(self, mine: Vote) -> Decision:
        if mine.stop:
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

    async def decide(self, mine: Vote) -> Decision:
        if not self.ranks.leader:  # the group follows rank 0's rollback, settings and checkpoint only
            mine = Vote(ready=mine.ready, stop=mine.stop)
        votes = await asyncio.to_thread(self.ranks.vote, mine)
        return self.of(votes, mine)

    def of(self, votes: list[Vote], mine: Vote) -> Decision:
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
