"""Durable rollback requests (``<run>/ops/rollback/<request_id>.json``), the one contract every writer
follows (docs/api.md, "Rollback requests"): a request is created ``pending`` with ``If-None-Match`` and never
overwritten by its requester; paramsync alone records ``applied`` / ``refused`` on it. Request ids sort by
request time (``<unix ns, 20 digits>-<8 hex>``), the order paramsync applies them in. Admin (an operator's
``flywheel rollback``) and the trainer's rollback guard both request rollbacks this way; paramsync reads
the pending ones with :class:`RollbackQueue` and records each decision with ``If-Match`` on the etag it
read, so a decision is recorded once and never overwritten. Nothing deletes a request.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from shared.store import ObjectStore, PreconditionFailed


def new_request_id() -> str:
    """Unique, and sorting by creation time."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


def create_request(store: ObjectStore, run: str, request_id: str, version: int, actor: str) -> dict[str, Any]:
    """Store a pending request to republish ``version``; raises PreconditionFailed if the id exists."""
    req = {"request_id": request_id, "version": version, "status": "pending", "requested_at": time.time(),
           "actor": actor, "new_version": None, "reason": None, "decided_at": None}
    store.put(f"{run}/{ROLLBACK_PREFIX}{request_id}.json", json.dumps(req, sort_keys=True).encode(),
              if_none_match=True)
    return req


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
