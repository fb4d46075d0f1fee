"""Data-parallel ranks (services/trainer/ranks.py): two real gloo processes on 127.0.0.1.

- A two-rank update equals one process's update on the union of the ranks' data (one minibatch, one epoch:
  the all-reduced gradient is the gradient of the mean loss over every sample).
- The ranks' weights stay identical over several updates with uneven data, a rank with none at all, the
  KL stop, and observation and reward normalisation.
- A rank that dies makes the other's next collective fail promptly instead of hanging.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import pickle
import socket
import time
from typing import Any

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.ranks import Ranks, Vote
from shared.rl.envs import fragment_spec
from shared.settings import TrainerSettings
from tests.unit.test_update import _fragments

SPEC = fragment_spec("CartPole-v1", 1 << 22)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(learner: Learner) -> str:
    return hashlib.sha256(learner.weights()).hexdigest()


def _rank_main(rank: int, port: int, cfg: TrainerSettings, batches: list[list[bytes]], out: Any) -> None:
    torch.set_num_threads(1)
    ranks = Ranks(world_size=2, rank=rank, rendezvous=f"127.0.0.1:{port}", timeout_s=30, device=torch.device("cpu"))
    ranks.join()
    try:
        learner = Learner(SPEC, cfg)
        digests, steps, calls = [], [], []
        for step_frags in batches:
            frags = [pickle.loads(b) for b in step_frags]
            before = sum(ranks.calls.values())
            stats = learner.update(frags, ranks)
            calls.append(sum(ranks.calls.values()) - before)
            digests.append(_digest(learner))
            steps.append((stats.env_steps, stats.sgd_steps, learner.counters.env_steps_trained))
        votes = ranks.vote(Vote(ready=rank == 1, stop=False))
        out.put((rank, digests, steps, [v.ready for v in votes], learner.weights(), calls))
    finally:
        ranks.close()


def _run_two(cfg: TrainerSettings, per_rank: list[list[list[bytes]]]) -> dict[int, tuple[Any, ...]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, cfg, per_rank[r], q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            rank, *rest = q.get(timeout=120)
            results[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def _frags_bytes(n: int, steps: int = 40, envs: int = 3) -> list[bytes]:
    return [pickle.dumps(f) for f in _fragments(Learner(SPEC, TrainerSettings()), n, steps, envs)]


@pytest.mark.timeout(300)
def test_two_ranks_equal_one_process_on_the_union() -> None:
    cfg = TrainerSettings(epochs=1, minibatches=1, normalize_advantages=False, learning_rate=1e-3)
    frags = _frags_bytes(3)
    # rank 0 holds two fragments, rank 1 one; a second step where rank 1 holds nothing.
    per_rank = [[frags[:2], frags[:1]], [frags[2:], []]]
    results = _run_two(cfg, per_rank)
    assert results[0][0] == results[1][0], "the ranks' weights differ"
    single = Learner(SPEC, cfg)
    single.update([pickle.loads(b) for b in frags])
    single.update([pickle.loads(b) for b in frags[:1]])
    got = Learner(SPEC, cfg)
    got.load_policy_weights(results[0][3])
    for a, b in zip(got.model.parameters(), single.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The counters count every rank's env steps: 3 x 40 x 3 then 40 x 3.
    assert [s[2] for s in results[0][1]] == [360, 480] == [s[2] for s in results[1][1]]
    assert results[0][2] == [False, True] == results[1][2]  # every rank sees every vote, in rank order


@pytest.mark.timeout(300)
def test_weights_stay_identical_with_uneven_data_kl_stop_and_normalisation() -> None:
    cfg = TrainerSettings(epochs=4, minibatches=4, target_kl=0.005, learning_rate=3e-3,
                          normalize_observations=True, normalize_rewards=True)
    frags = _frags_bytes(5, steps=32, envs=2)
    per_rank = [[frags[:3], [], frags[4:5], frags[:1]], [frags[3:4], frags[:2], frags[1:4], []]]
    results = _run_two(cfg, per_rank)
    assert results[0][0] == results[1][0], "the ranks' weights diverged"
    assert len(set(results[0][0])) == 4, "an update left the weights unchanged"
    # The KL stop and the step counts are decided together: both ranks took the same number of steps.
    assert [s[1] for s in results[0][1]] == [s[1] for s in results[1][1]]


@pytest.mark.timeout(300)
def test_one_collective_a_minibatch_step() -> None:
    """Across a network each collective waits a round trip or more, so the update's cost between hosts is its
    count of collectives: one a minibatch step (gradients, KL and sample counts in one all-reduce) plus at most
    three an update (the shared normalisation statistics and the env-step count). Two a step before: a
    trainer-to-trainer link at +20 ms each way ran 0.17 updates/s instead of 1.9 on the multi-host stack."""
    cfg = TrainerSettings(epochs=3, minibatches=4, target_kl=None, learning_rate=1e-3)
    frags = _frags_bytes(4, steps=32, envs=2)
    results = _run_two(cfg, [[frags[:2], frags[3:]], [frags[2:3], []]])
    for rank in (0, 1):
        steps, calls = [s[1] for s in results[rank][1]], results[rank][4]
        assert steps == [12, 12], steps  # every rank takes every step, with data or without
        assert all(12 <= c <= 12 + 3 for c in calls), f"rank {rank}: {calls} collectives for {steps} steps"


def _dying_rank(rank: int, port: int, out: Any) -> None:
    ranks = Ranks(world_size=2, rank=rank, rendezvous=f"127.0.0.1:{port}", timeout_s=60, device=torch.device("cpu"))
    ranks.join()
    ranks.vote(Vote())
    if rank == 1:
        import os
        os._exit(9)  # as kill -9: no goodbye
    t0 = time.monotonic()
    try:
        ranks.vote(Vote())
        out.put(("no error", time.monotonic() - t0))
    except Exception as exc:
        out.put((type(exc).__name__, time.monotonic() - t0))


@pytest.mark.timeout(120)
def test_a_dead_rank_fails_the_others_next_collective_promptly() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dying_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    what, waited = q.get(timeout=90)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert what != "no error"
    assert waited < 30, f"the survivor waited {waited:.1f} s (rank_timeout_s is 60)"


def test_vote_is_a_small_frozen_record() -> None:
    v = Vote(ready=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.ready = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="outside world size"):
        Ranks(world_size=2, rank=2, rendezvous="127.0.0.1:1", timeout_s=1, device=torch.device("cpu"))
