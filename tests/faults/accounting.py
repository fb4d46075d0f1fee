"""Account for every record: read the topics back from the broker and the trainer's log lines.

A record of ``<run>.samples`` is *accounted for* when the trainer logged an outcome for it
(``fragment_trained``, ``fragment_dropped_stale``, ``fragment_dead_lettered``) with its partition,
offset and sample id. A trainer *run* is one process lifetime (its log starts with
``config_resolved``). The guarantees checked (docs/reliability.md):

- within one run, no record has two outcomes (so none is trained twice);
- across runs, a record is trained again only when the later run restored a checkpoint whose
  offsets precede it (its first training was in no checkpointed model: exactly once in the model);
- every record below the trainer group's committed offsets has an outcome (nothing skipped);
- once drained (:meth:`Accounting.every_record_once`): every record on the topic has an outcome, counted by
  distinct (partition, offset), and a record's second outcome is only ever a refused re-delivery in the same
  run or a re-processing after a restore (so a doubled outcome can never stand in for a missing one);
- no record left the log before the trainer read it (``records_lost_before_training``) unless the suite deleted
  it on purpose (``deleted``: those are counted as deleted, and must be reported by the trainer).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.admin.trace import log_files, parse_line

OUTCOMES = {"fragment_trained": "trained", "fragment_dropped_stale": "dropped_stale",
            "fragment_dead_lettered": "dead_lettered"}
Key = tuple[int, int]  # (partition, offset)


def _log_inodes(path: Path) -> list[tuple[str, int]]:
    out = []
    for f in log_files(path.parent, path.name.removesuffix(".log")):
        try:
            out.append((f.name, f.stat().st_ino))
        except FileNotFoundError:
            out.append((f.name, -1))
    return out


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a service's log ``path`` and its rotated copies, oldest first (lines that do
    not start with a JSON object, a traceback's say, are skipped). A rotation while the copies are read
    renames them under the reader (a file read twice, another skipped): read again until no rotation
    happened meanwhile (a fault-suite run missed 54 records' outcome lines that way)."""
    for _ in range(20):
        before = _log_inodes(path)
        lines: list[str] = []
        for f in log_files(path.parent, path.name.removesuffix(".log")):
            try:
                lines.extend(f.read_text(errors="replace").splitlines())
            except FileNotFoundError:
                pass
        if _log_inodes(path) == before:
            break
    parsed = (parse_line(line) for line in lines if line.startswith("{"))
    return [one[1] for one in parsed if one is not None]


def split_runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    runs: list[list[dict[str, Any]]] = []
    for e in events:
        if e.get("event") == "config_resolved" or not runs:
            runs.append([])
        runs[-1].append(e)
    return runs


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 60) -> dict[Key, dict[str, str]]:
    """(partition, offset) -> headers of every record on ``topic``, from the broker itself."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    out: dict[Key, dict[str, str]] = {}
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            await consumer._client.force_metadata_update()  # noqa: SLF001
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in parts]
        if not tps:
            return out
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, recs in (await consumer.getmany(timeout_ms=500)).items():
                for rec in recs:
                    out[(tp.partition, rec.offset)] = {k: (v or b"").decode(errors="replace")
                                                       for k, v in (rec.headers or [])}
    finally:
        await consumer.stop()
    return out


async def committed(bootstrap: str, group: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return {tp.partition: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
    finally:
        await admin.close()


@dataclass
class Accounting:
    produced: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    trained_twice_in_a_run: list[Key] = field(default_factory=list)
    two_outcomes_in_a_run: list[Key] = field(default_factory=list)
    retrained_after_restore: int = 0
    retrained_without_restore: list[Key] = field(default_factory=list)
    missing: list[Key] = field(default_factory=list)
    wrong_sample_id: list[Key] = field(default_factory=list)
    dead_letter_reasons: Counter[str] = field(default_factory=Counter)
    silent_resets: list[str] = field(default_factory=list)
    accounted: int = 0
    """Distinct records on the topic with at least one outcome (by partition and offset, not outcome lines)."""
    unaccounted: list[Key] = field(default_factory=list)
    """Records on the topic with no outcome at all, committed or not (only a drained run must have none)."""
    lost_before_training: list[tuple[int, int, int]] = field(default_factory=list)
    """(partition, from, to) the trainer logged as left the log untrained, outside the spans deleted on purpose."""
    deleted_on_purpose: int = 0
    """Records the trainer reported lost that the suite deleted on purpose (``deleted``)."""
    unexplained_outcomes: list[Key] = field(default_factory=list)
    """Records with an outcome beyond their first that is neither a refused re-delivery in the same run (a
    dead letter ``duplicate``, or the first dead letter's own reason again) nor a re-processing in a later run
    at or past the offset that run restored from its checkpoint."""

    def problems(self) -> list[str]:
        out = []
        # two_outcomes_in_a_run is not a problem by itself: a record re-delivered in the same run (a commit
        # lost with a rebalance) is refused as a duplicate; only training it twice would be.
        for name in ("trained_twice_in_a_run", "retrained_without_restore", "missing", "wrong_sample_id",
                     "silent_resets", "lost_before_training"):
            items = getattr(self, name)
            if items:
                out.append(f"{name}: {len(items)}, e.g. {items[:5]}")
        return out

    def every_record_once(self) -> list[str]:
        """What keeps a drained run from having every record accounted for once: a record on the topic with no
        outcome, or a record with an outcome beyond its first that nothing explains. Records are counted by
        (partition, offset), never by summing outcome lines, so a record with two outcomes cannot stand in
        for one with none."""
        return [f"{name}: {len(items)}, e.g. {items[:5]}" for name in ("unaccounted", "unexplained_outcomes")
                if (items := getattr(self, name))]

    def summary(self) -> dict[str, Any]:
        return {"produced": self.produced, **{k: self.outcomes[k] for k in ("trained", "dropped_stale",
                                                                              "dead_lettered")},
                "trainer_runs": self.runs, "retrained_after_restore": self.retrained_after_restore,
                "trained_twice_in_a_run": len(self.trained_twice_in_a_run), "missing": len(self.missing),
                "redelivered_in_a_run": len(self.two_outcomes_in_a_run), "accounted": self.accounted,
                "unaccounted": len(self.unaccounted), "unexplained_outcomes": len(self.unexplained_outcomes),
                "lost_before_training": sum(hi - lo for _, lo, hi in self.lost_before_training),
                "deleted_on_purpose": self.deleted_on_purpose}


def _repeat_explained(first: tuple[str, str | None], later: tuple[str, str | None]) -> bool:
    """Within one run: ``later`` (kind, dead-letter reason) is a re-delivery of a record whose first outcome
    was ``first``, refused (``duplicate``) or dead-lettered again for the same reason, never trained or dropped."""
    kind, reason = later
    return kind == "dead_lettered" and (reason == "duplicate" or first == later)


def lost_spans(events: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """(partition, from, to) of every ``records_lost_before_training`` the trainer logged."""
    return [(int(e["partition"]), int(e["from_offset"]), int(e["to_offset"])) for e in events
            if e.get("event") == "records_lost_before_training"]


def account(produced: dict[Key, dict[str, str]], trainer_log: Path, committed_offsets: dict[int, int],
            deleted: dict[int, list[tuple[int, int]]] | None = None) -> Accounting:
    """``deleted``: spans per partition the suite removed from the log on purpose before the trainer read them."""
    acc = Accounting(produced=len(produced))
    events = read_events(trainer_log)
    for p, lo, hi in lost_spans(events):
        on_purpose = sum(max(0, min(hi, b) - max(lo, a)) for a, b in (deleted or {}).get(p, []))
        acc.deleted_on_purpose += on_purpose
        if on_purpose < hi - lo:
            acc.lost_before_training.append((p, lo, hi))
    runs = split_runs(events)
    acc.runs = len(runs)
    trained_before: dict[Key, int] = {}  # key -> run index of its last training
    seen_any: set[Key] = set()
    first_in_run: dict[Key, tuple[int, tuple[str, str | None]]] = {}  # key -> (run, its first outcome there)
    unexplained: set[Key] = set()
    for i, run in enumerate(runs):
        restored = [e for e in run if e.get("event") == "checkpoint_restored"]
        offsets = {int(k.rsplit(":", 1)[1]): int(v) for k, v in (restored[0].get("checkpoint_offsets") or {}).items()
                   } if restored else {}
        if i > 0 and not restored and any(e.get("event") == "update_done" for e in runs[i - 1]):
            acc.silent_resets.append(f"run {i} started without restoring a checkpoint after run {i - 1} trained")
        per_run: Counter[Key] = Counter()
        trained_in_run: Counter[Key] = Counter()
        for e in run:
            kind = OUTCOMES.get(e.get("event", ""))
            if kind is None or e.get("partition") is None or e.get("offset") is None:
                continue
            key = (int(e["partition"]), int(e["offset"]))
            per_run[key] += 1
            acc.outcomes[kind] += 1
            outcome = (kind, str(e.get("reason")) if kind == "dead_lettered" else None)
            if key not in first_in_run:
                first_in_run[key] = (i, outcome)
            elif first_in_run[key][0] == i:
                if not _repeat_explained(first_in_run[key][1], outcome):
                    unexplained.add(key)
            else:  # its first outcome in this run: re-processed only from the restored checkpoint's offsets on
                # (a partition the checkpoint does not name, or no checkpoint at all, is read from its start;
                # a restart that skipped an existing checkpoint is a silent reset, reported as such)
                if key[1] < offsets.get(key[0], 0):
                    unexplained.add(key)
                first_in_run[key] = (i, outcome)
            seen_any.add(key)
            if kind == "dead_lettered":
                acc.dead_letter_reasons[str(e.get("reason"))] += 1
            want = produced.get(key, {}).get("sample-id")
            if want is not None and e.get("sample_id") not in (None, want):
                acc.wrong_sample_id.append(key)
            if kind == "trained":
                trained_in_run[key] += 1
                if key in trained_before and trained_before[key] < i:
                    if key[1] >= offsets.get(key[0], 1 << 62):
                        acc.retrained_after_restore += 1
                    else:
                        acc.retrained_without_restore.append(key)
                trained_before[key] = i
        acc.two_outcomes_in_a_run += [k for k, n in per_run.items() if n > 1]
        acc.trained_twice_in_a_run += [k for k, n in trained_in_run.items() if n > 1]
    for key in produced:
        p, off = key
        if key in seen_any:
            acc.accounted += 1
            continue
        acc.unaccounted.append(key)
        if off < committed_offsets.get(p, 0):
            acc.missing.append(key)
    acc.unexplained_outcomes = sorted(unexplained)
    return acc


def account_now(bootstrap: str, topic: str, group: str, trainer_log: Path,
                deleted: dict[int, list[tuple[int, int]]] | None = None) -> Accounting:
    produced = asyncio.run(read_topic(bootstrap, topic))
    return account(produced, trainer_log, asyncio.run(committed(bootstrap, group)), deleted)
