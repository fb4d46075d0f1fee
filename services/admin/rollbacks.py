"""Durable rollback requests, admin's side: create one (``pending``), read it back, list the pending.

The layout and the writer rules are the contract in docs/api.md ("Rollback requests"):
``<run>/ops/rollback/<request_id>.json``; admin creates with ``If-None-Match`` (a request is never
overwritten by admin), paramsync alone records ``applied`` / ``refused`` on it. Request ids sort by
request time (``<unix ns, 20 digits>-<8 hex>``), the order paramsync applies them in.
"""

from __future__ import annotations

import json
from typing import Any

from shared.rollback import ROLLBACK_PREFIX, RollbackQueue, create_request, new_request_id
from shared.store import ObjectStore

__all__ = ["ROLLBACK_PREFIX", "RollbackRequests", "new_request_id"]


class RollbackRequests:
    """The run's rollback requests in the object store. Store errors propagate (the route makes them 503)."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.store = store
        self.run = run
        self.prefix = f"{run}/{ROLLBACK_PREFIX}"

    def create(self, request_id: str, version: int, actor: str) -> dict[str, Any]:
        return create_request(self.store, self.run, request_id, version, actor)

    def get(self, request_id: str) -> dict[str, Any] | None:
        obj = self.store.get(f"{self.prefix}{request_id}.json")
        if obj is None:
            return None
        data: dict[str, Any] = json.loads(obj.data)
        return data

    def pending(self) -> list[dict[str, Any]]:
        """Requests paramsync has not decided yet, oldest first (unreadable objects are skipped)."""
        return [{"request_id": req.request_id, "version": req.version, "requested_at": req.requested_at}
                for req, _etag in RollbackQueue(self.store, self.run).pending()]
