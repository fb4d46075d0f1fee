"""How one service process of the local stack is launched: its command line and its environment."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from shared.infra.config import InfraEndpoints
from shared.localstack.process import LocalStackError, proc_key
from shared.settings import ConfigError, load_settings

HOST = "127.0.0.1"


def service_command(service: str) -> list[str]:
    """``<this python> -m services.<service>``: what ``process.cmdline_matcher`` recognises."""
    return [sys.executable, "-m", f"services.{service}"]


def service_env(
    base: Mapping[str, str],
    *,
    service: str,
    replica: int,
    port: int,
    home: Path,
    config: Path,
    run: str | None,
    store_backend: str,
    endpoints: InfraEndpoints,
    admin_token: str,
    overrides: Mapping[str, str],
) -> dict[str, str]:
    """``base`` (os.environ) + endpoints + config, run, store, HTTP, sampler id + ``overrides``.

    ``FLYWHEEL_HOME`` is set last: it marks the process as this stack's (see ``find_service``).
    The admin token goes to the admin only.
    """
    key = proc_key(service, replica)
    env = dict(base)
    env.update(endpoints.as_env())
    env["FLYWHEEL_CONFIG"] = str(config)
    if run:
        env["FLYWHEEL_RUN"] = run
    env["FLYWHEEL_STORE_BACKEND"] = store_backend
    if store_backend == "local":
        env["FLYWHEEL_STORE_LOCAL_ROOT"] = str(home / "store")
    env["FLYWHEEL_HTTP_HOST"] = HOST
    env["FLYWHEEL_HTTP_PORT"] = str(port)
    if service == "sampler":
        env["FLYWHEEL_SAMPLER_ID"] = key
    if service == "admin":
        env["FLYWHEEL_ADMIN_TOKEN"] = admin_token
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    env["FLYWHEEL_HOME"] = str(home)
    return env


def validate_config(config: Path, env: Mapping[str, str]) -> None:
    """Load the settings a service would see, before starting any (no torch import: well under 1 s)."""
    try:
        load_settings(config, environ=env)
    except ConfigError as exc:
        raise LocalStackError(str(exc)) from None
