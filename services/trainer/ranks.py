"""Data-parallel trainer ranks: the process group, the per-step vote and gradient averaging.

K trainer processes (``trainer.world_size``) are members of one consumer group; each forms batches from
the partitions Kafka assigned to it. They move in lock step (docs/architecture.md, "Trainer ranks"):

- Every loop pass each rank calls :meth:`Ranks.vote` exactly once (an all-gather of a small
  :class:`Vote`). When any rank holds a batch, every rank runs one update: a rank with no data takes
  part with a zero gradient, so collectives always match and nobody deadlocks. A rank with no data
  holds the others back by at most one poll (``Intake``'s poll timeout) plus the vote's round trip.
- Inside an update every minibatch step makes one all-reduce (:meth:`Ranks.sum_step`): the gradients
  weighted by each rank's sample count together with the KL and sample counts; every rank divides by the
  step's total (the gradient of the mean loss over every rank's samples) and applies the same gradient
  to the same weights with the same optimizer state, so the weights stay identical (``/status`` shows
  each rank's weights digest).
- Rank 0 alone publishes candidates, writes checkpoints, runs the rollback guard and holds the trainer
  lease; ledgers are exchanged after every update (:meth:`Ranks.gather`), so rank 0's checkpoint holds
  what every rank trained and a partition that moves between ranks is read from where the model ends.
- A rank that dies makes the others' next collective fail (a closed connection at once, or after
  ``trainer.rank_timeout_s``): they stop, and every rank restarts from the checkpoint.

The collectives block, so the service calls them from a worker thread, one at a time, from its loop.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shared.retry import Health

T = TypeVar("T")
STUCK_AFTER_S = 10.0
"""A collective waiting this long (or half of ``trainer.rank_timeout_s`` when that is shorter) marks the trainer
degraded, naming it: a peer rank gone or cut off shows within seconds, not only when the timeout ends the group.
In lock step the ranks wait for each other at most an update or one poll, far shorter."""


@dataclasses.dataclass(frozen=True)
class Vote:
    """One rank's state at a loop pass; every rank sees every rank's vote."""

    ready: bool = False
    """This rank holds a batch due for training."""
    stop: bool = False
    """This rank is stopping (a signal, or an error it is about to raise)."""
    rollback: Any = None
    """Rank 0 only: a rollback to follow at this step (a ``PolicyMessage``)."""
    learner: Any = None
    """Rank 0 only: ``(TrainerSettings, UpdateConfig)`` the update uses (runtime changes reach the ranks at
    different moments; the leader's apply to all, at the same step)."""
    checkpoint: int | None = None
    """Rank 0 only: the update of its newest checkpoint (None: none yet; the ranks hold commits until one)."""


def parse_rendezvous(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class Ranks:
    """This process's membership of the trainer group. ``join`` before any other call."""

    def __init__(self, *, world_size: int, rank: int, rendezvous: str, timeout_s: float,
                 device: torch.device) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.world_size = world_size
        self.rank = rank
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.joined = False
        self.waiting: tuple[str, float] | None = None
        """The collective this process is in (set from the worker thread that runs it) and since when."""
        self._stuck_logged = False
        self.calls: collections.Counter[str] = collections.Counter()
        """Collectives made so far, by what they were (each waits a round trip or more across a network)."""

    def _collective(self, what: str, fn: Callable[[], T]) -> T:
        self.waiting = (what, time.monotonic())
        self.calls[what] += 1
        try:
            return fn()
        finally:
            self.waiting = None

    def stuck(self, now: float) -> str | None:
        """Why the group is stuck (a collective waiting past :data:`STUCK_AFTER_S`), else None."""
        w = self.waiting
        if w is None or now - w[1] < min(STUCK_AFTER_S, self.timeout_s / 2):
            return None
        what, since = w
        return (f"rank {self.rank}: {what} waiting {now - since:.0f} s for the other ranks (rendezvous "
                f"{self.rendezvous}); at trainer.rank_timeout_s={self.timeout_s:g} the group stops and restarts "
                "from its checkpoint")

    def report(self, health: Health, log: Any, now: float) -> None:
        """Mark ``health`` degraded (component ``ranks``) while :meth:`stuck`, and clear it after."""
        why = self.stuck(now)
        if why is not None:
            health.degraded("ranks", why)
            if not self._stuck_logged:
                self._stuck_logged = True
                log.warning("rank_collective_stuck", reason=why)
        elif "ranks" in health.reasons:
            waited = health.recovered("ranks")
            self._stuck_logged = False
            log.info("rank_collective_recovered", degraded_s=None if waited is None else round(waited, 1))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def join(self) -> None:
        """Blocks until every rank has joined (rank 0 listens on the rendezvous port), at most
        ``timeout_s``."""
        host, port = parse_rendezvous(self.rendezvous)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._collective("rendezvous", lambda: dist.init_process_group(
            self.backend, init_method=f"tcp://{host}:{port}", world_size=self.world_size, rank=self.rank,
            timeout=datetime.timedelta(seconds=self.timeout_s)))
        self.joined = True

    def close(self) -> None:
        if self.joined:
            self.joined = False
            dist.destroy_process_group()

    # ---- objects -------------------------------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled: small objects only)."""
        out: list[Any] = [None] * self.world_size
        self._collective("all_gather", lambda: dist.all_gather_object(out, obj))
        return out

    def vote(self, vote: Vote) -> list[Vote]:
        return self.gather(vote)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.leader else None]
        self._collective("broadcast", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    # ---- the update's collectives (services.trainer.update.GradSync) -----------------------------
    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._collective("all_reduce (update statistics)", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
        return [float(v) for v in t.cpu()]

    def sum_step(self, params: Iterable[torch.nn.Parameter], scale: float, values: list[float]) -> list[float]:
        """One minibatch step's only collective: every parameter's gradient becomes the sum over ranks of
        ``scale_r * grad_r`` and the sums over ranks of ``values`` are returned, in one all-reduce (a step is
        latency-bound across a network, so one collective instead of two halves its wait). A missing gradient
        counts as zero; a non-finite one stays non-finite everywhere (the step is then refused by every rank
        alike). ``values`` travel as float32 with the gradients: sample counts are exact below 2**24."""
        ps = list(params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        flat = torch.cat([g.reshape(-1).to(torch.float32) * scale for g in grads]
                         + [torch.tensor(values, dtype=torch.float32, device=self.device)])
        self._collective("all_reduce (gradients and step statistics)",
                         lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
        at = 0
        for p in ps:
            n = p.numel()
            p.grad = flat[at:at + n].view_as(p).to(p.dtype).clone()
            at += n
        return [float(v) for v in flat[at:].cpu()]
