"""The admin API conforms to its own OpenAPI schema: a bounded schemathesis run against the real
admin process (``python -m services.admin``, uvicorn) on the real Kafka and S3.

Every check schemathesis has (``--checks all``) on every generated request, valid and invalid, in all
its phases including the stateful one: no 5xx, every status code, content type, header and response
body as the schema declares, invalid input refused (4xx), schema-valid input accepted (never a 422),
a 405 naming the allowed methods. 25 examples per operation and a fixed seed (printed; set
``FLYWHEEL_SCHEMA_SEED`` to try another), so it stays in ``make test``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import TOKEN

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(480)]
REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("FLYWHEEL_SCHEMA_SEED", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def admin_url(kafka_bootstrap: str, s3_endpoint: Any, run_name: str, tmp_path: Path) -> Iterator[str]:
    """The real admin entrypoint on a free port; stopped with SIGTERM (by its own pid) afterwards."""
    port = _free_port()
    env = {**os.environ, **s3_endpoint.env(), "FLYWHEEL_RUN": run_name, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "FLYWHEEL_ADMIN_TOKEN": TOKEN, "FLYWHEEL_HTTP_HOST": "127.0.0.1", "FLYWHEEL_HTTP_PORT": str(port),
           "FLYWHEEL_ADMIN_REFRESH_INTERVAL_S": "0.5"}
    log = (tmp_path / "admin.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.admin"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"admin did not start: {(tmp_path / 'admin.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGINT if sys.platform == "win32" else signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_schema_declares_errors_content_types_and_constraints(admin_url: str) -> None:
    spec = httpx.get(f"{admin_url}/openapi.json", timeout=10).json()
    paths = spec["paths"]
    error = spec["components"]["schemas"]["ErrorResponse"]
    assert "anyOf" in error["properties"]["detail"] and "detail" in error["required"]
    for path, ops in paths.items():
        for method, op in ops.items():
            for code, resp in op["responses"].items():
                if code.startswith(("4", "5")) and path != "/healthz":  # /healthz's 503 is {"ok": false}
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, code)
    assert "text/plain; version=0.0.4" in str(paths["/metrics"]["get"]["responses"]["200"]["content"])
    param = paths["/trace/{sample_id}"]["get"]["parameters"][0]
    assert param["schema"]["pattern"] == "^[0-9A-Za-z._-]{1,128}$"
    body = paths["/config"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["minProperties"] == 1


def test_bad_requests_get_error_bodies_as_declared(admin_url: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.patch(f"{admin_url}/config", json={}, headers=auth, timeout=10)
    assert r.status_code == 422 and isinstance(r.json()["detail"], list) and r.json()["detail"][0]["msg"]
    r = httpx.patch(f"{admin_url}/config", json={"no.such": 1}, headers=auth, timeout=10)
    assert r.status_code == 422 and "not a runtime setting" in json.dumps(r.json()["detail"])
    r = httpx.get(f"{admin_url}/trace/not-hex!", headers=auth, timeout=10)  # reads need the token here
    assert r.status_code == 422 and isinstance(r.json()["detail"], list)


def test_what_the_schema_allows_is_not_refused_as_invalid(admin_url: str) -> None:
    """The cases schemathesis's full run found (issue 33): each now as the schema says."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.options(f"{admin_url}/config", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "GET, PATCH" and "allowed: GET, PATCH" in r.json()["detail"]
    spec = httpx.get(f"{admin_url}/openapi.json", timeout=10).json()
    body = spec["paths"]["/config"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["additionalProperties"] is False and body["properties"]["trainer.publish_every"]["type"] == "integer"
    r = httpx.patch(f"{admin_url}/config", json={"": []}, headers=auth, timeout=10)  # invalid by the schema now
    assert r.status_code == 422 and "not a runtime setting" in r.json()["detail"]
    r = httpx.patch(f"{admin_url}/config", json={"trainer.publish_every": "2"}, headers=auth, timeout=10)
    assert r.status_code == 422 and "trainer.publish_every" in r.json()["detail"]
    r = httpx.patch(f"{admin_url}/config", json={"trainer.guard.drop": 1.0}, headers=auth, timeout=10)
    assert r.status_code == 409 and "hold_tolerance" in r.json()["detail"]  # valid alone, not with the others
    r = httpx.post(f"{admin_url}/config/revert", json={"revision": 71452.0}, headers=auth, timeout=10)
    assert r.status_code == 404 and "revision 71452 does not exist" in r.json()["detail"]
    r = httpx.post(f"{admin_url}/policy/rollback", json={"version": 997.0}, headers=auth, timeout=10)
    assert r.status_code == 404, r.text
    r = httpx.get(f"{admin_url}/trace/sampler-1", headers=auth, timeout=10)
    assert r.status_code == 404, r.text


def test_schemathesis_finds_no_server_errors_and_no_drift(admin_url: str, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    print(f"schemathesis seed {SEED} (FLYWHEEL_SCHEMA_SEED)")
    cmd = [st, "run", f"{admin_url}/openapi.json", "--checks", "all", "--max-examples", "25", "--seed", str(SEED),
           "--phases", "examples,coverage,fuzzing,stateful", "--request-timeout", "15",
           "--workers", "1", "--no-shrink", "--suppress-health-check", "all",
           "-H", f"Authorization: Bearer {TOKEN}"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420,
                       env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"})
    assert r.returncode == 0, f"schemathesis failed (seed {SEED}):\n{r.stdout[-12000:]}\n{r.stderr[-3000:]}"
    counts = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    print(counts[0] if counts else r.stdout[-500:])
    assert counts and int(counts[1]) > 50 and counts[1] == counts[2], r.stdout[-3000:]
