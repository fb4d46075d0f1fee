"""Signed policies and checkpoints (docs/security.md, "Signed policies"): Ed25519, one key per role.

The chain: the **trainer** signs each candidate it sends on ``<run>.policy`` (``PolicyMessage.key_id`` /
``signature``) and each checkpoint record; **paramsync** publishes a candidate only when the trainer's signature
verifies, then signs the version records it publishes (the marker ``<run>/policy/LATEST`` and the history record
``versions/<v>.json``, in ``extra["signature"]``) and every announcement with its own key; a rollback republishes
only a kept record whose paramsync signature verifies. Samplers, the admin, ``eval``, ``export`` and
``flywheel verify`` hold public keys only: no process that runs environment code, and no reader, can make a
signature anything accepts. Readers refuse an unsigned or badly signed policy: not adopted, not taken as
published; logged, counted (:data:`REFUSED`) and, where the reader may write the audit trail, audited.

A signature covers the *claims*, prefixed by what is signed (a candidate's signature is never a valid
announcement's, and the reverse): for policies the run, version, the weights' sha256 and size, the trainer step,
the lineage and rollback fields; for checkpoints the run, the step, the blob's sha256 and size and the whole
record (ledger, offsets, lineage), so a blob is covered through its digest (every reader checks a blob against
the record's sha256). Each key has a role (``trainer`` or ``paramsync``) and verifies only what that role signs.

Keys are given by reference: ``signing.keys_file`` lists the public keys (every one listed verifies for its role,
so two keys of a role are valid at once during a rotation), ``signing.private_key_file`` is the trainer's or
paramsync's own private key. Formats in :mod:`shared.keyfile`; ``flywheel keys`` generates and rotates them.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prometheus_client import Counter

from shared.keyfile import (
    ROLES,
    PrivateKeyEntry,
    PublicKeyEntry,
    Role,
    check_pair,
    private_key_path,
    public_keys_path,
    read_private_key,
    read_public_keys,
    write_secret,
)
from shared.messages import SIGNATURE_FIELD, record_signature

if TYPE_CHECKING:
    from shared.marker import VersionRecord
    from shared.messages import PolicyMessage
    from shared.settings import Settings, SigningSettings

Kind = Literal["candidate", "policy", "checkpoint"]
DOMAINS: dict[Kind, bytes] = {"candidate": b"flywheel-candidate-ed25519-v1\n",
                              "policy": b"flywheel-policy-ed25519-v1\n",
                              "checkpoint": b"flywheel-checkpoint-ed25519-v1\n"}
"""Prefix of every signed message, by what it signs: a signature means nothing anywhere else."""
SIGNER_OF: dict[Kind, Role] = {"candidate": "trainer", "policy": "paramsync", "checkpoint": "trainer"}
PLURAL: dict[Kind, str] = {"candidate": "candidates", "policy": "policies", "checkpoint": "checkpoints"}

Reason = Literal["unsigned", "unknown_key", "wrong_role", "bad_signature", "other_run"]

REFUSED = Counter("flywheel_policy_signature_refused_total",
                  "Policies refused because they were unsigned or badly signed (not adopted, not taken as published)",
                  ["role", "source", "reason"])


class SignatureRefused(ValueError):
    """A policy, candidate or checkpoint whose signature does not verify: never act on it."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason
        self.detail = detail


def claims(run: str, version: int, sha256: str, size: int, trainer_step: int, lineage: int,
           rollback_of: int | None) -> bytes:
    """What a policy's (or candidate's) signature covers: canonical JSON of what identifies the policy."""
    body = {"run": run, "version": int(version), "sha256": sha256, "size": int(size), "trainer_step": int(trainer_step),
            "lineage": int(lineage), "rollback_of": None if rollback_of is None else int(rollback_of)}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def record_claims(run: str, rec: VersionRecord) -> bytes:
    rollback_of = rec.extra.get("rollback_of")
    return claims(run, rec.version, rec.sha256, rec.size, rec.trainer_step, rec.lineage,
                  None if rollback_of is None else int(rollback_of))


def message_claims(run: str, msg: PolicyMessage) -> bytes:
    return claims(run, msg.version, msg.sha256, msg.size, msg.trainer_step, msg.lineage, msg.rollback_of)


def checkpoint_claims(run: str, rec: VersionRecord) -> bytes:
    """A checkpoint record's claims: the run, the blob, and every field of ``extra`` but its signature (the
    ledger and offsets ``flywheel verify`` reads, the lineage, the abandoned versions)."""
    extra = {k: v for k, v in rec.extra.items() if k != "signature"}
    body = {"run": run, "version": int(rec.version), "sha256": rec.sha256, "size": int(rec.size),
            "trainer_step": int(rec.trainer_step), "extra": extra}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def public_of(seed: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def new_key(role: Role, key_id: str | None = None) -> tuple[PrivateKeyEntry, PublicKeyEntry]:
    """A fresh key pair for ``role`` (id ``<role>-<8 hex>`` unless given)."""
    seed = secrets.token_bytes(32)
    key_id = key_id or f"{role}-{secrets.token_hex(4)}"
    return PrivateKeyEntry(key_id, role, seed), PublicKeyEntry(key_id, role, public_of(seed))


@dataclass(frozen=True)
class KeyRing:
    """The run's public keys by id (each with its role), and this process's private key (trainer, paramsync)."""

    public: Mapping[str, PublicKeyEntry]
    private: PrivateKeyEntry | None = None

    def __post_init__(self) -> None:
        if not self.public:
            raise ValueError("a key ring needs at least one public key")
        if self.private is not None:
            check_pair(self.private, dict(self.public))
            if public_of(self.private.seed) != self.public[self.private.key_id].public:
                raise ValueError(f"signing.private_key_file's key {self.private.key_id!r} is not the private half of "
                                 "the public key signing.keys_file lists under that id")

    def __repr__(self) -> str:  # never the secret
        return f"KeyRing(ids={sorted(self.public)}, signer={None if self.private is None else self.private.key_id!r})"

    def sign(self, kind: Kind, data: bytes) -> tuple[str, str]:
        """``(key id, hex Ed25519 signature)`` of ``data`` as ``kind``; ValueError unless this process's key has the
        role that signs ``kind``."""
        if self.private is None:
            raise ValueError("signing.private_key_file is not set: this process verifies only")
        if self.private.role != SIGNER_OF[kind]:
            raise ValueError(f"a {self.private.role} key does not sign {PLURAL[kind]} (the {SIGNER_OF[kind]} does)")
        key = Ed25519PrivateKey.from_private_bytes(self.private.seed)
        return self.private.key_id, key.sign(DOMAINS[kind] + data).hex()

    def verify(self, kind: Kind, data: bytes, key_id: str | None, signature: str | None) -> None:
        """Raise :class:`SignatureRefused` unless ``signature`` is a valid ``kind`` signature of ``data`` by the
        listed key ``key_id``, whose role signs ``kind``."""
        if not key_id or not signature:
            raise SignatureRefused("unsigned", "no signature")
        entry = self.public.get(key_id)
        if entry is None:
            raise SignatureRefused("unknown_key", f"signed with key {key_id!r}, which is not listed (removed, or "
                                                  f"never issued; listed: {', '.join(sorted(self.public))})")
        if entry.role != SIGNER_OF[kind]:
            raise SignatureRefused("wrong_role", f"key {key_id!r} is a {entry.role} key; only a "
                                                 f"{SIGNER_OF[kind]} key signs {PLURAL[kind]}")
        try:
            Ed25519PublicKey.from_public_bytes(entry.public).verify(bytes.fromhex(signature), DOMAINS[kind] + data)
        except (InvalidSignature, ValueError):
            raise SignatureRefused("bad_signature", f"the {kind} signature under key {key_id!r} does not match its "
                                                    "claims (run, version, digest, lineage)") from None

    @classmethod
    def from_settings(cls, signing: SigningSettings, *, role: Role | None = None) -> KeyRing | None:
        """The ring ``signing`` names (None when signing is off); ``role``: this process signs as it, and
        ``signing.private_key_file`` must hold a key of that role. Raises ValueError naming the field."""
        if not signing.enabled:
            return None
        if signing.keys_file is None:
            raise ValueError("signing.keys_file is required when signing.enabled=true")
        private = None
        if role is not None:
            if signing.private_key_file is None:
                raise ValueError(f"signing.private_key_file is required by the {role} (it signs) when "
                                 "signing.enabled=true")
            private = read_private_key(signing.private_key_file)
            if private.role != role:
                raise ValueError(f"signing.private_key_file holds a {private.role} key; the {role} signs with a "
                                 f"{role} key")
        return cls(read_public_keys(signing.keys_file), private)


class Signer:
    """The trainer's (candidates, checkpoints) or paramsync's (version records, announcements) signing."""

    def __init__(self, run: str, ring: KeyRing) -> None:
        if ring.private is None:
            raise ValueError("signing.private_key_file is required to sign")
        self.run = run
        self.ring = ring
        self.role: Role = ring.private.role

    @classmethod
    def from_settings(cls, settings: Settings, role: Role) -> Signer | None:
        """None when signing is off. Raises ValueError naming the field."""
        ring = KeyRing.from_settings(settings.signing, role=role)
        return None if ring is None else cls(settings.run, ring)

    def sign_record(self, rec: VersionRecord) -> VersionRecord:
        """paramsync: the version record it publishes."""
        key_id, value = self.ring.sign("policy", record_claims(self.run, rec))
        return replace(rec, extra={**rec.extra, "signature": {"key_id": key_id, SIGNATURE_FIELD: value}})

    def sign_message(self, msg: PolicyMessage) -> PolicyMessage:
        """An announcement (paramsync) or a candidate (trainer)."""
        kind: Kind = "policy" if self.role == "paramsync" else "candidate"
        key_id, value = self.ring.sign(kind, message_claims(self.run, msg))
        return msg.model_copy(update={"key_id": key_id, "signature": value})

    def sign_checkpoint(self, rec: VersionRecord) -> VersionRecord:
        """The trainer: a checkpoint record, bound to this run (``extra["run"]``). ``extra`` is taken through JSON
        first, as a reader will see it (integer keys become strings), so the claims are the ones read back."""
        extra = json.loads(json.dumps({**rec.extra, "run": self.run}))
        extra.pop("signature", None)
        rec = replace(rec, extra=extra)
        key_id, value = self.ring.sign("checkpoint", checkpoint_claims(self.run, rec))
        return replace(rec, extra={**extra, "signature": {"key_id": key_id, SIGNATURE_FIELD: value}})


class PolicyVerifier:
    """A reader's check: each ``check_*`` raises :class:`SignatureRefused`. With signing off (``ring`` None) a
    policy passes unchecked; a checkpoint is still refused when it names another run."""

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
        """A published version record carries paramsync's signature."""
        if self.ring is not None:
            self.ring.verify("policy", record_claims(self.run, rec), *record_signature(rec))

    def check_message(self, msg: PolicyMessage) -> None:
        """An announcement carries paramsync's signature."""
        if self.ring is not None:
            self.ring.verify("policy", message_claims(self.run, msg), msg.key_id, msg.signature)

    def check_candidate(self, msg: PolicyMessage) -> None:
        """A candidate carries the trainer's signature."""
        if self.ring is not None:
            self.ring.verify("candidate", message_claims(self.run, msg), msg.key_id, msg.signature)

    def check_checkpoint(self, rec: VersionRecord) -> None:
        """A checkpoint record belongs to this run (``extra["run"]``, when it names one; with signing on it must)
        and carries the trainer's signature."""
        owner = rec.extra.get("run")
        if owner is not None and owner != self.run:
            raise SignatureRefused("other_run", f"checkpoint {rec.version} belongs to run {owner!r}, not to this "
                                                f"run {self.run!r} (copied from another run's prefix?)")
        if self.ring is not None:
            if owner is None:
                raise SignatureRefused("unsigned", f"checkpoint {rec.version} names no run and carries no signature "
                                                   f"(this run {self.run!r} signs its checkpoints)")
            self.ring.verify("checkpoint", checkpoint_claims(self.run, rec), *record_signature(rec))


def generate_keys(directory: Path) -> dict[str, Path]:
    """``flywheel keys init``: ``<dir>/trainer/trainer.key``, ``<dir>/paramsync/paramsync.key`` (mode 0600) and
    ``<dir>/public/public.keys`` listing both, each written only when absent (a second call keeps the keys, so a
    restart never invalidates what was signed). Returns the three paths."""
    public_path = public_keys_path(directory)
    paths: dict[str, Path] = {role: private_key_path(directory, role) for role in ROLES}
    listed = read_public_keys(public_path) if public_path.exists() else {}
    lines: list[str] = []
    for role in ROLES:
        path = paths[role]
        if path.exists():
            check_pair(read_private_key(path), listed)
            continue
        private, public = new_key(role)
        write_private(path, private)
        lines.append(public.line())
    if lines or not public_path.exists():
        append_public(public_path, lines)
    return {**paths, "public": public_path}


def write_private(path: Path, private: PrivateKeyEntry) -> None:
    write_secret(path, f"# the {private.role}'s private signing key (docs/security.md): keep it to the "
                       f"{private.role}\n{private.line()}\n")


def append_public(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    head = "" if path.exists() else ("# public signing keys: '<key id> <role> <Ed25519 public key hex>' "
                                     "(docs/security.md)\n")
    with path.open("a") as fh:
        fh.write(head + "".join(line + "\n" for line in lines))


def rotate_key(directory: Path, role: Role) -> tuple[str, str]:
    """``flywheel keys rotate``: a new ``role`` key replaces ``<dir>/<role>/<role>.key`` and is appended to the
    public list, where the old one stays listed (both verify) until ``flywheel keys retire`` removes it.
    Returns (old id, new id)."""
    path = private_key_path(directory, role)
    old = read_private_key(path)
    private, public = new_key(role)
    append_public(public_keys_path(directory), [public.line()])
    write_private(path, private)
    return old.key_id, private.key_id


def retire_key(directory: Path, key_id: str) -> None:
    """``flywheel keys retire``: remove ``key_id`` from the public list (what it signed no longer verifies).
    ValueError when it is unknown or still some role's current private key."""
    public_path = public_keys_path(directory)
    listed = read_public_keys(public_path)
    if key_id not in listed:
        raise ValueError(f"key {key_id!r} is not listed in {public_path} (listed: {', '.join(sorted(listed))})")
    for role in ROLES:
        path = private_key_path(directory, role)
        if path.exists() and read_private_key(path).key_id == key_id:
            raise ValueError(f"key {key_id!r} is the {role}'s current key: rotate it first")
    kept = [line for line in public_path.read_text().splitlines() if line.split()[:1] != [key_id]]
    public_path.write_text("".join(line + "\n" for line in kept))


def _source_of(msg: PolicyMessage) -> str:
    return "announcement" if msg.type == "announce" else "candidate"


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
        return self.note(exc, source=source, version=rec.version, sha256=rec.sha256, key_id=record_signature(rec)[0],
                         **context)

    def note_message(self, exc: SignatureRefused, msg: PolicyMessage, **context: Any) -> bool:
        return self.note(exc, source=_source_of(msg), version=msg.version, sha256=msg.sha256, key_id=msg.key_id,
                         **context)


def audit_params(exc: SignatureRefused, *, source: str, version: int, sha256: str, key_id: str | None,
                 **context: Any) -> dict[str, Any]:
    """The ``params`` of a ``policy_signature_refused`` audit entry."""
    return {"source": source, "version": version, "sha256": sha256[:16], "key_id": key_id, "reason": exc.reason,
            "detail": exc.detail[:300], **context}


def record_audit_params(exc: SignatureRefused, rec: VersionRecord, source: str, **context: Any) -> dict[str, Any]:
    return audit_params(exc, source=source, version=rec.version, sha256=rec.sha256, key_id=record_signature(rec)[0],
                        **context)


def message_audit_params(exc: SignatureRefused, msg: PolicyMessage, **context: Any) -> dict[str, Any]:
    return audit_params(exc, source=_source_of(msg), version=msg.version, sha256=msg.sha256, key_id=msg.key_id,
                        **context)


SIGNERS: tuple[Role, ...] = ROLES
"""The services that sign (and so need ``signing.private_key_file``, holding a key of their own role); every other
one only verifies and must hold no private key."""


def startup_problem(service: str, settings: Settings) -> str | None:
    """Why ``service`` must not start with these signing settings (the message names the field), or None.
    The settings' own validation has already checked that the files are readable and agree."""
    signing = settings.signing
    if not signing.enabled:
        return None
    if service in SIGNERS:
        if signing.private_key_file is None:
            return (f"signing.private_key_file is required by the {service} when signing.enabled=true: its own "
                    f"{service} key (FLYWHEEL_SIGNING_PRIVATE_KEY_FILE; flywheel keys init --dir DIR makes one)")
        role = read_private_key(signing.private_key_file).role
        if role != service:
            return f"signing.private_key_file holds a {role} key; the {service} signs only with a {service} key"
        return None
    if signing.private_key_file is not None:
        return (f"signing.private_key_file is set for the {service}, which only verifies: give it the public keys "
                "file alone (a process holding a private key could sign what readers trust)")
    return None
