"""Every protection turned off is named (shared.posture, issue 43 item 2): by each service's log at start
(``protection_off``), and by the admin's /status and ``flywheel status``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from services.admin.app import create_app
from services.admin.cli_format import render_status
from services.admin.state import AdminState
from shared.bus import MemoryBus
from shared.posture import protections_off
from shared.settings import Settings, load_settings
from shared.signing import generate_keys

REPO = Path(__file__).resolve().parents[2]


def settings_of(env: dict[str, str]) -> Settings:
    return load_settings(None, environ=env)


def hardened(tmp_path: Path) -> dict[str, str]:
    keys = generate_keys(tmp_path / "keys")
    return {"FLYWHEEL_SIGNING_ENABLED": "true", "FLYWHEEL_SIGNING_KEYS_FILE": str(keys["public"]),
            "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "FLYWHEEL_KAFKA_SASL_USERNAME": "sampler",
            "FLYWHEEL_KAFKA_SASL_PASSWORD": "a-password", "FLYWHEEL_S3_ENDPOINT": "https://s3.example:9000"}


def test_nothing_is_named_where_every_protection_is_on(tmp_path: Path) -> None:
    s = settings_of(hardened(tmp_path))
    assert all(protections_off(service, s) == [] for service in ("trainer", "paramsync", "sampler", "admin"))


def test_each_protection_turned_off_is_named_for_the_services_it_weakens(tmp_path: Path) -> None:
    base = hardened(tmp_path)
    cases = {
        "signing.enabled=false": ({"FLYWHEEL_SIGNING_ENABLED": "false", "FLYWHEEL_SIGNING_KEYS_FILE": ""},
                                  {"trainer", "paramsync", "sampler", "admin"}),
        "kafka.security_protocol=PLAINTEXT": ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
                                               "FLYWHEEL_KAFKA_SASL_USERNAME": "", "FLYWHEEL_KAFKA_SASL_PASSWORD": ""},
                                              {"trainer", "paramsync", "sampler", "admin"}),
        "kafka.security_protocol=SASL_PLAINTEXT": ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"},
                                                   {"trainer", "paramsync", "sampler", "admin"}),
        "s3.endpoint=http://minio:9000": ({"FLYWHEEL_S3_ENDPOINT": "http://minio:9000"},
                                          {"trainer", "paramsync", "sampler", "admin"}),
        "sampler.identity=false": ({"FLYWHEEL_SAMPLER_IDENTITY": "false"}, {"sampler"}),
        "admin.insecure_dev=true": ({"FLYWHEEL_ADMIN_INSECURE_DEV": "true"}, {"admin"}),
        "admin.public_reads=true": ({"FLYWHEEL_ADMIN_PUBLIC_READS": "true"}, {"admin"}),
    }
    for setting, (change, weakened) in cases.items():
        env = {k: v for k, v in {**base, **change}.items() if v != ""}
        s = settings_of(env)
        for service in ("trainer", "paramsync", "sampler", "admin"):
            named = [o.setting for o in protections_off(service, s)]
            assert named == ([setting] if service in weakened else []), (setting, service, named)


def test_a_service_logs_each_protection_off_at_start(tmp_path: Path) -> None:
    log = tmp_path / "sampler.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update({"FLYWHEEL_LOG_FILE": str(log), "FLYWHEEL_SAMPLER_IDENTITY": "false",
                "FLYWHEEL_STORE_BACKEND": "local", "FLYWHEEL_STORE_LOCAL_ROOT": str(tmp_path / "store")})
    out = subprocess.run([sys.executable, "-c", "from shared.service import entrypoint; entrypoint('sampler', [])"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    off = [(e["setting"], e["level"]) for e in events if e.get("event") == "protection_off"]
    assert off == [("signing.enabled=false", "warning"), ("kafka.security_protocol=PLAINTEXT", "warning"),
                   ("sampler.identity=false", "warning")], events


async def test_status_and_the_cli_name_the_admins_protections_off(tmp_path: Path) -> None:
    s = settings_of({"FLYWHEEL_ADMIN_INSECURE_DEV": "true", "FLYWHEEL_STORE_BACKEND": "local",
                     "FLYWHEEL_STORE_LOCAL_ROOT": str(tmp_path)})
    app = create_app(AdminState(s, bus=MemoryBus().bus()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
        status = (await client.get("/status")).json()
    assert [o["setting"] for o in status["security"]["protections_off"]] == [
        "signing.enabled=false", "kafka.security_protocol=PLAINTEXT", "admin.insecure_dev=true"]
    text = render_status(status)
    assert "security   3 protection(s) off" in text and "  admin.insecure_dev=true: the admin API checks no token" \
        in text, text
