"""What `make test-compose` (tools/compose/, deploy/standins/) relies on, checked without a Docker engine: the
stand-ins cover every third-party image docker-compose.yml names (Grafana excepted, and said so), the Kafka
stand-in reads KAFKA_* as the upstream image does, the stand-in `mc` knows every subcommand the compose files
call, the Dockerfiles take the pip wheelhouse arguments, and the test engine never uses the default socket."""
from __future__ import annotations

import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "deploy" / "standins"
BUILD = (REPO / "tools" / "compose" / "build.sh").read_text()
# deploy/Dockerfile: compose's two images and Kubernetes' CPU ones; Dockerfile.trainer: Kubernetes' GPU trainer.
DOCKERFILES = ("Dockerfile", "Dockerfile.trainer")


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compose_files() -> list[dict[str, Any]]:
    return [yaml.safe_load((REPO / "docker-compose.yml").read_text())]


def test_every_third_party_image_has_a_stand_in_but_grafana() -> None:
    images = {s["image"] for c in compose_files() for s in c["services"].values() if "image" in s}
    third_party = {i for i in images if i != "flywheel:local"}
    missing = {i for i in third_party if i not in BUILD}
    assert missing == {"grafana/grafana:12.4.5"}, missing
    conftest = (REPO / "tests" / "compose" / "conftest.py").read_text()
    assert '"grafana"' not in conftest.split("SERVICES = ")[1].split("\n")[0]


def test_kafka_stand_in_names_properties_as_the_upstream_image() -> None:
    run = load(STANDINS / "kafka" / "run.py")
    assert run.prop_name("KAFKA_NODE_ID") == "node.id"
    assert run.prop_name("KAFKA_LISTENER_NAME_SASL__PLAINTEXT_SASL_ENABLED_MECHANISMS") == \
        "listener.name.sasl_plaintext.sasl.enabled.mechanisms"
    assert run.prop_name("KAFKA_LISTENER_NAME_SASL__PLAINTEXT_SCRAM___SHA___512_SASL_JAAS_CONFIG") == \
        "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"
    assert "KAFKA_HEAP_OPTS" in run.NOT_PROPERTIES


def test_kafka_stand_in_is_the_local_stacks_kafka_version() -> None:
    def version(pom: Path) -> str:
        ns = {"m": "http://maven.apache.org/POM/4.0.0"}
        node = ET.parse(pom).getroot().find("m:properties/m:kafka.version", ns)
        assert node is not None and node.text
        return node.text
    v = version(REPO / "deploy" / "kafka" / "pom.xml")
    assert version(STANDINS / "kafka" / "pom-tools.xml") == v
    assert f"apache/kafka:{v}" in BUILD
    # The healthcheck's and kafka-users' tools exist in the stand-in.
    for tool in ("kafka-broker-api-versions.sh", "kafka-configs.sh"):
        assert (STANDINS / "kafka" / "bin" / tool).is_file()


def test_stand_in_mc_knows_every_mc_call_of_the_compose_files() -> None:
    mc = (STANDINS / "minio" / "mc.py").read_text()
    calls: set[tuple[str, ...]] = set()
    for c in compose_files():
        for s in c["services"].values():
            words = " ".join(str(x) for x in (s.get("command") or []) + (s.get("healthcheck") or {}).get("test", []))
            for m in re.finditer(r"\bmc,? (admin,? [a-z]+,? [a-z]+|alias,? [a-z]+|[a-z]+)", words):
                calls.add(tuple(m.group(1).replace(",", "").split()))
    assert {("alias", "set"), ("mb",), ("ready",), ("admin", "policy", "create"), ("admin", "user", "add"),
            ("admin", "policy", "attach")} <= calls, calls
    for call in calls:
        dispatch = f"args[:{len(call)}] == {list(call)!r}".replace("'", '"')
        assert dispatch in mc, f"stand-in mc lacks `mc {' '.join(call)}`"


def test_dockerfiles_take_the_wheelhouse_arguments_before_pip() -> None:
    for name in DOCKERFILES:
        text = (REPO / "deploy" / name).read_text()
        first_pip = text.index("pip install")
        for arg in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
            assert f"ARG {arg}\n" in text[:first_pip], f"{name}: ARG {arg} missing before the first pip install"


def test_dockerfiles_are_the_ones_the_tests_know() -> None:
    assert sorted(p.name for p in (REPO / "deploy").glob("Dockerfile*")) == sorted(DOCKERFILES)


def test_only_the_compose_builds_default_image_lifts_the_cpu_only_torch_check() -> None:
    """deploy/Dockerfile's default stage refuses a CUDA torch unless TORCH_CPU_ONLY=0; the wheelhouse here has only
    PyPI's torch (the CUDA build: download.pytorch.org cannot be reached), so build.sh lifts the check for that
    image, and for it alone."""
    builds = [line for line in BUILD.splitlines() if line.startswith("build flywheel")]
    assert [line.split()[1] for line in builds] == ["flywheel-sampler:local", "flywheel:local"], builds
    sampler, default = builds
    assert "TORCH_CPU_ONLY" not in sampler and default.endswith(" --build-arg TORCH_CPU_ONLY=0"), builds
    assert "\nARG TORCH_CPU_ONLY=1\n" in (REPO / "deploy" / "Dockerfile").read_text()


def test_the_test_engine_never_uses_the_default_socket() -> None:
    engine = (REPO / "tools" / "compose" / "engine.sh").read_text()
    assert "NAME=flywheel-test-docker\nSOCK=/run/$NAME.sock" in engine
    assert '--host "unix://$SOCK"' in engine and "--data-root" in engine and "--exec-root" in engine
    assert "/var/run/docker.sock" not in engine.replace("(/var/run/docker.sock,", "")
    assert "--iptables=false" in engine
    makefile = (REPO / "Makefile").read_text()
    assert "elif docker info >/dev/null 2>&1; then" in makefile  # make up's detection, unchanged


def test_images_give_the_non_root_user_a_writable_flywheel_home() -> None:
    """The trainer writes TensorBoard files under $FLYWHEEL_HOME (default .flywheel in the working directory, /app,
    which the image's user cannot write): seen in make test-compose, the trainer stopped with PermissionError."""
    for name in DOCKERFILES:
        text = (REPO / "deploy" / name).read_text()
        # the last stage, or the runtime stage that deploy/Dockerfile's images (default and sampler) build on
        runtime = text[text.index("AS runtime"):] if "AS runtime" in text else text[text.rindex("FROM "):]
        assert "ENV FLYWHEEL_HOME=/tmp/" in runtime, f"{name}: no writable FLYWHEEL_HOME for the non-root user"


def test_a_taken_published_port_moves_that_service_only() -> None:
    """make test-compose beside the partition suite's stack (admin-fwd on 127.0.0.1:8080, Prometheus on
    127.0.0.1:9090): Prometheus's port was not moved, and `up` failed with `bind: address already in use`."""
    import yaml

    from tests.compose.conftest import PUBLISHED, Compose, moved_ports

    assert moved_ports(lambda port: "") == {}
    both = moved_ports(lambda port: "LISTEN python" if port in (8080, 9090) else "", environ={})
    assert both == {"admin": 18080, "prometheus": 19090}
    assert moved_ports(lambda port: "x" if port == 9090 else "",
                       environ={"FLYWHEEL_COMPOSE_PROMETHEUS_PORT": "29090"}) == {"prometheus": 29090}
    c = Compose("t" * 64, both)
    assert c.admin == "http://127.0.0.1:18080" and c.env["FLYWHEEL_COMPOSE_PROMETHEUS_PORT"] == "19090"
    assert c.files() == ["-f", "docker-compose.yml", "-f", "tools/compose/admin-port.yml",
                         "-f", "tools/compose/prometheus-port.yml"]
    assert Compose("t" * 64).files() == ["-f", "docker-compose.yml"]
    shipped = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for service, (port, var, default, override) in PUBLISHED.items():
        assert f"127.0.0.1:{port}:{port}" in shipped[service]["ports"], service
        text = (REPO / override).read_text()
        assert f"  {service}:\n    ports: !override\n      - \"127.0.0.1:${{{var}:-{default}}}:{port}\"" in text
