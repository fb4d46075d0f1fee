"""``flywheel verify``: prove exactly-once from the artifact and the topics, not from log lines.

A checkpoint stores, per partition of the samples topic, the offset range ``[start, end)`` its model
reflects and the ledger of outcomes in it (``shared.digest``): a count and a 64-bit multiset hash of the
offsets per outcome (trained, dropped as stale, dead-lettered, gap, lost), with run-length ranges. The
ledger is cumulative from the partition's origin, so the newest checkpoint alone proves the whole run
(pruning older checkpoints breaks nothing). Verify checks:

1. **the whole run**: every partition of the run's samples topic that holds or held a record is in the
   ledger, and each range begins at the run's origin (offset 0; after a deliberate fresh start, where the
   new model began, which is said). A lost rank ledger, a partition added to the topic after the
   checkpoint, or a range that starts late fails here;
2. **nothing lost**: no offset has the outcome ``lost`` (records that left the log, by retention or
   ``deleteRecords``, before the trainer read them; the trainer records them when it reads past them);
3. **every offset exactly once**: the outcome digests add up to the closed-form digest of the range, and
   the ranges cover it without overlap (a doubled or missing offset is named; from the digests alone
   when the ranges agree but the hash does not and one offset explains the difference);
4. **the ranges agree with the digests** (a ledger whose parts disagree was tampered with or is corrupt);
5. **against the topics**: every dead-lettered offset has its copy on ``<run>.samples.dlq``
   (``dlq-source``), the log holds a record at every trained, dropped and dead offset still retained, and
   none at a gap. So the trained records are exactly the range minus what the DLQ and the drops account for.
   Drops as stale leave no record on a topic: they are checked by (3) and (4) only.

6. **the checkpoint itself**: its record names this run and, where signing is on, carries the trainer's valid
   signature over the run, the blob's digest and the whole record (ledger and offsets included); its blob is
   present with that digest.

Where the proof ends (``docs/reliability.md``): records beyond the checkpoint's frontier are not yet in the
model and are not claimed; offsets the log no longer holds (expired by retention after they were read) are
checked by the digests only; a log truncated below the trainer's position (unclean leader election, which
the project's topics forbid) cannot be told from the digests.

Exit 0 when every partition checks, 1 otherwise (each problem printed with the partition).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition

from shared.digest import ORIGIN, OUTCOMES, Digest, mix64, range_digest
from shared.kafka import Topics, make_consumer
from shared.marker import BadPayload, VersionedStore, VersionRecord
from shared.settings import Settings
from shared.signing import PolicyVerifier, SignatureRefused
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


def _spans(ranges: Iterable[Iterable[int]]) -> str:
    spans = [f"[{int(lo)}, {int(hi)})" for lo, hi in ranges]
    return ", ".join(spans[:MAX_NAMED]) + (f" (+{len(spans) - MAX_NAMED} more)" if len(spans) > MAX_NAMED else "")


def check_ledger(key: str, part: dict[str, Any], origin: int | None = ORIGIN) -> PartitionReport:
    """Checks 1 (the range's start; ``origin`` None: any start, after a deliberate fresh start) to 4 for one
    partition's ledger (pure: no topic is read)."""
    start, end = int(part["start"]), int(part["end"])
    rep = PartitionReport(key, start, end)
    if origin is not None and start != origin:
        rep.problems.append(f"the ledger starts at offset {start}, not at the run's origin {origin}: offsets "
                            f"[{min(origin, start)}, {max(origin, start)}) have no outcome in this model")
    lost = [list(r) for r in (part.get("ranges") or {}).get("lost", [])]
    if lost:
        n = sum(int(hi) - int(lo) for lo, hi in lost)
        rep.problems.append(f"lost before training (left the log untrained): {n} record(s) at {_spans(lost)}")
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


@dataclasses.dataclass
class TopicView:
    """What the topics hold, read once (:func:`read_topics`); partitions by number."""

    partitions: set[int]  # every partition of the samples topic
    log_start: dict[int, int]
    log_end: dict[int, int]
    present: dict[int, set[int]]  # offsets present on the log within each ledger range
    dlq_sources: dict[int, set[int]]  # offsets each dead-letter copy names, per samples partition


async def read_topics(settings: Settings, parts: dict[str, dict[str, Any]]) -> TopicView:
    """Every partition of the samples topic with its log start and end, the offsets present within each
    ledger range, and the DLQ's sources per partition."""
    topics = Topics.for_run(settings.run)
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        # The cluster's metadata as it is now (consumer.topics() fetches it but keeps it; partitions_for_topic
        # reads only what the consumer happened to cache, which for a new consumer is nothing).
        cluster = await consumer._client.fetch_all_metadata()  # noqa: SLF001 - aiokafka offers no public read
        numbers = set(cluster.partitions_for_topic(topics.samples) or set())
        numbers |= {int(k.rpartition(":")[2]) for k in parts}
        ranges = {int(k.rpartition(":")[2]): (int(p["start"]), int(p["end"])) for k, p in parts.items()}
        samples = [TopicPartition(topics.samples, n) for n in sorted(numbers)]
        dlq_tps = [TopicPartition(topics.dlq, p) for p in sorted(cluster.partitions_for_topic(topics.dlq) or {0})]
        consumer.assign(samples + dlq_tps)
        begin = await consumer.beginning_offsets(samples + dlq_tps)
        ends = await consumer.end_offsets(samples + dlq_tps)
        view = TopicView(partitions=set(numbers), log_start={tp.partition: begin[tp] for tp in samples},
                         log_end={tp.partition: ends[tp] for tp in samples}, present={}, dlq_sources={})
        limit: dict[TopicPartition, int] = {}
        for tp in samples:
            view.present[tp.partition] = set()
            lo, hi = ranges.get(tp.partition, (0, 0))
            consumer.seek(tp, max(lo, begin[tp]))
            limit[tp] = min(hi, ends[tp])
        for tp in dlq_tps:
            consumer.seek(tp, begin[tp])
            limit[tp] = ends[tp]
        todo = set()
        for tp in samples + dlq_tps:
            if limit[tp] > await consumer.position(tp):
                todo.add(tp)
            else:
                consumer.pause(tp)
        while todo:
            polled = await consumer.getmany(timeout_ms=2000, max_records=5000)
            if not polled:
                break
            for tp, records in polled.items():
                for rec in records:
                    if tp.topic == topics.samples:
                        if rec.offset < limit[tp]:
                            view.present[tp.partition].add(rec.offset)
                    else:
                        src = dict(rec.headers or []).get("dlq-source", b"").decode(errors="replace")
                        topic, _, rest = src.rpartition(":")
                        topic, _, part = topic.rpartition(":")
                        if topic == topics.samples and part.isdigit() and rest.isdigit():
                            view.dlq_sources.setdefault(int(part), set()).add(int(rest))
                if (await consumer.position(tp)) >= limit[tp]:
                    todo.discard(tp)
                    consumer.pause(tp)
    finally:
        await consumer.stop()
    return view


def check_topics(rep: PartitionReport, part: dict[str, Any], present: set[int], dlq_sources: set[int],
                 log_start: int) -> None:
    """Check 5 for one partition: the DLQ and the log agree with the ledger."""
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
        rep.counts["below_log_start"] = min(log_start, rep.end) - rep.start  # outcomes the log no longer holds


def check_run(parts: dict[str, dict[str, Any]], samples_topic: str, origin: int | None,
              view: TopicView | None) -> dict[str, PartitionReport]:
    """Every check on a checkpoint's ledger (``view`` None: the ledger alone, checks 1-4 without the topic's
    partitions). Partitions of the topic the ledger does not name get a report of their own."""
    reports: dict[str, PartitionReport] = {}
    for key, part in sorted(parts.items(), key=lambda kv: (kv[0].rpartition(":")[0], int(kv[0].rpartition(":")[2]))):
        rep = reports[key] = check_ledger(key, part, origin)
        if key.rpartition(":")[0] != samples_topic:
            rep.problems.append(f"not a partition of this run's samples topic {samples_topic}")
        elif view is not None:
            n = int(key.rpartition(":")[2])
            if n not in view.partitions:
                rep.problems.append(f"the topic has no partition {n}")
            check_topics(rep, part, view.present.get(n, set()), view.dlq_sources.get(n, set()),
                         view.log_start.get(n, 0))
    if view is not None:
        named = {int(k.rpartition(":")[2]) for k in parts if k.rpartition(":")[0] == samples_topic}
        for n in sorted(view.partitions - named):
            end = view.log_end.get(n, 0)
            if end > 0:  # the partition holds, or held, records this model has no outcome for
                key = f"{samples_topic}:{n}"
                rep = reports[key] = PartitionReport(key, 0, 0)
                rep.problems.append(f"not in the checkpoint's ledger, but the log has offsets [0, {end}) "
                                    f"(log start {view.log_start.get(n, 0)}): their outcome in this model is unknown")
    return reports


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


def check_checkpoint_blob(settings: Settings, ckpts: VersionedStore, rec: VersionRecord) -> tuple[bool, str]:
    """The checkpoint's own trust: its record belongs to this run and carries the trainer's valid signature
    (where signing is on), and its blob is present with the sha256 and size the record names. The ledger the
    proof reads is part of the signed record, so an edited ledger fails here."""
    verifier = PolicyVerifier.from_settings(settings)
    try:
        verifier.check_checkpoint(rec)
        ckpts.fetch(rec)
    except SignatureRefused as exc:
        return False, f"  checkpoint record: REFUSED ({exc})"
    except BadPayload as exc:
        return False, f"  checkpoint blob: FAILED ({exc})"
    key_id = (rec.extra.get("signature") or {}).get("key_id") if verifier.enabled else None
    signed = f"signed by trainer key {key_id}" if key_id else "signing is off: not signed"
    return True, f"  checkpoint record and blob: ok (run {settings.run}, {signed}, sha256 {rec.sha256[:12]}..)"


def verify(settings: Settings, step: int | None = None, read_log: bool = True) -> tuple[int, list[str]]:
    """Run every check on one checkpoint (the newest by default): exit code and the lines to print."""
    ckpts = VersionedStore(open_store(settings), settings.run, "checkpoints")
    rec = checkpoint_record(ckpts, step)
    parts: dict[str, dict[str, Any]] = dict(rec.extra.get("ledger") or {})
    lines = [f"checkpoint {rec.version} (policy version {rec.extra.get('policy_version')}, "
             f"{len(parts)} partition(s) in its ledger)"]
    if not parts:
        return 1, [*lines, "no ledger in this checkpoint (written before ledgers existed?): nothing can be proven"]
    trusted, said = check_checkpoint_blob(settings, ckpts, rec)
    lines.append(said)
    fresh = rec.extra.get("fresh_start_at")
    origin = None if fresh is not None else ORIGIN
    if fresh is not None:
        lines.append(f"  (a deliberate fresh start at {fresh}: each range is proven from where the new model began)")
    view = asyncio.run(read_topics(settings, parts)) if read_log else None
    if view is None:
        lines.append("  (--no-log: the ledger alone; the topic's partitions and records are not read)")
    reports = check_run(parts, Topics.for_run(settings.run).samples, origin, view)
    for k, r in reports.items():
        counts = ", ".join(f"{name} {n}" for name, n in r.counts.items() if n)
        lines.append(f"  {k} [{r.start}, {r.end}): {'ok' if r.ok else 'FAILED'} ({counts or 'empty'})")
        lines.extend(f"    - {p}" for p in r.problems)
    ok = trusted and all(r.ok for r in reports.values())
    if ok:
        lines.append(f"verify: ok: every offset exactly once ({len(reports)} partition(s), each from the run's origin "
                     "to the checkpoint's frontier; none lost before training)")
    else:
        lines.append("verify: FAILED" + ("" if trusted else " (the checkpoint itself is not trusted)"))
    return (0 if ok else 1), lines
