"""``flywheel verify``: prove exactly-once from the artifact, not from log lines.

A checkpoint stores, per partition of the samples topic, the offset range ``[start, end)`` its model
reflects and the ledger of outcomes in it (``shared.digest``): a count and a 64-bit multiset hash of the
offsets per outcome (trained, dropped as stale, dead-lettered, gap), with run-length ranges. Verify checks:

1. **every offset exactly once**: the outcome digests add up to the closed-form digest of the range, and
   the ranges cover it without overlap (a doubled or missing offset is named; from the digests alone
   when the ranges agree but the hash does not and one offset explains the difference);
2. **the ranges agree with the digests** (a ledger whose parts disagree was tampered with or is corrupt);
3. **against the topics**: every dead-lettered offset has its copy on ``<run>.samples.dlq``
   (``dlq-source``), the log holds a record at every trained, dropped and dead offset still retained, and
   none at a gap. So the trained records are exactly the range minus what the DLQ and the drops account for.
   Drops as stale leave no record on a topic: they are checked by (1) and (2) only.

Exit 0 when every partition checks, 1 otherwise (each problem printed with the partition).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition

from shared.digest import OUTCOMES, Digest, mix64, range_digest
from shared.kafka import Topics, make_consumer
from shared.marker import VersionedStore, VersionRecord
from shared.settings import Settings
from shared.store import open_store

MAX_NAMED = 20  # offsets named per problem


@dataclasses.dataclass
class PartitionReport:
    key: str
    start: int
    end: int
    problems: list[str] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def _offsets(ranges: Iterable[Iterable[int]]) -> list[int]:
    out: list[int] = []
    for lo, hi in ranges:
        out.extend(range(int(lo), int(hi)))
    return out


def _name(offsets: list[int]) -> str:
    shown = ", ".join(str(o) for o in offsets[:MAX_NAMED])
    return shown + (f" (+{len(offsets) - MAX_NAMED} more)" if len(offsets) > MAX_NAMED else "")


def _explain(diff: Digest, lo: int, hi: int) -> str:
    """Which offset one surplus or missing entry is, when a single offset explains the hash difference."""
    if abs(diff.count) != 1:
        return ""
    want = diff.hash if diff.count == 1 else (-diff.hash) & ((1 << 64) - 1)
    for o in range(lo, hi):
        if mix64(o) == want:
            return f": offset {o} {'doubled' if diff.count == 1 else 'missing'}"
    return ""


def check_ledger(key: str, part: dict[str, Any]) -> PartitionReport:
    """Checks 1 and 2 for one partition's ledger (pure: no topic is read)."""
    start, end = int(part["start"]), int(part["end"])
    rep = PartitionReport(key, start, end)
    digests = {k: Digest.from_json(d) for k, d in (part.get("digests") or {}).items()}
    ranges = {k: [list(r) for r in (part.get("ranges") or {}).get(k, [])] for k in OUTCOMES}
    rep.counts = {k: digests.get(k, Digest()).count for k in OUTCOMES}
    total = Digest()
    for k in OUTCOMES:
        total = total + digests.get(k, Digest())
    closed = range_digest(start, end)
    seen: dict[int, int] = {}
    for k in OUTCOMES:
        for o in _offsets(ranges[k]):
            seen[o] = seen.get(o, 0) + 1
        from_ranges = Digest()
        for lo, hi in ranges[k]:
            from_ranges = from_ranges + range_digest(int(lo), int(hi))
        if from_ranges != digests.get(k, Digest()):
            rep.problems.append(f"{k}: digest (count {digests.get(k, Digest()).count}) disagrees with its ranges "
                                f"(count {from_ranges.count})")
    missing = [o for o in range(start, end) if o not in seen]
    doubled = sorted(o for o, n in seen.items() if n > 1)
    outside = sorted(o for o in seen if o < start or o >= end)
    if missing:
        rep.problems.append(f"missing (no outcome): {_name(missing)}")
    if doubled:
        rep.problems.append(f"doubled (two outcomes): {_name(doubled)}")
    if outside:
        rep.problems.append(f"outcomes outside [{start}, {end}): {_name(outside)}")
    if total != closed:
        diff = total - closed
        rep.problems.append(f"outcome digest != closed form of [{start}, {end}): {total.count} outcomes for "
                            f"{closed.count} offsets{_explain(diff, start, end)}")
    return rep


async def read_topics(settings: Settings, parts: dict[str, dict[str, Any]]) -> tuple[
        dict[int, set[int]], dict[int, set[int]], dict[int, int]]:
    """Offsets present on the samples topic within each ledger range, the DLQ's sources per partition, and
    each partition's log start offset."""
    topics = Topics.for_run(settings.run)
    present: dict[int, set[int]] = {}
    log_start: dict[int, int] = {}
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        wanted = {TopicPartition(topics.samples, int(k.rpartition(":")[2])): (int(p["start"]), int(p["end"]))
                  for k, p in parts.items()}
        await consumer.topics()  # fetches the cluster's metadata
        dlq_tps = [TopicPartition(topics.dlq, p) for p in sorted(consumer.partitions_for_topic(topics.dlq) or {0})]
        consumer.assign(list(wanted) + dlq_tps)
        begin = await consumer.beginning_offsets(list(wanted) + dlq_tps)
        ends = await consumer.end_offsets(list(wanted) + dlq_tps)
        for tp, (lo, _hi) in wanted.items():
            log_start[tp.partition] = begin[tp]
            present[tp.partition] = set()
            consumer.seek(tp, max(lo, begin[tp]))
        for tp in dlq_tps:
            consumer.seek(tp, begin[tp])
        sources: dict[int, set[int]] = {}
        todo = {tp for tp in list(wanted) + dlq_tps
                if (wanted[tp][1] if tp in wanted else ends[tp]) > max(begin[tp], wanted.get(tp, (0, 0))[0])}
        while todo:
            polled = await consumer.getmany(timeout_ms=2000, max_records=5000)
            if not polled:
                break
            for tp, records in polled.items():
                for rec in records:
                    if tp in wanted:
                        if rec.offset < wanted[tp][1]:
                            present[tp.partition].add(rec.offset)
                    else:
                        src = dict(rec.headers or []).get("dlq-source", b"").decode(errors="replace")
                        topic, _, rest = src.rpartition(":")
                        topic, _, part = topic.rpartition(":")
                        if topic == topics.samples and part.isdigit() and rest.isdigit():
                            sources.setdefault(int(part), set()).add(int(rest))
                limit = wanted[tp][1] if tp in wanted else ends[tp]
                if (await consumer.position(tp)) >= limit:
                    todo.discard(tp)
                    consumer.pause(tp)
    finally:
        await consumer.stop()
    return present, sources, log_start


def check_topics(rep: PartitionReport, part: dict[str, Any], present: set[int], dlq_sources: set[int],
                 log_start: int) -> None:
    """Check 3 for one partition: the DLQ and the log agree with the ledger."""
    ranges = part.get("ranges") or {}
    dead = _offsets(ranges.get("dead", []))
    no_copy = [o for o in dead if o not in dlq_sources]
    if no_copy:
        rep.problems.append(f"dead-lettered per the ledger but not on the DLQ: {_name(no_copy)}")
    retained = [o for k in ("trained", "dropped", "dead") for o in _offsets(ranges.get(k, [])) if o >= log_start]
    absent = sorted(o for o in retained if o not in present)
    if absent:
        rep.problems.append(f"outcome recorded for offsets the log does not hold: {_name(absent)}")
    gaps = [o for o in _offsets(ranges.get("gap", [])) if o >= log_start and o in present]
    if gaps:
        rep.problems.append(f"recorded as gaps but the log holds records there: {_name(gaps)}")
    if log_start > rep.start:
        rep.counts["expired_by_retention"] = min(log_start, rep.end) - rep.start


def checkpoint_record(store: VersionedStore, step: int | None) -> VersionRecord:
    if step is None:
        current = store.read_marker()
        if current is None:
            raise LookupError("no checkpoint in this run yet")
        return current[0]
    for rec in store.records():
        if rec.version == step:
            return rec
    raise LookupError(f"checkpoint {step} is not kept (have {[r.version for r in store.records()]})")


def verify(settings: Settings, step: int | None = None, read_log: bool = True) -> tuple[int, list[str]]:
    """Run every check on one checkpoint (the newest by default): exit code and the lines to print."""
    ckpts = VersionedStore(open_store(settings), settings.run, "checkpoints")
    rec = checkpoint_record(ckpts, step)
    parts: dict[str, dict[str, Any]] = dict(rec.extra.get("ledger") or {})
    lines = [f"checkpoint {rec.version} (policy version {rec.extra.get('policy_version')}, "
             f"{len(parts)} partition(s))"]
    if not parts:
        return 1, [*lines, "no ledger in this checkpoint (written before ledgers existed?): nothing can be proven"]
    reports = {k: check_ledger(k, p) for k, p in sorted(parts.items())}
    if read_log:
        present, sources, log_start = asyncio.run(read_topics(settings, parts))
        for k, p in parts.items():
            n = int(k.rpartition(":")[2])
            check_topics(reports[k], p, present.get(n, set()), sources.get(n, set()), log_start.get(n, 0))
    for k, r in reports.items():
        counts = ", ".join(f"{name} {n}" for name, n in r.counts.items() if n)
        lines.append(f"  {k} [{r.start}, {r.end}): {'ok' if r.ok else 'FAILED'} ({counts or 'empty'})")
        lines.extend(f"    - {p}" for p in r.problems)
    ok = all(r.ok for r in reports.values())
    lines.append("verify: ok: every offset exactly once" if ok else "verify: FAILED")
    return (0 if ok else 1), lines
