"""Apache Kafka in KRaft mode, run from Maven Central jars: one node (combined broker + controller) by default, or
a cluster of ``InfraConfig.brokers`` such nodes on 127.0.0.1 that share one cluster id and one static controller
quorum (``controller.quorum.voters``). Node 1 keeps the single broker's name, directory and ports; see
``InfraConfig.kafka_nodes`` for the others'."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devstack.config import (
    HEALTHCHECK_TOPIC,
    KAFKA_AUTHORIZER,
    KAFKA_LOG4J2,
    KAFKA_SASL_MECHANISM,
    InfraConfig,
    KafkaNode,
    StackError,
)
from devstack.procs import Proc, read_cmdline, tail

NAME = "kafka"
HEAP_OPTS = ["-Xms256m", "-Xmx768m"]
CLUSTER_HEAP_OPTS = ["-Xms192m", "-Xmx512m"]
_PORTS_FLAG = "-Dflywheel.infra.ports="
_SASL_PORT_FLAG = "-Dflywheel.infra.sasl_port="
_AUTHORIZER_FLAG = "-Dflywheel.infra.authorizer=on"
_BROKERS_FLAG = "-Dflywheel.infra.brokers="
BROKERS_FILE = "brokers"
"""Beside each node's data dir: the cluster size its storage was formatted for (the voters are fixed then)."""
SCRAM_USERS_FILE = "scram-users"
"""Beside the data dir: the SCRAM users added when the storage was formatted (names only)."""


def proc(cfg: InfraConfig, node: KafkaNode | None = None) -> Proc:
    """The process of ``node`` (default: node 1, the single broker's ``kafka``)."""
    return Proc(cfg.home, (node or cfg.kafka_nodes[0]).name)


def procs(cfg: InfraConfig) -> list[Proc]:
    """Every node's process, node 1 first."""
    return [proc(cfg, node) for node in cfg.kafka_nodes]


def running_brokers(args: list[str]) -> int:
    """The cluster size recorded on a running node's command line (1 when absent: a single broker)."""
    for arg in args:
        if arg.startswith(_BROKERS_FLAG):
            return int(arg[len(_BROKERS_FLAG) :])
    return 1


def running_ports(args: list[str]) -> tuple[int, int] | None:
    """(broker port, controller port) recorded on a running broker's command line."""
    for arg in args:
        if arg.startswith(_PORTS_FLAG):
            broker, controller = arg[len(_PORTS_FLAG) :].split(",")
            return int(broker), int(controller)
    return None


def running_sasl_port(args: list[str]) -> int | None:
    """The SASL listener's port recorded on a running broker's command line (None: it has none)."""
    for arg in args:
        if arg.startswith(_SASL_PORT_FLAG):
            return int(arg[len(_SASL_PORT_FLAG) :])
    return None


def running_authorizer(args: list[str]) -> bool:
    """Whether a running broker was started with the authorizer on (recorded on its command line)."""
    return _AUTHORIZER_FLAG in args


def server_properties(cfg: InfraConfig, node: KafkaNode | None = None) -> str:
    """The broker's configuration: PLAINTEXT for clients and the controller; with ``cfg.kafka_sasl_port`` also a
    SASL_PLAINTEXT listener for clients that authenticates with SCRAM-SHA-512 (users in the cluster metadata,
    added at format time; see :func:`prepare`). Inter-broker and controller traffic stay PLAINTEXT. ``node`` (default
    node 1): which node of the cluster; every node is a voter of the controller quorum, and the internal topics get
    the cluster's replication factor and min.insync.replicas."""
    node = node or cfg.kafka_nodes[0]
    port, cport, sport = node.port, node.controller_port, cfg.kafka_sasl_port
    rf, min_isr = cfg.kafka_replication
    host = cfg.host(node.name)  # 127.0.0.1, or the node's own host's address in the multi-host stack
    voters = ",".join(f"{n.node_id}@{cfg.host(n.name)}:{n.controller_port}" for n in cfg.kafka_nodes)
    shape = "Single-node" if cfg.brokers == 1 else f"Node {node.node_id} of {cfg.brokers}:"
    listeners = f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}"
    advertised = f"PLAINTEXT://{host}:{port}"
    protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    sasl = ""
    if sport is not None:
        listeners += f",SASL_PLAINTEXT://{host}:{sport}"
        advertised += f",SASL_PLAINTEXT://{host}:{sport}"
        protocols += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        mech = KAFKA_SASL_MECHANISM.lower()
        # The server side of SCRAM needs a JAAS entry without options: credentials live in the cluster metadata.
        sasl = f"""\
# SASL_PLAINTEXT listener (devstack kafka_sasl_port): SCRAM users are created by `kafka-storage format --add-scram`.
sasl.enabled.mechanisms={KAFKA_SASL_MECHANISM}
listener.name.sasl_plaintext.sasl.enabled.mechanisms={KAFKA_SASL_MECHANISM}
listener.name.sasl_plaintext.{mech}.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
"""
    if cfg.kafka_authorizer:
        # ACLs enforced for the role users; ANONYMOUS (the PLAINTEXT, controller and inter-broker listeners) and
        # the stack's own SASL user are super users: the first so the node can talk to itself, the second to
        # create topics and ACLs (shared.acl.provision_run).
        sasl += f"""\
# Authorizer (devstack kafka_authorizer): role users get only the ACLs shared.acl.provision_run creates.
authorizer.class.name={KAFKA_AUTHORIZER}
super.users=User:ANONYMOUS;User:{cfg.kafka_sasl_username}
allow.everyone.if.no.acl.found=false
"""
    return f"""\
# Written by `python -m devstack infra-up` / `up`; regenerated on every start. {shape} KRaft on {host}.
process.roles=broker,controller
node.id={node.node_id}
controller.quorum.voters={voters}
listeners={listeners}
advertised.listeners={advertised}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map={protocols}
{sasl}log.dirs={node.data_dir}
num.partitions=1
default.replication.factor={rf}
min.insync.replicas={min_isr}
offsets.topic.replication.factor={rf}
transaction.state.log.replication.factor={rf}
transaction.state.log.min.isr={min_isr}
share.coordinator.state.topic.replication.factor={rf}
share.coordinator.state.topic.min.isr={min_isr}
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


def _formatted(node: KafkaNode) -> bool:
    return (node.data_dir / "meta.properties").is_file()


def _cluster_id(node: KafkaNode) -> str | None:
    """The cluster id a node's storage was formatted with (None: not formatted, or no id recorded)."""
    if not _formatted(node):
        return None
    for line in (node.data_dir / "meta.properties").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id":
            return value.strip()
    return None


def prepare(cfg: InfraConfig, java: str, libs: Path, progress: Callable[[str], None]) -> None:
    """Write every node's server.properties and format each node's log dir unless it already holds a formatted
    cluster (with every SCRAM user of ``cfg.kafka_scram_users``: users are added at format time only). The nodes of
    a cluster share one cluster id (node 1's when it is formatted already) and must have been formatted for the
    same number of brokers (the static voters are written into the metadata log)."""
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    for node in cfg.kafka_nodes:
        node.dir.mkdir(parents=True, exist_ok=True)
        node.properties.write_text(server_properties(cfg, node))
        if _formatted(node):
            _check_formatted(cfg, node)
    cluster_id = next((cid for node in cfg.kafka_nodes if (cid := _cluster_id(node)) is not None), None)
    cluster_id = cluster_id or _new_cluster_id()
    for node in cfg.kafka_nodes:
        if not _formatted(node):
            _format(cfg, node, cluster_id, java, libs, progress)


def _check_formatted(cfg: InfraConfig, node: KafkaNode) -> None:
    users_file = node.dir / SCRAM_USERS_FILE
    users = users_file.read_text().split() if users_file.is_file() else []
    missing = [name for name in cfg.kafka_scram_users if name not in users]
    if missing:
        raise StackError(
            f"the Kafka storage in {node.data_dir} was formatted without the SCRAM user "
            f"{missing[0]!r} (users are added at format time): use another home for a SASL "
            "broker, or stop this one and delete its data dir"
        )
    brokers_file = node.dir / BROKERS_FILE
    formatted_for = int(brokers_file.read_text().strip() or 1) if brokers_file.is_file() else 1
    if formatted_for != cfg.brokers:
        raise StackError(
            f"the Kafka storage in {node.data_dir} was formatted for {formatted_for} broker(s), not "
            f"{cfg.brokers} (the controller quorum is fixed at format time): use another home, or stop "
            f"this one and delete its kafka* dirs"
        )


def _format(cfg: InfraConfig, node: KafkaNode, cluster_id: str, java: str, libs: Path,
            progress: Callable[[str], None]) -> None:
    progress(f"formatting Kafka storage in {node.data_dir} (cluster id {cluster_id})")
    cmd = [java, "-cp", f"{libs}/*", f"-Dlog4j2.configurationFile={KAFKA_LOG4J2}", "kafka.tools.StorageTool",
           "format", "-t", cluster_id, "-c", str(node.properties)]
    shown = list(cmd)
    for name, password in cfg.kafka_scram_users.items():
        cmd += ["--add-scram", f"{KAFKA_SASL_MECHANISM}=[name={name},password={password}]"]
        shown += ["--add-scram", f"{KAFKA_SASL_MECHANISM}=[name={name},password=***]"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = proc(cfg, node).log
    with open(log, "a") as fh:
        fh.write(f"\n===== devstack: {' '.join(shown)}\n{out.stdout}{out.stderr}")
    if out.returncode != 0:
        raise StackError(f"formatting Kafka storage failed (exit {out.returncode}); last lines of {log}:\n{tail(log)}")
    (node.dir / SCRAM_USERS_FILE).write_text("".join(f"{name}\n" for name in cfg.kafka_scram_users))
    (node.dir / BROKERS_FILE).write_text(f"{cfg.brokers}\n")


def command(cfg: InfraConfig, java: str, libs: Path, node: KafkaNode | None = None) -> list[str]:
    """A node's command line (default node 1); log4j2 writes to the console only (the log, which is rotated).
    The nodes of a cluster get a smaller heap: three JVMs share the machine."""
    node = node or cfg.kafka_nodes[0]
    return [
        java,
        *(HEAP_OPTS if cfg.brokers == 1 else CLUSTER_HEAP_OPTS),
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"{_PORTS_FLAG}{node.port},{node.controller_port}",
        *([f"{_BROKERS_FLAG}{cfg.brokers}"] if cfg.brokers > 1 else []),
        *([f"{_SASL_PORT_FLAG}{cfg.kafka_sasl_port}"] if cfg.kafka_sasl_port is not None else []),
        *([_AUTHORIZER_FLAG] if cfg.kafka_authorizer else []),
        f"-Dlog4j2.configurationFile={KAFKA_LOG4J2}",
        f"-Dkafka.logs.dir={cfg.logs_dir}",
        "-cp",
        f"{libs}/*",
        "kafka.Kafka",
        str(node.properties),
    ]


def check_ports(cfg: InfraConfig, pid: int, node: KafkaNode | None = None) -> None:
    """A reused node must listen where this call expects it, in a cluster of the expected size."""
    node = node or cfg.kafka_nodes[0]
    args = read_cmdline(pid) or []
    ports, sasl_port, authorizer = running_ports(args), running_sasl_port(args), running_authorizer(args)
    if running_brokers(args) != cfg.brokers:
        raise StackError(
            f"our Kafka in {cfg.home} ({node.name}, pid {pid}) runs in a cluster of {running_brokers(args)} "
            f"broker(s), not {cfg.brokers}; run `python -m devstack infra-down --home {cfg.home}` first"
        )
    if ports != (node.port, node.controller_port) or sasl_port != cfg.kafka_sasl_port:
        raise StackError(
            f"our Kafka in {cfg.home} ({node.name}, pid {pid}) already runs with (broker, controller) ports {ports} "
            f"and SASL port {sasl_port}, not {(node.port, node.controller_port)} and {cfg.kafka_sasl_port}; run "
            f"`python -m devstack infra-down --home {cfg.home}` first or use the same ports"
        )
    if authorizer != cfg.kafka_authorizer:
        raise StackError(
            f"our Kafka in {cfg.home} (pid {pid}) runs with the authorizer {'on' if authorizer else 'off'}, not "
            f"{'on' if cfg.kafka_authorizer else 'off'}; run `python -m devstack infra-down --home {cfg.home}` first"
        )


def sasl_security(cfg: InfraConfig) -> dict[str, Any]:
    """aiokafka's keyword arguments for the SASL listener (what shared.kafka.client_security gives for it)."""
    return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": KAFKA_SASL_MECHANISM,
            "sasl_plain_username": cfg.kafka_sasl_username, "sasl_plain_password": cfg.kafka_sasl_password}


async def roundtrip(bootstrap: str, timeout_s: float, security: dict[str, Any] | None = None, *,
                    brokers: int = 1, replication: tuple[int, int] = (1, 1)) -> None:
    """Check that ``brokers`` brokers are registered, create the health-check topic if needed (with
    ``replication``: replication factor, min.insync.replicas), produce one record with acks=all, consume it back
    and commit it.

    ``security``: aiokafka's security keyword arguments (e.g. :func:`sasl_security`); none: PLAINTEXT.
    """
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    sec = security or {}

    async def _run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **sec)
        await admin.start()
        try:
            registered = len((await admin.describe_cluster())["brokers"])
            if registered < brokers:
                raise StackError(f"{registered} of {brokers} Kafka brokers registered")
            rf, min_isr = replication
            topic = NewTopic(HEALTHCHECK_TOPIC, 1, rf,
                             topic_configs={"retention.ms": "3600000", "min.insync.replicas": str(min_isr)})
            response = await admin.create_topics([topic])
            for _name, code, *_rest in response.topic_errors:
                if code and for_code(code) is not TopicAlreadyExistsError:
                    raise for_code(code)(f"creating {HEALTHCHECK_TOPIC}: {_rest}")
        finally:
            await admin.close()
        payload = uuid.uuid4().hex.encode()
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=5000, **sec
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
            **sec,
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
