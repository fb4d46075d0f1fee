"""Durable rollback requests (``<run>/ops/rollback/<request_id>.json``), the one contract every writer
follows (docs/api.md, "Rollback requests"): a request is created ``pending`` with ``If-None-Match`` and never
overwritten by its requester; paramsync alone records ``applied`` / ``refused`` on it. Request ids sort by
request time (``<unix ns, 20 digits>-<8 hex>``), the order paramsync applies them in. Admin (an operator's
``flywheel rollback``) and the trainer's rollback guard both request rollbacks this way.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from shared.store import ObjectStore

ROLLBACK_PREFIX = "ops/rollback/"


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
