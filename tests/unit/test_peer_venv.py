"""A peer's own virtualenv: built once, rebuilt when its requirements change, never marked ready when its
probe fails (a real ``python -m venv``; pip installs only pip itself, which needs no network)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.peers.venv import build_venv

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


def test_built_once_then_reused(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    python = build_venv(venv, ("pip",), probe="print('ok')", what="test", python=PY, timeout_s=300)
    assert python.exists() and (venv / ".flywheel-ready").read_text().strip() == "pip"
    (venv / "sentinel").write_text("kept")
    assert build_venv(venv, ("pip",), probe="raise SystemExit(1)", what="test", python=PY) == python
    assert (venv / "sentinel").exists()  # ready for these requirements: not rebuilt, not probed again


def test_a_failing_probe_is_an_error_and_leaves_it_unready(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    with pytest.raises(RuntimeError, match="(?s)test's virtualenv .* fails its probe: .*no_such_module"):
        build_venv(venv, ("pip",), probe="import no_such_module", what="test", python=PY, timeout_s=300)
    assert not (venv / ".flywheel-ready").exists()


def test_other_requirements_rebuild_it(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    build_venv(venv, ("pip",), probe="print('ok')", what="test", python=PY, timeout_s=300)
    (venv / "sentinel").write_text("old")
    build_venv(venv, ("pip", "setuptools"), probe="import setuptools", what="test", python=PY, timeout_s=300)
    assert not (venv / "sentinel").exists() and (venv / ".flywheel-ready").read_text().strip() == "pip setuptools"
