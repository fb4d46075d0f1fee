"""The compose stack for real (make test-compose): docker-compose.yml as shipped, on the test engine that
tools/compose/engine.sh starts on its own socket, with the images tools/compose/build.sh built. Nothing here
starts or stops the engine; the Makefile target does, around pytest."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FLYWHEEL_COMPOSE_CACHE", "/var/cache/flywheel-compose"))
TEST_SOCKET = "unix:///run/flywheel-test-docker.sock"
PROJECT = "flywheel-compose-test"
ADMIN_PORT_OVERRIDE = "tools/compose/admin-port.yml"
PUBLISHED = {  # service: (the port docker-compose.yml publishes, the variable and default of the port used when
    # that one is taken on the machine, the override file that publishes it there)
    "admin": (8080, "FLYWHEEL_COMPOSE_ADMIN_PORT", 18080, ADMIN_PORT_OVERRIDE),
    "prometheus": (9090, "FLYWHEEL_COMPOSE_PROMETHEUS_PORT", 19090, "tools/compose/prometheus-port.yml"),
}
# Every service but Grafana, whose image has no stand-in (docs/local-stack.md, "Stand-in images"); the one-shot
# init services (keys, minio-init, kafka-users, kafka-init) come as dependencies.
SERVICES = ["kafka", "minio", "prometheus", "trainer", "paramsync", "admin", "sampler"]
STARTED = time.monotonic()  # when pytest loaded the suite: "the suite took" on the red-team section

# Collected only under `make test-compose` (which starts the test engine and builds the images first), never
# by `make test`.
collect_ignore_glob = [] if os.environ.get("FLYWHEEL_TEST_COMPOSE") == "1" else ["test_*.py"]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, subprocess.SubprocessError, KeyError, TypeError, ValueError) as exc:
            last = repr(exc)
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {str(last)[-1500:]}")


class Compose:
    """`docker compose` on the test engine, for one project."""

    def __init__(self, token: str, moved: dict[str, int] | None = None) -> None:
        """``moved``: service -> the host port it is published on instead of the shipped one (:func:`moved_ports`)."""
        self.token = token
        self.moved = dict(moved or {})
        self.admin_port = self.moved.get("admin", PUBLISHED["admin"][0])
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.env = {**os.environ, "DOCKER_HOST": TEST_SOCKET, "DOCKER_CONFIG": str(CACHE / "docker-config"),
                    "FLYWHEEL_ADMIN_TOKEN": token, "COMPOSE_PROJECT_NAME": PROJECT}
        self.env.update({PUBLISHED[service][1]: str(port) for service, port in self.moved.items()})
        for k in ("COMPOSE_PROFILES", "COMPOSE_FILE"):
            self.env.pop(k, None)

    def files(self) -> list[str]:
        return ["-f", "docker-compose.yml",
                *(f for service in sorted(self.moved) for f in ("-f", PUBLISHED[service][3]))]

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "compose", *self.files(), *args]
        out = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {out.returncode}:\n"
                                 f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def up(self, *extra: str, timeout_s: float = 900) -> None:
        """`up -d` of every service but Grafana, then until each of their containers is running and healthy."""
        self.run("up", "-d", "--no-build", *extra, *SERVICES, timeout=timeout_s)

        def healthy() -> bool | str:
            bad = []
            for service in SERVICES:
                ids = self.containers(service)
                for info in (self.inspect(c) for c in ids):
                    state = info["State"]
                    if not state["Running"] or state.get("Health", {}).get("Status", "healthy") != "healthy":
                        bad.append(f"{service}: {state['Status']}/{state.get('Health', {}).get('Status')}")
                if not ids:
                    bad.append(f"{service}: no container")
            return not bad or "; ".join(bad)
        wait_until(lambda: healthy() is True, timeout_s, "every service running and healthy", interval=5)

    def containers(self, service: str) -> list[str]:
        return [c for c in self.run("ps", "-q", service).stdout.split() if c]

    def inspect(self, container: str) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(self.docker("inspect", container).stdout)[0]
        return info

    def exec(self, service: str, *cmd: str, timeout: float = 300, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``cmd`` in ``service``'s first container; ``env`` set (or replaced) in its environment for this command."""
        flags = [f for k, v in (env or {}).items() for f in ("-e", f"{k}={v}")]
        return self.run("exec", "-T", *flags, service, *cmd, timeout=timeout, check=check)

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.admin}/status", headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def verify(self) -> tuple[int, str]:
        """``flywheel verify`` in the admin container, which has the stack's endpoints and credentials (Kafka and
        MinIO are not published to the host)."""
        out = self.exec("admin", "python", "-m", "services.admin.cli", "verify", timeout=600, check=False)
        return out.returncode, out.stdout + out.stderr

    def logs(self, service: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout


def listener(port: int) -> str:
    """What listens on TCP ``port`` on this machine (``ss``'s line), or ''."""
    return subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout.strip()


def moved_ports(busy: Callable[[int], str], environ: dict[str, str] | None = None) -> dict[str, int]:
    """The published services whose shipped host port is taken (``busy(port)`` non-empty), each with the port it
    is published on instead (its variable in ``environ``, else the default in :data:`PUBLISHED`)."""
    env = os.environ if environ is None else environ
    return {service: int(env.get(var, str(default)))
            for service, (shipped, var, default, _) in PUBLISHED.items() if busy(shipped)}


@pytest.fixture(scope="session")
def redteam() -> Any:
    """The red-team rows this run adds (tests/security/report.py): written into docs/security.md at the end when
    COMPOSE_REPORT=1 (the Makefile's test-compose sets it), as make test-security writes its own."""
    from tests.security.report import AttackRow

    rows: list[AttackRow] = []
    yield rows
    if os.environ.get("COMPOSE_REPORT") == "1" and rows:
        from tests.security.report import write_compose

        minutes = (time.monotonic() - STARTED) / 60
        print(f"\nwrote the compose red-team section of {write_compose(rows, minutes=minutes)}")


@pytest.fixture(scope="session")
def compose() -> Any:
    engine = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                            env={**os.environ, "DOCKER_HOST": TEST_SOCKET})
    if engine.returncode != 0:
        pytest.fail(f"no test engine on {TEST_SOCKET}: run `make test-compose` (tools/compose/engine.sh start)")
    moved = moved_ports(listener)
    for service, port in moved.items():  # e.g. `make up`'s stack or the partition suite's beside the suite: said loudly
        shipped, _, _, override = PUBLISHED[service]
        print(f"\ncompose: 127.0.0.1:{shipped} is taken on this machine ({listener(shipped)}); {service} is "
              f"published on 127.0.0.1:{port} instead ({override})")
    c = Compose(secrets.token_hex(32), moved)
    c.run("down", "-v", "--remove-orphans", check=False)  # what an interrupted run left
    t0 = time.monotonic()
    try:
        c.up()
        print(f"\ncompose: stack up and healthy in {time.monotonic() - t0:.0f} s")
        yield c
    finally:
        c.run("down", "-v", "--remove-orphans", "--timeout", "30", check=False, timeout=300)
