"""Durable rollback requests, paramsync's side: republish a request's version (the request contract and
the queue of pending ones are ``shared.rollback``).

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

from collections.abc import Callable

from shared.marker import VersionedStore, VersionRecord
from shared.rl.model import ActorCritic, load_weights
from shared.rollback import RollbackQueue, RollbackRequest, Status

__all__ = ["RollbackQueue", "RollbackRequest", "Status", "republish"]


def republish(policies: VersionedStore, model: ActorCritic, req: RollbackRequest,
              sign: Callable[[VersionRecord], VersionRecord] = lambda rec: rec,
              check: Callable[[VersionRecord], None] = lambda rec: None) -> VersionRecord:
    """Publish ``req.version``'s weights as the newest version, from a pinned copy of its payload (a
    concurrent prune cannot delete the blob the new marker names). Idempotent per request: a version
    already published for this request (paramsync stopped before recording it) is returned as is.
    ``check`` raises to refuse the kept record (``PolicyVerifier.check_record``: only a version paramsync signed
    is republished, never one written into the history by anyone else); ``sign`` signs the new record
    (paramsync's key; docs/security.md). Raises LookupError (refused: not kept, already current),
    SignatureRefused, BadPayload, WeightsError, MarkerConflict."""
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
    check(target)
    if current is not None and current[0].sha256 == target.sha256:
        raise LookupError(f"version {current[0].version} already has version {version}'s weights")
    load_weights(model, policies.fetch(target))  # present, intact, loadable
    pinned = policies.pin_copy(target)
    new_version = (current[0].version if current else 0) + 1
    record = VersionRecord(version=new_version, blob=pinned.blob, sha256=target.sha256, size=target.size,
                           trainer_step=target.trainer_step,
                           extra={"rollback_of": version, "lineage": new_version,
                                  "rollback_request": req.request_id})
    record = sign(record)
    policies.publish(record, None if current is None else current[1])
    return record
