"""A 3-node KRaft cluster from devstack: its configuration (pure), its run topics (RF 3, min ISR 2), and what an
acks=all idempotent producer does with one broker killed (keeps working) and with two (refused, retried, delivered
once when the brokers are back). Every node is also a controller: two down is below the quorum as well as below
min.insync.replicas, so the refusal is the leader's RequestTimedOut (NotEnoughReplicas once a quorum is back while the
returning replica catches up), never an acknowledgement.

The cluster has its own home and ports (19692.., controllers 19693..; S3 19690), so it never meets the test infra
(19092) or the fault suite's (19392); it is stopped at the end of the module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from devstack import infra
from devstack import kafka as devkafka
from devstack.config import InfraConfig, InfraEndpoints, StackError
from shared.kafka import Topics, ensure_topics, make_producer, replication_for, topic_specs
from shared.settings import Settings, load_settings

KAFKA_PORT, CONTROLLER_PORT, S3_PORT = 19692, 19693, 19690
BROKERS = 3


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


# ---- pure: the configuration of a cluster and of its topics ---------------------------------------------------
def test_replication_follows_the_cluster_size() -> None:
    assert [replication_for(n) for n in (1, 2, 3, 5)] == [(1, 1), (2, 2), (3, 2), (3, 2)]
    with pytest.raises(ValueError, match="at least one broker"):
        replication_for(0)


def test_topic_specs_for_one_and_three_brokers() -> None:
    settings = load_settings(None, environ={"FLYWHEEL_RUN": "cfg"})
    plain = {t.name: (t.replication_factor, dict(t.topic_configs)) for t in topic_specs(settings)}
    single = {t.name: (t.replication_factor, t.topic_configs) for t in topic_specs(settings, 1)}
    cluster = {t.name: (t.replication_factor, t.topic_configs) for t in topic_specs(settings, 3)}
    assert set(plain) == set(single) == set(cluster) == set(vars(Topics.for_run("cfg")).values())
    for name, (rf, configs) in single.items():
        assert rf == 1 and configs == {**plain[name][1], "min.insync.replicas": "1"}, name
    for name, (rf, configs) in cluster.items():
        assert rf == 3 and configs == {**plain[name][1], "min.insync.replicas": "2"}, name
    assert all(rf == 1 and "min.insync.replicas" not in c for rf, c in plain.values()), "no cluster: as configured"


def test_three_nodes_share_one_quorum_on_their_own_ports(tmp_path: Path) -> None:
    cfg = InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, brokers=BROKERS)
    nodes = cfg.kafka_nodes
    assert [(n.name, n.node_id, n.port, n.controller_port) for n in nodes] == [
        ("kafka", 1, 19692, 19693), ("kafka-2", 2, 19694, 19695), ("kafka-3", 3, 19696, 19697)]
    assert cfg.endpoints.kafka_bootstrap == "127.0.0.1:19692,127.0.0.1:19694,127.0.0.1:19696"
    voters = "1@127.0.0.1:19693,2@127.0.0.1:19695,3@127.0.0.1:19697"
    for node in nodes:
        props = _props(devkafka.server_properties(cfg, node))
        assert props["node.id"] == str(node.node_id) and props["controller.quorum.voters"] == voters
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        assert props["log.dirs"] == str(node.data_dir) and len({n.data_dir for n in nodes}) == 3
        for key in ("default.replication.factor", "offsets.topic.replication.factor",
                    "transaction.state.log.replication.factor"):
            assert props[key] == "3", key
        assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
        args = devkafka.command(cfg, "java", tmp_path, node)
        assert devkafka.running_ports(args) == (node.port, node.controller_port)
        assert devkafka.running_brokers(args) == 3
    single = _props(devkafka.server_properties(InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT)))
    assert single["controller.quorum.voters"] == "1@127.0.0.1:19693" and single["min.insync.replicas"] == "1"


def test_bad_cluster_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="brokers must be 1..5"):
        InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, brokers=9)
    with pytest.raises(StackError, match="must differ"):  # node 2's broker port would be node 1's controller port
        InfraConfig.resolve(tmp_path, KAFKA_PORT, KAFKA_PORT + 2, S3_PORT, brokers=3)
    with pytest.raises(StackError, match="single broker only"):
        InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, brokers=3, kafka_sasl_port=19699)
    one = InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT)
    one.kafka_data_dir.mkdir(parents=True)
    (one.kafka_data_dir / "meta.properties").write_text("cluster.id=x\nnode.id=1\n")  # formatted for 1 broker
    three = InfraConfig.resolve(tmp_path, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, brokers=3)
    with pytest.raises(StackError, match="formatted for 1 broker"):
        devkafka.prepare(three, "java", tmp_path, progress=lambda _msg: None)


# ---- the real cluster -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InfraConfig, InfraEndpoints]]:
    home = tmp_path_factory.mktemp("kafka-cluster")
    ep = infra.ensure_up(home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT, s3_port=S3_PORT,
                         brokers=BROKERS, timeout_s=240, progress=lambda _msg: None)
    cfg = InfraConfig.resolve(home, KAFKA_PORT, CONTROLLER_PORT, S3_PORT, brokers=BROKERS)
    try:
        yield cfg, ep
    finally:
        infra.down(home, progress=lambda _msg: None)


def _settings(ep: InfraEndpoints, run: str) -> Settings:
    return load_settings(None, environ={"FLYWHEEL_RUN": run, "FLYWHEEL_KAFKA_BOOTSTRAP": ep.kafka_bootstrap,
                                        "FLYWHEEL_KAFKA_SAMPLES_PARTITIONS": "1",
                                        "FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS": "5000"})


async def _leader(ep: InfraEndpoints, topic: str) -> tuple[int, list[int]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=ep.kafka_bootstrap, request_timeout_ms=5000)
    await admin.start()
    try:
        [desc] = await admin.describe_topics([topic])
        [part] = desc["partitions"]
        return int(part["leader"]), [int(r) for r in part["isr"]]
    finally:
        await admin.close()


def _kill(cfg: InfraConfig, node_id: int) -> None:
    node = cfg.kafka_nodes[node_id - 1]
    pid = devkafka.proc(cfg, node).pid()
    assert pid is not None, f"{node.name} is not running"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while devkafka.proc(cfg, node).pid() is not None and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.kafka
async def test_run_topics_get_rf3_and_min_isr2(cluster: tuple[InfraConfig, InfraEndpoints], run_name: str) -> None:
    _cfg, ep = cluster
    topics = await ensure_topics(_settings(ep, run_name))
    names = sorted(vars(topics).values())
    admin = AIOKafkaAdminClient(bootstrap_servers=ep.kafka_bootstrap, request_timeout_ms=5000)
    await admin.start()
    try:
        assert len((await admin.describe_cluster())["brokers"]) == 3
        for desc in await admin.describe_topics(names):
            for part in desc["partitions"]:
                assert len(part["replicas"]) == 3 and len(part["isr"]) == 3, (desc["topic"], part)
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, configs=None) for name in names])
        isr = {res[3]: {c[0]: c[1] for c in res[4]}["min.insync.replicas"]
               for response in responses for res in response.resources}
        assert isr == dict.fromkeys(names, "2")
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_acks_all_survives_one_broker_and_waits_out_two(
    cluster: tuple[InfraConfig, InfraEndpoints], run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, ep = cluster
    settings = _settings(ep, run_name)
    topic = (await ensure_topics(settings)).samples
    producer = make_producer(settings, request_timeout_ms=3000, retry_backoff_ms=200)
    await producer.start()
    sent: list[bytes] = []
    try:
        async def send(i: int, timeout_s: float = 30.0) -> None:
            value = f"r{i}".encode()
            await asyncio.wait_for(producer.send_and_wait(topic, value), timeout_s)
            sent.append(value)

        for i in range(5):
            await send(i)
        # 1. kill -9 the partition's leader: a new one is elected from the ISR, writes go on (acks=all, ISR >= 2).
        leader, isr = await _leader(ep, topic)
        assert len(isr) == 3
        _kill(cfg, leader)
        started = time.monotonic()
        for i in range(5, 10):
            await send(i)
        one_down_s = time.monotonic() - started
        new_leader, isr = await _leader(ep, topic)
        assert new_leader != leader and leader not in isr and len(isr) == 2
        # 2. a second broker away (the follower: the leader stays): below min.insync.replicas, and below the
        # controller quorum too (every node is a voter). The write is refused and retried, not acknowledged.
        [follower] = [n for n in isr if n != new_leader]
        _kill(cfg, follower)
        caplog.set_level(logging.WARNING, logger="aiokafka")
        pending = asyncio.create_task(send(10, timeout_s=120.0))
        await asyncio.sleep(8.0)
        assert not pending.done(), "a write was acknowledged with one replica of three"
        refusals = [r.getMessage() for r in caplog.records if "produce response" in r.getMessage()]
        # The leader lives but cannot have the write acknowledged by a quorum of the ISR: RequestTimedOut from the
        # broker (with no controller quorum the ISR cannot shrink to 1, which would give NotEnoughReplicas), and the
        # producer retries it.
        assert refusals, "the producer was not refused"
        # 3. the brokers come back: the pending write lands (once), and new ones too.
        infra.ensure_up(cfg.home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT, s3_port=S3_PORT,
                        brokers=BROKERS, timeout_s=180, progress=lambda _msg: None)
        await pending
        for i in range(11, 15):
            await send(i)
    finally:
        await producer.stop()
    assert sent == [f"r{i}".encode() for i in range(15)]
    logging.getLogger(__name__).warning("one broker down: 5 writes in %.1f s; two down: %s", one_down_s,
                                        sorted({m.split("Error: ")[-1] for m in refusals}) or "no error logged")

    consumer = AIOKafkaConsumer(bootstrap_servers=ep.kafka_bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest", request_timeout_ms=5000)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        got: list[bytes] = []
        while len(got) < end:
            batch = await consumer.getmany(tp, timeout_ms=5000)
            got += [r.value for r in batch.get(tp, [])]
    finally:
        await consumer.stop()
    assert got == sent, "every acknowledged write once, in order (idempotent producer)"
