"""``flywheel`` against the real admin API (uvicorn, the real broker and S3): the contract both sides
code against, end to end. The unit tests (tests/unit/test_cli.py) cover each subcommand in detail."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from services.admin import cli
from services.admin.app import create_app
from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3]
SERVER_LOG = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[|\{\"")  # structlog console or JSON lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _flywheel(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, ["--url", url, *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    # the server runs in this process and logs to the same stdout: keep the CLI's lines only
    out = "".join(x for x in captured.out.splitlines(keepends=True) if not SERVER_LOG.match(x))
    return code, out, captured.err


@contextlib.asynccontextmanager
async def served(state: Any) -> AsyncIterator[str]:
    """The admin API of ``state`` over HTTP (uvicorn, in this loop): its URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(100):
            if server.started:
                break
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_cli_against_the_admin_api(api: Any, run_name: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    _, state = api
    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))  # no token file there
    async with served(state) as url:
        code, out, _ = await _flywheel(capsys, url, "status")
        assert code == 0 and out.startswith(f"run        {run_name}\n") and "trainer    DOWN" in out

        code, out, _ = await _flywheel(capsys, url, "versions")
        assert code == 0 and out.strip() == "no policy has been published yet"

        code, _, err = await _flywheel(capsys, url, "config", "set", "trainer.learning_rate=0.0005")
        assert code == 1 and "401 missing bearer token" in err

        code, out, _ = await _flywheel(capsys, url, "--token", TOKEN, "config", "set", "trainer.learning_rate=0.0005",
                                       "sampler.max_backlog=12")
        assert code == 0 and out.startswith("revision 1\n") and "sampler.max_backlog: " in out and "-> 12" in out

        code, _, err = await _flywheel(capsys, url, "--token", TOKEN, "config", "set", "sampler.max_backlog=many")
        assert code == 1 and "422" in err and "sampler.max_backlog" in err

        code, out, _ = await _flywheel(capsys, url, "config", "get")
        assert code == 0 and out.startswith("revision 1 at ") and "sampler.max_backlog" in out and "= 12" in out

        code, out, _ = await _flywheel(capsys, url, "--token", TOKEN, "config", "revert", "1")
        assert code == 0 and out.startswith("revision 2")

        code, out, _ = await _flywheel(capsys, url, "config", "history")
        assert code == 0 and "(revert to r1)" in out

        code, out, _ = await _flywheel(capsys, url, "--token", TOKEN, "pause")
        assert code == 0 and out.startswith("pause requested for every sampler")

        code, _, err = await _flywheel(capsys, url, "--token", TOKEN, "resume", "no-such-sampler")
        assert code == 1 and "404 unknown sampler" in err

        code, out, _ = await _flywheel(capsys, url, "audit", "--limit", "10")
        assert code == 0 and "config_change" in out and "config_revert" in out and "pause" in out
