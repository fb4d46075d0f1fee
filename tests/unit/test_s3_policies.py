"""The S3 policies per role (deploy/minio/flywheel-<role>.json, the same documents in deploy/iam/), evaluated
against the object keys each role touches, allowed and denied.

The evaluator is a small pure model of AWS's policy semantics for one identity policy: a request is allowed
when some ``Allow`` statement matches it and no ``Deny`` statement does (an explicit Deny wins; nothing matching
is an implicit deny). A statement matches when its ``Action`` and ``Resource`` patterns match (``*`` any run of
characters, ``/`` included; ``?`` one character) and its ``Condition`` holds: ``StringLike`` on a context key
needs the key present and matching; ``StringLikeIfExists`` also holds when the key is absent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from shared.marker import VersionedStore
from shared.runtime import PAUSE_KEY
from shared.store import LocalDirStore

REPO = Path(__file__).resolve().parents[2]
ROLES = ("sampler", "trainer", "paramsync", "admin")
BUCKET = "flywheel"
RUN = "cartpole-7"
SHA = "ab" * 32


@cache
def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern))


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _like(pattern: str, value: str) -> bool:
    return _glob(pattern).fullmatch(value) is not None


@dataclass(frozen=True)
class Request:
    action: str
    resource: str
    context: dict[str, str] = field(default_factory=dict)


def _condition_holds(condition: dict[str, dict[str, Any]], context: dict[str, str]) -> bool:
    for operator, keys in condition.items():
        if operator not in ("StringLike", "StringLikeIfExists"):
            raise AssertionError(f"the evaluator does not model the condition operator {operator}")
        for key, patterns in keys.items():
            if key not in context:
                if operator == "StringLike":
                    return False
                continue
            if not any(_like(p, context[key]) for p in _listed(patterns)):
                return False
    return True


def _matches(statement: dict[str, Any], req: Request) -> bool:
    return (any(_like(a, req.action) for a in _listed(statement["Action"]))
            and any(_like(r, req.resource) for r in _listed(statement["Resource"]))
            and _condition_holds(statement.get("Condition", {}), req.context))


def allowed(policy: dict[str, Any], req: Request) -> bool:
    """AWS's decision for one identity policy: explicit Deny wins, else an Allow is needed."""
    statements = policy["Statement"]
    if any(s["Effect"] == "Deny" and _matches(s, req) for s in statements):
        return False
    return any(s["Effect"] == "Allow" and _matches(s, req) for s in statements)


def policy_of(role: str, where: str = "minio") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((REPO / "deploy" / where / f"flywheel-{role}.json").read_text())
    return doc


def get(key: str) -> Request:
    return Request("s3:GetObject", f"arn:aws:s3:::{BUCKET}/{key}")


def put(key: str) -> Request:
    return Request("s3:PutObject", f"arn:aws:s3:::{BUCKET}/{key}")


def delete(key: str) -> Request:
    return Request("s3:DeleteObject", f"arn:aws:s3:::{BUCKET}/{key}")


def list_prefix(prefix: str | None) -> Request:
    """ListObjects with ``prefix``; None: the existence check of a GetObject (no s3:prefix in the context)."""
    return Request("s3:ListBucket", f"arn:aws:s3:::{BUCKET}", {} if prefix is None else {"s3:prefix": prefix})


# The keys, spelled by the code that writes them (shared/marker.py, shared/runtime.py, services/*).
_NOWHERE = LocalDirStore("/nonexistent")  # only the key layout is used, nothing is read or written
policy = VersionedStore(_NOWHERE, RUN, "policy")
ckpt = VersionedStore(_NOWHERE, RUN, "checkpoints")
config = VersionedStore(_NOWHERE, RUN, "config")
POLICY = [policy.marker_key, policy.blob_key(SHA), policy.history_key(3)]
CANDIDATE = policy.blob_key(SHA)
CHECKPOINTS = [ckpt.marker_key, ckpt.blob_key(SHA), ckpt.history_key(3)]
CONFIG = [config.marker_key, config.blob_key(SHA), config.history_key(2)]
PAUSE = f"{RUN}/{PAUSE_KEY}"
ROLLBACK = f"{RUN}/ops/rollback/0123abcd.json"
AUDIT = f"{RUN}/audit/{'1' * 20}-0123abcd.json"
LEASE = f"{RUN}/trainer/lease.json"
EVERYTHING = [*POLICY, *CHECKPOINTS, *CONFIG, PAUSE, ROLLBACK, AUDIT, LEASE]

# role -> (requests it must be allowed, requests it must be denied)
CASES: dict[str, tuple[list[Request], list[Request]]] = {
    "sampler": (
        [*map(get, POLICY), *map(get, CONFIG), get(PAUSE), list_prefix(None), list_prefix(f"{RUN}/policy/versions/")],
        [*map(put, POLICY), *map(get, CHECKPOINTS), get(ROLLBACK), get(AUDIT), get(LEASE), *map(put, CONFIG),
         put(PAUSE), put(AUDIT), *map(delete, POLICY), list_prefix(f"{RUN}/checkpoints/"), list_prefix(f"{RUN}/")],
    ),
    "trainer": (
        [*map(get, POLICY), put(CANDIDATE), *map(get, CHECKPOINTS), *map(put, CHECKPOINTS), *map(delete, CHECKPOINTS),
         *map(get, CONFIG), get(LEASE), put(LEASE), put(AUDIT), list_prefix(f"{RUN}/checkpoints/versions/"),
         list_prefix(None)],
        [put(policy.marker_key), put(policy.history_key(3)), *map(delete, POLICY), *map(put, CONFIG), put(PAUSE),
         put(ROLLBACK), get(AUDIT), delete(AUDIT), list_prefix(f"{RUN}/audit/")],
    ),
    "paramsync": (
        [*map(get, POLICY), *map(put, POLICY), *map(delete, POLICY), get(ROLLBACK), put(ROLLBACK),
         list_prefix(f"{RUN}/policy/versions/"), list_prefix(f"{RUN}/ops/rollback/"), list_prefix(None)],
        [*map(get, CHECKPOINTS), *map(put, CHECKPOINTS), *map(put, CONFIG), put(PAUSE), put(AUDIT), put(LEASE),
         delete(ROLLBACK), list_prefix(f"{RUN}/checkpoints/")],
    ),
    "admin": (
        [*map(get, EVERYTHING), *map(put, CONFIG), put(PAUSE), put(ROLLBACK), put(AUDIT),
         list_prefix(f"{RUN}/"), list_prefix(None)],
        [*map(put, POLICY), *map(put, CHECKPOINTS), put(LEASE), *map(delete, POLICY), *map(delete, CHECKPOINTS),
         delete(AUDIT), *map(delete, CONFIG)],
    ),
}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_may_touch_what_it_needs_and_nothing_else(role: str) -> None:
    must, must_not = CASES[role]
    doc = policy_of(role)
    refused = [r for r in must if not allowed(doc, r)]
    assert not refused, f"{role} is refused what it needs: {refused}"
    granted = [r for r in must_not if allowed(doc, r)]
    assert not granted, f"{role} is allowed what it must not do: {granted}"


@pytest.mark.parametrize("role", ROLES)
def test_iam_documents_equal_the_minio_policies(role: str) -> None:
    assert policy_of(role, "iam") == policy_of(role, "minio"), "deploy/iam and deploy/minio drifted apart"


@pytest.mark.parametrize("role", ROLES)
def test_policies_name_only_the_bucket(role: str) -> None:
    doc = policy_of(role)
    assert doc["Version"] == "2012-10-17"
    for statement in doc["Statement"]:
        for resource in _listed(statement["Resource"]):
            assert resource == f"arn:aws:s3:::{BUCKET}" or resource.startswith(f"arn:aws:s3:::{BUCKET}/"), resource
        assert all(a.startswith("s3:") and "*" not in a for a in _listed(statement["Action"])), statement


def test_the_evaluator_follows_aws_semantics() -> None:
    doc: dict[str, Any] = {"Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"},
        {"Effect": "Deny", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::b/*/secret/*"]},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
         "Condition": {"StringLike": {"s3:prefix": ["r/*"]}}},
    ]}
    assert allowed(doc, Request("s3:GetObject", "arn:aws:s3:::b/r/x"))
    assert not allowed(doc, Request("s3:GetObject", "arn:aws:s3:::b/r/secret/x")), "explicit Deny wins"
    assert not allowed(doc, Request("s3:PutObject", "arn:aws:s3:::b/r/x")), "no Allow: implicit deny"
    assert not allowed(doc, Request("s3:GetObject", "arn:aws:s3:::other/r/x"))
    assert allowed(doc, Request("s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "r/a"}))
    assert not allowed(doc, Request("s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "q/a"}))
    assert not allowed(doc, Request("s3:ListBucket", "arn:aws:s3:::b")), "StringLike needs the key"
    if_exists = {"Statement": [{**doc["Statement"][2], "Condition": {"StringLikeIfExists": {"s3:prefix": "r/*"}}}]}
    assert allowed(if_exists, Request("s3:ListBucket", "arn:aws:s3:::b"))
    assert not allowed(if_exists, Request("s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "q/"}))
