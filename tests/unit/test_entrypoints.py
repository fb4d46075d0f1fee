"""Thin entrypoints: --help and config errors answer fast, before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ["sampler", "trainer", "paramsync", "admin"]


def _run(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    full_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("service", SERVICES)
def test_help_is_fast(service: str) -> None:
    proc, took = _run(["-m", f"services.{service}", "--help"])
    assert proc.returncode == 0 and "--config" in proc.stdout
    assert took < 5, f"--help took {took:.1f}s: something heavy is imported before the config is parsed"


@pytest.mark.parametrize("service", SERVICES)
def test_bad_config_fails_at_start_naming_the_field(service: str) -> None:
    proc, _ = _run(["-m", f"services.{service}", "--config", "configs/cartpole.yaml"],
                   env={"FLYWHEEL_TRAINER_MAX_STALENESS": "-3"})
    assert proc.returncode == 2
    assert "trainer.max_staleness" in proc.stderr


def test_admin_refuses_to_start_without_a_token() -> None:
    proc, _ = _run(["-m", "services.admin", "--config", "configs/cartpole.yaml"])
    assert proc.returncode == 2 and "FLYWHEEL_ADMIN_TOKEN" in proc.stderr


def test_cli_reports_an_unreachable_api() -> None:
    proc, _ = _run(["-m", "services.admin.cli", "--url", "http://127.0.0.1:9", "status"])
    assert proc.returncode == 2 and "cannot reach the admin API" in proc.stderr
