"""A peer's own virtualenv, built once: peers that need other library versions than Flywheel's (Sample
Factory 2.1.1 wants numpy < 2 and gymnasium < 1.0; EnvPool is not in Flywheel's environment) run there.

``build_venv`` is idempotent: a marker naming the requirements is written only after ``probe`` (python code
run by the new interpreter) succeeds, so an interrupted or failed build is redone from scratch next time.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def build_venv(venv: Path, requirements: tuple[str, ...], *, probe: str, what: str, python: str = "python3.11",
               timeout_s: float = 3600.0, note: str = "") -> Path:
    """The python of ``venv``, creating it with ``python -m venv`` and installing ``requirements`` first when it
    is missing or was built for other requirements. ``probe`` must exit 0 there (its stdout is reported);
    otherwise RuntimeError names ``what`` and the probe's error."""
    from bench.context import say

    marker = venv / ".flywheel-ready"
    want = " ".join(requirements)
    if marker.exists() and marker.read_text().strip() == want and venv_python(venv).exists():
        return venv_python(venv)
    exe = shutil.which(python)
    if exe is None:
        raise RuntimeError(f"{python} is needed to build {what}'s virtualenv and is not on PATH")
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    say(f"peers: creating {venv} ({want}{'; ' + note if note else ''})")
    subprocess.run([exe, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "--quiet", *requirements], check=True,
                   timeout=timeout_s)
    check = subprocess.run([str(venv_python(venv)), "-c", probe], capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        raise RuntimeError(f"{what}'s virtualenv {venv} fails its probe: {check.stderr[-2000:]}")
    marker.write_text(want + "\n")
    say(f"peers: {what} venv ready ({check.stdout.strip()})")
    return venv_python(venv)
