"""A rollback requested while paramsync is down is not lost: it is stored as ``pending`` (the CLI says
so and exits 3), and paramsync applies it when it starts, from a pinned copy of the payload.
Real Kafka and S3; admin served by uvicorn, paramsync in process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
import uvicorn

from services.admin import cli
from services.admin.app import create_app
from services.paramsync.service import Paramsync
from services.trainer.learner import Learner
from shared.marker import VersionedStore, VersionRecord
from shared.rl.envs import fragment_spec
from shared.settings import load_settings
from shared.store import S3Store
from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _rollback_cli(capsys: pytest.CaptureFixture[str], url: str, version: int) -> tuple[int, str]:
    code = await asyncio.to_thread(cli.main, ["--url", url, "--token", TOKEN, "rollback", str(version)])
    out = [x for x in capsys.readouterr().out.splitlines() if x.startswith("rollback to")]
    return code, "\n".join(out)


async def test_rollback_requested_while_paramsync_is_down_is_applied_when_it_starts(
        api: Any, s3_endpoint: Any, kafka_bootstrap: str, run_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    client, state = api
    vs = VersionedStore(S3Store(s3_endpoint.client(), s3_endpoint.bucket), run_name)
    spec = fragment_spec("CartPole-v1", 1 << 20)
    settings = state.settings
    blobs = [Learner(spec, settings.trainer.model_copy(update={"seed": seed})).weights() for seed in (1, 2)]
    assert blobs[0] != blobs[1]
    for v, data in enumerate(blobs, start=1):
        key, sha = vs.put_blob(data)
        vs.publish_next(VersionRecord(version=v, blob=key, sha256=sha, size=len(data), trainer_step=v * 10))
    v1 = vs.records()[0]

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    serving = asyncio.create_task(server.serve())
    paramsync: Paramsync | None = None
    stop = asyncio.Event()
    running: asyncio.Task[None] | None = None
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port}"

        # ---- paramsync is down: stored as pending, the CLI says so and exits 3 ----
        code, out = await _rollback_cli(capsys, url, 1)
        assert code == cli.EXIT_PENDING == 3, out
        assert "pending: paramsync not running" in out
        versions = (await client.get("/policy/versions")).json()
        assert versions["current"] == 2
        [pending] = versions["pending_rollbacks"]
        assert pending["version"] == 1
        stored = json.loads(vs.store.get(f"{run_name}/ops/rollback/{pending['request_id']}.json").data)  # type: ignore[union-attr]
        assert stored["status"] == "pending" and stored["new_version"] is None
        assert vs.read_marker()[0].version == 2  # type: ignore[index]

        # ---- paramsync starts: it applies the stored request and records the outcome ----
        env = {"FLYWHEEL_RUN": run_name, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_bootstrap,
               **{k: v for k, v in s3_endpoint.env().items() if k.startswith("FLYWHEEL_")}}
        paramsync = Paramsync(load_settings(None, environ=env))
        await paramsync.start()
        running = asyncio.create_task(paramsync.run(stop))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and vs.read_marker()[0].version == 2:  # type: ignore[index]
            await asyncio.sleep(0.2)
        marker = vs.read_marker()[0]  # type: ignore[index]
        assert marker.version == 3 and marker.extra["rollback_of"] == 1 and marker.extra["lineage"] == 3
        assert marker.sha256 == v1.sha256 and marker.blob != v1.blob  # a pinned copy: pruning v1 cannot hurt it
        assert vs.fetch(marker) == blobs[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stored = json.loads(vs.store.get(f"{run_name}/ops/rollback/{pending['request_id']}.json").data)  # type: ignore[union-attr]
            if stored["status"] != "pending":
                break
            await asyncio.sleep(0.2)
        assert stored["status"] == "applied" and stored["new_version"] == 3
        assert (await client.get("/policy/versions")).json()["pending_rollbacks"] == []

        # ---- paramsync running: the command applies at once, the CLI reports the version, exit 0 ----
        code, out = await _rollback_cli(capsys, url, 2)
        assert code == 0 and out.endswith("published as v4"), out
        assert vs.read_marker()[0].extra["rollback_of"] == 2  # type: ignore[index]
        audit = [e["outcome"] for e in (await client.get("/audit")).json()["entries"] if e["action"] == "rollback"]
        assert audit[0].startswith("pending: paramsync not running") and audit[1] == "published as version 4"
    finally:
        stop.set()
        if running is not None:
            await running
        if paramsync is not None:
            await paramsync.stop()
        server.should_exit = True
        await serving
