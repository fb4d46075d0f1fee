"""The policy signing key files (docs/security.md, "Signed policies"): Ed25519, one role per key.

``signing.keys_file`` (every service: public keys only)::

    # comments and blank lines allowed
    <key id> <role> <Ed25519 public key, 64 hex>

``signing.private_key_file`` (the trainer's and paramsync's own, never anyone else's): one line
``<key id> <role> <Ed25519 private key seed, 64 hex>``, whose id is listed in ``keys_file`` with the same role.

``role`` is ``trainer`` (signs candidates and checkpoints) or ``paramsync`` (signs the version records and
announcements readers act on). A leaf module (standard library only): ``shared.settings`` checks the files at
start-up and :mod:`shared.signing` does the cryptography, so neither imports the other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["trainer", "paramsync"]
ROLES: tuple[Role, ...] = ("trainer", "paramsync")
KEY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
KEY_BYTES = 32
"""An Ed25519 public key and a private key's seed are both 32 bytes."""
GENERATE_HINT = "generate keys with: flywheel keys init --dir DIR"


def private_key_path(directory: Path, role: Role) -> Path:
    """Where ``flywheel keys init`` keeps ``role``'s private key in a keys directory: ``<dir>/<role>/<role>.key``."""
    return directory / role / f"{role}.key"


def public_keys_path(directory: Path) -> Path:
    """Where ``flywheel keys init`` keeps the public list in a keys directory: ``<dir>/public/public.keys``."""
    return directory / "public" / "public.keys"


@dataclass(frozen=True)
class PublicKeyEntry:
    key_id: str
    role: Role
    public: bytes

    def line(self) -> str:
        return f"{self.key_id} {self.role} {self.public.hex()}"


@dataclass(frozen=True)
class PrivateKeyEntry:
    key_id: str
    role: Role
    seed: bytes

    def __repr__(self) -> str:  # never the secret
        return f"PrivateKeyEntry(key_id={self.key_id!r}, role={self.role!r})"

    def line(self) -> str:
        return f"{self.key_id} {self.role} {self.seed.hex()}"


def _parse_line(line: str, number: int, where: str, what: str) -> tuple[str, Role, bytes]:
    parts = line.split()
    if len(parts) == 2:
        raise ValueError(f"{where} line {number}: 2 fields is the shared-secret (HMAC) format signatures no longer "
                         f"use; expected '<key id> <role> <{what}, hex>' ({GENERATE_HINT})")
    if len(parts) != 3:
        raise ValueError(f"{where} line {number}: expected '<key id> <role> <{what}, hex>' "
                         f"(3 fields, got {len(parts)})")
    key_id, role, value = parts
    if not re.match(KEY_ID_PATTERN, key_id):
        raise ValueError(f"{where} line {number}: key id {key_id!r} must be 1-64 of letters, digits, '.', '_', '-'")
    if role not in ROLES:
        raise ValueError(f"{where} line {number}: role {role!r} of key {key_id!r} is not one of {', '.join(ROLES)}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{where} line {number}: the {what} of key {key_id!r} is not hex") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"{where} line {number}: the {what} of key {key_id!r} is {len(raw)} bytes, an Ed25519 "
                         f"{what} is {KEY_BYTES} ({GENERATE_HINT})")
    return key_id, role, raw


def _lines(text: str) -> list[tuple[int, str]]:
    return [(n, s) for n, line in enumerate(text.splitlines(), 1) if (s := line.strip()) and not s.startswith("#")]


def parse_public_keys(text: str, where: str = "signing.keys_file") -> dict[str, PublicKeyEntry]:
    """{key id: entry}; ValueError naming ``where`` and the line."""
    keys: dict[str, PublicKeyEntry] = {}
    for number, line in _lines(text):
        key_id, role, raw = _parse_line(line, number, where, "public key")
        if key_id in keys:
            raise ValueError(f"{where} line {number}: key id {key_id!r} is listed twice")
        keys[key_id] = PublicKeyEntry(key_id, role, raw)
    if not keys:
        raise ValueError(f"{where} lists no key ({GENERATE_HINT})")
    return keys


def parse_private_key(text: str, where: str = "signing.private_key_file") -> PrivateKeyEntry:
    """The one private key in ``text``; ValueError naming ``where``, never echoing the secret."""
    found = _lines(text)
    if len(found) != 1:
        raise ValueError(f"{where} must hold exactly one key line, it holds {len(found)} ({GENERATE_HINT})")
    number, line = found[0]
    return PrivateKeyEntry(*_parse_line(line, number, where, "private key"))


def _read(path: Path, where: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {str(path)!r} ({exc.strerror or exc})") from None


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600 from the first byte), replacing it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text(text)
    tmp.replace(path)


def read_public_keys(path: Path) -> dict[str, PublicKeyEntry]:
    """The keys in ``path``; ValueError naming ``signing.keys_file`` when missing, unreadable or malformed."""
    return parse_public_keys(_read(path, "signing.keys_file"))


def read_private_key(path: Path) -> PrivateKeyEntry:
    """The key in ``path``; ValueError naming ``signing.private_key_file``."""
    return parse_private_key(_read(path, "signing.private_key_file"))


def check_pair(private: PrivateKeyEntry, public: dict[str, PublicKeyEntry]) -> None:
    """ValueError unless ``private``'s id is listed in ``public`` with the same role (the key itself is compared
    by :class:`shared.signing.KeyRing`, which derives it)."""
    entry = public.get(private.key_id)
    if entry is None:
        raise ValueError(f"signing.private_key_file's key {private.key_id!r} is not listed in signing.keys_file "
                         f"(listed: {', '.join(sorted(public))}): readers could not verify what it signs")
    if entry.role != private.role:
        raise ValueError(f"signing.private_key_file's key {private.key_id!r} has role {private.role!r}, but "
                         f"signing.keys_file lists it as {entry.role!r}")
