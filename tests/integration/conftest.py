"""Fixtures of the integration tests: the admin API on the real broker and S3."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from services.admin.app import create_app
from services.admin.state import AdminState
from shared.settings import load_settings

TOKEN = "t0ken-for-tests-0123456789abcdefghij"


@pytest.fixture
def admin_bootstrap(kafka_bootstrap: str) -> str:
    """The bootstrap servers admin is given: the broker's (a module may override it to put a proxy in between)."""
    return kafka_bootstrap


@pytest.fixture
async def api(admin_bootstrap: str, s3_endpoint: Any, run_name: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for k, v in s3_endpoint.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    # Reads open, as the local stack has them: these tests read without a token. Closed reads (the default) are
    # tested in tests/unit/test_admin_operators.py and by test_api_schema.py's real admin (schemathesis).
    env = {"FLYWHEEL_RUN": run_name, "FLYWHEEL_KAFKA_BOOTSTRAP": admin_bootstrap, "FLYWHEEL_ADMIN_TOKEN": TOKEN,
           "FLYWHEEL_ADMIN_PUBLIC_READS": "true", "FLYWHEEL_ADMIN_REFRESH_INTERVAL_S": "0.2",
           **{k: v for k, v in s3_endpoint.env().items() if k.startswith("FLYWHEEL_")}}
    settings = load_settings(None, environ=env)
    state = AdminState(settings)
    await state.start()
    stop = asyncio.Event()
    task = asyncio.create_task(state.run(stop))
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        yield client, state
    stop.set()
    await task
    await state.stop()


