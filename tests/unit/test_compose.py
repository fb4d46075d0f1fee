"""Structure of docker-compose.yml and deploy/Dockerfile.

No Docker engine is needed: the files are parsed and checked against what the design promises
(official Kafka image in KRaft mode, pinned images, one Dockerfile for the four services,
healthchecks and start-up ordering, a scalable sampler), against the security defaults
(ports on 127.0.0.1 only, one Kafka user and one MinIO user per role, no unauthenticated listener
off the broker's loopback, rotated logs) and against the local stack (the same broker settings as
its SASL listener with the authorizer, valid Flywheel settings). `docker compose config` runs
only where Docker works; tests/unit/test_compose_spec.py loads the file with compose-go itself.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CONFIG = REPO / "configs" / "cartpole.yaml"
MINIO_DIR = REPO / "deploy" / "minio"

FLYWHEEL_SERVICES = ("trainer", "paramsync", "admin", "sampler")
INFRA_SERVICES = ("kafka", "minio", "minio-init", "kafka-users", "kafka-init", "keys", "prometheus", "grafana")
INIT_STEPS = ("kafka-users", "kafka-init", "minio-init")  # the identities, before the services
ROOT_CREDENTIAL_SERVICES = ("minio", "minio-init")
PUBLISHED = {
    "admin": ["127.0.0.1:8080:8080"],
    "prometheus": ["127.0.0.1:9090:9090"],
    "grafana": ["127.0.0.1:3000:3000"],
}
BUCKET_ACTIONS = {"s3:ListBucket", "s3:GetBucketLocation"}
OBJECT_ACTIONS = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
HTTP_PORTS = {"trainer": 8000, "paramsync": 8000, "admin": 8080, "sampler": 8000}
MINIO_MIN_RELEASE = dt.datetime(2025, 8, 29, tzinfo=dt.UTC)
RELEASE_TAG = re.compile(r"RELEASE\.(\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}Z)")
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}
INTERPOLATION = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _interpolate(value: str, given: dict[str, str]) -> str:
    """Compose-style variable substitution; required variables without a value must be in `given`."""

    def sub(m: re.Match[str]) -> str:
        name, dash_op, default, q_op, _msg = m.groups()
        if name in given:
            return given[name]
        if dash_op is not None:
            return default
        raise AssertionError(f"${{{name}}} is required but the test did not provide it")

    return INTERPOLATION.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def _image_ref(image: str) -> tuple[str, str]:
    """(repository, tag) of an image reference; a digest suffix is ignored."""
    name = image.split("@", 1)[0]
    repo, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        return name, ""
    return repo, tag


def _healthcheck_cmd(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    if isinstance(test, list):
        assert test[0] in ("CMD", "CMD-SHELL"), f"healthcheck test must start with CMD or CMD-SHELL: {test}"
        return " ".join(test[1:])
    assert isinstance(test, str), test
    return test


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            instr, _, args = full.partition(" ")
            out.append((instr.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


# ---- services and images ----------------------------------------------------------------------


def test_all_services_present(services: dict[str, Any]) -> None:
    missing = set(FLYWHEEL_SERVICES + INFRA_SERVICES) - set(services)
    assert not missing, f"docker-compose.yml lacks services {sorted(missing)}"


def test_every_pulled_image_is_pinned(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"{name}: needs an image or a build"
        if "build" in svc:
            continue  # built locally from this repository
        repo, tag = _image_ref(svc["image"])
        assert tag, f"{name}: image {svc['image']!r} has no tag"
        assert tag != "latest" and "latest" not in tag.split("-"), (
            f"{name}: image {svc['image']!r} is not pinned"
        )


def test_kafka_is_official_image_in_kraft_mode(compose: dict[str, Any], services: dict[str, Any]) -> None:
    kafka = services["kafka"]
    repo, tag = _image_ref(kafka["image"])
    assert repo == "apache/kafka", f"expected the official apache/kafka image, got {kafka['image']!r}"
    assert re.fullmatch(r"4\.\d+\.\d+", tag), f"expected a pinned 4.x.y tag, got {tag!r}"

    env = {k: _interpolate(v, {}) for k, v in _env(kafka).items()}  # without the `cluster` profile's variables
    assert not any("ZOOKEEPER" in k for k in env), "Kafka 4 has no ZooKeeper mode"
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@127.0.0.1:9093"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", "topics are created by the services from config"
    # The image formats its storage with CLUSTER_ID: 16 bytes, URL-safe base64 without padding.
    assert len(base64.urlsafe_b64decode(env["CLUSTER_ID"] + "==")) == 16

    # Data on a named volume at the configured log dir, so it survives `docker compose down`.
    named = compose.get("volumes") or {}
    volumes = [v.split(":") for v in kafka.get("volumes", [])]
    assert [v[1] for v in volumes if v[0] in named] == [env["KAFKA_LOG_DIRS"]]

    assert (
        "/opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server 127.0.0.1:9092"
        in _interpolate(_healthcheck_cmd(kafka), {})
    )


def test_only_the_sasl_listener_leaves_the_brokers_loopback(services: dict[str, Any]) -> None:
    """The single broker (no `cluster` profile variables): the services' listener, SASL_PLAINTEXT on 9094, is the
    only one on the compose network; PLAINTEXT and CONTROLLER, where User:ANONYMOUS is a super user, listen and
    are advertised on 127.0.0.1 only. Nothing is published."""
    env = {k: _interpolate(v, {}) for k, v in _env(services["kafka"]).items()}
    assert env["KAFKA_LISTENERS"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093,SASL_PLAINTEXT://:9094"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://127.0.0.1:9092,SASL_PLAINTEXT://kafka:9094"
    assert env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"] == (
        "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT")
    assert env["KAFKA_SUPER_USERS"].split(";") == ["User:ANONYMOUS", "User:flywheel"]
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert not services["kafka"].get("ports"), "the broker stays unpublished"
    for name in FLYWHEEL_SERVICES:
        assert _interpolate(_env(services[name])["FLYWHEEL_KAFKA_BOOTSTRAP"], {}) == "kafka:9094", name
    # Only the two Kafka init steps reach the loopback listener: they share the broker's network namespace.
    shared_ns = {name for name, svc in services.items() if "network_mode" in svc}
    assert shared_ns == {"kafka-users", "kafka-init"}
    for step in shared_ns:
        assert services[step]["network_mode"] == "service:kafka", step


def _kafka_env_to_properties(env: dict[str, str]) -> dict[str, str]:
    """The apache/kafka image's env -> server.properties mapping (KAFKA_FOO___BAR__BAZ -> foo-bar_baz)."""
    not_props = {"KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_VERSION"}
    props = {}
    for key, value in env.items():
        if key.startswith("KAFKA_") and key not in not_props:
            name = key[len("KAFKA_") :].lower().replace("_", ".").replace("...", "-").replace("..", "_")
            props[name] = value
    return props


def test_kafka_settings_match_the_local_stack(services: dict[str, Any], tmp_path: Path) -> None:
    """The local stack's broker with its SASL listener and the authorizer (kafka_sasl_port + kafka_authorizer):
    the same settings but for addresses and paths."""
    from devstack.config import InfraConfig
    from devstack.kafka import server_properties

    local = {}
    cfg = InfraConfig.resolve(home=tmp_path, kafka_sasl_port=19094, kafka_authorizer=True)
    for line in server_properties(cfg).splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            local[key.strip()] = value.strip()
    compose_props = _kafka_env_to_properties({k: _interpolate(v, {}) for k, v in _env(services["kafka"]).items()})
    # Addresses and paths legitimately differ between a container and a local process.
    where = {"listeners", "advertised.listeners", "controller.quorum.voters", "log.dirs"}
    local_settings = {k: v for k, v in local.items() if k not in where}
    compose_settings = {k: v for k, v in compose_props.items() if k not in where}
    assert compose_settings == local_settings


def _makefile_cluster_env() -> dict[str, str]:
    """The variables `make up BROKERS=3` exports for docker compose (the Makefile's COMPOSE_CLUSTER)."""
    [line] = [ln for ln in (REPO / "Makefile").read_text().splitlines() if ln.startswith("COMPOSE_CLUSTER :=")]
    return dict(item.split("=", 1) for item in line.split(":=", 1)[1].split())


def test_cluster_profile_runs_three_nodes_like_the_local_cluster(services: dict[str, Any], tmp_path: Path) -> None:
    from devstack.config import InfraConfig
    from devstack.kafka import server_properties

    given = _makefile_cluster_env()
    assert given["COMPOSE_PROFILES"] == "cluster"
    assert "profiles" not in services["kafka"], "node 1 runs with and without the profile"
    nodes = {name: {k: _interpolate(v, given) for k, v in _env(services[name]).items()}
             for name in ("kafka", "kafka-2", "kafka-3")}
    for name in ("kafka-2", "kafka-3"):
        assert services[name]["profiles"] == ["cluster"], name
        assert services[name]["image"] == services["kafka"]["image"] and services[name]["hostname"] == name
        assert _interpolate(_healthcheck_cmd(services[name]), given) == _interpolate(
            _healthcheck_cmd(services["kafka"]), given).replace("kafka:", "localhost:"), name
    assert [env["KAFKA_NODE_ID"] for env in nodes.values()] == ["1", "2", "3"]
    assert len({env["CLUSTER_ID"] for env in nodes.values()}) == 1, "one cluster id formats every node"
    volumes = [tuple(v.split(":")) for name in nodes for v in services[name]["volumes"]]
    assert len({v[0] for v in volumes}) == 3 and {v[1] for v in volumes} == {"/var/lib/kafka/data"}
    voters = "1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"
    local = InfraConfig.resolve(home=tmp_path, brokers=3)
    where = {"listeners", "advertised.listeners", "controller.quorum.voters", "log.dirs", "node.id"}
    # The local stack's SASL listener and authorizer are for a single broker only: what they add to its settings
    # is what every compose node adds to the local cluster's.
    def props_of(text: str) -> dict[str, str]:
        return dict(line.partition("=")[::2] for line in text.splitlines() if line.strip() and not line.startswith("#"))
    single = props_of(server_properties(InfraConfig.resolve(home=tmp_path / "single")))
    with_sasl = props_of(server_properties(InfraConfig.resolve(home=tmp_path / "sasl", kafka_sasl_port=19094,
                                                               kafka_authorizer=True)))
    sasl = {k: v for k, v in with_sasl.items() if single.get(k) != v and k not in where}
    assert {"authorizer.class.name", "super.users", "sasl.enabled.mechanisms"} <= set(sasl), sasl
    for (name, env), node in zip(nodes.items(), local.kafka_nodes, strict=True):
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == voters, name
        # Every node's PLAINTEXT and controller listeners on the compose network (the nodes replicate and vote over
        # them); node 1's on its name there, the others' on every interface.
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092,SASL_PLAINTEXT://{name}:9094"
        host = name if name == "kafka" else ""
        assert env["KAFKA_LISTENERS"] == f"PLAINTEXT://{host}:9092,CONTROLLER://{host}:9093,SASL_PLAINTEXT://:9094"
        props = {**props_of(server_properties(local, node)), **sasl}
        compose_props = _kafka_env_to_properties(env)
        assert {k: v for k, v in compose_props.items() if k not in where} == {
            k: v for k, v in props.items() if k not in where}, name
    for name in FLYWHEEL_SERVICES:
        env = _env(services[name])
        assert _interpolate(env["FLYWHEEL_KAFKA_BOOTSTRAP"], {}) == "kafka:9094"
        assert _interpolate(env["FLYWHEEL_KAFKA_BOOTSTRAP"], given) == "kafka:9094,kafka-2:9094,kafka-3:9094"
    for step in ("kafka-users", "kafka-init"):  # node 1's PLAINTEXT listener, on its name with the profile
        bootstrap = {k: _interpolate(v, given) for k, v in _env(services[step]).items()}
        assert bootstrap.get("BOOTSTRAP", bootstrap.get("FLYWHEEL_KAFKA_BOOTSTRAP")) == "kafka:9092", step


def test_minio_pinned_to_recent_release(services: dict[str, Any]) -> None:
    repo, tag = _image_ref(services["minio"]["image"])
    assert repo in ("minio/minio", "quay.io/minio/minio"), f"unexpected MinIO image {repo!r}"
    m = RELEASE_TAG.fullmatch(tag)
    assert m, f"MinIO must be pinned to a RELEASE.<date> tag, got {tag!r}"
    released = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H-%M-%SZ").replace(tzinfo=dt.UTC)
    assert released > MINIO_MIN_RELEASE, f"MinIO {tag} predates {MINIO_MIN_RELEASE:%Y-%m-%d}"
    assert services["minio"]["command"][:2] == ["server", "/data"]
    assert "healthcheck" in services["minio"]


def test_minio_init_creates_the_services_bucket_idempotently(services: dict[str, Any]) -> None:
    init = services["minio-init"]
    repo, tag = _image_ref(init["image"])
    assert repo in ("minio/mc", "quay.io/minio/mc") and RELEASE_TAG.fullmatch(tag), init["image"]
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"}}
    script = " ".join(init["command"]) if isinstance(init["command"], list) else init["command"]
    assert "mc mb --ignore-existing" in script
    bucket = _env(init)["BUCKET"]
    for name in FLYWHEEL_SERVICES:
        assert _env(services[name])["FLYWHEEL_S3_BUCKET"] == bucket, f"{name} uses another bucket"
    # minio-init logs in as the root user that minio was started with.
    minio_env, init_env = _env(services["minio"]), _env(init)
    assert init_env["MINIO_ROOT_USER"] == minio_env["MINIO_ROOT_USER"]
    assert init_env["MINIO_ROOT_PASSWORD"] == minio_env["MINIO_ROOT_PASSWORD"]


def test_prometheus_mounts_config_and_rules(services: dict[str, Any]) -> None:
    prom = services["prometheus"]
    repo, tag = _image_ref(prom["image"])
    assert repo in ("prom/prometheus", "quay.io/prometheus/prometheus")
    assert re.fullmatch(r"v3\.\d+\.\d+", tag), f"expected a pinned v3.x.y tag, got {tag!r}"
    mounts = {}
    for volume in prom["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    assert mounts.get("/etc/prometheus") == "./deploy/prometheus"
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_in_container = Path(config_flag.split("=", 1)[1])
    assert config_in_container.parent == Path("/etc/prometheus")
    config = REPO / "deploy" / "prometheus" / config_in_container.name
    rule_files = yaml.safe_load(config.read_text())["rule_files"]
    assert rule_files == ["alerts.yml"] and (config.parent / "alerts.yml").is_file()
    assert prom["ports"] == PUBLISHED["prometheus"]
    assert "/-/healthy" in _healthcheck_cmd(prom)


def test_prometheus_scrapes_the_compose_services(services: dict[str, Any]) -> None:
    cfg = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    for name in ("trainer", "paramsync", "admin"):
        targets = [t for sc in jobs[f"flywheel-{name}"]["static_configs"] for t in sc["targets"]]
        assert targets == [f"{name}:{HTTP_PORTS[name]}"]
    (dns,) = jobs["flywheel-sampler"]["dns_sd_configs"]
    assert dns["names"] == ["sampler"] and dns["type"] == "A" and dns["port"] == HTTP_PORTS["sampler"]


def test_grafana_is_provisioned_read_only_and_signs_in(compose: dict[str, Any], services: dict[str, Any]) -> None:
    """Pinned official image, the data source and dashboards mounted read-only from deploy/grafana, started
    after Prometheus is healthy, no anonymous access, and an admin password from the environment with a
    default for a laptop. tests/unit/test_grafana.py checks what the mounted files contain."""
    grafana = services["grafana"]
    repo, tag = _image_ref(grafana["image"])
    assert repo in ("grafana/grafana", "grafana/grafana-oss"), f"expected the official image, got {repo!r}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", tag), f"expected a pinned X.Y.Z tag, got {tag!r}"
    assert grafana["ports"] == PUBLISHED["grafana"]
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert grafana["restart"] == "unless-stopped"
    assert "http://127.0.0.1:3000/api/health" in _healthcheck_cmd(grafana)

    binds = {}
    for volume in grafana["volumes"]:
        source, target, *mode = volume.split(":")
        if source.startswith("./"):
            assert mode == ["ro"], f"grafana: mount {source} read-only"
            assert (REPO / source).is_dir(), f"grafana mounts {source}, which does not exist"
            binds[target] = source
        else:
            assert source in (compose.get("volumes") or {}), f"grafana: {volume} is not a named volume"
    assert binds["/etc/grafana/provisioning/datasources"] == "./deploy/grafana/provisioning/datasources"
    assert binds["/etc/grafana/provisioning/dashboards"] == "./deploy/grafana/provisioning/dashboards"
    assert "./deploy/grafana/dashboards" in binds.values()

    env = _env(grafana)
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED", "false").lower() == "false", "no anonymous access"
    assert env.get("GF_USERS_ALLOW_SIGN_UP", "false").lower() == "false", "no self sign-up"
    assert "GF_AUTH_DISABLE_LOGIN_FORM" not in env, "the login form is the only way in"
    password_var, password_default = _default(env["GF_SECURITY_ADMIN_PASSWORD"])
    assert not password_var.startswith("FLYWHEEL_"), "the services reject unknown FLYWHEEL_* variables"
    assert password_default != "admin" and len(password_default) >= 12, (
        "the compose default must not be Grafana's own (admin)"
    )


# ---- the four Flywheel services ---------------------------------------------------------------


def test_flywheel_services_build_from_deploy_dockerfile_the_sampler_its_torch_free_target(
        services: dict[str, Any]) -> None:
    """trainer, paramsync and admin share flywheel:local (deploy/Dockerfile's default stage, with torch); the
    samplers run its `sampler` target (flywheel-sampler:local, no torch)."""
    images = {}
    for name in FLYWHEEL_SERVICES:
        svc = services[name]
        build = svc["build"]
        want = {"context": ".", "dockerfile": "deploy/Dockerfile"}
        if name == "sampler":
            want["target"] = "sampler"
        assert build == want, f"{name}: {build}"
        images[name] = svc["image"]
        assert svc["command"] == [f"services.{name}"], f"{name}: command {svc['command']}"
    assert images == {"trainer": "flywheel:local", "paramsync": "flywheel:local", "admin": "flywheel:local",
                      "sampler": "flywheel-sampler:local"}, images
    stages = [rest.split() for instr, rest in _dockerfile_instructions() if instr == "FROM"]
    assert ["runtime", "AS", "sampler"] in stages, "deploy/Dockerfile has no `sampler` target"


@pytest.mark.parametrize("name", FLYWHEEL_SERVICES)
def test_compose_command_is_a_runnable_module(name: str) -> None:
    # ENTRYPOINT ["python", "-m"] + command ["services.<name>"] needs a package __main__.
    main = REPO / "services" / name / "__main__.py"
    assert main.is_file(), f"`python -m services.{name}` needs {main.relative_to(REPO)}"


def test_flywheel_services_settings_are_valid(services: dict[str, Any]) -> None:
    """Each service's environment resolves, with the shared config file, to valid Flywheel settings: signed by
    default (issue 43), the trainer and paramsync each with its own private key, every other service with the
    public keys only (``startup_problem`` passes for each, with keys as the `keys` service makes them)."""
    from shared.settings import load_settings
    from shared.signing import startup_problem

    assert CONFIG.is_file()
    for name in FLYWHEEL_SERVICES:
        raw = _env(services[name])
        assert raw["FLYWHEEL_CONFIG"] == f"/app/configs/{CONFIG.name}", f"{name}: another config file"
        env = _at_local_keys({k: _interpolate(v, {"FLYWHEEL_ADMIN_TOKEN": "test-token"}) for k, v in raw.items()})
        settings = load_settings(CONFIG, environ=env)  # unknown FLYWHEEL_* variables raise
        assert settings.signing.enabled, f"{name}: signing must be on by default"
        assert (settings.signing.private_key_file is not None) == (name in ("trainer", "paramsync")), name
        assert startup_problem(name, settings) is None, name
        mounts = {v.split(":")[1] for v in services[name].get("volumes") or []}
        assert "/keys/public" in mounts, f"{name}: the public keys are not mounted"
        own = {"trainer": {"/keys/trainer"}, "paramsync": {"/keys/paramsync"}}.get(name, set())
        assert mounts & {"/keys/trainer", "/keys/paramsync"} == own, f"{name} mounts another role's private key"
        kafka = settings.kafka
        assert (kafka.bootstrap, kafka.security_protocol, kafka.sasl_mechanism) == (
            "kafka:9094", "SASL_PLAINTEXT", "SCRAM-SHA-512"), name
        assert kafka.sasl_username == name, f"{name}: principal User:{name} is what shared.acl grants"
        assert settings.store.backend == "s3"
        assert settings.s3.endpoint == "http://minio:9000"
        assert settings.http.host == "0.0.0.0", f"{name}: must listen beyond the container's loopback"
        assert settings.http.port == HTTP_PORTS[name]


def test_admin_requires_a_token_and_publishes_8080(services: dict[str, Any]) -> None:
    admin = services["admin"]
    token = _env(admin)["FLYWHEEL_ADMIN_TOKEN"]
    assert re.fullmatch(r"\$\{FLYWHEEL_ADMIN_TOKEN:\?[^}]+\}", token), (
        f"the token must be required: {token!r}"
    )
    assert admin["ports"] == PUBLISHED["admin"]
    for name in ("trainer", "paramsync", "sampler"):
        assert "FLYWHEEL_ADMIN_TOKEN" not in _env(services[name]), f"{name} has no use for the admin token"


@pytest.mark.parametrize("name", FLYWHEEL_SERVICES)
def test_flywheel_service_healthcheck_and_ordering(services: dict[str, Any], name: str) -> None:
    svc = services[name]
    cmd = _healthcheck_cmd(svc)
    assert cmd.startswith("python -c "), f"{name}: the slim image has no curl; use python"
    assert f"http://127.0.0.1:{HTTP_PORTS[name]}/healthz" in cmd
    assert svc["depends_on"] == {
        "kafka": {"condition": "service_healthy"},
        # The `cluster` profile's brokers: waited for when the profile runs them, ignored when it does not.
        "kafka-2": {"condition": "service_healthy", "required": False},
        "kafka-3": {"condition": "service_healthy", "required": False},
        "minio-init": {"condition": "service_completed_successfully"},
        # Its users and ACLs exist before any service (no role may create topics or ACLs itself).
        "kafka-users": {"condition": "service_completed_successfully"},
        "kafka-init": {"condition": "service_completed_successfully"},
        "keys": {"condition": "service_completed_successfully"},  # the signing keys exist before any service
    }
    assert svc["restart"] == "unless-stopped"


def test_healthy_dependencies_have_healthchecks(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        for dep, spec in deps.items() if isinstance(deps, dict) else []:
            assert dep in services, f"{name} depends on unknown service {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy but it has no healthcheck"
                )


def test_sampler_is_scalable(services: dict[str, Any]) -> None:
    sampler = services["sampler"]
    for key in ("container_name", "ports", "hostname"):
        assert key not in sampler, f"sampler must not set {key}: `--scale sampler=N` replicas would collide"
    assert "deploy" not in sampler or "replicas" not in sampler["deploy"]


# ---- security defaults ------------------------------------------------------------------------


def _port_binding(port: str | int | dict[str, Any]) -> tuple[str | None, str | None, str]:
    """(host_ip, published, target) of a port in short (`[IP:][HOST:]CONTAINER[/PROTO]`) or long syntax."""
    if isinstance(port, dict):
        published = port.get("published")
        return port.get("host_ip"), None if published is None else str(published), str(port["target"])
    spec = str(port).split("/", 1)[0]
    if spec.startswith("["):  # [IPv6]:HOST:CONTAINER
        ip, _, rest = spec[1:].partition("]:")
        host, _, target = rest.rpartition(":")
        return ip, host or None, target
    parts = spec.split(":")
    if len(parts) == 1:
        return None, None, parts[0]
    if len(parts) == 2:
        return None, parts[0], parts[1]
    return ":".join(parts[:-2]), parts[-2] or None, parts[-1]


def test_published_ports_bind_loopback_only(services: dict[str, Any]) -> None:
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert published == PUBLISHED, "only admin, Prometheus and Grafana are published, and only as listed"
    for name, ports in published.items():
        for port in ports:
            host_ip, host_port, _ = _port_binding(port)
            assert host_ip == "127.0.0.1", (
                f"{name}: {port!r} must bind 127.0.0.1 (a port without an address is published on every "
                "interface, past the host firewall); expose deliberately with an override file"
            )
            assert host_port, f"{name}: {port!r} needs a fixed host port to be reachable as documented"
    for name in ("kafka", "minio", *INIT_STEPS) + tuple(n for n in FLYWHEEL_SERVICES if n != "admin"):
        assert "ports" not in services[name], f"{name} must not be published"


def _mentions(value: object, needle: str) -> bool:
    return needle in json.dumps(value)


def test_only_minio_and_minio_init_see_the_root_credentials(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        env = _env(svc)
        if name in ROOT_CREDENTIAL_SERVICES:
            assert {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} <= set(env), name
            continue
        assert not any(k.startswith("MINIO_ROOT") for k in env), f"{name} must not get MinIO root credentials"
        assert not _mentions(svc, "MINIO_ROOT"), f"{name} must not refer to MinIO root credentials"
        assert "env_file" not in svc, f"{name}: an env_file could carry the root credentials"


def _default(value: str) -> tuple[str, str]:
    """(variable, default) of a `${VAR:-default}` value."""
    m = INTERPOLATION.fullmatch(value)
    assert m and m.group(2) == ":-", f"expected ${{VAR:-default}}, got {value!r}"
    return m.group(1), m.group(3)


def test_every_service_has_its_own_identity(services: dict[str, Any]) -> None:
    """Each service (both trainer ranks the trainer) sends its role's Kafka user and MinIO user, with the passwords
    that kafka-users and minio-init set from the same variables; the init steps make exactly shared.acl.ROLES."""
    from shared.acl import ROLES
    from shared.settings import load_settings

    users, minio = _env(services["kafka-users"]), _env(services["minio-init"])
    assert tuple(users["ROLES"].split()) == ROLES, "kafka-users must create exactly shared.acl.ROLES"
    assert tuple(minio["ROLES"].split()) == ROLES, "minio-init must create exactly shared.acl.ROLES"
    given = {"FLYWHEEL_ADMIN_TOKEN": "t" * 40, "TRAINERS": "2"}
    for name in (*FLYWHEEL_SERVICES, "trainer-1"):
        role = "trainer" if name == "trainer-1" else name
        raw = _env(services[name])
        env = _at_local_keys({k: _interpolate(v, given) for k, v in raw.items()})
        kafka = load_settings(CONFIG, environ=env).kafka  # unknown FLYWHEEL_* variables raise
        assert kafka.sasl_username == role and kafka.sasl_password is not None, name
        assert raw["FLYWHEEL_KAFKA_SASL_PASSWORD"] == users[f"SCRAM_PASSWORD_{role}"], name
        assert env["AWS_ACCESS_KEY_ID"] == f"flywheel-{role}", name
        assert raw["AWS_SECRET_ACCESS_KEY"] == minio[f"PASSWORD_{role}"], name
        assert (MINIO_DIR / f"flywheel-{role}.json").is_file()
    for var in [*users.values(), *minio.values()]:
        if INTERPOLATION.fullmatch(var):
            name, default = _default(var)
            assert not name.startswith("FLYWHEEL_"), (
                "the services reject unknown FLYWHEEL_* variables; name compose-only variables otherwise")
    for role in ROLES:
        _, password = _default(minio[f"PASSWORD_{role}"])
        assert len(password) >= 8, "MinIO's minimum secret length"


def test_dev_passwords_are_the_local_stacks(services: dict[str, Any]) -> None:
    from devstack.config import kafka_role_password as role_password
    from shared.acl import ROLES

    users = {k: _interpolate(v, {}) for k, v in _env(services["kafka-users"]).items()}
    assert {role: users[f"SCRAM_PASSWORD_{role}"] for role in ROLES} == {role: role_password(role) for role in ROLES}


def test_interpolated_flywheel_variables_are_settings() -> None:
    """A FLYWHEEL_* variable that compose reads from the shell also reaches local services: it must be valid."""
    from shared.settings import load_settings

    names = {m.group(1) for m in INTERPOLATION.finditer(COMPOSE.read_text()) if m.group(1).startswith("FLYWHEEL_")}
    assert names == {"FLYWHEEL_ADMIN_TOKEN"}
    for name in names:
        load_settings(None, environ={name: "x" * 40})


def _as_set(value: str | list[str]) -> set[str]:
    return {value} if isinstance(value, str) else set(value)


def test_role_policies_name_only_the_bucket(services: dict[str, Any]) -> None:
    """Every role's policy that minio-init installs names only the bucket that minio-init creates and the services
    use (tests/unit/test_s3_policies.py checks what each allows)."""
    from shared.acl import ROLES

    bucket = _env(services["minio-init"])["BUCKET"]
    for role in ROLES:
        policy = json.loads((MINIO_DIR / f"flywheel-{role}.json").read_text())
        for statement in policy["Statement"]:
            for resource in _as_set(statement["Resource"]):
                assert resource == f"arn:aws:s3:::{bucket}" or resource.startswith(f"arn:aws:s3:::{bucket}/"), (
                    role, resource)


def test_bucket_policy_names_only_the_bucket(services: dict[str, Any]) -> None:
    """deploy/minio/flywheel-bucket-policy.json, one policy for every service: compose no longer uses it (a user per
    role instead); the Kubernetes local overlay's MinIO does (a copy, tests/unit/test_k8s_check.py)."""
    path = MINIO_DIR / "flywheel-bucket-policy.json"
    bucket = _env(services["minio-init"])["BUCKET"]
    policy = json.loads(path.read_text())
    assert policy["Version"] == "2012-10-17"
    actions: set[str] = set()
    resources: set[str] = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow" and set(statement) <= {"Sid", "Effect", "Action", "Resource"}
        stmt_actions, stmt_resources = _as_set(statement["Action"]), _as_set(statement["Resource"])
        # Bucket-level actions on the bucket, object actions on its objects; nothing else, no wildcards.
        if stmt_actions <= BUCKET_ACTIONS:
            assert stmt_resources == {f"arn:aws:s3:::{bucket}"}, statement
        else:
            assert stmt_actions <= OBJECT_ACTIONS and stmt_resources == {f"arn:aws:s3:::{bucket}/*"}, statement
        actions |= stmt_actions
        resources |= stmt_resources
    assert actions == BUCKET_ACTIONS | OBJECT_ACTIONS
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}


MC_STUB = """#!/bin/sh
echo "$*" >> "$MC_LOG"
case "$*" in
  "admin policy attach"*)
    case "$MC_ATTACH" in
      ok) echo "Attached Policies: [$4]" ;;
      already) echo "mc: <ERROR> $MC_PREFIX The specified policy change is already in effect." >&2; exit 1 ;;
      *) echo "mc: <ERROR> $MC_PREFIX Access Denied." >&2; exit 1 ;;
    esac ;;
esac
"""


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX sh")
@pytest.mark.parametrize("attach", ["ok", "already", "denied"])
def test_minio_init_script(services: dict[str, Any], tmp_path: Path, attach: str) -> None:
    """The script, with a stand-in `mc`: the bucket, then for each role the policy from the mounted file, the user
    with its own password, the attachment; attaching a policy that is already attached counts as success, any other
    failure fails the job."""
    from shared.acl import ROLES

    init = services["minio-init"]
    assert init["entrypoint"] == ["/bin/sh", "-c"] and len(init["command"]) == 1
    script = _interpolate(init["command"][0], {})
    env = {k: _interpolate(v, {}) for k, v in _env(init).items()}
    (tmp_path / "mc").write_text(MC_STUB)
    (tmp_path / "mc").chmod(0o755)
    log = tmp_path / "mc.log"
    proc = subprocess.run(
        ["sh", "-c", script],
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "MC_LOG": str(log), "MC_ATTACH": attach,
             "MC_PREFIX": "Unable to make user/group policy association.", **env},
        capture_output=True, text=True, timeout=30, check=False,
    )
    if attach == "denied":
        assert proc.returncode != 0 and "Access Denied" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    [mount] = init["volumes"]
    src, dst, mode = mount.split(":")
    assert (REPO / src).resolve() == MINIO_DIR and mode == "ro"
    expected = [f"alias set flywheel http://minio:9000 {env['MINIO_ROOT_USER']} {env['MINIO_ROOT_PASSWORD']}",
                f"mb --ignore-existing flywheel/{env['BUCKET']}"]
    for role in ROLES:
        assert (MINIO_DIR / f"flywheel-{role}.json").is_file()
        expected += [f"admin policy create flywheel flywheel-{role} {dst}/flywheel-{role}.json",
                     f"admin user add flywheel flywheel-{role} flywheel-{role}-dev-secret",
                     f"admin policy attach flywheel flywheel-{role} --user flywheel-{role}"]
    assert log.read_text().splitlines() == expected


def test_every_service_rotates_its_logs(compose: dict[str, Any], services: dict[str, Any]) -> None:
    shared = compose["x-logging"]
    assert shared["driver"] == "json-file"
    assert re.fullmatch(r"\d+[km]", shared["options"]["max-size"]), shared
    assert 1 <= int(shared["options"]["max-file"]) <= 10
    for name, svc in services.items():
        assert svc.get("logging") == shared, f"{name}: use the shared log limits (logging: *logging)"


# ---- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_runs_services_with_python_m() -> None:
    raw = _dockerfile_instructions()
    args = {}
    for instr, rest in raw:
        if instr == "ARG" and "=" in rest:
            key, _, default = rest.partition("=")
            args[key] = default
    # Build-arg defaults substituted, as a plain `docker build` would.
    instructions = [
        (i, re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), r)) for i, r in raw
    ]
    froms = [rest for instr, rest in instructions if instr == "FROM"]
    assert froms, "Dockerfile has no FROM"
    assert froms[-1].split()[0] == "runtime"  # the default image: the runtime stage, torch and the project
    assert "python:3.11-slim AS runtime" in froms

    last = {instr: rest for instr, rest in instructions}  # the last of each instruction wins
    assert yaml.safe_load(last["ENTRYPOINT"]) == ["python", "-m"]
    assert yaml.safe_load(last["CMD"]) == ["services.admin"]
    assert "8000" in last["EXPOSE"].split()
    # Numeric, so that the kubelet can verify runAsNonRoot from the image alone (Kubernetes runs both images).
    users = [rest for instr, rest in instructions if instr == "USER"]
    assert users == ["10001:10001", "10001:10001"], f"the sampler and default stages run as 10001:10001: {users}"
    runs = [rest.replace('"', "") for instr, rest in instructions if instr == "RUN"]
    assert any("pip wheel --no-deps" in r for r in runs), "the project is built as a wheel without its dependencies"
    project_installs = [r for r in runs if "pip install --no-deps /tmp/wheel/" in r]
    assert len(project_installs) == 2, "both images install the project's wheel, without dependencies"
    assert any("--index-url https://download.pytorch.org/whl/cpu" in r for r in runs), (
        "install CPU torch: pip install --index-url https://download.pytorch.org/whl/cpu"
    )
    copies = [rest for instr, rest in instructions if instr == "COPY"]
    assert any(c.split()[0] == "configs" for c in copies), "the config files must be in the image"


def test_dockerfile_installs_dependencies_before_the_source_is_copied() -> None:
    """A source change rebuilds only the project's small layers: the dependency installs come from requirement
    lists written from pyproject.toml's dependency lists (COPY --from=requirements), never after a COPY of
    shared/ or services/ in the same stage, and the sampler's build fails if torch is importable."""
    stage, seen_source, installs = "", set(), []
    for instr, rest in _dockerfile_instructions():
        if instr == "FROM":
            stage = rest.split()[-1] if " AS " in rest else "final"
        elif instr == "COPY" and rest.split()[0] in ("shared", "services"):
            seen_source.add(stage)
        elif instr == "RUN" and re.search(r"pip install -r /req/(base|train)\.txt", rest):
            installs.append(stage)
            assert stage not in seen_source, f"stage {stage}: dependencies installed after the source was copied"
    assert installs == ["runtime", "final"], installs
    # A stage does not inherit its parent's ARGs: the default image's stage declares pip's again (without them the
    # wheelhouse build went to PyPI's torch index, offline, and failed in make test-compose).
    final = DOCKERFILE.read_text().split("\nFROM runtime\n")[-1]
    for arg in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        assert f"ARG {arg}\n" in final[:final.index("pip install")], f"the default stage lacks ARG {arg}"
    text = DOCKERFILE.read_text()
    sampler = text[text.index("AS sampler"):text.index("FROM runtime\n")]
    assert "find_spec('torch')" in sampler and "train.txt" not in sampler
    reqs = text[text.index("AS requirements"):text.index("AS wheel")]
    assert "['dependencies']" in reqs and "['optional-dependencies']['train']" in reqs


def test_dockerignore_keeps_local_state_out() -> None:
    entries = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()}
    for required in (".git", ".venv", ".flywheel", ".env"):
        assert required in entries, f".dockerignore must exclude {required}"


# ---- docker compose itself, where it runs -----------------------------------------------------


def _docker_compose_works() -> str | None:
    """None when `docker compose` can be used here, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
            return "`docker info` failed: no Docker engine answers"
        if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
            return "the docker compose plugin is not installed"
    except subprocess.TimeoutExpired:
        return "docker did not answer within 30 s"
    return None


def test_docker_compose_config_is_valid() -> None:
    reason = _docker_compose_works()
    if reason:
        pytest.skip(f"docker compose config not run: {reason}")
    env = {**os.environ, "FLYWHEEL_ADMIN_TOKEN": os.environ.get("FLYWHEEL_ADMIN_TOKEN", "test-token")}
    proc = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"docker compose config failed:\n{proc.stdout}\n{proc.stderr}"


# ---- trainer ranks (the `ranks` profile) -------------------------------------------------------


@functools.cache
def _keys_dir() -> str:
    """Signing keys laid out as the `keys` service makes them under /keys (``flywheel keys init``)."""
    from shared.signing import generate_keys

    directory = tempfile.mkdtemp(prefix="flywheel-compose-keys-")
    generate_keys(Path(directory))
    return directory


def _at_local_keys(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the containers' /keys/ paths pointed at :func:`_keys_dir`."""
    return {k: v.replace("/keys/", f"{_keys_dir()}/") for k, v in env.items()}


def _trainer_settings(services: dict[str, Any], name: str, given: dict[str, str]) -> Any:
    from shared.settings import load_settings

    env = _at_local_keys({k: _interpolate(v, given) for k, v in _env(services[name]).items()})
    return load_settings(CONFIG, environ=env)


def test_ranks_profile_runs_rank_1_beside_rank_0(services: dict[str, Any]) -> None:
    from shared.settings import ConfigError

    trainer, rank1 = services["trainer"], services["trainer-1"]
    assert "profiles" not in trainer and rank1["profiles"] == ["ranks"]
    for key in ("image", "build", "command", "healthcheck", "depends_on", "restart", "init", "stop_grace_period"):
        assert rank1[key] == trainer[key], key
    for svc in (trainer, rank1):
        assert not svc.get("ports"), "the rendezvous store has no authentication: never published"
    given = {"TRAINERS": "2"}
    r0, r1 = (_trainer_settings(services, n, given).trainer for n in ("trainer", "trainer-1"))
    assert (r0.world_size, r0.rank, r1.world_size, r1.rank) == (2, 0, 2, 1)
    assert r0.rendezvous == r1.rendezvous == "trainer:29500"  # rank 0's service name
    # One group instance id; the rank suffix makes the static member ids distinct.
    assert r0.group_instance_id == r1.group_instance_id
    assert len({f"{t.group_instance_id}-rank{t.rank}" for t in (r0, r1)}) == 2
    assert _trainer_settings(services, "trainer", {}).trainer.world_size == 1  # default: one rank
    with pytest.raises(ConfigError, match="rank"):
        _trainer_settings(services, "trainer-1", {})  # the profile without TRAINERS=2 stops at start


# ---- the init steps of the per-role identities ------------------------------------------------


def test_init_steps_are_pinned_logged_and_ordered(compose: dict[str, Any], services: dict[str, Any]) -> None:
    for step in INIT_STEPS:
        assert services[step]["restart"] == "no", step
        assert "healthcheck" not in services[step], f"{step}: a one-shot job has no health"
    assert services["kafka-users"]["image"] == services["kafka"]["image"]
    assert services["kafka-init"]["image"] == services["trainer"]["image"]
    assert services["kafka-init"]["build"] == services["trainer"]["build"]
    assert services["kafka-users"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    assert services["kafka-init"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    assert services["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}


def test_kafka_init_generates_the_acls_from_shared_acl(services: dict[str, Any]) -> None:
    """kafka-init runs ``python -m shared.kafka_init`` from the image with the services' config, on the broker's
    loopback PLAINTEXT listener (User:ANONYMOUS, a super user): provision_run, no copy of the ACLs, nothing
    mounted from the checkout."""
    from shared import kafka_init
    from shared.settings import load_settings

    init = services["kafka-init"]
    assert init["entrypoint"] == ["python", "-m", "shared.kafka_init"] and "volumes" not in init
    env = {k: _interpolate(v, {}) for k, v in _env(init).items()}
    settings = load_settings(CONFIG, environ=env)
    assert settings.kafka.bootstrap == "127.0.0.1:9092" and settings.kafka.security_protocol == "PLAINTEXT"
    assert env["FLYWHEEL_CONFIG"] == _env(services["trainer"])["FLYWHEEL_CONFIG"]
    text = Path(kafka_init.__file__).read_text()
    assert "provision_run(settings)" in text and "User:" not in text


KAFKA_CONFIGS_STUB = """#!/bin/sh
echo "$*" >> "$KC_LOG"
"""


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX sh")
@pytest.mark.parametrize("password", ["ok", "bad"])
def test_kafka_users_script(services: dict[str, Any], tmp_path: Path, password: str) -> None:
    """The script, with a stand-in kafka-configs.sh: one SCRAM user per role with its own password, on the broker's
    loopback listener; a password that kafka-configs' syntax cannot carry (any role's) stops it before any user
    is changed."""
    from shared.acl import ROLES

    users = services["kafka-users"]
    assert users["entrypoint"] == ["/bin/sh", "-c"] and len(users["command"]) == 1
    bin_dir = tmp_path / "opt" / "kafka" / "bin"
    bin_dir.mkdir(parents=True)
    script = _interpolate(users["command"][0], {}).replace("/opt/kafka/bin/", f"{bin_dir}/")
    given = {} if password == "ok" else {"KAFKA_ADMIN_PASSWORD": "x],SCRAM-SHA-256=[password=y"}
    env = {k: _interpolate(v, given) for k, v in _env(users).items()}
    (bin_dir / "kafka-configs.sh").write_text(KAFKA_CONFIGS_STUB)
    (bin_dir / "kafka-configs.sh").chmod(0o755)
    log = tmp_path / "kc.log"
    proc = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", "KC_LOG": str(log), **env},
                          capture_output=True, text=True, timeout=30, check=False)
    if password == "bad":  # admin is the last role: no user before it was changed either
        assert proc.returncode == 2 and "the password of admin" in proc.stderr and not log.exists()
        return
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        f"--bootstrap-server 127.0.0.1:9092 --alter --entity-type users --entity-name {role} "
        f"--add-config SCRAM-SHA-512=[password={role}-dev-scram-secret]" for role in ROLES]


