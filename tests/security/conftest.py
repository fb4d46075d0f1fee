"""The red-team suite's stack (``make test-security``, issue 43 item 6): one local stack as the project starts it,
signed by default (devstack generates the run's keys under ``<home>/policy-keys/<run>/``, the trainer and
paramsync alone get a private key, every other service the public keys), CartPole, 2 samplers, shared by every
row in file order. It is the fault suite's stack (:func:`tests.faults.conftest.fault_stack`: its own Kafka and
moto S3 on ports of their own, the services under the local stack's supervisor), so the same helpers read it.

Each row makes one attack from outside the services, then checks that it was refused (and by whom), that an
audit entry says so where one is expected, that training goes on (the trainer's updates and the published
version both advance after it) and that ``flywheel verify`` exits 0. ``SECURITY_REPORT=1`` (``make
test-security``) writes the rows into ``docs/security.md``'s generated section (``tests/security/report.py``);
a row whose test fails is written as ``FAILED`` with the reason: the page never drops an attack that got
through. The suite runs only when selected with ``-m security`` (``make test`` collects and skips it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.faults.conftest import FaultEnv, fault_stack
from tests.faults.liveness import read_healthz
from tests.faults.report import pytest_runtest_makereport, unrecorded_outcome  # noqa: F401 (a hook)
from tests.hosts.conftest import selected
from tests.security.report import AttackRow

KAFKA_PORT, CONTROLLER_PORT, S3_PORT, S3_PROXY_PORT = 19992, 19993, 19900, 19901
ADMIN_PORT = 18200
TRAINING_GOES_ON_S = 120.0
"""How long the trainer's updates and the published version may take to advance after an attack."""


@dataclass
class SecurityEnv:
    fault: FaultEnv
    rows: list[AttackRow] = field(default_factory=list)
    attack: str = ""
    """The current row's attack, as the page names it (its test's ``attack`` mark)."""

    @property
    def run(self) -> str:
        return self.fault.run

    def say(self, msg: str) -> None:
        self.fault.say(msg)

    # ---- reading the stack, as an operator with the token -------------------------------------------
    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.fault.stack.admin_token}"}

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.fault.stack.admin_url}{path}", params=params, headers=self.auth(), timeout=30)
        r.raise_for_status()
        return r.json()

    def audit(self) -> list[dict[str, Any]]:
        """The run's audit trail, oldest first (with the token: reads may be closed)."""
        entries: list[dict[str, Any]] = self.get("/audit", limit=10_000)["entries"]
        return entries

    def wait_audit(self, match: Callable[[dict[str, Any]], bool], n: int, timeout_s: float,
                   what: str) -> list[dict[str, Any]]:
        """The first ``n`` audit entries ``match`` accepts, once there are that many; fails naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.audit() if match(e)]
            if len(found) >= n or time.monotonic() > deadline:
                assert len(found) >= n, f"no audit entry says {what} within {timeout_s:.0f} s (found {found})"
                return found[:n]
            time.sleep(1.0)

    def progress(self) -> tuple[int, int]:
        """The trainer's updates and the published version, from ``/status``."""
        st = self.fault.status()
        return int(st["trainer"]["updates"] or 0), int(st["policy"]["version"] or -1)

    def sampler_versions(self) -> dict[str, int | None]:
        """Each sampler's policy version, from its own ``/healthz`` (``None``: none yet, or not answering)."""
        out: dict[str, int | None] = {}
        for name, url in self.fault.sampler_urls().items():
            v = read_healthz(url).get("policy_version")
            out[name] = None if v is None else int(v)
        return out

    def watch_samplers(self, seconds: float, bad: Callable[[str, int | None, int | None], str | None]) -> str:
        """Read every sampler's version every 0.5 s for ``seconds``; ``bad(name, before, now)`` says what is wrong
        with a reading (None: nothing). Fails with the first wrong one; returns what was seen (first -> last)."""
        first = self.sampler_versions()
        last, deadline = first, time.monotonic() + seconds
        while time.monotonic() < deadline:
            last = self.sampler_versions()
            for name, v in last.items():
                if (why := bad(name, first.get(name), v)) is not None:
                    raise AssertionError(f"{name}: {why} (versions {first} -> {last})")
            time.sleep(0.5)
        return ", ".join(f"{n} v{first.get(n)} -> v{v}" for n, v in sorted(last.items()))

    # ---- a row's checks after its attack --------------------------------------------------------------
    def training_goes_on(self, before: tuple[int, int], timeout_s: float = TRAINING_GOES_ON_S) -> str:
        """Wait until the trainer's updates and the published version both passed ``before``; the row's cell."""
        t0 = time.monotonic()
        now = self.progress()
        while not (now[0] > before[0] and now[1] > before[1]):
            assert time.monotonic() - t0 < timeout_s, (
                f"training did not go on within {timeout_s:.0f} s: updates {before[0]} -> {now[0]}, published "
                f"{before[1]} -> {now[1]} (trainer log: {self.fault.stack.log_path('trainer')})")
            time.sleep(0.5)
            now = self.progress()
        return (f"updates {before[0]} -> {now[0]}, published v{before[1]} -> v{now[1]} "
                f"({time.monotonic() - t0:.1f} s)")

    def finish(self, *, refused: str, audit: str, before: tuple[int, int], note: str = "") -> None:
        """The end of every row: training goes on, ``flywheel verify`` exits 0; the row is added, then asserted."""
        attack = self.attack
        training = self.training_goes_on(before)
        code, out = self.fault.verify()
        self.say(f"[{attack}] flywheel verify exit {code}:\n{out}")
        ok = code == 0
        self.rows.append(AttackRow(attack, "ok" if ok else "FAILED", refused, audit, training,
                                   "ok" if ok else f"FAILED (exit {code})", note))
        assert ok, f"flywheel verify failed after {attack}:\n{out}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only with ``-m security``: ``make test`` collects this directory and skips it (minutes, its own stack)."""
    if selected(config.option.markexpr or "", "security"):
        return
    skip = pytest.mark.skip(reason="the red-team suite (its own stack, minutes): make test-security (-m security)")
    for item in items:
        if item.get_closest_marker("security"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def security_env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[SecurityEnv]:
    with fault_stack(tmp_path_factory.mktemp("security"), request, label="security", kafka_port=KAFKA_PORT,
                     controller_port=CONTROLLER_PORT, s3_port=S3_PORT, s3_proxy_port=S3_PROXY_PORT,
                     admin_port=ADMIN_PORT) as fault:
        env = SecurityEnv(fault)
        try:
            yield env
        finally:
            if os.environ.get("SECURITY_REPORT") == "1" and env.rows:
                from tests.security.report import write_security

                path = write_security(env.rows, fault.seed, minutes=(time.monotonic() - fault.started) / 60)
                env.say(f"wrote the red-team section of {path}")


@pytest.fixture(autouse=True)
def _row_for_every_attack(request: pytest.FixtureRequest) -> Iterator[None]:
    """An attack whose test fails (or xfails) before it added its row gets one anyway, marked so."""
    env: SecurityEnv | None = request.getfixturevalue("security_env") \
        if "security_env" in request.fixturenames else None
    before = len(env.rows) if env is not None else 0
    if env is not None:
        env.attack = str(getattr(request.node.function, "attack", request.node.name))
    yield
    if env is None or len(env.rows) != before or (unrecorded := unrecorded_outcome(request)) is None:
        return
    _name, outcome, reason = unrecorded
    env.rows.append(AttackRow(env.attack, outcome, note=reason))
