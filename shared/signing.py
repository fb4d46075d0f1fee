"""Signed policies (docs/security.md, "Signed policies"): HMAC-SHA256 with a per-run key, stdlib only.

paramsync signs every version record it publishes (the marker ``<run>/policy/LATEST`` and the history record
``versions/<v>.json``, in ``extra["signature"]``) and every announcement it sends on ``<run>.policy``
(``PolicyMessage.key_id`` / ``signature``). The signature covers the *claims*: run, version, the weights'
sha256 and size, the trainer step, and the lineage and rollback fields, so a blob is covered through its
digest (every reader checks a blob against the record's sha256). Readers (samplers, the trainer, the
admin's ``/status``, ``eval`` and ``export``) refuse an unsigned or badly signed policy: not adopted, not
taken as published; logged, counted (:data:`REFUSED`) and, where the reader may write the audit trail,
audited.

Keys are given by reference: ``signing.keys_file`` names a file of ``<key id> <secret, hex>`` lines (all
of them verify; ``signing.key_id`` names the one paramsync signs with), never the secret itself in a config
file. Rotation: add the new key to every reader's file, switch paramsync's ``key_id``, restart; remove the
old key once a version signed with the new one is published.

HMAC means a reader holds the same secret as the signer, so this keeps out whoever can write the policy
topic or the store without holding the key (a producer with write access, a misconfigured ACL), not a
compromised process that holds the key.

The key file's format and reading are in :mod:`shared.keyfile`, which ``shared.settings`` uses at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import Counter

from shared.keyfile import read_keys

if TYPE_CHECKING:
    from shared.marker import VersionRecord
    from shared.messages import PolicyMessage
    from shared.settings import Settings, SigningSettings

DOMAIN = b"flywheel-policy-signature-v1\n"
"""Prefix of every signed message: a signature over policy claims means nothing anywhere else."""

Reason = Literal["unsigned", "unknown_key", "bad_signature"]

REFUSED = Counter("flywheel_policy_signature_refused_total",
                  "Policies refused because they were unsigned or badly signed (not adopted, not taken as published)",
                  ["role", "source", "reason"])


class SignatureRefused(ValueError):
    """A policy (announcement or version record) whose signature does not verify: never act on it."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason
        self.detail = detail


def claims(run: str, version: int, sha256: str, size: int, trainer_step: int, lineage: int,
           rollback_of: int | None) -> bytes:
    """The bytes a policy's signature covers: canonical JSON of what identifies the policy."""
    body = {"run": run, "version": int(version), "sha256": sha256, "size": int(size), "trainer_step": int(trainer_step),
            "lineage": int(lineage), "rollback_of": None if rollback_of is None else int(rollback_of)}
    return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def record_claims(run: str, rec: VersionRecord) -> bytes:
    rollback_of = rec.extra.get("rollback_of")
    return claims(run, rec.version, rec.sha256, rec.size, rec.trainer_step, rec.lineage,
                  None if rollback_of is None else int(rollback_of))


def message_claims(run: str, msg: PolicyMessage) -> bytes:
    return claims(run, msg.version, msg.sha256, msg.size, msg.trainer_step, msg.lineage, msg.rollback_of)


def mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class KeyRing:
    """The verification keys of a run, and the id of the one to sign with (paramsync's; None elsewhere)."""

    keys: Mapping[str, bytes]
    signing_id: str | None = None

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a key ring needs at least one key")
        if self.signing_id is not None and self.signing_id not in self.keys:
            raise ValueError(f"signing.key_id {self.signing_id!r} is not in signing.keys_file")

    def __repr__(self) -> str:  # never the secrets
        return f"KeyRing(ids={sorted(self.keys)}, signing_id={self.signing_id!r})"

    def sign(self, data: bytes) -> tuple[str, str]:
        """``(key id, hex HMAC-SHA256)`` of ``data`` with the signing key."""
        if self.signing_id is None:
            raise ValueError("signing.key_id is not set: this process verifies only")
        return self.signing_id, mac(self.keys[self.signing_id], data)

    def verify(self, data: bytes, key_id: str | None, signature: str | None) -> None:
        """Raise :class:`SignatureRefused` unless ``signature`` is ``data``'s HMAC under the listed key ``key_id``."""
        if not key_id or not signature:
            raise SignatureRefused("unsigned", "no signature")
        key = self.keys.get(key_id)
        if key is None:
            raise SignatureRefused("unknown_key", f"signed with key {key_id!r}, which is not listed (removed, or "
                                                  f"never issued; listed: {', '.join(sorted(self.keys))})")
        if not hmac.compare_digest(mac(key, data), signature):
            raise SignatureRefused("bad_signature", f"the signature under key {key_id!r} does not match the policy's "
                                                    "run, version, digest and lineage")

    @classmethod
    def from_settings(cls, signing: SigningSettings, *, signer: bool = False) -> KeyRing | None:
        """The ring ``signing`` names (None when signing is off). ``signer``: ``signing.key_id`` is required.
        Raises ValueError naming the field."""
        if not signing.enabled:
            return None
        if signing.keys_file is None:
            raise ValueError("signing.keys_file is required when signing.enabled=true")
        if signer and signing.key_id is None:
            raise ValueError("signing.key_id is required by paramsync (it signs) when signing.enabled=true")
        return cls(read_keys(signing.keys_file), signing.key_id if signer else None)


def _signature_of(rec: VersionRecord) -> tuple[str | None, str | None]:
    sig = rec.extra.get("signature")
    if not isinstance(sig, dict):
        return None, None
    key_id, value = sig.get("key_id"), sig.get("hmac")
    return (key_id if isinstance(key_id, str) else None), (value if isinstance(value, str) else None)


class PolicySigner:
    """paramsync's: signs version records (marker, history) and announcements with the run's current key."""

    def __init__(self, run: str, ring: KeyRing) -> None:
        if ring.signing_id is None:
            raise ValueError("signing.key_id is required to sign")
        self.run = run
        self.ring = ring

    @classmethod
    def from_settings(cls, settings: Settings) -> PolicySigner | None:
        """None when signing is off. Raises ValueError naming the field (``signing.key_id``, ``signing.keys_file``)."""
        ring = KeyRing.from_settings(settings.signing, signer=True)
        return None if ring is None else cls(settings.run, ring)

    def sign_record(self, rec: VersionRecord) -> VersionRecord:
        key_id, value = self.ring.sign(record_claims(self.run, rec))
        return replace(rec, extra={**rec.extra, "signature": {"key_id": key_id, "hmac": value}})

    def sign_message(self, msg: PolicyMessage) -> PolicyMessage:
        key_id, value = self.ring.sign(message_claims(self.run, msg))
        return msg.model_copy(update={"key_id": key_id, "signature": value})


class PolicyVerifier:
    """A reader's check: :meth:`check_record` / :meth:`check_message` raise :class:`SignatureRefused`.
    With signing off (``ring`` None) everything passes, as before signed policies."""

    def __init__(self, run: str, ring: KeyRing | None) -> None:
        self.run = run
        self.ring = ring

    @property
    def enabled(self) -> bool:
        return self.ring is not None

    @classmethod
    def from_settings(cls, settings: Settings) -> PolicyVerifier:
        """Raises ValueError naming the field when signing is on but its keys cannot be read."""
        return cls(settings.run, KeyRing.from_settings(settings.signing))

    def check_record(self, rec: VersionRecord) -> None:
        if self.ring is not None:
            self.ring.verify(record_claims(self.run, rec), *_signature_of(rec))

    def check_message(self, msg: PolicyMessage) -> None:
        if self.ring is not None:
            self.ring.verify(message_claims(self.run, msg), msg.key_id, msg.signature)


class Refusals:
    """One reader's refusals: each distinct refused policy is counted and logged once (a marker refused at
    every poll, an announcement re-read after a restart of the reader's tail are not news); :meth:`note`
    says whether it was new, so the caller audits it once."""

    def __init__(self, role: str, log: Any, memory: int = 256) -> None:
        self.role = role
        self.log = log
        self._seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._memory = memory

    def note(self, exc: SignatureRefused, *, source: str, version: int, sha256: str, key_id: str | None,
             **context: Any) -> bool:
        """Count and log ``exc`` for the policy ``version``/``sha256`` read from ``source`` (``announcement``,
        ``marker``, ``history``); True when this policy was not refused before (audit it)."""
        key = (source, version, sha256, key_id, exc.reason)
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        while len(self._seen) > self._memory:
            self._seen.popitem(last=False)
        REFUSED.labels(role=self.role, source=source, reason=exc.reason).inc()
        self.log.warning("policy_signature_refused", source=source, policy_version=version, sha256=sha256[:12],
                         key_id=key_id, reason=exc.reason, detail=exc.detail, **context)
        return True

    def note_record(self, exc: SignatureRefused, rec: VersionRecord, source: str, **context: Any) -> bool:
        return self.note(exc, source=source, version=rec.version, sha256=rec.sha256, key_id=_signature_of(rec)[0],
                         **context)

    def note_message(self, exc: SignatureRefused, msg: PolicyMessage, **context: Any) -> bool:
        return self.note(exc, source="announcement", version=msg.version, sha256=msg.sha256, key_id=msg.key_id,
                         **context)


def audit_params(exc: SignatureRefused, *, source: str, version: int, sha256: str, key_id: str | None,
                 **context: Any) -> dict[str, Any]:
    """The ``params`` of a ``policy_signature_refused`` audit entry."""
    return {"source": source, "version": version, "sha256": sha256[:16], "key_id": key_id, "reason": exc.reason,
            "detail": exc.detail[:300], **context}


def record_audit_params(exc: SignatureRefused, rec: VersionRecord, source: str, **context: Any) -> dict[str, Any]:
    return audit_params(exc, source=source, version=rec.version, sha256=rec.sha256, key_id=_signature_of(rec)[0],
                        **context)


def message_audit_params(exc: SignatureRefused, msg: PolicyMessage, **context: Any) -> dict[str, Any]:
    return audit_params(exc, source="announcement", version=msg.version, sha256=msg.sha256, key_id=msg.key_id,
                        **context)


SIGNERS = ("paramsync",)
"""The services that sign (and so need ``signing.key_id``); every other one only verifies."""


def startup_problem(service: str, settings: Settings) -> str | None:
    """Why ``service`` must not start with these signing settings (the message names the field), or None.
    The settings' own validation has already checked that the keys file is readable and lists ``key_id``."""
    signing = settings.signing
    if signing.enabled and service in SIGNERS and signing.key_id is None:
        return (f"signing.key_id is required by {service} when signing.enabled=true: the id of the key in "
                "signing.keys_file it signs policies with (FLYWHEEL_SIGNING_KEY_ID)")
    return None
