"""Admin refuses to start with a missing or short token, unless admin.insecure_dev; no server is started."""

from __future__ import annotations

import importlib
import os
import secrets
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from services.admin.__main__ import MIN_TOKEN_LENGTH, admin_token_problem, build
from shared.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
# Where the local launcher generates its token: shared/localstack is moving to devstack/ (either may exist).
LAUNCHER_TOKEN_MODULES = ("devstack.services", "shared.localstack.token")


def _settings(**env: str) -> Settings:
    return load_settings(None, environ={f"FLYWHEEL_ADMIN_{k.upper()}": v for k, v in env.items()})


def test_minimum_is_32() -> None:
    assert MIN_TOKEN_LENGTH == 32


@pytest.mark.parametrize(
    "token",
    ["a" * 32, secrets.token_urlsafe(32), secrets.token_hex(32)],
    ids=["exactly-32", "token_urlsafe-32", "openssl-rand-hex-32"],
)
def test_long_enough_token_is_accepted(token: str) -> None:
    assert admin_token_problem(_settings(token=token).admin) is None


@pytest.mark.parametrize("token", ["x", "t0ken-for-tests", "a" * 31])
def test_short_token_is_refused_naming_the_field(token: str) -> None:
    problem = admin_token_problem(_settings(token=token).admin)
    assert problem is not None and "admin.token" in problem
    assert f"({len(token)} characters, at least 32)" in problem
    assert token not in problem or len(token) == 1, "the message must not echo the token"


def test_missing_token_is_refused_naming_the_variable() -> None:
    problem = admin_token_problem(_settings().admin)
    assert problem is not None and "admin.token" in problem and "FLYWHEEL_ADMIN_TOKEN" in problem


@pytest.mark.parametrize("env", [{"token": "short"}, {}], ids=["short-token", "no-token"])
def test_insecure_dev_waives_the_checks(env: dict[str, str]) -> None:
    assert admin_token_problem(_settings(insecure_dev="true", **env).admin) is None


def test_build_exits_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build(_settings(token="too-short"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flywheel admin: admin.token is too short") and "too-short" not in err


def test_entrypoint_refuses_a_short_token() -> None:
    """The real `python -m services.admin`: the check runs after settings, before any server or Kafka."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_ADMIN_TOKEN"] = "short-token"
    proc = subprocess.run(
        [sys.executable, "-m", "services.admin", "--config", "configs/cartpole.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "admin.token" in proc.stderr and "short-token" not in proc.stderr


def _launcher_token_generators() -> list[ModuleType]:
    found = []
    for name in LAUNCHER_TOKEN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "resolve_admin_token"):
            found.append(module)
    if not found:
        pytest.fail(f"no resolve_admin_token in any of {LAUNCHER_TOKEN_MODULES}: update this test")
    return found


def test_local_launcher_generates_an_accepted_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    for module in _launcher_token_generators():
        home = tmp_path / module.__name__
        token, source = module.resolve_admin_token(home, {})
        assert source == str(home / "admin-token"), module.__name__
        assert len(token) >= MIN_TOKEN_LENGTH, f"{module.__name__}: the token has {len(token)} characters"
        assert admin_token_problem(_settings(token=token).admin) is None


def test_a_generated_token_never_reads_as_an_option_on_the_command_line(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``flywheel --token TOKEN`` with a token beginning "-" failed a CI run ("expected one argument"): one
    ``token_urlsafe`` in 64 begins so. Generated tokens are hex; 200 draws make a "-" start all but certain."""
    from services.admin.cli import build_parser

    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    for module in _launcher_token_generators():
        for i in range(200):
            token, _ = module.resolve_admin_token(tmp_path / module.__name__ / str(i), {})
            assert build_parser().parse_args(["--token", token, "status"]).token == token
