"""``python -m services.admin --config configs/cartpole.yaml``: the admin API on http.host:http.port."""

import asyncio
import sys

from shared.service import entrypoint


def main() -> None:
    settings = entrypoint("admin")
    if settings.admin.token is None and not settings.admin.insecure_dev:
        sys.stderr.write(
            "flywheel admin: admin.token is not set: export FLYWHEEL_ADMIN_TOKEN=<secret> "
            "(or FLYWHEEL_ADMIN_INSECURE_DEV=true for an unauthenticated development server)\n"
        )
        raise SystemExit(2)
    from services.admin.app import create_app
    from services.admin.state import AdminState
    from shared.service import serve

    async def amain() -> None:
        state = AdminState(settings)  # aiokafka clients need the running loop
        await serve(state, settings, app=create_app(state))

    asyncio.run(amain())


if __name__ == "__main__":
    main()
