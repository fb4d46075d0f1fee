"""Durable rollback requests, paramsync's side: read the pending ones in order, record each decision.

Layout (the contract in docs/api.md, "Rollback requests"): ``<run>/ops/rollback/<request_id>.json``,
one JSON object per request::

    {"request_id", "version", "status": "pending" | "applied" | "refused",
     "requested_at", "actor", "new_version", "reason", "decided_at"}

Writers: admin creates a request with ``If-None-Match`` (status ``pending``); paramsync alone moves
it to ``applied`` (with ``new_version``) or ``refused`` (with ``reason``), with ``If-Match`` on the
etag it read, so a decision is recorded once and never overwritten. Request ids sort by request
time (admin makes them ``<unix ns, 20 digits>-<hex>``), so listing the prefix gives the order in
which they are applied. Nothing deletes a request: they are an operator's record, like the audit.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from shared.marker import VersionedStore, VersionRecord
from shared.rl.model import ActorCritic, load_weights
from shared.store import ObjectStore, PreconditionFailed

Status = Literal["pending", "applied", "refused"]
ROLLBACK_PREFIX = "ops/rollback/"


@dataclass(frozen=True)
class RollbackRequest:
    request_id: str
    version: int
    status: Status = "pending"
    requested_at: float = 0.0
    actor: str = ""
    new_version: int | None = None
    reason: str | None = None
    decided_at: float | None = None

    @classmethod
    def from_json(cls, data: bytes) -> RollbackRequest:
        raw: dict[str, Any] = json.loads(data)
        status = str(raw.get("status"))
        if status not in ("pending", "applied", "refused"):
            raise ValueError(f"status {status!r} is not pending, applied or refused")
        nv = raw.get("new_version")
        return cls(request_id=str(raw["request_id"]), version=int(raw["version"]), status=status,  # type: ignore[arg-type]
                   requested_at=float(raw.get("requested_at") or 0.0), actor=str(raw.get("actor") or ""),
                   new_version=None if nv is None else int(nv), reason=raw.get("reason"),
                   decided_at=raw.get("decided_at"))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


class RollbackQueue:
    """Pending rollback requests of one run, oldest first; :meth:`decide` records an outcome once."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.store = store
        self.prefix = f"{run}/{ROLLBACK_PREFIX}"

    def key(self, request_id: str) -> str:
        return f"{self.prefix}{request_id}.json"

    def pending(self) -> list[tuple[RollbackRequest, str]]:
        """Pending requests with their etags, in request order. Unreadable objects are skipped (never
        applied, never rewritten): the rest stay usable. Store errors propagate."""
        out: list[tuple[RollbackRequest, str]] = []
        for key in self.store.list(self.prefix):
            obj = self.store.get(key)
            if obj is None:
                continue
            try:
                req = RollbackRequest.from_json(obj.data)
            except (ValueError, KeyError, TypeError):
                continue
            if req.status == "pending":
                out.append((req, obj.etag))
        return sorted(out, key=lambda p: (p[0].requested_at, p[0].request_id))

    def decide(self, req: RollbackRequest, etag: str, status: Status, *, new_version: int | None = None,
               reason: str | None = None) -> bool:
        """Record ``status`` on a pending request read with ``etag``. False: another paramsync decided
        it first (its decision stands)."""
        done = replace(req, status=status, new_version=new_version, reason=reason, decided_at=time.time())
        try:
            self.store.put(self.key(req.request_id), done.to_json(), if_match=etag)
        except PreconditionFailed:
            return False
        return True


def republish(policies: VersionedStore, model: ActorCritic, req: RollbackRequest) -> VersionRecord:
    """Publish ``req.version``'s weights as the newest version, from a pinned copy of its payload (a
    concurrent prune cannot delete the blob the new marker names). Idempotent per request: a version
    already published for this request (paramsync stopped before recording it) is returned as is.
    Raises LookupError (refused: not kept, already current), BadPayload, WeightsError, MarkerConflict."""
    version = req.version
    current = policies.read_marker()
    for rec in ([current[0]] if current else []) + policies.records()[::-1]:
        if rec.extra.get("rollback_request") == req.request_id:
            return rec
    old = policies.store.get(f"{policies.prefix}/versions/{version}.json")
    if old is None:
        raise LookupError(f"version {version} is not kept (pruned, or never published)")
    try:
        target = VersionRecord.from_json(old.data)
    except (ValueError, KeyError, TypeError) as exc:
        raise LookupError(f"version {version}'s record is unreadable: {exc}") from exc
    if current is not None and current[0].sha256 == target.sha256:
        raise LookupError(f"version {current[0].version} already has version {version}'s weights")
    load_weights(model, policies.fetch(target))  # present, intact, loadable
    pinned = policies.pin_copy(target)
    new_version = (current[0].version if current else 0) + 1
    record = VersionRecord(version=new_version, blob=pinned.blob, sha256=target.sha256, size=target.size,
                           trainer_step=target.trainer_step,
                           extra={"rollback_of": version, "lineage": new_version,
                                  "rollback_request": req.request_id})
    policies.publish(record, None if current is None else current[1])
    return record
