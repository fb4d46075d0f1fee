"""``flywheel verify`` / ``eval`` / ``export`` against a local stack whose store is the S3 server (``up --store
s3``): the stack's S3 credentials in ``<home>/infra.env`` reach boto3, which reads them from the process
environment (found on the multi-host stack: verify failed "Unable to locate credentials")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.admin.cli import local_settings


def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS_ / FLYWHEEL_ variable, and those local_settings sets are removed again after the test."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "")  # recorded, so undone after the test whoever set it meanwhile
    for k in [k for k in os.environ if k.startswith(("AWS_", "FLYWHEEL_"))]:
        monkeypatch.delenv(k)


def _home(tmp_path: Path) -> Path:
    (tmp_path / "localstack.json").write_text(json.dumps({"store_backend": "s3", "run": "netparts"}))
    (tmp_path / "infra.env").write_text("FLYWHEEL_KAFKA_BOOTSTRAP=10.77.0.11:9092\nFLYWHEEL_S3_ENDPOINT=http://10.77.0.20:9000\n"
                                        "AWS_ACCESS_KEY_ID=stack-key\nAWS_SECRET_ACCESS_KEY=stack-secret\n")
    return tmp_path


def test_the_stacks_s3_credentials_reach_the_process_environment(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _clean(monkeypatch)
    monkeypatch.setenv("FLYWHEEL_HOME", str(_home(tmp_path)))
    settings = local_settings(None)
    assert settings.run == "netparts" and settings.kafka.bootstrap == "10.77.0.11:9092"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "stack-key" and os.environ["AWS_SECRET_ACCESS_KEY"] == "stack-secret"


def test_credentials_of_the_callers_own_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean(monkeypatch)
    monkeypatch.setenv("FLYWHEEL_HOME", str(_home(tmp_path)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    local_settings(None)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "mine"
