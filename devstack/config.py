"""Where a local stack lives and what it listens on: its home, ports, endpoints, credentials; the one error."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from devstack.errors import StackError as StackError  # re-exported: the stack's one error, raised by every part

REPO_ROOT = Path(__file__).resolve().parents[1]
KAFKA_POM = REPO_ROOT / "deploy" / "kafka" / "pom.xml"
KAFKA_LOG4J2 = REPO_ROOT / "deploy" / "kafka" / "log4j2.properties"
DEFAULT_CONFIG = REPO_ROOT / "configs" / "cartpole.yaml"

DEFAULT_KAFKA_PORT = 9092
DEFAULT_CONTROLLER_PORT = 9093
DEFAULT_S3_PORT = 9000
DEFAULT_BUCKET = "flywheel"
DEFAULT_TIMEOUT_S = 120.0
MAX_BROKERS = 5
BROKER_PORT_STEP = 2
"""Node ``i`` (1-based) of a cluster listens on ``kafka_port + 2 * (i - 1)`` and ``controller_port + 2 * (i - 1)``:
a step of 2 keeps the default pairs (9092/9093, 9094/9095, ...) apart."""

# The stack the test-suite starts when no endpoints are given (tests/conftest.py): its own home and
# ports, so it never collides with a `make up` stack.
TEST_HOME = REPO_ROOT / ".flywheel" / "test-infra"
TEST_KAFKA_PORT = 19092
TEST_CONTROLLER_PORT = 19093
TEST_S3_PORT = 19000

# moto accepts any credentials; these are the conventional placeholder values.
S3_ACCESS_KEY = "testing"
S3_SECRET_KEY = "testing"
S3_REGION = "us-east-1"

# The SCRAM user of the optional SASL_PLAINTEXT listener (InfraConfig.kafka_sasl_port), created when the
# broker's storage is formatted. Development credentials, like the S3 ones above; the PLAINTEXT listener
# stays open beside it, so this listener is for exercising authentication, not for keeping anyone out.
KAFKA_SASL_MECHANISM = "SCRAM-SHA-512"
KAFKA_SASL_USERNAME = "flywheel"
KAFKA_SASL_PASSWORD = "flywheel-dev-scram-secret"
KAFKA_ROLE_USERS = ("sampler", "trainer", "paramsync", "admin")
"""With ``InfraConfig.kafka_authorizer``: one SCRAM user per role (shared.acl.ROLES), created at format time beside
``KAFKA_SASL_USERNAME``, which becomes a super user (it creates the topics and the ACLs)."""
KAFKA_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def kafka_role_password(role: str) -> str:
    """The development SCRAM password of a role's user (like the others here: for a laptop, not a secret)."""
    return f"{role}-dev-scram-secret"


_SCRAM_SAFE = re.compile(r"[A-Za-z0-9._@-]+")  # no ',', '=', ']', quotes: kafka-storage --add-scram's syntax

HEALTHCHECK_TOPIC = "_flywheel_healthcheck"
HEALTHCHECK_KEY = "_flywheel_healthcheck"


InfraError = StackError  # the names the two former packages used
LocalStackError = StackError


def default_home() -> Path:
    """``$FLYWHEEL_HOME``, else ``<repo>/.flywheel``."""
    return Path(os.environ.get("FLYWHEEL_HOME") or REPO_ROOT / ".flywheel").expanduser().resolve()


@dataclass(frozen=True)
class InfraEndpoints:
    """Where a running Kafka broker and S3 endpoint can be reached, and how to authenticate."""

    kafka_bootstrap: str
    """Every broker, comma-separated (``host:port,host:port``): clients bootstrap from whichever answers."""
    s3_endpoint: str
    bucket: str
    access_key: str = S3_ACCESS_KEY
    secret_key: str = S3_SECRET_KEY
    region: str = S3_REGION
    kafka_sasl_bootstrap: str | None = None
    """The broker's SASL_PLAINTEXT listener (SCRAM-SHA-512), when it has one; not in :meth:`as_env`."""
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = field(default=None, repr=False)
    kafka_role_users: tuple[str, ...] = ()
    """With the authorizer on: the per-role SCRAM users (``KAFKA_ROLE_USERS``); empty otherwise."""

    def as_env(self) -> dict[str, str]:
        """The environment variables that point Flywheel's services at these endpoints."""
        return {
            "FLYWHEEL_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "FLYWHEEL_S3_ENDPOINT": self.s3_endpoint,
            "FLYWHEEL_S3_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def kafka_sasl_env(self, role: str | None = None) -> dict[str, str]:
        """The FLYWHEEL_KAFKA_* variables that point Flywheel's clients at the SASL listener (SCRAM-SHA-512), as
        the stack's user (a super user when the authorizer is on) or, with ``role``, as that role's user."""
        if self.kafka_sasl_bootstrap is None or self.kafka_sasl_username is None or self.kafka_sasl_password is None:
            raise StackError("this broker has no SASL listener (start it with kafka_sasl_port)")
        user, password = self.kafka_sasl_username, self.kafka_sasl_password
        if role is not None:
            if role not in self.kafka_role_users:
                raise StackError(f"this broker has no SCRAM user {role!r} (users per role: "
                                 f"{', '.join(self.kafka_role_users) or 'none; start it with kafka_authorizer'})")
            user, password = role, kafka_role_password(role)
        return {
            "FLYWHEEL_KAFKA_BOOTSTRAP": self.kafka_sasl_bootstrap,
            "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "FLYWHEEL_KAFKA_SASL_MECHANISM": KAFKA_SASL_MECHANISM,
            "FLYWHEEL_KAFKA_SASL_USERNAME": user,
            "FLYWHEEL_KAFKA_SASL_PASSWORD": password,
        }


def _env_int(name: str, default: int, what: str) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not {what}") from None


def _env_port(name: str, default: int) -> int:
    return _env_int(name, default, "a port number")


@dataclass(frozen=True)
class KafkaNode:
    """One node (combined KRaft controller + broker) of this home's Kafka: its process name, dir and ports."""

    node_id: int
    name: str
    """The process name: ``kafka`` for node 1 (as with a single broker), ``kafka-<i>`` for the others."""
    dir: Path
    port: int
    controller_port: int

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def properties(self) -> Path:
        return self.dir / "server.properties"


@dataclass(frozen=True)
class InfraConfig:
    """Everything that identifies one home's Kafka + S3: the home directory and the ports."""

    home: Path
    kafka_port: int
    controller_port: int
    s3_port: int
    bucket: str
    kafka_sasl_port: int | None = None
    """An extra SASL_PLAINTEXT listener (SCRAM-SHA-512) on this port; None (the default): PLAINTEXT only."""
    kafka_sasl_username: str = KAFKA_SASL_USERNAME
    kafka_sasl_password: str = field(default=KAFKA_SASL_PASSWORD, repr=False)
    kafka_authorizer: bool = False
    """Run the StandardAuthorizer with a SCRAM user per role (needs ``kafka_sasl_port``): the SASL user
    ``kafka_sasl_username`` and the PLAINTEXT listener's ``User:ANONYMOUS`` are super users, the role users get
    only the ACLs that ``shared.acl.provision_run`` creates. Off by default."""
    brokers: int = 1
    """Kafka nodes (each a combined KRaft controller + broker), 1..MAX_BROKERS; see :attr:`kafka_nodes` for their
    ports. More than one: run topics get replication factor min(3, n) and min.insync.replicas min(2, n)."""
    hosts: bool = False
    """The multi-host stack (``devstack.hosts``): each Kafka node and the S3 server in a network namespace of its
    own, listening on (and advertising) that host's address instead of 127.0.0.1."""

    @classmethod
    def resolve(
        cls,
        home: str | os.PathLike[str] | None = None,
        kafka_port: int | None = None,
        controller_port: int | None = None,
        s3_port: int | None = None,
        bucket: str | None = None,
        *,
        kafka_sasl_port: int | None = None,
        kafka_authorizer: bool = False,
        brokers: int | None = None,
        hosts: bool | None = None,
    ) -> InfraConfig:
        """Explicit arguments win, then FLYWHEEL_INFRA_*_PORT / FLYWHEEL_INFRA_BROKERS / FLYWHEEL_HOME, then defaults.

        The SASL listener is off unless ``kafka_sasl_port`` is given, the authorizer unless ``kafka_authorizer``
        (no environment variable turns either on). ``hosts`` None: as the home's stack is (a multi-host one while
        its ``hosts.json`` exists, see ``devstack.hosts``).
        """
        resolved_home = Path(home).expanduser().resolve() if home else default_home()
        if hosts is None:
            from devstack.hosts import active  # lazily: the multi-host parts load only when asked about

            hosts = active(resolved_home)
        cfg = cls(
            home=resolved_home,
            kafka_port=kafka_port or _env_port("FLYWHEEL_INFRA_KAFKA_PORT", DEFAULT_KAFKA_PORT),
            controller_port=controller_port
            or _env_port("FLYWHEEL_INFRA_CONTROLLER_PORT", DEFAULT_CONTROLLER_PORT),
            s3_port=s3_port or _env_port("FLYWHEEL_INFRA_S3_PORT", DEFAULT_S3_PORT),
            bucket=bucket or DEFAULT_BUCKET,
            kafka_sasl_port=kafka_sasl_port,
            kafka_authorizer=kafka_authorizer,
            brokers=brokers or _env_int("FLYWHEEL_INFRA_BROKERS", 1, "a number of brokers"),
            hosts=hosts,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not 1 <= self.brokers <= MAX_BROKERS:
            raise StackError(f"brokers must be 1..{MAX_BROKERS}, got {self.brokers=}")
        if self.brokers > 1 and self.kafka_sasl_port is not None:
            raise StackError(f"the SASL listener (kafka_sasl_port) is for a single broker only, got {self.brokers=}")
        ports = {"kafka": self.kafka_port, "controller": self.controller_port, "s3": self.s3_port}
        for node in self.kafka_nodes[1:]:
            ports[f"{node.name}"] = node.port
            ports[f"{node.name} controller"] = node.controller_port
        if self.kafka_sasl_port is not None:
            ports["kafka sasl"] = self.kafka_sasl_port
        for name, port in ports.items():
            if not 1 <= port <= 65535:
                raise StackError(f"{name} port {port} is outside 1..65535")
        if len(set(ports.values())) != len(ports):
            raise StackError(f"the {', '.join(ports)} ports must differ, got {ports}")
        if not (3 <= len(self.bucket) <= 63) or self.bucket != self.bucket.lower():
            raise StackError(f"bucket name {self.bucket!r} is not a valid S3 bucket name")
        for what, value in (("user name", self.kafka_sasl_username), ("password", self.kafka_sasl_password)):
            if not _SCRAM_SAFE.fullmatch(value):
                raise StackError(f"the Kafka SASL {what} may hold only letters, digits and . _ @ -")
        if self.kafka_authorizer and self.kafka_sasl_port is None:
            raise StackError("the Kafka authorizer needs the SASL listener (kafka_sasl_port): its users are SCRAM")
        if self.kafka_authorizer and self.kafka_sasl_username in KAFKA_ROLE_USERS:
            raise StackError(f"the Kafka SASL user {self.kafka_sasl_username!r} is a super user with the authorizer "
                             "on: it must not be named after a role")

    def host(self, name: str) -> str:
        """The address process ``name`` (``kafka``, ``kafka-<i>``, ``s3``) listens on: 127.0.0.1, or its own
        host's address in the multi-host stack."""
        if not self.hosts:
            return "127.0.0.1"
        from devstack.hosts import address

        return address(name)

    def netns(self, name: str) -> str | None:
        """The network namespace process ``name`` runs in (None: the caller's; see :attr:`hosts`)."""
        if not self.hosts:
            return None
        from devstack.hosts import netns_name

        return netns_name(name)

    @property
    def kafka_scram_users(self) -> dict[str, str]:
        """The SCRAM users to create when the storage is formatted: name -> password."""
        if self.kafka_sasl_port is None:
            return {}
        users = {self.kafka_sasl_username: self.kafka_sasl_password}
        if self.kafka_authorizer:
            users |= {role: kafka_role_password(role) for role in KAFKA_ROLE_USERS}
        return users

    @property
    def kafka_nodes(self) -> tuple[KafkaNode, ...]:
        """The Kafka nodes, node 1 first (``kafka``: the single broker's name, dir and ports)."""
        return tuple(
            KafkaNode(node_id=i, name="kafka" if i == 1 else f"kafka-{i}",
                      dir=self.home / ("kafka" if i == 1 else f"kafka-{i}"),
                      port=self.kafka_port + BROKER_PORT_STEP * (i - 1),
                      controller_port=self.controller_port + BROKER_PORT_STEP * (i - 1))
            for i in range(1, self.brokers + 1)
        )

    @property
    def kafka_replication(self) -> tuple[int, int]:
        """(replication factor, min.insync.replicas) for this cluster's size (``shared.kafka.replication_for``)."""
        from shared.kafka import replication_for  # lazily: aiokafka is not needed to parse a command line

        return replication_for(self.brokers)

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"

    @property
    def kafka_data_dir(self) -> Path:
        return self.kafka_dir / "data"

    @property
    def kafka_properties(self) -> Path:
        return self.kafka_dir / "server.properties"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def env_file(self) -> Path:
        return self.home / "infra.env"

    @property
    def endpoints(self) -> InfraEndpoints:
        sasl = self.kafka_sasl_port is not None
        return InfraEndpoints(
            kafka_bootstrap=",".join(f"{self.host(node.name)}:{node.port}" for node in self.kafka_nodes),
            s3_endpoint=f"http://{self.host('s3')}:{self.s3_port}",
            bucket=self.bucket,
            kafka_sasl_bootstrap=f"{self.host('kafka')}:{self.kafka_sasl_port}" if sasl else None,
            kafka_sasl_username=self.kafka_sasl_username if sasl else None,
            kafka_sasl_password=self.kafka_sasl_password if sasl else None,
            kafka_role_users=KAFKA_ROLE_USERS if self.kafka_authorizer else (),
        )


def cache_root() -> Path:
    """Downloads shared by every checkout: ${FLYWHEEL_CACHE:-~/.cache/flywheel}."""
    return Path(os.environ.get("FLYWHEEL_CACHE") or Path.home() / ".cache" / "flywheel").expanduser()


def kafka_version() -> str:
    """The Kafka version pinned in deploy/kafka/pom.xml (the single source of truth)."""
    try:
        root = ET.parse(KAFKA_POM).getroot()
    except (OSError, ET.ParseError) as exc:
        raise StackError(f"cannot read the Kafka version from {KAFKA_POM}: {exc}") from exc
    ns = "{http://maven.apache.org/POM/4.0.0}"
    node = root.find(f"{ns}properties/{ns}kafka.version")
    if node is None or not (node.text or "").strip():
        raise StackError(f"{KAFKA_POM} has no <properties><kafka.version>")
    return (node.text or "").strip()
