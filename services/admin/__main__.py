"""``python -m services.admin --config configs/cartpole.yaml``: the admin API on http.host:http.port."""

import sys
from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, Any]:
    if settings.admin.token is None and not settings.admin.insecure_dev:
        sys.stderr.write(
            "flywheel admin: admin.token is not set: export FLYWHEEL_ADMIN_TOKEN=<secret> "
            "(or FLYWHEEL_ADMIN_INSECURE_DEV=true for an unauthenticated development server)\n"
        )
        raise SystemExit(2)
    from services.admin.app import create_app
    from services.admin.state import AdminState

    state = AdminState(settings)
    return state, create_app(state)


def main() -> None:
    run_main("admin", build)


if __name__ == "__main__":
    main()
