"""FastAPI dependencies of the admin API: the state, and who the operator is.

Operators are named: ``admin.tokens_file`` lists ``<name> <sha256 hex of the token>`` a line, and ``admin.token``
(if given) is one more operator named ``admin``. A request's bearer token is hashed and compared in constant time
(:func:`hmac.compare_digest`) with every operator's hash; the name found is what the audit records as the actor and
what the request's log lines carry (``operator``). Writes always need a token; reads need one unless
``admin.public_reads``. No token: 401; a token no operator has: 403. Only with ``admin.insecure_dev`` and no token
at all does the API answer everyone (the actor is then ``anonymous@<client address>``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import structlog
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.admin.refusals import RequestRefusals
from services.admin.state import AdminState
from shared.logging import get_logger
from shared.settings import AdminSettings, ConfigError

LEGACY_OPERATOR = "admin"
"""The operator ``admin.token`` (FLYWHEEL_ADMIN_TOKEN) belongs to."""
OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
"""An operator's name: 1-64 letters, digits, ``.``, ``_``, ``@``, ``-``; not beginning with a punctuation mark."""
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
TOKENS_FIELD = "admin.tokens_file"

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {401: {"description": "No bearer token"},
                                                  403: {"description": "A bearer token no operator has"}}


def token_sha256(token: str) -> str:
    """The hex sha256 of ``token`` as the tokens file lists it."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """``{name: sha256 hex}`` of a tokens file's text; :class:`ConfigError` naming ``admin.tokens_file``, ``source``
    and the line for a malformed line, a name or token listed twice, a hash that is not 64 hex digits, or no
    operator at all. Never echoes a line (a token pasted instead of its hash would be a secret)."""
    found: dict[str, str] = {}
    line_of: dict[str, int] = {}
    by_hash: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{TOKENS_FIELD} ({source}) line {number}"
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected '<operator name> <sha256 hex of the token>', got {len(parts)} "
                              f"field{'s' if len(parts) != 1 else ''}")
        name, digest = parts
        if not OPERATOR_NAME.fullmatch(name):
            raise ConfigError(f"{where}: the operator name is not 1-64 letters, digits, '.', '_', '@' or '-' "
                              "beginning with a letter or digit")
        if not SHA256_HEX.fullmatch(digest):
            raise ConfigError(f"{where}: operator {name!r}: the token hash is not 64 hex digits (sha256) but "
                              f"{len(digest)} characters; 'flywheel tokens add {name} --file F' writes one")
        if name in found:
            raise ConfigError(f"{where}: operator {name!r} is listed twice (first on line {line_of[name]})")
        digest = digest.lower()
        if digest in by_hash:
            raise ConfigError(f"{where}: operator {name!r} has the same token as {by_hash[digest]!r}")
        found[name], line_of[name], by_hash[digest] = digest, number, name
    if not found:
        raise ConfigError(f"{TOKENS_FIELD} ({source}): lists no operator (every line is empty or a comment)")
    return found


def read_tokens_file(path: Path) -> dict[str, str]:
    """:func:`parse_tokens` of the file at ``path``; a file that cannot be read is a :class:`ConfigError` too."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{TOKENS_FIELD}: cannot read {path}: {type(exc).__name__}: {exc}") from None
    return parse_tokens(text, str(path))


@dataclass(frozen=True, repr=False)
class Operators:
    """Who may call the API: operator names and their tokens' sha256 digests (never the tokens)."""

    digests: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_settings(cls, admin: AdminSettings) -> Operators:
        """The operators of ``admin.tokens_file`` and ``admin.token`` (named ``admin``); :class:`ConfigError`
        naming the field on a bad file, or when both name an operator ``admin`` or give the same token."""
        named = read_tokens_file(admin.tokens_file) if admin.tokens_file is not None else {}
        if admin.token is not None:
            digest = token_sha256(admin.token.get_secret_value())
            if LEGACY_OPERATOR in named:
                raise ConfigError(f"{TOKENS_FIELD} lists an operator named {LEGACY_OPERATOR!r}, the name admin.token "
                                  "(FLYWHEEL_ADMIN_TOKEN) has: rename it, or give one of the two")
            if (other := next((n for n, d in named.items() if d == digest), None)) is not None:
                raise ConfigError(f"{TOKENS_FIELD}: operator {other!r} has the token of admin.token "
                                  "(FLYWHEEL_ADMIN_TOKEN)")
            named = {LEGACY_OPERATOR: digest, **named}
        return cls(tuple((name, bytes.fromhex(d)) for name, d in named.items()))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.digests]

    def identify(self, token: str) -> str | None:
        """The operator whose token ``token`` is, or None: every digest is compared, in constant time each."""
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for name, digest in self.digests:
            if hmac.compare_digest(presented, digest) and found is None:
                found = name
        return found

    def __bool__(self) -> bool:
        return bool(self.digests)

    def __repr__(self) -> str:
        return f"Operators({self.names})"


def get_state(request: Request) -> AdminState:
    state: AdminState = request.app.state.admin
    return state


State = Annotated[AdminState, Depends(get_state)]
bearer = HTTPBearer(auto_error=False)


def operators_of(request: Request) -> Operators:
    ops: Operators = request.app.state.operators
    return ops


def _client_host(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _anonymous(request: Request) -> str:
    return f"anonymous@{_client_host(request)}"


def identify(request: Request, creds: HTTPAuthorizationCredentials | None) -> str:
    """The operator ``creds`` name, remembered on the request; 401 without a token, 403 with one no operator has.
    With no operator at all (``admin.insecure_dev``), ``anonymous@<client address>``."""
    ops = operators_of(request)
    if not ops:  # only reachable with admin.insecure_dev=true (checked at start-up)
        name = _anonymous(request)
    elif creds is None:
        raise HTTPException(status_code=401, detail="missing bearer token: send Authorization: Bearer <token>",
                            headers={"WWW-Authenticate": "Bearer"})
    else:
        found = ops.identify(creds.credentials)
        if found is None:
            raise HTTPException(status_code=403, detail="wrong bearer token: it is no operator's")
        name = found
    request.state.operator = name
    return name


async def _identified(request: Request, creds: HTTPAuthorizationCredentials | None, access: str) -> str:
    """:func:`identify`; a refusal is counted, logged and (the first of its client and reason a window) audited as
    ``request_refused`` before the 401/403 goes out (:mod:`services.admin.refusals`)."""
    try:
        return identify(request, creds)
    except HTTPException as exc:
        refusals: RequestRefusals = request.app.state.request_refusals
        params = refusals.note(_client_host(request), exc.status_code, access, request.method, request.url.path)
        if params is not None:
            await get_state(request).append_audit(_anonymous(request), "request_refused", params,
                                                  f"refused {exc.status_code}")
        raise


async def require_token(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> AsyncIterator[str]:
    """Writes: the operator (see :func:`identify`). The request's log lines carry ``operator=<name>``, and one
    ``operator_request`` line says who asked for what."""
    name = await _identified(request, creds, "write")
    with structlog.contextvars.bound_contextvars(operator=name):
        get_logger().info("operator_request", method=request.method, path=request.url.path)
        yield name


async def require_reader(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    """Reads while ``admin.public_reads`` is false: an operator's token, as for writes (no log line per read)."""
    return await _identified(request, creds, "read")


def actor(request: Request) -> str:
    """Who an audit entry names: the operator the request's token belongs to (:func:`identify`)."""
    name = getattr(request.state, "operator", None)
    return name if isinstance(name, str) else _anonymous(request)
