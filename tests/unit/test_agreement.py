"""The trainer's agreement (``services.trainer.agreement``): what one trainer decides alone, and what the ranks'
votes decide for each rank. The loop that acts on the decisions is the same for both."""

from __future__ import annotations

import torch

from services.trainer.agreement import Adopt, Agreed, Alone, Decision
from services.trainer.ranks import Ranks, Vote

ROLLBACK = object()  # stands for a PolicyMessage: the agreement only passes it on


async def test_alone_stops_first_then_follows_a_rollback_then_trains_every_due_batch() -> None:
    alone = Alone()
    assert await alone.decide(Vote(ready=True, stop=True, rollback=ROLLBACK)) == Decision(stop=True)
    assert await alone.decide(Vote(ready=True, rollback=ROLLBACK)) == Decision(
        rollback=ROLLBACK, again=True)
    assert await alone.decide(Vote(ready=True)) == Decision(train=True, again=True)
    assert await alone.decide(Vote()) == Decision()  # the pass ends: poll again


def _agreed(rank: int) -> Agreed:
    return Agreed(Ranks(world_size=3, rank=rank, rendezvous="127.0.0.1:1", timeout_s=1.0,
                        device=torch.device("cpu")))


def test_every_rank_gets_the_same_decision_from_the_same_votes() -> None:
    lead = Vote(ready=False, learner=("cfg", "update"), checkpoint=7)
    cases = [
        ([lead, Vote(ready=True), Vote()], {"train": True}),
        ([Vote(rollback=ROLLBACK, learner=("cfg", "update"), checkpoint=7), Vote(ready=True), Vote(stop=True)],
         {"rollback": ROLLBACK}),  # rank 0's rollback first: stopping and training wait for the next pass
        ([lead, Vote(ready=True), Vote(stop=True)], {"stop": True, "stopping_ranks": (2,)}),
        ([lead, Vote(), Vote()], {}),
    ]
    for votes, want in cases:
        for rank in range(3):
            mine = Vote(ready=votes[rank].ready, stop=votes[rank].stop)
            got = _agreed(rank).of(votes, mine)
            adopt = None if rank == 0 else Adopt(("cfg", "update"), 7)  # rank 0's settings are the group's
            force = bool(want.get("train")) and not votes[rank].ready  # a rank with nothing due takes part
            assert got == Decision(**want, force=force, adopt=adopt), (votes, rank)
            assert not got.again  # one vote a pass: the ranks poll between updates in lock step
