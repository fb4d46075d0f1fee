"""The version-marker protocol of DESIGN.md, shared by policies and checkpoints.

Layout under ``<run>/<kind>/`` (kind = ``policy`` or ``checkpoints``)::

    blobs/<sha256>.safetensors   content-addressed payload, written first
    LATEST                       the marker: a JSON :class:`VersionRecord`, written last, conditionally
    versions/<v>.json            the same record per published version (history, rollback)

Writers: payload, then the marker with ``If-None-Match: *`` (first version) or ``If-Match: <etag
read>``, then the history record. Two writers racing for the same next version cannot both win.
Readers: marker, payload, sha256 check; on anything missing or wrong they keep what they had.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
        )


class VersionedStore:
    """Blobs behind a marker, for one run and kind (``policy`` or ``checkpoints``)."""

    def __init__(self, store: ObjectStore, run: str, kind: str = "policy") -> None:
        self.store = store
        self.prefix = f"{run}/{kind}"
        self.marker_key = f"{self.prefix}/LATEST"
        self._log = get_logger(component=f"marker:{kind}")

    def blob_key(self, sha256: str) -> str:
        return f"{self.prefix}/blobs/{sha256}.safetensors"

    def put_blob(self, data: bytes, key: str | None = None) -> tuple[str, str]:
        """Write a payload (content-addressed unless ``key`` is given; idempotent). Returns ``(key, sha256)``."""
        sha = hashlib.sha256(data).hexdigest()
        key = key or self.blob_key(sha)
        if not self.store.exists(key):
            self.store.put(key, data)
        return key, sha

    def read_marker(self) -> tuple[VersionRecord, str] | None:
        """The published record and the marker's etag, or None before the first publish."""
        obj = self.store.get(self.marker_key)
        if obj is None:
            return None
        try:
            return VersionRecord.from_json(obj.data), obj.etag
        except (ValueError, KeyError, TypeError) as exc:
            raise BadMarker(f"marker {self.marker_key} is unreadable: {exc}") from exc

    def publish(self, record: VersionRecord, expected_etag: str | None) -> str:
        """Move the marker to ``record``; ``expected_etag`` is the etag read before (None: first).

        The payload must already be stored. Raises :class:`MarkerConflict` if another writer
        moved the marker since it was read.
        """
        try:
            if expected_etag is None:
                etag = self.store.put(self.marker_key, record.to_json(), if_none_match=True)
            else:
                etag = self.store.put(self.marker_key, record.to_json(), if_match=expected_etag)
        except PreconditionFailed as exc:
            raise MarkerConflict(f"marker {self.marker_key} moved before version {record.version}: {exc}") from exc
        self.store.put(f"{self.prefix}/versions/{record.version}.json", record.to_json())
        return etag

    def publish_next(self, record: VersionRecord) -> str:
        """Publish ``record`` if its version is newer than the marker's (read-check-write)."""
        current = self.read_marker()
        if current is not None and record.version <= current[0].version:
            raise StaleVersion(f"version {record.version} is not newer than published {current[0].version}")
        return self.publish(record, None if current is None else current[1])

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

    def load_newer(self, have: int | None) -> tuple[VersionRecord, bytes] | None:
        """The published version and payload when newer than ``have``; else None.

        Missing or corrupt payloads, and unreadable markers, are logged and yield None, so the
        caller keeps the version it has.
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
        self, verify: Callable[[bytes], object] | None = None
    ) -> tuple[VersionRecord, bytes, list[str]] | None:
        """The newest version whose payload is intact (and passes ``verify``, which raises to refuse it):
        the marker's, else the history's, newest first. Returns it with the reasons the newer ones were
        refused, or None when nothing was ever published here.

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

    def records(self) -> list[VersionRecord]:
        """History records, oldest first."""
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

    def prune(self, keep: int) -> list[int]:
        """Delete history records and blobs beyond the newest ``keep`` versions; never the marker's."""
        history = self.records()
        current = self.read_marker()
        live_blobs = {r.blob for r in history[-keep:]}
        if current is not None:
            live_blobs.add(current[0].blob)
        removed = []
        for rec in history[:-keep]:
            self.store.delete(f"{self.prefix}/versions/{rec.version}.json")
            if rec.blob not in live_blobs:
                self.store.delete(rec.blob)
            removed.append(rec.version)
        return removed
