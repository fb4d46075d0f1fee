"""The version-marker protocol (docs/architecture.md, "Object store and the marker"), shared by policies,
checkpoints and runtime config revisions.

Layout under ``<run>/<kind>/`` (kind = ``policy``, ``checkpoints`` or ``config``)::

    blobs/<sha256>.safetensors   content-addressed payload, written first
    LATEST                       the marker: a JSON :class:`VersionRecord`, written last, conditionally
    versions/<v>.json            the same record per published version (history, rollback)

Writers: payload, then the marker with ``If-None-Match: *`` (first version) or ``If-Match: <etag
read>``, then the history record. Two writers racing for the same next version cannot both win.
Readers: marker, payload, sha256 check; on anything missing or wrong they keep what they had.

Repair: a marker that is not a readable record (a torn or overwritten object) is put back from the
newest-written history record whose payload is intact, with ``If-Match: <the corrupt marker's etag>``,
so of two repairers one wins and the other re-reads; a writer still holding the corrupt etag gets
:class:`MarkerConflict`. Each repair is logged (``marker_repaired``) and reported to ``on_repair``.

Pruning keeps the most recently *written* history records (``written_at``), never the marker's record
or the blob the marker names (re-read before every delete); :meth:`VersionedStore.pin_copy` gives a
republished old version its own copy of the payload, so pruning the old key cannot hurt it.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shared.logging import get_logger
from shared.store import ObjectStore, PreconditionFailed, StoreError


class MarkerConflict(RuntimeError):
    """Another writer moved the marker first; re-read it and decide again."""


class StaleVersion(ValueError):
    """The record's version is not newer than the published one."""


class BadPayload(StoreError):
    """A record's payload is missing or does not match its sha256 and size: a fact about the data,
    not a connectivity fault, so it is not retried."""


class BadMarker(BadPayload):
    """The marker (or a history record) is not a readable record."""


@dataclass(frozen=True)
class VersionRecord:
    version: int
    blob: str
    sha256: str
    size: int
    trainer_step: int
    created_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    written_at: float | None = field(default=None, compare=False)
    """When :meth:`VersionedStore.publish` stored it (its clock); None in records written before this
    field existed. Not part of equality: the same record read back from the store equals the one sent."""

    @property
    def lineage(self) -> int:
        """The rollback these weights descend from (``extra["lineage"]``; 0: none)."""
        return int(self.extra.get("lineage") or 0)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> VersionRecord:
        raw = json.loads(data)
        return cls(
            version=int(raw["version"]),
            blob=str(raw["blob"]),
            sha256=str(raw["sha256"]),
            size=int(raw["size"]),
            trainer_step=int(raw["trainer_step"]),
            created_at=float(raw["created_at"]),
            extra=dict(raw.get("extra") or {}),
            written_at=None if raw.get("written_at") is None else float(raw["written_at"]),
        )

    def recency(self) -> tuple[int, float, int]:
        """Sort key, most recently written last: records without ``written_at`` (older code) come
        before those with it, and among themselves go by version."""
        return (0, 0.0, self.version) if self.written_at is None else (1, self.written_at, self.version)


RepairHook = Callable[[VersionRecord, str], None]
"""Called with the record a repair restored and why the marker was unreadable (for the audit trail)."""

REPAIR_ATTEMPTS = 5
"""Re-reads after losing a repair race before giving up (each loss means another repairer wrote)."""


class VersionedStore:
    """Blobs behind a marker, for one run and kind (``policy``, ``checkpoints`` or ``config``).

    Invariants: the marker only moves by conditional writes; a repair never replaces a readable marker;
    prune never deletes the marker's history record nor any blob the marker names at the moment of the
    delete.
    """

    def __init__(self, store: ObjectStore, run: str, kind: str = "policy", *,
                 on_repair: RepairHook | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.kind = kind
        self.prefix = f"{run}/{kind}"
        self.marker_key = f"{self.prefix}/LATEST"
        self.on_repair = on_repair
        self._clock = clock
        self._log = get_logger(component=f"marker:{kind}")

    def blob_key(self, sha256: str) -> str:
        return f"{self.prefix}/blobs/{sha256}.safetensors"

    def history_key(self, version: int) -> str:
        return f"{self.prefix}/versions/{version}.json"

    def put_blob(self, data: bytes, key: str | None = None) -> tuple[str, str]:
        """Write a payload (content-addressed unless ``key`` is given; idempotent). Returns ``(key, sha256)``."""
        sha = hashlib.sha256(data).hexdigest()
        key = key or self.blob_key(sha)
        if not self.store.exists(key):
            self.store.put(key, data)
        return key, sha

    # ---- the marker ----------------------------------------------------------------------------
    def read_marker(self, repair: bool = True) -> tuple[VersionRecord, str] | None:
        """The published record and the marker's etag, or None before the first publish.

        An unreadable marker is repaired from the history (:meth:`repair_marker`) when ``repair``;
        :class:`BadMarker` when it cannot be (``repair=False``, or no readable history).
        """
        for _ in range(REPAIR_ATTEMPTS):
            obj = self.store.get(self.marker_key)
            if obj is None:
                return None
            try:
                return VersionRecord.from_json(obj.data), obj.etag
            except (ValueError, KeyError, TypeError) as exc:
                if not repair:
                    raise BadMarker(f"marker {self.marker_key} is unreadable: {exc}") from exc
                self._repair(obj.etag, f"marker {self.marker_key} is unreadable: {exc}"[:300])
                # repaired by us or by another repairer: read it again
        raise BadMarker(f"marker {self.marker_key} stayed unreadable through {REPAIR_ATTEMPTS} repairs")

    def repair_marker(self) -> VersionRecord | None:
        """Put an unreadable marker back from the newest-written history record whose payload is intact.

        Returns the record restored; None when the marker is readable or absent (or another repairer
        restored it first). Raises :class:`BadMarker` (a :class:`BadPayload`) when no history record
        is readable with an intact payload.
        """
        obj = self.store.get(self.marker_key)
        if obj is None:
            return None
        try:
            VersionRecord.from_json(obj.data)
            return None
        except (ValueError, KeyError, TypeError) as exc:
            return self._repair(obj.etag, f"marker {self.marker_key} is unreadable: {exc}"[:300])

    def _repair(self, bad_etag: str, reason: str) -> VersionRecord | None:
        """Replace the marker whose etag is ``bad_etag``; None if another writer replaced it first."""
        refused: list[str] = []
        for rec in sorted(self.records(), key=VersionRecord.recency, reverse=True):
            try:
                self.fetch(rec)
            except BadPayload as exc:
                refused.append(str(exc))
                continue
            try:
                self.store.put(self.marker_key, rec.to_json(), if_match=bad_etag)
            except PreconditionFailed:
                self._log.info("marker_repair_lost", kind=self.kind, reason=reason)
                return None  # another repairer (or a writer) moved it: the caller re-reads
            self._log.warning("marker_repaired", kind=self.kind, version=rec.version, reason=reason,
                              skipped=refused or None)
            if self.on_repair is not None:
                try:
                    self.on_repair(rec, reason)
                except Exception as exc:  # the audit hook must not undo or hide a done repair
                    self._log.error("marker_repair_report_failed", kind=self.kind, version=rec.version,
                                    error=f"{type(exc).__name__}: {exc}"[:300])
            return rec
        raise BadMarker(f"{reason}; no history record under {self.prefix}/versions/ is readable with an intact "
                        f"payload" + (": " + "; ".join(refused)[:700] if refused else ""))

    def publish(self, record: VersionRecord, expected_etag: str | None) -> str:
        """Move the marker to ``record``; ``expected_etag`` is the etag read before (None: first).

        The payload must already be stored. Raises :class:`MarkerConflict` if another writer
        moved the marker since it was read. Marker and history record carry ``written_at`` (now).
        """
        record = replace(record, written_at=self._clock())
        try:
            if expected_etag is None:
                etag = self.store.put(self.marker_key, record.to_json(), if_none_match=True)
            else:
                etag = self.store.put(self.marker_key, record.to_json(), if_match=expected_etag)
        except PreconditionFailed as exc:
            raise MarkerConflict(f"marker {self.marker_key} moved before version {record.version}: {exc}") from exc
        self.store.put(self.history_key(record.version), record.to_json())
        return etag

    def publish_next(self, record: VersionRecord) -> str:
        """Publish ``record`` if its version is newer than the marker's (read-check-write)."""
        current = self.read_marker()
        if current is not None and record.version <= current[0].version:
            raise StaleVersion(f"version {record.version} is not newer than published {current[0].version}")
        return self.publish(record, None if current is None else current[1])

    # ---- payloads --------------------------------------------------------------------------------
    def fetch(self, record: VersionRecord) -> bytes:
        """The payload of ``record``, checked against its sha256; raises StoreError if bad."""
        obj = self.store.get(record.blob)
        if obj is None:
            raise BadPayload(f"payload {record.blob} of version {record.version} is missing")
        sha = hashlib.sha256(obj.data).hexdigest()
        if sha != record.sha256 or len(obj.data) != record.size:
            raise BadPayload(
                f"payload {record.blob} of version {record.version} is corrupt: "
                f"sha256 {sha[:12]}.. size {len(obj.data)}, want {record.sha256[:12]}.. size {record.size}"
            )
        return obj.data

    def pin_copy(self, record: VersionRecord) -> VersionRecord:
        """``record`` with its (checked) payload copied under a fresh key of its own,
        ``blobs/<sha256>.pin-<random>.safetensors``: a republished old version names this copy, so a
        concurrent prune of the old record's blob cannot leave the marker naming a deleted payload.

        Raises :class:`BadPayload` when the payload is already gone or corrupt. The caller sets the
        new version (``dataclasses.replace``) and publishes; an unpublished copy is only wasted space.
        """
        data = self.fetch(record)
        key = f"{self.prefix}/blobs/{record.sha256}.pin-{uuid.uuid4().hex[:12]}.safetensors"
        self.store.put(key, data, if_none_match=True)
        return replace(record, blob=key, written_at=None)

    def load_newer(self, have: int | None) -> tuple[VersionRecord, bytes] | None:
        """The published version and payload when newer than ``have``; else None.

        Missing or corrupt payloads, and markers that cannot be read nor repaired, are logged and
        yield None, so the caller keeps the version it has.
        """
        try:
            current = self.read_marker()
            if current is None or (have is not None and current[0].version <= have):
                return None
            record = current[0]
            return record, self.fetch(record)
        except StoreError as exc:
            self._log.warning("marker_read_rejected", keeping_version=have, reason=str(exc))
            return None

    def load_latest_good(
        self, verify: Callable[[bytes], object] | None = None, check: Callable[[VersionRecord], object] | None = None
    ) -> tuple[VersionRecord, bytes, list[str]] | None:
        """The newest version whose record passes ``check`` (which raises to refuse it, before its payload is read)
        and whose payload is intact (and passes ``verify``, which raises to refuse it):
        the marker's (repaired first if unreadable), else the history's, newest first. Returns it with
        the reasons the newer ones were refused, or None when nothing was ever published here.

        Raises :class:`StoreError` when the store cannot be read (an outage is never taken for "no
        checkpoint"), and :class:`BadPayload` when versions exist but none is usable.
        """
        refused: list[str] = []
        try:
            current = self.read_marker()
        except BadMarker as exc:  # fall back to the history, which names the same versions
            refused.append(str(exc))
            current = None
        candidates = [] if current is None else [current[0]]
        seen = {c.version for c in candidates}
        candidates += [r for r in reversed(self.records()) if r.version not in seen]
        if not candidates:
            if refused:
                raise BadPayload(f"no usable version under {self.prefix}: " + "; ".join(refused)[:1000])
            return None
        for rec in candidates:
            try:
                if check is not None:
                    check(rec)
                data = self.fetch(rec)
                if verify is not None:
                    verify(data)
            except BadPayload as exc:
                refused.append(str(exc))
                continue
            except Exception as exc:  # the verifier refused it (unloadable, wrong shapes)
                if isinstance(exc, StoreError):
                    raise
                refused.append(f"version {rec.version} refused: {type(exc).__name__}: {exc}"[:300])
                continue
            if refused:
                self._log.warning("fell_back_to_older_version", version=rec.version, refused=refused)
            return rec, data, refused
        raise BadPayload(f"no usable version under {self.prefix}: " + "; ".join(refused)[:1000])

    # ---- history -----------------------------------------------------------------------------------
    def records(self) -> list[VersionRecord]:
        """History records, oldest first (by version)."""
        out = []
        for key in self.store.list(f"{self.prefix}/versions/"):
            obj = self.store.get(key)
            if obj is None:
                continue
            try:
                out.append(VersionRecord.from_json(obj.data))
            except (ValueError, KeyError, TypeError) as exc:  # one damaged record must not hide the rest
                self._log.warning("history_record_unreadable", key=key, reason=str(exc)[:200])
        return sorted(out, key=lambda r: r.version)

    def pin(self, version: int, holder: str, ttl_s: float) -> None:
        """Keep ``version`` from :meth:`prune` for ``ttl_s`` (a pin is renewed by pinning again; it expires so
        that a holder that died leaves nothing pinned for good). The rollback guard pins the versions it may
        restore."""
        body = json.dumps({"version": version, "holder": holder, "until": self._clock() + ttl_s}).encode()
        self.store.put(f"{self.prefix}/pins/{version}.json", body)

    def unpin(self, version: int) -> None:
        self.store.delete(f"{self.prefix}/pins/{version}.json")

    def pinned(self) -> set[int]:
        """Versions with a live pin (expired or unreadable pins are ignored)."""
        out = set()
        now = self._clock()
        for key in self.store.list(f"{self.prefix}/pins/"):
            obj = self.store.get(key)
            if obj is None:
                continue
            try:
                pin = json.loads(obj.data)
                if float(pin["until"]) > now:
                    out.add(int(pin["version"]))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def prune(self, keep: int) -> list[int]:
        """Delete history records and blobs beyond the ``keep`` most recently written; returns the
        versions removed, least recently written first.

        Recency is ``written_at`` (records without it count as older, by version), not the version
        number: after a fresh start the new run's lower numbers are the ones kept. Never deleted: the
        marker's history record, a pinned version (:meth:`pin`), a blob a kept record names, and a blob the
        marker names, the marker
        being re-read just before each delete (a rollback may republish an old version meanwhile).
        """
        history = sorted(self.records(), key=VersionRecord.recency)
        kept = history[-keep:] if keep > 0 else []
        pinned = self.pinned()
        kept += [r for r in history[: len(history) - len(kept)] if r.version in pinned]
        doomed = [r for r in history if r not in kept]
        live_blobs = {r.blob for r in kept}
        removed = []
        for rec in doomed:
            current = self.read_marker()
            if current is not None and current[0].version == rec.version:
                continue  # the published version's own record stays
            self.store.delete(self.history_key(rec.version))
            removed.append(rec.version)
            if rec.blob in live_blobs:
                continue
            current = self.read_marker()  # again, right before the blob goes
            if current is not None and current[0].blob == rec.blob:
                live_blobs.add(rec.blob)
                continue
            self.store.delete(rec.blob)
        return removed
