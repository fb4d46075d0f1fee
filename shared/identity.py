"""A sampler's id bound to a key it alone holds (docs/security.md, "Sampler identity").

Why: a sampler's id is a header (fragments) and a field (heartbeats), and every sampler shares one Kafka principal
(the ``sampler`` user), so Kafka's ACLs cannot stop one sampler from producing, beating or taking credits under
another's id. Kafka never shows a consumer the producer's principal, so the binding has to travel in the records.

- Every sampler process holds an Ed25519 key of its own (:class:`SamplerKey`): made at start, or read from
  ``sampler.identity_key_file`` so that a restart under the same id keeps it. It signs each fragment (every header
  but the identity ones, then the payload's sha256) and each heartbeat (the JSON value), and sends its public key
  and the signature as two headers, :data:`H_KEY` and :data:`H_SIG`.
- Every reader of them (the trainer for fragments and credits, paramsync, the admin and a synchronous trainer for
  heartbeats) keeps an :class:`IdentityBook`: an id is bound to the first key it sees signing for it (trust on
  first use), and from then on a record of that id is refused unless that key signed it. A different key takes
  the id over only after the bound key has been silent for ``sampler.identity_handover_s`` (a restarted sampler
  with a fresh key; a live sampler beats every second), and the old key's records made before the handover are
  still accepted (its backlog). A binding silent for :data:`FORGET_S` is forgotten.
- A record that carries no key claims nothing: it is accepted for an id no key holds (samplers with
  ``sampler.identity: false``, hand-made test records), refused for an id bound to a key.

What it does not stop: a process with the ``sampler`` credentials can claim an id that no live sampler holds (a
fresh one, or one silent for the handover), and each reader binds on its own, in memory (a restarted reader binds
again from what it reads first). It stops the hijack of a live sampler's id: its credits, its heartbeats (the
sync latency, the liveness the alerts watch) and its fragments.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prometheus_client import Counter

from shared.bus import Headers, Record
from shared.keyfile import write_secret

H_KEY = "sampler-key"
"""The sampler process's Ed25519 public key, 64 hex digits."""
H_SIG = "sampler-sig"
"""Its signature of the record (:func:`fragment_message`, :func:`beat_message`), 128 hex digits."""
IDENTITY_HEADERS = (H_KEY, H_SIG)
DOMAIN_FRAGMENT = b"flywheel-sampler-fragment-ed25519-v1\n"
DOMAIN_BEAT = b"flywheel-sampler-beat-ed25519-v1\n"
FORGET_S = 600.0
"""A binding whose key has not been seen for this long is forgotten (the credits' own horizon)."""
PREVIOUS_KEPT = 4
"""Keys an id had before its current one whose backlog is still accepted."""

Reason = Literal["unsigned", "malformed", "bad_signature", "id_in_use"]

REFUSED = Counter("flywheel_sampler_identity_refused_total",
                  "Sampler records refused because their id is bound to another key, or their signature does not "
                  "verify (fragments dead-lettered, heartbeats ignored)", ["role", "kind", "reason"])


def fragment_message(headers: Headers, payload: bytes | None) -> bytes:
    """What a fragment's signature covers: every header but the identity ones, in order, each name and value
    length-prefixed, then the payload's sha256."""
    h = hashlib.sha256()
    for name, value in headers:
        if name in IDENTITY_HEADERS:
            continue
        n, v = name.encode(), value or b""
        h.update(struct.pack(">I", len(n)) + n + struct.pack(">I", len(v)) + v)
    return DOMAIN_FRAGMENT + h.digest() + hashlib.sha256(payload or b"").digest()


def beat_message(value: bytes) -> bytes:
    """What a heartbeat's signature covers: its JSON value (the id, the version, the time in it)."""
    return DOMAIN_BEAT + hashlib.sha256(value).digest()


class SamplerKey:
    """This sampler process's key: :meth:`headers` to append to a record it sends."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_hex = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    @classmethod
    def generate(cls) -> SamplerKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> SamplerKey:
        """The key kept at ``path`` (32 raw seed bytes as hex, mode 0600), made and written there first if absent:
        a sampler restarted under the same id keeps its binding."""
        if path.exists():
            text = path.read_text().strip()
            try:
                return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text)))
            except ValueError:
                raise ValueError(f"sampler.identity_key_file {path}: not a 64-hex-digit Ed25519 seed") from None
        key = Ed25519PrivateKey.generate()
        write_secret(path, key.private_bytes_raw().hex() + "\n")
        return cls(key)

    @property
    def key_id(self) -> str:
        return key_id(self.public_hex)

    def headers(self, message: bytes) -> Headers:
        return [(H_KEY, self.public_hex.encode()), (H_SIG, self._private.sign(message).hex().encode())]


def key_id(public_hex: str) -> str:
    """The short form of a sampler key in logs and audit entries."""
    return public_hex[:12]


def identity_of(headers: Headers | None) -> tuple[str, str] | None:
    """``(public key hex, signature hex)`` from a record's headers, or None when it carries no key."""
    key = sig = None
    for name, value in headers or []:
        if name == H_KEY:
            key = (value or b"").decode("ascii", "replace")
        elif name == H_SIG:
            sig = (value or b"").decode("ascii", "replace")
    if key is None and sig is None:
        return None
    return key or "", sig or ""


class IdentityRefused(ValueError):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason
        self.detail = detail


@dataclass
class _Binding:
    key: str
    last_seen: float
    previous: OrderedDict[str, float] = field(default_factory=OrderedDict)  # old key -> when it was handed over


class IdentityBook:
    """One reader's bindings of sampler ids to keys (the module's doc has the rules). ``check`` raises
    :class:`IdentityRefused`, or returns the key id it accepted (None for a record that carries no key).

    ``at`` is the reader's time of the record: ``min(now, the record's timestamp)`` (a record replayed from history
    is dated by when it was made; a producer cannot date one later than now)."""

    def __init__(self, handover_s: float = 3.0, forget_s: float = FORGET_S) -> None:
        self.handover_s = handover_s
        self.forget_s = forget_s
        self._bound: dict[str, _Binding] = {}
        self._swept_at = float("-inf")

    def bound(self, sampler_id: str) -> str | None:
        b = self._bound.get(sampler_id)
        return None if b is None else b.key

    def check(self, sampler_id: str, identity: tuple[str, str] | None, message: bytes, at: float) -> str | None:
        self._forget(at)
        b = self._bound.get(sampler_id)
        if identity is None:
            if b is not None:
                raise IdentityRefused("unsigned", f"sampler id {sampler_id!r} is bound to key {key_id(b.key)}; "
                                                  "this record carries no key")
            return None
        key, sig = identity
        try:
            public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(key))
            signature = bytes.fromhex(sig)
        except ValueError:
            raise IdentityRefused("malformed", f"{H_KEY}/{H_SIG} headers are not an Ed25519 key and signature "
                                               "in hex") from None
        try:
            public.verify(signature, message)
        except InvalidSignature:
            raise IdentityRefused("bad_signature", f"the signature under key {key_id(key)} does not verify "
                                                   "(the record was altered, or signed by another key)") from None
        if b is None:
            self._bound[sampler_id] = _Binding(key, at)
            return key_id(key)
        if key == b.key:
            b.last_seen = max(b.last_seen, at)
            return key_id(key)
        handed = b.previous.get(key)
        if handed is not None and at <= handed:
            return key_id(key)  # the previous key's backlog, made before the id was handed over
        silent = at - b.last_seen
        if silent < self.handover_s:
            raise IdentityRefused("id_in_use", f"sampler id {sampler_id!r} is held by key {key_id(b.key)} (last "
                                               f"seen {max(0.0, silent):.1f} s ago); key {key_id(key)} may take it "
                                               f"after {self.handover_s:g} s of its silence")
        b.previous.pop(key, None)
        b.previous[b.key] = at
        while len(b.previous) > PREVIOUS_KEPT:
            b.previous.popitem(last=False)
        b.key, b.last_seen = key, at
        return key_id(key)

    def _forget(self, now: float) -> None:
        """Drop the bindings silent for ``forget_s``: a sweep at most every ``forget_s / 10`` (a thousand ids beating
        every second cost one pass over them a minute, not one per record)."""
        if now - self._swept_at < self.forget_s / 10:
            return
        self._swept_at = now
        for sid in [s for s, b in self._bound.items() if now - b.last_seen > self.forget_s]:
            del self._bound[sid]


class RefusalLog:
    """Counts every refusal; logs (and says to audit) one per ``(id, key, reason)`` each ``every_s``."""

    def __init__(self, role: str, log: Any, every_s: float = 60.0) -> None:
        self.role = role
        self.log = log
        self.every_s = every_s
        self._last: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def note(self, exc: IdentityRefused, *, kind: str, sampler_id: str, identity: tuple[str, str] | None,
             now: float, **context: object) -> bool:
        REFUSED.labels(role=self.role, kind=kind, reason=exc.reason).inc()
        claimed = "" if identity is None else key_id(identity[0])
        k = (sampler_id, claimed, exc.reason)
        last = self._last.get(k)
        if last is not None and now - last < self.every_s:
            return False
        self._last[k] = now
        self._last.move_to_end(k)
        while len(self._last) > 1024:
            self._last.popitem(last=False)
        self.log.warning("sampler_identity_refused", kind=kind, sampler_id=sampler_id,
                         key_id=claimed or None, reason=exc.reason, detail=exc.detail, **context)
        return True


def record_time(rec: Record) -> float:
    """A record's time for :meth:`IdentityBook.check`: when it was made, never later than now."""
    return min(time.time(), rec.timestamp_ms / 1000.0)


@dataclass(frozen=True)
class Refusal:
    error: IdentityRefused
    news: bool
    """The first refusal of its id, key and reason in a minute (logged): audit it."""
    audit: dict[str, object]
    """The params of its ``sampler_identity_refused`` audit entry."""


class IdentityCheck:
    """A reader's book and refusal log in one: :meth:`refusal` of each sampler record it reads."""

    def __init__(self, role: str, log: Any, handover_s: float) -> None:
        self.book = IdentityBook(handover_s)
        self.refusals = RefusalLog(role, log)

    def refusal(self, kind: Literal["fragment", "heartbeat"], sampler_id: str, headers: Headers | None,
                message: bytes, at: float, **context: object) -> Refusal | None:
        """None when the record (``message``: :func:`fragment_message` or :func:`beat_message`) may be believed as
        ``sampler_id``'s; else the refusal (counted; ``context`` goes to its log line)."""
        identity = identity_of(headers)
        try:
            self.book.check(sampler_id, identity, message, at)
            return None
        except IdentityRefused as exc:
            news = self.refusals.note(exc, kind=kind, sampler_id=sampler_id, identity=identity, now=at, **context)
            return Refusal(exc, news, {"kind": kind, "sampler_id": sampler_id,
                                       "key_id": None if identity is None else key_id(identity[0]),
                                       "reason": exc.reason, "detail": exc.detail[:300]})
