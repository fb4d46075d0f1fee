"""The admin API's bearer token for a local stack: from the environment, else a file in its home."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from shared.localstack.process import LocalStackError

TOKEN_ENV = "FLYWHEEL_ADMIN_TOKEN"
TOKEN_FILE = "admin-token"


def resolve_admin_token(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """(token, where it comes from): ``env`` / the environment if they set it, else ``<home>/admin-token``.

    The file is created once with a fresh ``secrets.token_urlsafe(32)`` and mode 0600; later calls
    read it, so restarts keep the token. The ``flywheel`` CLI reads the same file.
    """
    for source, mapping in (("the stack's env", env), ("$FLYWHEEL_ADMIN_TOKEN", os.environ)):
        value = mapping.get(TOKEN_ENV)
        if value:
            return value, source
    path = home / TOKEN_FILE
    home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
        token = path.read_text().strip()
        if not token:
            raise LocalStackError(f"{path} is empty; delete it to generate a new admin token") from None
        return token, str(path)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token, str(path)
