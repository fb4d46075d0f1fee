"""Faults of a replicated Kafka: the whole stack (devstack.LocalStack) on a 3-node KRaft cluster (run topics with
replication factor 3, min.insync.replicas 2; producers acks=all + idempotent).

- ``kill -9`` of the leader of a samples partition mid-run: a follower in the ISR takes over, no service exits, and
  the accounting holds (0 lost, 0 trained twice, ``flywheel verify`` ok); the row gives the time to resume.
- A second broker taken away (two of three down: below min.insync.replicas, and below the controller quorum, since
  every node is also a controller): producers are refused and back off, samplers and trainer report ``degraded`` on
  /healthz, nothing is lost, and everything resumes when the brokers are back.

Its own stack, home and ports (Kafka 19892.. with controllers 19893.., S3 19800 behind a proxy on 19801, services
18900..), so it runs beside the single-broker fault suite (tests/faults/conftest.py, whose FaultEnv it reuses). Marked
``faults_full``: ``make test-faults BROKERS=3`` only. The rows are printed, and with ``FAULT_REPORT=1`` written to
docs/reliability-cluster.md (docs/reliability.md is the single-broker suite's and is rewritten by every run).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

import devstack
from devstack import kafka as devkafka
from devstack.procs import is_running
from shared.kafka import Topics
from tests.faults.conftest import RECOVERY_GOAL_S, FaultEnv, fault_stack
from tests.faults.report import write_cluster_reliability

# Three JVMs, moto and five services start on a small machine within the first test's time: 10 min, not 5.
pytestmark = [
    pytest.mark.kafka, pytest.mark.s3, pytest.mark.faults_full, pytest.mark.timeout(600),
    # A 3-broker cluster and a full stack take ~8 minutes on a 2-core machine: these rows run with the
    # suite's broker option (`make test-faults BROKERS=3`), not in every run.
    pytest.mark.skipif(int(os.environ.get("FLYWHEEL_INFRA_BROKERS") or 1) < 3,
                       reason="cluster rows run with make test-faults BROKERS=3"),
]

KAFKA_PORT, CONTROLLER_PORT, S3_PORT, S3_PROXY_PORT = 19892, 19893, 19800, 19801
ADMIN_PORT = 18900
BROKERS = 3


class ClusterFaults:
    """The 3-node cluster under a FaultEnv: which node leads a partition, kill -9 a node, bring the nodes back."""

    def __init__(self, env: FaultEnv) -> None:
        self.env = env
        self.cfg = devstack.InfraConfig.resolve(env.infra_home, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, None,
                                                brokers=BROKERS)

    def pid(self, node_id: int) -> int | None:
        return devkafka.proc(self.cfg, self.cfg.kafka_nodes[node_id - 1]).pid()

    def kill(self, node_id: int) -> int:
        """SIGKILL node ``node_id``; its pid (no longer the node's recorded process once this returns, unless 15 s
        were not enough; :meth:`assert_away` waits for it to have exited)."""
        pid = self.pid(node_id)
        assert pid is not None, f"Kafka node {node_id} is not running"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while self.pid(node_id) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.env.say(f"Kafka node {node_id} (pid {pid}) killed with SIGKILL")
        return pid

    def assert_away(self, node_id: int, pid: int, within_s: float = 30.0) -> None:
        """Node ``node_id`` is really away: the process killed (``pid``) has exited, no process of the node runs,
        and its broker and controller ports refuse connections. A SIGKILLed JVM takes a while to unwind (its
        threads exit, its heap is unmapped, its sockets close with the last thread): up to ``within_s``."""
        node = self.cfg.kafka_nodes[node_id - 1]
        deadline = time.monotonic() + within_s
        while True:
            alive = is_running(pid)
            listening = [port for port in (node.port, node.controller_port) if _accepts(port)]
            if not (alive or listening) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        assert not alive, f"Kafka node {node_id} (pid {pid}) still runs {within_s:.0f} s after SIGKILL"
        assert not listening, f"Kafka node {node_id} (pid {pid}) was killed but port(s) {listening} still accept " \
                              f"connections after {within_s:.0f} s"
        assert self.pid(node_id) is None, f"Kafka node {node_id} runs again (pid {self.pid(node_id)})"

    def start_all(self) -> None:
        """Start the nodes that are down; returns once all three are registered and a round trip works."""
        devstack.ensure_up(self.env.infra_home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT,
                           s3_port=S3_PORT, brokers=BROKERS, progress=self.env.say)

    def partition(self, topic: str, partition: int, alive: int | None = None) -> tuple[int, list[int]]:
        """(leader, ISR) of a partition, asked of ``alive`` (a node known to run) or any node."""
        nodes = [n for n in self.cfg.kafka_nodes if alive is None or n.node_id == alive]
        bootstrap = ",".join(f"127.0.0.1:{n.port}" for n in nodes)

        async def ask() -> tuple[int, list[int]]:
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
            await admin.start()
            try:
                [desc] = await admin.describe_topics([topic])
                [part] = [p for p in desc["partitions"] if p["partition"] == partition]
                return int(part["leader"]), [int(r) for r in part["isr"]]
            finally:
                await admin.close()

        return asyncio.run(ask())

    def health(self) -> dict[str, dict[str, Any]]:
        """Each service's own /healthz (admin's /status reads heartbeats through Kafka, which is what is down)."""
        out: dict[str, dict[str, Any]] = {}
        names = [("trainer", 0)] + [("sampler", r) for r in self.env.stack.state.samplers()]
        for service, replica in names:
            key = service if service == "trainer" else f"sampler-{replica}"
            try:
                r = httpx.get(f"http://127.0.0.1:{self.env.stack.port(service, replica)}/healthz", timeout=5)
                out[key] = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                out[key] = {"error": str(exc)}
        return out


def _accepts(port: int) -> bool:
    """Something on 127.0.0.1 accepts a TCP connection on ``port``."""
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _degraded(body: dict[str, Any]) -> bool:
    return body.get("state") == "degraded" or bool(body.get("reasons"))


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[FaultEnv]:
    with fault_stack(tmp_path_factory.mktemp("cluster-faults"), request, label="cluster faults",
                     kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT, s3_port=S3_PORT,
                     s3_proxy_port=S3_PROXY_PORT, admin_port=ADMIN_PORT, brokers=BROKERS, timeout_s=240) as env:
        try:
            yield env
        finally:
            for row in env.rows:
                env.say(f"row: {row}")
            if os.environ.get("FAULT_REPORT") == "1" and env.rows:
                path = write_cluster_reliability(env.rows, env.seed, minutes=(time.monotonic() - env.started) / 60)
                env.say(f"wrote {path}")


def test_samples_partition_leader_kill9_mid_run(cluster_env: FaultEnv) -> None:
    env, cluster = cluster_env, ClusterFaults(cluster_env)
    topic = Topics.for_run(env.run).samples
    restarts_before = env.restarts()
    partition = env.rng.randrange(4)  # configs/cartpole.yaml: 4 samples partitions
    leader, isr = cluster.partition(topic, partition)
    assert len(isr) == 3, f"partition {partition} is not fully replicated: ISR {isr}"
    version = env.published()
    cluster.kill(leader)
    killed = time.monotonic()
    alive = next(n for n in isr if n != leader)
    new_leader = leader
    while new_leader in (leader, -1) and time.monotonic() - killed < 60:
        time.sleep(0.5)
        try:  # the dead node stays in the metadata until it is fenced: a request may go to it
            new_leader, _ = cluster.partition(topic, partition, alive=alive)
        except KafkaError:
            continue
    elected = time.monotonic() - killed
    assert new_leader not in (leader, -1), f"no new leader for {topic}[{partition}] within 60 s"
    watch = env.watch_samplers()  # the heal: a new leader
    env.wait_version_advances(version + 1, timeout_s=RECOVERY_GOAL_S + 60)
    recover = time.monotonic() - killed
    env.say(f"{topic}[{partition}]: leader {leader} killed, {new_leader} leads after {elected:.1f} s; the policy "
            f"version advanced {recover:.1f} s after the kill")
    assert env.restarts() == restarts_before, f"a service exited: {env.restarts()}"
    env.samplers_back(watch)
    cluster.start_all()  # the node comes back and catches up as a follower
    env.wait_version_advances(env.published() + 2, timeout_s=120)
    env.check_accounting("samples partition leader kill -9 (3 brokers, RF 3, min ISR 2)", round(recover, 1),
                         f"new leader after {elected:.1f} s; no service exited; broker restarted after")


def test_two_brokers_away_below_min_isr(cluster_env: FaultEnv) -> None:
    env, cluster = cluster_env, ClusterFaults(cluster_env)
    restarts_before = env.restarts()
    version = env.published()
    first, second = env.rng.sample([1, 2, 3], 2)
    killed = {first: cluster.kill(first)}
    time.sleep(5)
    killed[second] = cluster.kill(second)
    down_at = time.monotonic()
    # The fault is real: both nodes are gone (processes, ports), and only the third still answers.
    for node_id, pid in killed.items():
        cluster.assert_away(node_id, pid)
    [survivor] = [n for n in (1, 2, 3) if n not in killed]
    assert cluster.pid(survivor) is not None, f"Kafka node {survivor}, the one left, is not running"
    env.say(f"Kafka nodes {sorted(killed)} away (processes gone, ports refusing); node {survivor} runs")
    seen: dict[str, str] = {}
    while time.monotonic() - down_at < 60:
        time.sleep(3)
        for name, body in cluster.health().items():
            if _degraded(body) and name not in seen:
                seen[name] = str(body.get("reasons") or body)[:200]
                env.say(f"{name} degraded after {time.monotonic() - down_at:.0f} s: {seen[name]}")
    stalled = env.published()
    for node_id, pid in killed.items():  # still away for the whole 60 s: nothing brought them back early
        cluster.assert_away(node_id, pid)
    cluster.start_all()
    back = time.monotonic()
    watch = env.watch_samplers()
    restarted = {n: cluster.pid(n) for n in killed}
    assert all(p is not None and p != killed[n] for n, p in restarted.items()), \
        f"the nodes did not come back as new processes: {restarted} (killed: {killed})"
    env.wait_version_advances(max(version, stalled), timeout_s=RECOVERY_GOAL_S + 60)
    recover = time.monotonic() - back
    env.say(f"two brokers away 60 s: degraded {sorted(seen)}; version {version} -> {stalled} meanwhile; training "
            f"resumed {recover:.1f} s after the brokers answered")
    assert env.restarts() == restarts_before, f"a service exited while two brokers were away: {env.restarts()}"
    assert "trainer" in seen, f"the trainer did not report degraded: {cluster.health()}"
    env.samplers_back(watch)
    env.wait_version_advances(env.published() + 2, timeout_s=120)
    # Samplers whose last sends were acknowledged before the second broker went wait for credits (which come
    # through Kafka): they report `credits` degraded once that wait outlasts a Kafka request's timeout.
    samplers = sorted(name for name in seen if name.startswith("sampler"))
    assert samplers, f"no sampler reported degraded while Kafka was below min ISR: {cluster.health()}"
    env.check_accounting("two of three brokers away 60 s (below min ISR)", round(recover, 1),
                         f"degraded: {', '.join(sorted(seen))}; no service exited; resumed unaided")
