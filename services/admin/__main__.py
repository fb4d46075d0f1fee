"""``python -m services.admin --config configs/cartpole.yaml``: the admin API on http.host:http.port."""

import sys
from typing import Any

from shared.service import run_main
from shared.settings import AdminSettings, ConfigError, Settings

MIN_TOKEN_LENGTH = 32
"""Shortest admin token accepted outside insecure dev mode (``openssl rand -hex 32`` gives 64)."""


def admin_token_problem(admin: AdminSettings) -> str | None:
    """Why admin must not start with these settings, or None. ``admin.insecure_dev`` waives both checks (no
    operator at all; a short token). The tokens file is read and checked by :func:`build`."""
    if admin.insecure_dev:
        return None
    if admin.token is None and admin.tokens_file is None:
        return (
            "neither admin.token nor admin.tokens_file is set: export FLYWHEEL_ADMIN_TOKEN=<secret>, or list named "
            "operators in a file (flywheel tokens add NAME --file F) and set FLYWHEEL_ADMIN_TOKENS_FILE=F "
            "(or FLYWHEEL_ADMIN_INSECURE_DEV=true for an unauthenticated development server)"
        )
    if admin.token is None:
        return None
    length = len(admin.token.get_secret_value())
    if length < MIN_TOKEN_LENGTH:
        return (
            f"admin.token is too short ({length} characters, at least {MIN_TOKEN_LENGTH}): generate one with "
            "`openssl rand -hex 32` or `python -c 'import secrets; print(secrets.token_hex(32))'` "
            "(or FLYWHEEL_ADMIN_INSECURE_DEV=true for a development server)"
        )
    return None


def build(settings: Settings) -> tuple[Any, Any]:
    problem = admin_token_problem(settings.admin)
    if problem is not None:
        sys.stderr.write(f"flywheel admin: {problem}\n")
        raise SystemExit(2)
    from services.admin.app import create_app
    from services.admin.deps import Operators
    from services.admin.state import AdminState
    from shared.logging import get_logger

    try:
        operators = Operators.from_settings(settings.admin)  # names admin.tokens_file on a bad file
    except ConfigError as exc:
        sys.stderr.write(f"flywheel admin: invalid configuration: {exc}\n")
        raise SystemExit(2) from None
    get_logger().info("admin_operators", operators=operators.names, public_reads=settings.admin.public_reads,
                      tokens_file=str(settings.admin.tokens_file) if settings.admin.tokens_file else None)
    state = AdminState(settings)
    return state, create_app(state, operators)


def main() -> None:
    run_main("admin", build)


if __name__ == "__main__":
    main()
