"""The policy signing key file (``signing.keys_file``): ``<key id> <secret, hex>`` per line.

A leaf module (standard library only): ``shared.settings`` checks the file at start-up and
:mod:`shared.signing` signs and verifies with its keys, so neither imports the other.
"""

from __future__ import annotations

import re
from pathlib import Path

KEY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
MIN_KEY_BYTES = 32
"""Shortest secret accepted (HMAC-SHA256's block is 64 bytes; 32 random bytes is the usual floor)."""


def parse_keys(text: str, where: str = "signing.keys_file") -> dict[str, bytes]:
    """``<key id> <secret hex>`` per line (``#`` comments and blank lines allowed) -> {key id: secret}.

    Raises ValueError naming ``where`` and the line, never echoing a secret."""
    keys: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{where} line {number}: expected '<key id> <secret, hex>' (2 fields, got {len(parts)})")
        key_id, secret = parts
        if not re.match(KEY_ID_PATTERN, key_id):
            raise ValueError(f"{where} line {number}: key id {key_id!r} must be 1-64 of letters, digits, '.', '_', '-'")
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            raise ValueError(f"{where} line {number}: the secret of key {key_id!r} is not hex") from None
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(f"{where} line {number}: the secret of key {key_id!r} is {len(raw)} bytes, at least "
                             f"{MIN_KEY_BYTES} (generate one: python -c "
                             "'import secrets; print(secrets.token_hex(32))')")
        if key_id in keys:
            raise ValueError(f"{where} line {number}: key id {key_id!r} is listed twice")
        keys[key_id] = raw
    if not keys:
        raise ValueError(f"{where} lists no key")
    return keys


def read_keys(path: Path) -> dict[str, bytes]:
    """The keys in ``path``; ValueError naming ``signing.keys_file`` when it is missing, unreadable or malformed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"signing.keys_file cannot be read: {str(path)!r} ({exc.strerror or exc})") from None
    return parse_keys(text)
