"""The package an env id needs: named before any service starts, installed by ``make up``, refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import shared.rl.envs as envs_mod
from devstack import services as devstack_services
from devstack.config import StackError
from shared.rl.envs import EnvPackageMissing, env_extra, missing_extra, register_image_envs

REPO = Path(__file__).resolve().parents[2]
MINATAR_CONFIG = REPO / "configs" / "minatar-breakout.yaml"


@pytest.fixture
def absent(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Modules made to look not installed (``find_spec`` answers None for them)."""
    names: set[str] = set()
    real = envs_mod.importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name in names else real(name, package)

    monkeypatch.setattr(envs_mod.importlib.util, "find_spec", find_spec)
    return names


def test_each_env_family_names_its_extra_and_module() -> None:
    assert env_extra("MinAtar/Breakout-v1") == ("minatar", "minatar")
    assert env_extra("ALE/Pong-v5") == ("atari", "ale_py")
    assert env_extra("HalfCheetah-v5") == ("mujoco", "mujoco")  # from gymnasium's registry entry point
    assert env_extra("CartPole-v1") is None
    assert env_extra("Pendulum-v1") is None


def test_a_missing_package_is_refused_naming_it_and_the_command(absent: set[str]) -> None:
    absent.add("minatar")
    assert missing_extra("MinAtar/Breakout-v1") == ("minatar", "minatar")
    with pytest.raises(EnvPackageMissing) as err:
        register_image_envs("MinAtar/NotRegistered-v1")
    text = str(err.value)
    assert "'minatar'" in text and f"{sys.executable} -m pip install -e '{REPO}[minatar]'" in text
    assert "\n" not in text


def test_an_installed_package_is_not_missing() -> None:
    assert missing_extra("CartPole-v1") is None  # gymnasium alone
    installed = envs_mod.importlib.util.find_spec("ale_py") is not None
    assert missing_extra("ALE/Pong-v5") == (None if installed else ("atari", "ale_py"))


def test_up_refuses_the_config_in_one_line_before_any_service(absent: set[str]) -> None:
    absent.add("minatar")
    with pytest.raises(StackError) as err:
        devstack_services.validate_config(MINATAR_CONFIG, {})
    assert "\n" not in str(err.value)
    assert "MinAtar/Breakout-v1" in str(err.value) and "[minatar]" in str(err.value)


def test_up_installs_with_the_command_it_names_and_still_refuses_when_that_does_not_help(
        absent: set[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    absent.add("minatar")
    ran = tmp_path / "ran"
    monkeypatch.setattr(devstack_services, "install_command",
                        lambda extra: f"{sys.executable} -c \"open('{ran}', 'w').write('{extra}')\"")
    said: list[str] = []
    with pytest.raises(StackError, match="needs the Python package 'minatar'"):
        devstack_services.validate_config(MINATAR_CONFIG, {}, install_extras=True, progress=said.append)
    assert ran.read_text() == "minatar"
    assert said and "installing it" in said[0]


def test_a_failed_install_is_reported_with_its_output(absent: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    absent.add("minatar")
    monkeypatch.setattr(devstack_services, "install_command",
                        lambda extra: f"{sys.executable} -c \"import sys; print('no index'); sys.exit(3)\"")
    with pytest.raises(StackError, match=r"(?s)installing the 'minatar' extra .* failed \(exit 3\).*no index"):
        devstack_services.validate_config(MINATAR_CONFIG, {}, install_extras=True, progress=lambda _: None)
