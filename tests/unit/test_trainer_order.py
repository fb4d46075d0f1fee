"""The order of the trainer's trust steps, observed while it runs on the in-memory bus and a local store:
a fresh run's first checkpoint is written before its first offset commit, and the ledger marks a batch's
records ``trained`` only after the optimizer step that trained them.

Observed at the moment it happens (a wrapped commit, a wrapped update), not afterwards: ``Trainer.stop``
writes a final checkpoint and commits anyway, so looking once the trainer stopped proves nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from services.trainer.ranks import Ranks
from services.trainer.service import Trainer
from services.trainer.update import UpdateStats
from shared.bus import MemoryBus
from shared.fragment import Fragment, encode_fragment
from shared.kafka import Topics
from shared.settings import Settings, StoreSettings, TrainerSettings
from tests.fragments import blank_fragment
from tests.unit.test_trainer_bus import run_until

RUN = "r"
T = Topics.for_run(RUN)
TP0 = TopicPartition(T.samples, 0)
KEY0 = f"{T.samples}:0"


def make(tmp_path: Path, **trainer: Any) -> tuple[Trainer, MemoryBus]:
    mem = MemoryBus()
    mem.create(T.samples, 2)
    # checkpoint_every is far away: the only checkpoint written while running is a fresh run's first one.
    cfg = {"batch_fragments": 2, "minibatches": 2, "epochs": 1, "checkpoint_every": 1000, "batch_timeout_s": 0.2,
           **trainer}
    settings = Settings(run=RUN, store=StoreSettings(backend="local", local_root=tmp_path),
                        trainer=TrainerSettings(**cfg))
    return Trainer(settings, trainer_id="t", bus=mem.bus()), mem


def put(mem: MemoryBus, n: int) -> None:
    for _ in range(n):
        headers, payload = encode_fragment(blank_fragment(0, steps=4, envs=2))
        mem.append(T.samples, payload, headers=headers, partition=TP0.partition)


def trained_in_ledger(t: Trainer) -> int:
    """Records the ledger holds as ``trained`` (one partition, finished in order: all folded)."""
    st = t.group.ledger.state().get(KEY0)
    return 0 if st is None else int(st["digests"]["trained"]["count"])


async def test_the_first_checkpoint_is_written_before_the_first_commit(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, 2)  # one update
    source: Any = t.source
    real_commit = source.commit
    commits: list[dict[str, Any]] = []

    async def commit(offsets: dict[TopicPartition, int]) -> None:
        # Only a commit that moves a partition on counts records as consumed (a commit of the position a
        # partition was seeked to, before anything was read, names none).
        moved = {tp: off for tp, off in offsets.items() if off > mem.committed.get(tp, 0)}
        if moved:
            marker = t.checkpoints.store.read_marker()  # what a restart would resume from, at this very moment
            commits.append({"offsets": moved, "stopping": t._stop.is_set(),
                            "checkpoint": None if marker is None else marker[0]})
        await real_commit(offsets)

    source.commit = commit
    await run_until(t, lambda: mem.committed.get(TP0) == 2)
    first = commits[0]
    assert not first["stopping"], "observed during the run, not at stop()"
    assert first["offsets"] == {TP0: 2}
    ckpt = first["checkpoint"]
    assert ckpt is not None, "offsets were committed while no checkpoint held what was trained"
    # The checkpoint holds the committed records: a crash now resumes after them, with their gradients.
    assert ckpt.version == 1 and ckpt.extra["trainer_id"] == "t"
    assert ckpt.extra["offsets"][KEY0] >= 2
    assert ckpt.extra["ledger"][KEY0]["digests"]["trained"]["count"] == 2


async def test_records_are_marked_trained_only_after_the_optimizer_step(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, 4)  # two updates of two
    loop = asyncio.get_running_loop()
    real_update = t.learner.update
    seen: list[tuple[int, int, int]] = []

    async def look() -> tuple[int, int]:  # on the loop thread, which owns the ledger
        return trained_in_ledger(t), t.group.ledger.snapshot().get(KEY0, 0)

    def update(fragments: list[Fragment], ranks: Ranks | None = None) -> UpdateStats:
        trained, frontier = asyncio.run_coroutine_threadsafe(look(), loop).result(10)
        seen.append((trained, t.learner.counters.fragments_trained, frontier))
        return real_update(fragments, ranks)

    t.learner.update = update  # type: ignore[method-assign]
    await run_until(t, lambda: trained_in_ledger(t) == 4)
    assert len(seen) >= 2 and seen[0] == (0, 0, 0)
    # At the start of each step the ledger's "trained" records are exactly those of the steps completed, and
    # the commit position (the ledger's frontier) has not passed the batch in training: neither a commit nor
    # a checkpoint taken meanwhile could count its records as consumed before their step.
    assert all(trained == done == frontier for trained, done, frontier in seen), seen


async def test_a_failed_step_leaves_its_records_untrained_and_uncommitted(tmp_path: Path) -> None:
    t, mem = make(tmp_path)
    put(mem, 2)
    calls: list[int] = []

    def update(fragments: list[Fragment], ranks: Ranks | None = None) -> UpdateStats:
        calls.append(len(fragments))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")  # the step did not happen

    t.learner.update = update  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await run_until(t, lambda: False)
    assert calls == [2]
    assert trained_in_ledger(t) == 0
    assert t.group.ledger.committable() == {}  # its records stay pending: a restart trains them
    assert mem.committed.get(TP0, 0) == 0
    assert t.checkpoints.store.read_marker() is None  # and no checkpoint claims them
