"""The local overlay on a real cluster (make test-k8s): the single-node cluster tools/k8s/cluster.sh starts in
network namespace flywheel-k8s, with the images tools/k8s/images.sh imported. Nothing here starts or stops the
cluster; tools/k8s/run.sh does, around pytest. Each test appends what it saw to the report (FLYWHEEL_K8S_REPORT),
which run.sh prints and docs/kubernetes.md quotes."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compose.conftest import wait_until  # the same waiting rule as the compose suite

__all__ = ["Cluster", "wait_until"]

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "tools" / "k8s" / "cluster.sh"
STATE = Path(os.environ.get("FLYWHEEL_K8S_STATE", "/var/lib/flywheel-k8s"))
NAMESPACE = "flywheel"
OVERLAY = "deploy/k8s/overlays/local"

# Collected only under `make test-k8s` (which starts the cluster first), never by `make test`.
collect_ignore_glob = [] if os.environ.get("FLYWHEEL_TEST_K8S") == "1" else ["test_*.py"]


class Cluster:
    """kubectl and commands inside the cluster's network namespace (tools/k8s/cluster.sh)."""

    def __init__(self, token: str, report: Path) -> None:
        self.token = token
        self.report_path = report
        # deploy/k8s/signing-keys.sh calls `kubectl`: this one, through cluster.sh.
        self.bin = STATE / "test-bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin / "kubectl"
        wrapper.write_text(f'#!/bin/sh\nexec {CLUSTER} kubectl "$@"\n')
        wrapper.chmod(0o755)

    def run(self, *args: str, timeout: float = 300, check: bool = True,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"}
        out = subprocess.run(list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                             input=stdin)
        if check and out.returncode != 0:  # a SubprocessError: wait_until retries it
            raise subprocess.CalledProcessError(out.returncode, " ".join(args), out.stdout[-3000:], out.stderr[-3000:])
        return out

    def kubectl(self, *args: str, timeout: float = 300, check: bool = True,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(str(CLUSTER), "kubectl", *args, timeout=timeout, check=check, stdin=stdin)

    def ns(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("-n", NAMESPACE, *args, timeout=timeout, check=check)

    def get(self, *args: str) -> Any:
        return json.loads(self.ns("get", *args, "-o", "json").stdout)

    def admin_url(self) -> str:
        """The admin API through its Service: the ClusterIP, which kube-proxy's rules send to the pod."""
        ip = self.ns("get", "service", "flywheel-admin", "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
        return f"http://{ip}:8080"

    def status(self) -> dict[str, Any]:
        """GET /status from inside the cluster's network namespace, through the Service."""
        code = ("import httpx, sys; r = httpx.get(sys.argv[1] + '/status', timeout=10, "
                "headers={'Authorization': 'Bearer ' + sys.argv[2]}); r.raise_for_status(); print(r.text)")
        out = self.run(str(CLUSTER), "exec", str(REPO / ".venv/bin/python"), "-c", code, self.admin_url(), self.token,
                       timeout=60)
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def verify(self) -> tuple[int, str]:
        """``flywheel verify`` in the admin pod, as an operator runs it (``kubectl exec deploy/flywheel-admin``)."""
        out = self.ns("exec", "deploy/flywheel-admin", "--", "python", "-m", "services.admin.cli", "verify",
                      timeout=600, check=False)
        return out.returncode, out.stdout + out.stderr

    def pod(self, selector: str) -> dict[str, Any]:
        """The one pod of ``selector`` that is not being deleted (KeyError while there is not exactly one)."""
        pods = [p for p in self.get("pods", "-l", selector)["items"] if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != 1:
            raise KeyError(f"{selector}: {[p['metadata']['name'] for p in pods]}")
        return pods[0]

    def report(self, line: str) -> None:
        print(line)
        with self.report_path.open("a") as fh:
            fh.write(line + "\n")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    report = Path(os.environ.get("FLYWHEEL_K8S_REPORT", str(STATE / "report.md")))
    c = Cluster(secrets.token_hex(32), report)
    nodes = c.kubectl("get", "nodes", "-o", "json", timeout=30)
    node = json.loads(nodes.stdout)["items"][0]
    c.report(f"- cluster: node {node['metadata']['name']}, kubelet {node['status']['nodeInfo']['kubeletVersion']}, "
             f"runtime {node['status']['nodeInfo']['containerRuntimeVersion']}, "
             f"kernel {node['status']['nodeInfo']['kernelVersion']}")
    yield c
