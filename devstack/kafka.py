"""A single-node Apache Kafka (KRaft, combined broker + controller) run from Maven Central jars."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

from devstack.config import HEALTHCHECK_TOPIC, KAFKA_LOG4J2, InfraConfig, StackError
from devstack.procs import Proc, read_cmdline, tail

NAME = "kafka"
HEAP_OPTS = ["-Xms256m", "-Xmx768m"]
_PORTS_FLAG = "-Dflywheel.infra.ports="


def proc(cfg: InfraConfig) -> Proc:
    return Proc(cfg.home, NAME)


def running_ports(args: list[str]) -> tuple[int, int] | None:
    """(broker port, controller port) recorded on a running broker's command line."""
    for arg in args:
        if arg.startswith(_PORTS_FLAG):
            broker, controller = arg[len(_PORTS_FLAG) :].split(",")
            return int(broker), int(controller)
    return None


def server_properties(cfg: InfraConfig) -> str:
    port, cport = cfg.kafka_port, cfg.controller_port
    return f"""\
# Written by `python -m devstack infra-up` / `up`; regenerated on every start. Single-node KRaft on 127.0.0.1.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={cfg.kafka_data_dir}
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
delete.topic.enable=true
num.network.threads=2
num.io.threads=4
log.retention.hours=168
"""


def _new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding, not starting with '-'."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def prepare(cfg: InfraConfig, java: str, libs: Path, progress: Callable[[str], None]) -> None:
    """Write server.properties and format the log dir unless it already holds a formatted cluster."""
    cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    cfg.kafka_properties.write_text(server_properties(cfg))
    if (cfg.kafka_data_dir / "meta.properties").is_file():
        return
    cluster_id = _new_cluster_id()
    progress(f"formatting Kafka storage in {cfg.kafka_data_dir} (cluster id {cluster_id})")
    cmd = [java, "-cp", f"{libs}/*", f"-Dlog4j2.configurationFile={KAFKA_LOG4J2}", "kafka.tools.StorageTool",
           "format", "-t", cluster_id, "-c", str(cfg.kafka_properties)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = proc(cfg).log
    with open(log, "a") as fh:
        fh.write(f"\n===== devstack: {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    if out.returncode != 0:
        raise StackError(f"formatting Kafka storage failed (exit {out.returncode}); last lines of {log}:\n{tail(log)}")


def command(cfg: InfraConfig, java: str, libs: Path) -> list[str]:
    """The broker's command line; log4j2 writes to the console only (the log, which is rotated)."""
    return [
        java,
        *HEAP_OPTS,
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"{_PORTS_FLAG}{cfg.kafka_port},{cfg.controller_port}",
        f"-Dlog4j2.configurationFile={KAFKA_LOG4J2}",
        f"-Dkafka.logs.dir={cfg.logs_dir}",
        "-cp",
        f"{libs}/*",
        "kafka.Kafka",
        str(cfg.kafka_properties),
    ]


def check_ports(cfg: InfraConfig, pid: int) -> None:
    """A reused broker must listen where this call expects it."""
    ports = running_ports(read_cmdline(pid) or [])
    if ports != (cfg.kafka_port, cfg.controller_port):
        raise StackError(
            f"our Kafka in {cfg.home} (pid {pid}) already runs with (broker, controller) ports {ports}, not "
            f"{(cfg.kafka_port, cfg.controller_port)}; run `python -m devstack infra-down --home {cfg.home}` "
            "first or use the same ports"
        )


async def roundtrip(bootstrap: str, timeout_s: float) -> None:
    """Create the health-check topic if needed, produce one record, consume it back and commit it."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    async def _run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        await admin.start()
        try:
            topic = NewTopic(HEALTHCHECK_TOPIC, 1, 1, topic_configs={"retention.ms": "3600000"})
            response = await admin.create_topics([topic])
            for _name, code, *_rest in response.topic_errors:
                if code and for_code(code) is not TopicAlreadyExistsError:
                    raise for_code(code)(f"creating {HEALTHCHECK_TOPIC}: {_rest}")
        finally:
            await admin.close()
        payload = uuid.uuid4().hex.encode()
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=5000
        )
        await producer.start()
        try:
            meta = await producer.send_and_wait(HEALTHCHECK_TOPIC, payload)
        finally:
            await producer.stop()
        tp = TopicPartition(HEALTHCHECK_TOPIC, meta.partition)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=HEALTHCHECK_TOPIC,
            enable_auto_commit=False,
            request_timeout_ms=5000,
        )
        await consumer.start()
        try:
            consumer.assign([tp])
            consumer.seek(tp, meta.offset)
            record = await consumer.getone()
            if record.value != payload:
                raise StackError(f"health-check read back {record.value!r}, expected {payload!r}")
            await consumer.commit({tp: meta.offset + 1})
        finally:
            await consumer.stop()

    await asyncio.wait_for(_run(), timeout=timeout_s)
