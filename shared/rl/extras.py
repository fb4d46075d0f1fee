"""The command that installs one of the project's optional extras (an env's package, EnvPool)."""

from __future__ import annotations

import sys
from pathlib import Path


def install_command(extra: str) -> str:
    """The command that installs the project's ``extra`` into this interpreter's environment."""
    repo = Path(__file__).resolve().parents[2]
    where = f"-e '{repo}[{extra}]'" if (repo / "pyproject.toml").is_file() else f"'flywheel[{extra}]'"
    return f"{sys.executable} -m pip install {where}"
