"""The fault-injection suite's stack: its own Kafka (so a test can kill it), moto S3 behind a proxy
(so the endpoint can go down while the objects stay), and the four services under the supervisor.

Faults are injected from outside the processes: signals, stopping and restarting Kafka, closing the
S3 endpoint, another member joining the trainer's consumer group, poison records on the topic. Random
points come from one seed, logged at the start (``FAULT_SEED=<n>`` replays a run).

``make test`` runs the tests marked ``faults`` only; ``make test-faults`` runs the whole suite
(``faults_full`` too; CI runs it after ``make test``) and writes ``docs/reliability.md`` from what it
measured: one row per fault test, a failed or xfailed test included (marked so), with the commit it ran on.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import devstack
from devstack import kafka as devkafka
from shared.kafka import Topics, trainer_group
from shared.store import ObjectStore, S3Store
from tests.faults.accounting import Accounting, account_now
from tests.faults.liveness import Back, SamplersBack, assert_back, not_applicable
from tests.faults.proxy import TcpProxy
from tests.faults.report import pytest_runtest_makereport, unrecorded_outcome  # noqa: F401 (a hook)

KAFKA_PORT, CONTROLLER_PORT, S3_PORT, S3_PROXY_PORT = 19392, 19393, 19300, 19301
REPO = Path(__file__).resolve().parents[2]
ADMIN_PORT = 18700
RECOVERY_GOAL_S = 30.0
LOG_CAP = 64 * 1024
"""A small log cap, so files rotate during the suite, make test's ~3-minute quick subset included (its
trainer wrote under 256 KiB there once, so a 256 KiB cap proved nothing); services keep every backup here
(the accounting reads all of them), a real stack keeps 3."""


@dataclass
class Row:
    fault: str
    outcome: str
    recover_s: float | None
    lost: int | None  # None: not accounted (the test failed before it could)
    trained_twice: int | None
    restarts: dict[str, int]
    note: str = ""
    verify: str = "-"
    """``flywheel verify``'s outcome after the fault: ``ok``, ``FAILED (exit n)``, or ``-`` (not run)."""
    samplers: str = "-"
    """Each sampler's seconds from the heal to its first fragment after it (:mod:`tests.faults.liveness`), or why
    the row has no such check."""


@dataclass
class FaultEnv:
    stack: devstack.LocalStack
    infra_home: Path
    proxy: TcpProxy
    endpoints: devstack.InfraEndpoints
    run: str
    seed: int
    rng: random.Random
    say: Callable[[str], None]
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    back: Back | None = None
    """The current row's samplers' liveness after its heal(s) (reset for every test)."""
    deleted: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Spans of ``<run>.samples`` deleted on purpose before the trainer read them (the lost-records row), per
    partition: the accounting counts them as deleted, and ``flywheel verify`` names them from then on."""

    # ---- reading the stack ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.stack.admin_url}/status", timeout=10)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def published(self) -> int:
        try:
            return int(self.status()["policy"]["version"] or -1)
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return -1

    def wait_version_advances(self, beyond: int, timeout_s: float) -> float:
        """Seconds until the published version passes ``beyond``; raises on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.published() > beyond:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise AssertionError(f"the published version did not pass {beyond} within {timeout_s:.0f} s "
                             f"(trainer log: {self.stack.log_path('trainer')})")

    def audit(self) -> list[dict[str, Any]]:
        """Every entry of the run's audit trail (``GET /audit``), oldest first."""
        r = httpx.get(f"{self.stack.admin_url}/audit", params={"limit": 10_000}, timeout=30)
        r.raise_for_status()
        entries: list[dict[str, Any]] = r.json()["entries"]
        return entries

    def cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """``flywheel <args>`` against this stack's admin, as an operator runs it."""
        cmd = [sys.executable, "-m", "services.admin.cli", "--url", self.stack.admin_url,
               f"--token={self.stack.admin_token}", *args]  # "=": a token may begin with "-"
        return subprocess.run(cmd, env=self.stack.service_env("admin"), capture_output=True, text=True,
                              timeout=timeout_s, cwd=REPO)

    def store(self) -> ObjectStore:
        """The run's object store, through the S3 proxy the services use."""
        return s3_store(self.endpoints)

    def restarts(self) -> dict[str, int]:
        return {k: v for k, v in self.stack.restarts().items() if v}

    def wait_restarted(self, before: dict[str, int], timeout_s: float) -> dict[str, int]:
        """The supervisor's restart counts once every process named in ``before`` shows more restarts than
        there, or when ``timeout_s`` has passed (the caller asserts what it expects of them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            after = self.stack.restarts()
            if all(after.get(name, 0) > n for name, n in before.items()) or time.monotonic() >= deadline:
                return after
            time.sleep(0.2)

    # ---- liveness ---------------------------------------------------------------------------
    def sampler_urls(self) -> dict[str, str]:
        return {f"sampler-{r}": f"http://127.0.0.1:{self.stack.port('sampler', r)}/healthz"
                for r in self.stack.state.samplers()}

    def watch_samplers(self, paused: dict[str, str] | None = None) -> SamplersBack:
        """At a heal: start watching every sampler of the stack (but ``paused``, name -> why) for its next
        fragment (:class:`SamplersBack`); :meth:`samplers_back` takes the result."""
        return SamplersBack(self.sampler_urls(), paused=paused or {})

    def samplers_back(self, watch: SamplersBack) -> Back:
        """Every watched sampler produced again within the bound (the row fails naming one that did not, with its
        ``/healthz`` reasons); a row with several heals keeps each sampler's worst."""
        back = watch.result()
        self.back = back if self.back is None else self.back.worst(back)
        self.say(f"samplers back after the heal: {back.cell()}")
        assert_back(back, "after the heal")
        return back

    def samplers_cell(self, samplers_na: str | None) -> str:
        if self.back is not None:
            return self.back.cell()
        assert samplers_na, "the row checked neither its samplers' liveness (samplers_back) nor said why not"
        return not_applicable(samplers_na)

    def account(self) -> Accounting:
        topic = Topics.for_run(self.run).samples
        return account_now(self.endpoints.kafka_bootstrap, topic, trainer_group(self.run),
                           self.stack.log_path("trainer"), self.deleted)

    def verify_problems(self, out: str) -> list[str]:
        """``flywheel verify``'s problems (``partition: problem``) but the loss of the spans this suite deleted on
        purpose (:attr:`deleted`), which verify must keep naming, exactly, for the rest of the run."""
        topic = re.escape(Topics.for_run(self.run).samples)
        partition: int | None = None
        out_of_place, named = [], set()
        for line in out.splitlines():
            if m := re.match(rf"  {topic}:(\d+) \[", line):
                partition = int(m[1])
            elif line.startswith("    - "):
                problem = line.removeprefix("    - ")
                if partition in self.deleted and problem == lost_line(self.deleted[partition]):
                    named.add(partition)
                    continue
                out_of_place.append(f"{partition}: {problem}")
        unnamed = [f"{p}: not named as lost: {lost_line(spans)}" for p, spans in sorted(self.deleted.items())
                   if p not in named]
        return out_of_place + unnamed

    def verify_cell(self, code: int, out: str) -> tuple[bool, str]:
        """Whether verify's outcome is the expected one, and the row's *verify* cell: exit 0; or, once records were
        deleted on purpose, exit 1 naming exactly those spans lost and nothing else."""
        if code == 0:
            return True, "ok"
        if code == 1 and self.deleted and "verify: FAILED" in out and not self.verify_problems(out):
            n = sum(hi - lo for spans in self.deleted.values() for lo, hi in spans)
            return True, (f"exit 1 as expected: names only the {n} records deleted on purpose "
                          f"(partitions {', '.join(map(str, sorted(self.deleted)))})")
        return False, f"FAILED (exit {code})"

    def verify(self) -> tuple[int, str]:
        """``flywheel verify`` on the newest checkpoint, as an operator runs it: the proof from the artifact
        (the checkpoint's ledger against the topics), independent of the trainer's log lines."""
        env = self.stack.service_env("admin")
        proc = subprocess.run([sys.executable, "-m", "services.admin.cli", "verify"], env=env, capture_output=True,
                              text=True, timeout=180, cwd=REPO)
        return proc.returncode, (proc.stdout + proc.stderr).strip()

    def check_accounting(self, fault: str, recover_s: float | None, note: str = "", *,
                         drained: bool = False, samplers_na: str | None = None,
                         lost: int | None = None) -> Accounting:
        """Account for every record so far and run ``flywheel verify``; add the row. ``drained``: nothing is in
        flight, so every record on the topic must have an outcome, each accounted once
        (:meth:`Accounting.every_record_once`), not only those below the committed offsets. The row must have
        checked its samplers' liveness after its heal (:meth:`samplers_back`), or say why not (``samplers_na``).
        ``lost``: the row's *records lost* when it deleted records on purpose (its own check proved them)."""
        samplers = self.samplers_cell(samplers_na)
        acc = self.account()
        self.say(f"[{fault}] accounting: {acc.summary()}")
        code, out = self.verify()
        self.say(f"[{fault}] flywheel verify exit {code}:\n{out}")
        problems = acc.problems() + (acc.every_record_once() if drained else [])
        verified, cell = self.verify_cell(code, out)
        ok = not problems and verified
        self.rows.append(Row(fault, "ok" if ok else "FAILED", recover_s,
                             len(acc.missing) if lost is None else lost + len(acc.missing),
                             len(acc.trained_twice_in_a_run), self.restarts(), note, cell, samplers))
        assert not problems, problems
        assert verified, (f"flywheel verify failed after {fault} (unexpected: {self.verify_problems(out)}):\n{out}")
        return acc

    # ---- faults ---------------------------------------------------------------------------
    def kafka_pid(self) -> int | None:
        cfg = devstack.InfraConfig.resolve(self.infra_home, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, None)
        return devkafka.proc(cfg).pid()

    def kill_kafka(self) -> None:
        pid = self.kafka_pid()
        assert pid is not None, "the fault suite's Kafka is not running"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while self.kafka_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.say(f"kafka (pid {pid}) killed with SIGKILL")

    def start_kafka(self) -> None:
        devstack.ensure_up(self.infra_home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT,
                           s3_port=S3_PORT, progress=self.say)


@contextmanager
def fault_stack(root: Path, request: pytest.FixtureRequest, *, label: str, kafka_port: int, controller_port: int,
                s3_port: int, s3_proxy_port: int, admin_port: int, brokers: int = 1,
                timeout_s: float = 180) -> Iterator[FaultEnv]:
    """Kafka (``brokers`` nodes) and moto S3 of their own under ``root``, S3 behind a proxy, and the four
    services under the supervisor, training; everything is stopped afterwards. The seed is logged (``FAULT_SEED``
    replays it)."""
    seed = int(os.environ.get("FAULT_SEED") or random.SystemRandom().randrange(1 << 31))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def say(msg: str) -> None:
        line = f"[{label} {time.strftime('%H:%M:%S')}] {msg}"
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)  # noqa: T201

    say(f"seed {seed} (replay with FAULT_SEED={seed})")
    infra_home = root / "infra"
    ep = devstack.ensure_up(infra_home, kafka_port=kafka_port, controller_port=controller_port, s3_port=s3_port,
                            brokers=brokers, timeout_s=max(120.0, timeout_s), progress=say)
    proxy = TcpProxy(s3_proxy_port, "127.0.0.1", s3_port)
    proxy.up()
    endpoints = devstack.InfraEndpoints(kafka_bootstrap=ep.kafka_bootstrap, s3_endpoint=proxy.endpoint,
                                        bucket=ep.bucket, access_key=ep.access_key, secret_key=ep.secret_key,
                                        region=ep.region)
    run = f"{label.replace(' ', '-')}-{seed}"
    stack = devstack.LocalStack(
        root / "stack", run=run, infra=endpoints, store_backend="s3", admin_port=admin_port,
        trainer_port=admin_port + 1, paramsync_port=admin_port + 2, sampler_base_port=admin_port + 10,
        trainer_rank_base_port=admin_port + 60, rendezvous_port=admin_port + 99,
        env={"FLYWHEEL_TRAINER_CHECKPOINT_EVERY": "10", "FLYWHEEL_TRAINER_SEED": str(seed % 1000),
             "FLYWHEEL_SAMPLER_SEED": str(seed % 1000), "FLYWHEEL_LOG_BACKUPS": "1000"},
        log_max_bytes=LOG_CAP, progress=say)
    env = FaultEnv(stack, infra_home, proxy, endpoints, run, seed, random.Random(seed), say)
    try:
        stack.up(samplers=2, prometheus=False, timeout_s=timeout_s)
        env.wait_version_advances(3, timeout_s=timeout_s - 60)  # training runs
        yield env
    finally:
        try:
            stack.down(infra=False)
        finally:
            proxy.close()
            devstack.down(infra_home, progress=say)


@pytest.fixture(scope="session")
def fault_env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[FaultEnv]:
    with fault_stack(tmp_path_factory.mktemp("faults"), request, label="faults", kafka_port=KAFKA_PORT,
                     controller_port=CONTROLLER_PORT, s3_port=S3_PORT, s3_proxy_port=S3_PROXY_PORT,
                     admin_port=ADMIN_PORT) as env:
        try:
            yield env
        finally:
            if os.environ.get("FAULT_REPORT") == "1" and env.rows:
                from tests.faults.report import write_reliability

                path = write_reliability(env.rows, env.seed, minutes=(time.monotonic() - env.started) / 60)
                env.say(f"wrote {path}")


@pytest.fixture(autouse=True)
def _row_for_every_fault_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fault test that fails (or xfails) before it accounted adds its row anyway, marked so: the report
    never drops a row because its test failed."""
    fixture = next((n for n in ("fault_env", "cluster_env") if n in request.fixturenames), None)
    env: FaultEnv | None = request.getfixturevalue(fixture) if fixture is not None else None
    before = len(env.rows) if env is not None else 0
    if env is not None:
        env.back = None
    yield
    if env is None or len(env.rows) != before or (unrecorded := unrecorded_outcome(request)) is None:
        return
    name, outcome, reason = unrecorded
    samplers = env.back.cell() if env.back is not None else "not measured: the test failed before its heal's check"
    env.rows.append(Row(name, outcome, None, None, None, env.restarts(), reason, "-", samplers))


def s3_store(ep: devstack.InfraEndpoints) -> S3Store:
    """An S3 store on ``ep`` with its credentials passed explicitly (this process's environment has none)."""
    import boto3

    client = boto3.client("s3", endpoint_url=ep.s3_endpoint, region_name=ep.region, aws_access_key_id=ep.access_key,
                          aws_secret_access_key=ep.secret_key)
    return S3Store(client, ep.bucket)


def lost_line(spans: list[tuple[int, int]]) -> str:
    """``flywheel verify``'s line for records of one partition lost before training (services/admin/verify.py)."""
    n = sum(hi - lo for lo, hi in spans)
    return f"lost before training (left the log untrained): {n} record(s) at " + \
        ", ".join(f"[{lo}, {hi})" for lo, hi in spans)


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)
