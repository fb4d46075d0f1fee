"""docker-compose.yml as `docker compose` itself reads it, without a Docker engine.

tools/compose-validate is a small Go program around github.com/compose-spec/compose-go/v2, the
loader inside `docker compose`: JSON-schema validation against the Compose Specification,
interpolation, normalisation (ports become {host_ip, published, target}, durations are parsed) and
the consistency checks. It is built once into ${FLYWHEEL_CACHE:-~/.cache/flywheel}/bin, keyed on a
hash of its source, go.mod, go.sum and the Go version (the first build downloads the modules and
compiles for a minute or so; later runs reuse the binary). The tests assert on the normalised
project, and that broken copies of the file are rejected with the loader's message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
EXPOSE_EXAMPLE = REPO / "deploy" / "compose.expose.example.yml"
TOOL = REPO / "tools" / "compose-validate"

FLYWHEEL_SERVICES = ("trainer", "paramsync", "admin", "sampler")
LONG_RUNNING = ("kafka", "minio", "prometheus", "grafana", *FLYWHEEL_SERVICES)
ADMIN_TOKEN = "compose-spec-test-token-0123456789abcdef"  # >= 32 characters, as admin requires
# Variables the file interpolates: dropped from the test's environment so that the shell's values
# (or a developer's exports) cannot change what is checked.
COMPOSE_VARIABLES = ("FLYWHEEL_", "MINIO_", "GRAFANA_", "COMPOSE_", "DOCKER_", "KAFKA_", "TRAINERS")
BUILD_TIMEOUT_S = 270  # inside pytest-timeout's 300 s for the first test


def _cache_dir() -> Path:
    return Path(os.environ.get("FLYWHEEL_CACHE") or Path.home() / ".cache" / "flywheel").expanduser() / "bin"


def _go_env() -> dict[str, str]:
    # GOTOOLCHAIN=local: build with the Go on PATH, never download another toolchain.
    # -mod=readonly: go.sum is the committed one; a missing or changed checksum is an error.
    # -buildvcs=false: the binary does not depend on the state of the git checkout.
    return {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly -buildvcs=false"}


def _build_validator() -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("compose-go validation needs Go (https://go.dev/dl/) on PATH; `go` was not found")
    version = subprocess.run(
        [go, "env", "GOVERSION"], env=_go_env(), capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    key = hashlib.sha256(version.encode())
    for path in [*sorted(TOOL.glob("*.go")), TOOL / "go.mod", TOOL / "go.sum"]:
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    binary = _cache_dir() / f"compose-validate-{key.hexdigest()[:16]}"
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
    started = time.monotonic()
    proc = subprocess.run(
        [go, "build", "-trimpath", "-o", str(partial), "."],
        cwd=TOOL, env=_go_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        pytest.fail(
            f"building {TOOL.relative_to(REPO)} failed (the first build downloads its modules through "
            f"GOPROXY={os.environ.get('GOPROXY', 'https://proxy.golang.org')}):\n{proc.stderr}"
        )
    partial.replace(binary)  # atomic: a concurrent run sees the whole binary or none
    for stale in binary.parent.glob("compose-validate-*"):
        if stale != binary and not stale.name.endswith(".partial"):
            stale.unlink(missing_ok=True)
    print(f"built {binary} in {time.monotonic() - started:.1f}s ({version})")
    return binary


@pytest.fixture(scope="module")
def validator() -> Path:
    return _build_validator()


def _run(
    validator: Path, *files: Path, scale: dict[str, int] | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    args = [str(validator)]
    for f in files or (COMPOSE,):
        args += ["-f", str(f)]
    for service, n in (scale or {}).items():
        args += ["-scale", f"{service}={n}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(COMPOSE_VARIABLES)}
    return subprocess.run(
        args, cwd=REPO, env={**base, "FLYWHEEL_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})},
        capture_output=True, text=True, timeout=60, check=False,
    )


def _load(validator: Path, *files: Path, **kwargs: Any) -> dict[str, Any]:
    proc = _run(validator, *files, **kwargs)
    assert proc.returncode == 0, f"compose-go rejected the file:\n{proc.stderr}"
    project: dict[str, Any] = json.loads(proc.stdout)
    return project


@pytest.fixture(scope="module")
def project(validator: Path) -> dict[str, Any]:
    return _load(validator)


@pytest.fixture(scope="module")
def services(project: dict[str, Any]) -> dict[str, Any]:
    svcs: dict[str, Any] = project["services"]
    return svcs


# ---- the file as docker compose sees it -------------------------------------------------------


def test_loads_under_the_compose_specification(project: dict[str, Any]) -> None:
    assert project["name"] == "flywheel"
    assert set(project["services"]) == {"kafka", "minio", "minio-init", "kafka-users", "kafka-init", "keys",
                                        "prometheus", "grafana", *FLYWHEEL_SERVICES}
    assert set(project["volumes"]) == {"kafka-data", "kafka-2-data", "kafka-3-data", "minio-data", "prometheus-data",
                                       "grafana-data", "trainer-key", "paramsync-key", "signing-public"}
    assert "kafka-2" not in project["services"] and "kafka-3" not in project["services"], "the `cluster` profile"


def test_published_ports_are_loopback_only(services: dict[str, Any]) -> None:
    published = {
        name: [(p.get("host_ip"), p.get("published"), p["target"], p["protocol"]) for p in svc.get("ports", [])]
        for name, svc in services.items()
        if svc.get("ports")
    }
    assert published == {
        "admin": [("127.0.0.1", "8080", 8080, "tcp")],
        "prometheus": [("127.0.0.1", "9090", 9090, "tcp")],
        "grafana": [("127.0.0.1", "3000", 3000, "tcp")],
    }


def test_credentials(validator: Path, services: dict[str, Any]) -> None:
    init_env = services["minio-init"]["environment"]
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if name not in ("minio", "minio-init"):
            assert not [k for k in env if k.startswith("MINIO_ROOT")], f"{name} sees the MinIO root credentials"
            assert env.get("AWS_ACCESS_KEY_ID") != init_env["MINIO_ROOT_USER"], name
    users_env = services["kafka-users"]["environment"]
    for name in FLYWHEEL_SERVICES:
        env = services[name]["environment"]
        assert env["AWS_ACCESS_KEY_ID"] == f"flywheel-{name}", name
        assert env["AWS_SECRET_ACCESS_KEY"] == init_env[f"PASSWORD_{name}"], name
        assert (env["FLYWHEEL_KAFKA_BOOTSTRAP"], env["FLYWHEEL_KAFKA_SASL_USERNAME"]) == ("kafka:9094", name)
        assert env["FLYWHEEL_KAFKA_SASL_PASSWORD"] == users_env[f"SCRAM_PASSWORD_{name}"], name
        assert ("FLYWHEEL_ADMIN_TOKEN" in env) == (name == "admin"), name
    assert services["admin"]["environment"]["FLYWHEEL_ADMIN_TOKEN"] == ADMIN_TOKEN
    # `$$` in the file reaches the shell as `$`: the indirect lookup of each role's password.
    [users] = services["kafka-users"]["command"]
    assert 'eval "password=\\${SCRAM_PASSWORD_$role}"' in users, users
    [minio_init] = services["minio-init"]["command"]
    assert 'eval "password=\\${PASSWORD_$role}"' in minio_init, minio_init

    # Operators' values flow to the right places (each role's to its service only), and the root password never
    # reaches a service.
    custom = {"MINIO_ROOT_USER": "ops-root", "MINIO_ROOT_PASSWORD": "ops-root-secret-1",
              **{f"MINIO_{n.upper()}_PASSWORD": f"ops-{n}-s3-secret" for n in FLYWHEEL_SERVICES},
              **{f"KAFKA_{n.upper()}_PASSWORD": f"ops-{n}-kafka-secret" for n in FLYWHEEL_SERVICES}}
    custom_services = _load(validator, env=custom)["services"]
    assert custom_services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "ops-root-secret-1"
    for name, svc in custom_services.items():
        if name not in ("minio", "minio-init"):
            assert "ops-root" not in json.dumps(svc), f"{name} sees the MinIO root credentials"
    for name in FLYWHEEL_SERVICES:
        env = custom_services[name]["environment"]
        assert custom_services["minio-init"]["environment"][f"PASSWORD_{name}"] == f"ops-{name}-s3-secret"
        assert custom_services["kafka-users"]["environment"][f"SCRAM_PASSWORD_{name}"] == f"ops-{name}-kafka-secret"
        assert (env["AWS_SECRET_ACCESS_KEY"], env["FLYWHEEL_KAFKA_SASL_PASSWORD"]) == (
            f"ops-{name}-s3-secret", f"ops-{name}-kafka-secret"), name
        others = [n for n in FLYWHEEL_SERVICES if n != name]
        assert not any(f"ops-{n}-" in json.dumps(env) for n in others), f"{name} sees another role's password"


def test_policy_mount(services: dict[str, Any]) -> None:
    init = services["minio-init"]
    (mount,) = init["volumes"]
    assert mount["type"] == "bind" and mount.get("read_only") is True
    assert Path(mount["source"]) == REPO / "deploy" / "minio"  # resolved against the project directory
    for role in init["environment"]["ROLES"].split():
        assert f"{mount['target']}/flywheel-$role.json" in init["command"][0]
        assert (Path(mount["source"]) / f"flywheel-{role}.json").is_file(), role


def test_grafana(validator: Path, services: dict[str, Any]) -> None:
    """Provisioning mounted read-only from the project directory, after a healthy Prometheus; no anonymous
    access; the admin password is the operator's when given, a laptop default otherwise."""
    grafana = services["grafana"]
    binds = {m["target"]: m for m in grafana["volumes"] if m["type"] == "bind"}
    assert set(binds) == {"/etc/grafana/provisioning/datasources", "/etc/grafana/provisioning/dashboards",
                          "/etc/grafana/dashboards"}
    for target, mount in binds.items():
        assert mount.get("read_only") is True, f"{target} must be mounted read-only"
        assert Path(mount["source"]).is_relative_to(REPO / "deploy" / "grafana") and Path(mount["source"]).is_dir()
    (data,) = [m for m in grafana["volumes"] if m["type"] == "volume"]
    assert (data["source"], data["target"]) == ("grafana-data", "/var/lib/grafana")
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy", "required": True}}

    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] not in ("", "admin")
    custom = _load(validator, env={"GRAFANA_ADMIN_PASSWORD": "ops-grafana-secret-1"})["services"]
    assert custom["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "ops-grafana-secret-1"
    for name, svc in custom.items():
        if name != "grafana":
            assert "ops-grafana-secret-1" not in json.dumps(svc), f"{name} sees Grafana's admin password"


def test_every_service_rotates_its_logs(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        assert svc.get("logging") == {"driver": "json-file", "options": {"max-size": "10m", "max-file": "5"}}, name


def test_healthchecks_and_ordering(services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        hc = services[name].get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL") and not hc.get("disable"), f"{name}: no healthcheck"
        for field in ("interval", "timeout", "start_period"):
            assert field in hc, f"{name}: healthcheck without {field}"
        assert hc["retries"] >= 3, name
    for step in ("minio-init", "kafka-users", "kafka-init"):
        assert "healthcheck" not in services[step], f"{step}: a one-shot job has no health"
    for name in FLYWHEEL_SERVICES:
        assert services[name]["depends_on"] == {
            "kafka": {"condition": "service_healthy", "required": True},
            "kafka-2": {"condition": "service_healthy", "required": False},  # the `cluster` profile's
            "kafka-3": {"condition": "service_healthy", "required": False},
            "minio-init": {"condition": "service_completed_successfully", "required": True},
            "kafka-users": {"condition": "service_completed_successfully", "required": True},
            "kafka-init": {"condition": "service_completed_successfully", "required": True},
            "keys": {"condition": "service_completed_successfully", "required": True},
        }, name
    assert "healthcheck" not in services["keys"], "a one-shot job has no health"
    assert services["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy", "required": True}}


def test_restart_policies(services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
    for step in ("minio-init", "kafka-users", "kafka-init"):
        assert services[step]["restart"] == "no", f"{step}: a one-shot job must not be restarted after it succeeds"
    for name in FLYWHEEL_SERVICES:
        assert services[name]["init"] is True and services[name]["stop_grace_period"] == "30s", name


def test_cluster_variables_make_kafka_node_one_of_three(validator: Path) -> None:
    """What `make up BROKERS=3` exports (the Makefile's COMPOSE_CLUSTER) interpolates into a valid project: node 1
    votes in a quorum of three and the services bootstrap from all three. (kafka-2 and kafka-3 themselves are in
    the `cluster` profile, which this loader leaves off; tests/unit/test_compose.py checks them.)"""
    [line] = [ln for ln in (REPO / "Makefile").read_text().splitlines() if ln.startswith("COMPOSE_CLUSTER :=")]
    given = dict(item.split("=", 1) for item in line.split(":=", 1)[1].split())
    svcs = _load(validator, env={k: v for k, v in given.items() if k != "COMPOSE_PROFILES"})["services"]
    env = svcs["kafka"]["environment"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"
    assert (env["KAFKA_DEFAULT_REPLICATION_FACTOR"], env["KAFKA_MIN_INSYNC_REPLICAS"]) == ("3", "2")
    assert (env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"], env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == ("3", "2")
    assert env["KAFKA_LISTENERS"] == "PLAINTEXT://kafka:9092,CONTROLLER://kafka:9093,SASL_PLAINTEXT://:9094"
    for name in FLYWHEEL_SERVICES:
        assert svcs[name]["environment"]["FLYWHEEL_KAFKA_BOOTSTRAP"] == "kafka:9094,kafka-2:9094,kafka-3:9094"


def test_sampler_scales(validator: Path) -> None:
    scaled = _load(validator, scale={"sampler": 4})["services"]["sampler"]
    assert scaled["scale"] == 4
    for key in ("container_name", "ports", "hostname"):
        assert key not in scaled, f"sampler must not set {key}: replicas would collide"


def test_expose_example_overrides_the_loopback_binding(validator: Path) -> None:
    """deploy/compose.expose.example.yml does what docker-compose.yml's comment says, and only that."""
    services = _load(validator, COMPOSE, EXPOSE_EXAMPLE)["services"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in services["admin"]["ports"]] == [
        ("0.0.0.0", "8080", 8080)
    ]
    assert services["prometheus"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_trainers_sets_the_world_size_of_both_ranks(validator: Path, tmp_path: Path) -> None:
    """`TRAINERS=2 docker compose --profile ranks up`: both ranks get world size 2 and rank 1 is the trainer's
    service with its own rank. The loader leaves profiles off, so a copy without the profile line shows trainer-1
    as compose-go merges it (the YAML merge keys and the environment)."""
    assert _load(validator)["services"]["trainer"]["environment"]["FLYWHEEL_TRAINER_WORLD_SIZE"] == "1"
    copy = _broken(tmp_path, "    profiles: [ranks]\n", "")
    svcs = _load(validator, copy, env={"TRAINERS": "2"})["services"]
    trainer, rank1 = svcs["trainer"], svcs["trainer-1"]
    env0, env1 = trainer["environment"], rank1["environment"]
    assert env0["FLYWHEEL_TRAINER_WORLD_SIZE"] == env1["FLYWHEEL_TRAINER_WORLD_SIZE"] == "2"
    assert (env0["FLYWHEEL_TRAINER_RANK"], env1["FLYWHEEL_TRAINER_RANK"]) == ("0", "1")
    rank = "FLYWHEEL_TRAINER_RANK"
    assert {k: v for k, v in env1.items() if k != rank} == {k: v for k, v in env0.items() if k != rank}
    for key in ("image", "command", "depends_on", "healthcheck", "restart", "init", "stop_grace_period", "logging"):
        assert rank1[key] == trainer[key], key
    assert "ports" not in rank1 and "ports" not in trainer


def test_per_role_identities_and_the_brokers_loopback(services: dict[str, Any]) -> None:
    """The default: the broker's unauthenticated listeners on its loopback, the services on the SASL listener, the
    two Kafka init steps in the broker's network namespace (compose-go resolves `service:kafka`)."""
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_LISTENERS"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093,SASL_PLAINTEXT://:9094"
    assert kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@127.0.0.1:9093"
    assert kafka["KAFKA_SUPER_USERS"] == "User:ANONYMOUS;User:flywheel"
    for step in ("kafka-users", "kafka-init"):
        assert services[step]["network_mode"] == "service:kafka", step
        assert services[step]["depends_on"]["kafka"]["condition"] == "service_healthy", step
        assert services[step]["logging"]["driver"] == "json-file", step
    assert services["kafka-users"]["environment"]["BOOTSTRAP"] == "127.0.0.1:9092"
    assert services["kafka-init"]["environment"]["FLYWHEEL_KAFKA_BOOTSTRAP"] == "127.0.0.1:9092"
    assert not services["kafka-init"].get("volumes"), "kafka-init runs the image's own code, nothing mounted"
    assert services["kafka-init"]["entrypoint"] == ["python", "-m", "shared.kafka_init"]
    assert not services["kafka-init"].get("command"), "the image's CMD must not reach the module as arguments"


# ---- broken files are rejected ----------------------------------------------------------------


def _broken(tmp_path: Path, old: str, new: str) -> Path:
    text = COMPOSE.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in docker-compose.yml"
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(text.replace(old, new))
    return copy


def test_an_unchanged_copy_loads(validator: Path, tmp_path: Path) -> None:
    """The control for the tests below: a copy elsewhere fails only because of what they change."""
    copy = _broken(tmp_path, "name: flywheel\n", "name: flywheel\n")
    assert _run(validator, copy).returncode == 0


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("name: flywheel\n", "name: flywheel\nservice:\n  oops: {}\n", "additional properties 'service' not allowed"),
        ('"127.0.0.1:9090:9090"', '"127.0.0.1:90900:9090"', "90900"),
        ('    restart: "no"\n', '    restart_policy: "no"\n', "services.minio-init.restart_policy"),
        ('      target: sampler\n    command: ["services.sampler"]\n',
         '      target: sampler\n    command: ["services.sampler"]\n    init: maybe\n', "invalid boolean: maybe"),
        ("      interval: 5s\n", "      interval: five seconds\n", "five seconds"),
        ("  prometheus-data:\n", "", "prometheus-data"),
    ],
    ids=["unknown-top-level-key", "port-out-of-range", "unknown-service-key", "bad-boolean", "bad-duration",
         "undefined-volume"],
)
def test_a_broken_file_is_rejected(validator: Path, tmp_path: Path, old: str, new: str, message: str) -> None:
    proc = _run(validator, _broken(tmp_path, old, new))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("compose-validate: ") and message in proc.stderr, proc.stderr


def test_the_admin_token_is_required(validator: Path) -> None:
    proc = _run(validator, env={"FLYWHEEL_ADMIN_TOKEN": ""})
    assert proc.returncode == 1 and "set FLYWHEEL_ADMIN_TOKEN" in proc.stderr, proc.stderr


def test_a_fixed_host_port_does_not_scale(validator: Path) -> None:
    proc = _run(validator, scale={"admin": 2})
    assert proc.returncode == 1 and "services.admin: scale 2 with the fixed host port 8080" in proc.stderr


def test_container_name_does_not_scale(validator: Path, tmp_path: Path) -> None:
    copy = _broken(tmp_path, '    command: ["services.sampler"]\n',
                   '    command: ["services.sampler"]\n    container_name: sampler\n')
    assert _run(validator, copy).returncode == 0
    proc = _run(validator, copy, scale={"sampler": 2})
    assert proc.returncode == 1 and "container name must be unique" in proc.stderr, proc.stderr
