"""deploy/k8s/signing-keys.sh (docs/kubernetes.md, "Signing keys"), against a stand-in kubectl that records what it
is asked: three Secrets, each holding what `flywheel keys init` made, the private keys in their own role's Secret
only, and nothing replaced when one exists."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shared.keyfile import parse_private_key, parse_public_keys

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "k8s" / "signing-keys.sh"

KUBECTL = """#!/usr/bin/env bash
# get: exit 0 when $EXISTING names the secret; create: copy each --from-file into $OUT/<secret>/<key>.
if [ "$3" = get ]; then [ "$5" = "${EXISTING:-}" ]; exit; fi
name=$6; mkdir -p "$OUT/$name"
for arg in "$@"; do
  case "$arg" in --from-file=*) spec=${arg#--from-file=}; cp "${spec#*=}" "$OUT/$name/${spec%%=*}";; esac
done
"""


def run(tmp_path: Path, existing: str = "") -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "kubectl").write_text(KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "EXISTING": existing, "FLYWHEEL": str(REPO / ".venv" / "bin" / "flywheel")}
    return subprocess.run(["bash", str(SCRIPT), "flywheel"], env=env, capture_output=True, text=True, timeout=120)


def test_three_secrets_each_role_its_own_private_key(tmp_path: Path) -> None:
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "flywheel-paramsync-signing-key", "flywheel-signing-public", "flywheel-trainer-signing-key"]
    public = parse_public_keys((out / "flywheel-signing-public" / "public.keys").read_text())
    for role in ("trainer", "paramsync"):
        files = list((out / f"flywheel-{role}-signing-key").iterdir())
        assert [f.name for f in files] == [f"{role}.key"]
        private = parse_private_key(files[0].read_text())
        assert private.role == role and public[private.key_id].role == role
    assert [f.name for f in (out / "flywheel-signing-public").iterdir()] == ["public.keys"]


def test_an_existing_secret_is_never_replaced(tmp_path: Path) -> None:
    proc = run(tmp_path, existing="flywheel-trainer-signing-key")
    assert proc.returncode == 1 and "flywheel-trainer-signing-key exists" in proc.stderr
    assert not (tmp_path / "out").exists()
