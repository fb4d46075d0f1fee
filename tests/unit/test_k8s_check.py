"""The Kubernetes manifests (deploy/k8s) as `make k8s-check` builds and checks them.

`make k8s-check` builds tools/k8s-check (a Go program around kustomize's krusty API and the
k8s.io/api types) into .flywheel/bin once, then builds every overlay in-process, decodes every object
strictly and applies the project's rules (docs/kubernetes.md, "What k8s-check enforces"). These tests
run it over the real overlays (they pass) and over temporary copies with one rule broken (each is
refused, naming that rule and the object). Go is required: without it the first test fails rather
than skips (CI machines have Go). The first build downloads the modules and compiles for minutes; later
runs reuse the binary (make rebuilds it only when tools/k8s-check changes).

The other tests read what the overlays deploy (`k8s-check -dump`): the settings every container gets
are ones the services accept (shared.settings.load_settings), the cluster overlay's KafkaTopics are
exactly the topics the services would create, and each role reads only its own credentials. Each image they run is
checked against the Dockerfile stages it is built from (deploy/Dockerfile's `sampler` target and default stage, the
images compose builds, and Dockerfile.trainer): a numeric USER equal to the pods' runAsUser, home and caches under
/tmp (the pods' only writable path), and torch as the role needs it (none, CPU-only, CUDA).

Strimzi's objects are validated against Strimzi's own CRDs (tools/k8s-check/crds, pinned). The cluster
overlay's KafkaUsers, ACLs and KafkaTopics are generated from shared/acl.py and shared/kafka.py
(`python -m shared.k8s_acl`): `make k8s-check` refuses a hand-edited copy, and any KafkaUser granted more
than shared/acl.py grants its role, however the overlay grants it (the last tests, through make itself).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.acl import role_acls
from shared.k8s_acl import strimzi_acls
from shared.kafka import topic_specs
from shared.settings import load_settings
from shared.signing import generate_keys, startup_problem

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("local", "gpu", "cluster")
BINARY = REPO / ".flywheel" / "bin" / "k8s-check"
POLICY = REPO / ".flywheel" / "k8s-acl-policy.json"  # written from shared/acl.py by make k8s-check
ROLES = ("sampler", "trainer", "paramsync", "admin")
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
BUILD_TIMEOUT_S = 560  # a cold Go cache downloads kustomize and k8s.io/api and compiles them
# Whichever test runs first builds the checker inside its own timeout.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 60)

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def checker() -> Path:
    """`make k8s-check` over the real overlays: it must pass (and leaves the binary built)."""
    for tool in ("go", "make"):  # fail, never skip: CI machines have both
        if shutil.which(tool) is None:
            pytest.fail(f"`make k8s-check` needs {tool} on PATH (Go: https://go.dev/dl/)")
    proc = subprocess.run(["make", "--no-print-directory", "k8s-check"], cwd=REPO, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"make k8s-check failed (Go is required):\n{proc.stdout}\n{proc.stderr}"
    for overlay in OVERLAYS:
        assert f"ok  deploy/k8s/overlays/{overlay}: " in proc.stdout, proc.stdout
    assert BINARY.is_file()
    return BINARY


def test_make_k8s_check_passes_on_every_overlay(checker: Path) -> None:
    assert checker.is_file()


def _dump(checker: Path, overlay: str) -> list[Doc]:
    proc = subprocess.run([str(checker), "-acl-policy", str(POLICY), "-dump", str(K8S / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _workload(docs: list[Doc], role: str) -> Doc:
    [found] = [d for d in docs
               if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == f"flywheel-{role}"]
    return found


def _container(docs: list[Doc], role: str) -> Doc:
    [c] = _workload(docs, role)["spec"]["template"]["spec"]["containers"]
    container: Doc = c
    return container


# ---- broken copies: each is refused, naming the rule -------------------------------------------------

def _edit(root: Path, relpath: str, kind: str, name: str, change: Callable[[Doc], None]) -> None:
    """Apply ``change`` to the object ``kind``/``name`` of the YAML file ``relpath`` under ``root``."""
    path = root / relpath
    docs = list(yaml.safe_load_all(path.read_text()))
    matches = [d for d in docs if d and d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} not in {relpath}"
    change(matches[0])
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def _pod(d: Doc) -> Doc:
    spec: Doc = d["spec"]["template"]["spec"]
    return spec


def _first(d: Doc) -> Doc:
    c: Doc = _pod(d)["containers"][0]
    return c


def _drop_pdb(root: Path) -> None:
    path = root / "base" / "paramsync.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] != "PodDisruptionBudget"]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def _drop_netpol(root: Path) -> None:
    path = root / "base" / "trainer.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] != "NetworkPolicy"]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def _add_secret(root: Path) -> None:
    path = root / "overlays" / "cluster" / "users.yaml"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "flywheel-sampler-s3"},
              "stringData": {"AWS_SECRET_ACCESS_KEY": "committed-by-mistake"}}
    path.write_text(path.read_text() + "---\n" + yaml.safe_dump(secret))


CLUSTER_KAFKA = "overlays/cluster/kafka.yaml"
SAMPLER, TRAINER, ADMIN = "base/sampler.yaml", "base/trainer.yaml", "base/admin.yaml"
GPU_RANKS = "overlays/gpu/trainer-ranks.yaml"
SAMPLER_DEPLOYMENT, TRAINER_STS = "Deployment/flywheel/flywheel-sampler", "StatefulSet/flywheel/flywheel-trainer"
ADMIN_DEPLOYMENT = "Deployment/flywheel/flywheel-admin"


@dataclass(frozen=True)
class Broken:
    """One rule broken in a copy of deploy/k8s: ``overlay`` must refuse it with one finding kind."""

    id: str
    overlay: str
    rule: str  # the rule every finding names
    ref: str  # the object every finding names
    text: str  # in at least one finding
    breakage: Callable[[Path], None]  # edits the copy rooted at its argument


def _sampler(change: Callable[[Doc], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root, SAMPLER, "Deployment", "flywheel-sampler", change)


def _trainer(change: Callable[[Doc], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root, TRAINER, "StatefulSet", "flywheel-trainer", change)


def _trainer_env(name: str, var: Doc) -> Callable[[Path], None]:
    """Replace the base trainer's env variable ``name`` with ``var``."""
    def change(d: Doc) -> None:
        env = _first(d)["env"]
        [i] = [i for i, v in enumerate(env) if v["name"] == name]
        env[i] = var
    return _trainer(change)


def _two_replicas_without_world_size(d: Doc) -> None:
    d["spec"]["replicas"] = 2
    _first(d)["env"] = [v for v in _first(d)["env"] if v["name"] != "FLYWHEEL_TRAINER_WORLD_SIZE"]


def _admin(change: Callable[[Doc], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root, ADMIN, "Deployment", "flywheel-admin", change)


USERS, TOPICS = "overlays/cluster/users.yaml", "overlays/cluster/topics.yaml"
POLICY_TOPIC_WRITE = {"resource": {"type": "topic", "name": "cartpole.policy", "patternType": "literal"},
                      "operations": ["Write"]}


def _sampler_writes_policy(user: Doc) -> None:
    user["spec"]["authorization"]["acls"].append(POLICY_TOPIC_WRITE)


def _kafka_authorization(change: Callable[[Doc], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root, CLUSTER_KAFKA, "Kafka", "flywheel",
                              lambda d: change(d["spec"]["kafka"]["authorization"]))


def _kafka_listener(change: Callable[[Doc], None]) -> Callable[[Path], None]:
    return lambda root: _edit(root, CLUSTER_KAFKA, "Kafka", "flywheel",
                              lambda d: change(d["spec"]["kafka"]["listeners"][0]))


BROKEN = [
    Broken("hostpath", "local", "no-host-access", SAMPLER_DEPLOYMENT, 'volume "host" is a hostPath',
           _sampler(lambda d: _pod(d)["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}}))),
    Broken("unknown-field", "local", "strict-decode", SAMPLER_DEPLOYMENT, 'unknown field "spec.replica"',
           _sampler(lambda d: d["spec"].update(replica=3))),
    Broken("missing-probe", "gpu", "probes", TRAINER_STS, 'container "trainer" has no readinessProbe',
           _trainer(lambda d: _first(d).pop("readinessProbe"))),
    Broken("probe-path", "local", "probes", ADMIN_DEPLOYMENT, "livenessProbe must be an HTTP GET of /healthz",
           _admin(lambda d: _first(d)["livenessProbe"]["httpGet"].update(path="/metrics"))),
    Broken("no-limits", "cluster", "resources", ADMIN_DEPLOYMENT, "memory request and limit must both be set",
           _admin(lambda d: _first(d)["resources"].pop("limits"))),
    Broken("writable-root", "local", "security-context", SAMPLER_DEPLOYMENT, "readOnlyRootFilesystem must be true",
           _sampler(lambda d: _first(d)["securityContext"].update(readOnlyRootFilesystem=False))),
    Broken("root", "local", "security-context", SAMPLER_DEPLOYMENT, "runAsNonRoot must be true",
           _sampler(lambda d: _pod(d)["securityContext"].pop("runAsNonRoot"))),
    Broken("privilege-escalation", "local", "security-context", TRAINER_STS, "allowPrivilegeEscalation must be false",
           _trainer(lambda d: _first(d)["securityContext"].pop("allowPrivilegeEscalation"))),
    Broken("inline-secret", "local", "secret-by-reference", ADMIN_DEPLOYMENT,
           "env FLYWHEEL_ADMIN_TOKEN has an inline value",
           _admin(lambda d: _first(d)["env"].__setitem__(1, {"name": "FLYWHEEL_ADMIN_TOKEN", "value": "x" * 40}))),
    Broken("secret-object", "cluster", "secret-by-reference", "Secret/flywheel/flywheel-sampler-s3",
           "a Secret with inline data", _add_secret),
    Broken("no-pdb", "local", "pdb", "Deployment/flywheel/flywheel-paramsync", "no PodDisruptionBudget selects",
           _drop_pdb),
    Broken("no-netpol", "cluster", "network-policy", TRAINER_STS, "no NetworkPolicy selects", _drop_netpol),
    Broken("hpa-target", "local", "references", "HorizontalPodAutoscaler/flywheel/flywheel-sampler",
           "scaleTargetRef Deployment/flywheel-samplers is not a workload",
           lambda root: _edit(root, SAMPLER, "HorizontalPodAutoscaler", "flywheel-sampler",
                              lambda d: d["spec"]["scaleTargetRef"].update(name="flywheel-samplers"))),
    Broken("strimzi-unknown-field", "cluster", "strict-decode", "Kafka/flywheel/flywheel",
           'unknown field "spec.kafka.listeners[0].authentification"',
           _kafka_listener(lambda listener: listener.update(authentification={"type": "scram-sha-512"}))),
    Broken("ranks-replicas", "gpu", "trainer-ranks", TRAINER_STS,
           "replicas 3 but FLYWHEEL_TRAINER_WORLD_SIZE 2; scale the StatefulSet and the world size together",
           lambda root: _edit(root, GPU_RANKS, "StatefulSet", "flywheel-trainer",
                              lambda d: d["spec"].update(replicas=3))),
    Broken("ranks-rendezvous-other-pod", "gpu", "trainer-ranks", TRAINER_STS,
           'FLYWHEEL_TRAINER_RENDEZVOUS "flywheel-trainer-1.flywheel-trainer:29500" must be '
           "flywheel-trainer-0.flywheel-trainer",
           _trainer_env("FLYWHEEL_TRAINER_RENDEZVOUS", {"name": "FLYWHEEL_TRAINER_RENDEZVOUS",
                                                        "value": "flywheel-trainer-1.flywheel-trainer:29500"})),
    Broken("ranks-rendezvous-port", "gpu", "trainer-ranks", TRAINER_STS,
           "rendezvous port 29501 is not one of its container ports",
           _trainer_env("FLYWHEEL_TRAINER_RENDEZVOUS",
                        {"name": "FLYWHEEL_TRAINER_RENDEZVOUS",
                         "value": "flywheel-trainer-0.flywheel-trainer.flywheel:29501"})),
    Broken("ranks-constant-rank", "gpu", "trainer-ranks", TRAINER_STS,
           "FLYWHEEL_TRAINER_RANK must come from fieldRef metadata.labels['apps.kubernetes.io/pod-index']",
           _trainer_env("FLYWHEEL_TRAINER_RANK", {"name": "FLYWHEEL_TRAINER_RANK", "value": "0"})),
    Broken("ranks-without-world-size", "local", "trainer-ranks", TRAINER_STS,
           "2 replicas of services.trainer without FLYWHEEL_TRAINER_WORLD_SIZE: each pod would train alone",
           _trainer(_two_replicas_without_world_size)),
    Broken("strimzi-enum", "cluster", "strict-decode", "Kafka/flywheel/flywheel",
           "spec.kafka.listeners[0].type in body should be one of [internal route",
           _kafka_listener(lambda listener: listener.update(type="internel"))),
    # Strimzi's CRD schema, not the checker's own structs: an ACL operation Strimzi does not know.
    Broken("strimzi-schema-acl-operation", "cluster", "strict-decode", "KafkaUser/flywheel/flywheel-sampler",
           "spec.authorization.acls[0].operations[0] in body should be one of [Read Write Create Delete",
           lambda root: _edit(root, USERS, "KafkaUser", "flywheel-sampler",
                              lambda d: d["spec"]["authorization"]["acls"][0].update(operations=["Writ"]))),
    Broken("strimzi-schema-topic-partitions", "cluster", "strict-decode", "KafkaTopic/flywheel/cartpole.policy",
           "spec.partitions in body should be greater than or equal to 1",
           lambda root: _edit(root, TOPICS, "KafkaTopic", "cartpole.policy", lambda d: d["spec"].update(partitions=0))),
    Broken("acl-sampler-writes-policy", "cluster", "acl-policy", "KafkaUser/flywheel/flywheel-sampler",
           'role sampler (run cartpole) may Write topic "cartpole.policy" (literal), which shared/acl.py does not '
           "grant it", lambda root: _edit(root, USERS, "KafkaUser", "flywheel-sampler", _sampler_writes_policy)),
    Broken("acl-sampler-super-user", "cluster", "acl-policy", "Kafka/flywheel/flywheel",
           '"User:flywheel-sampler" makes role sampler a super user',
           _kafka_authorization(lambda a: a.update(superUsers=["User:flywheel-sampler"]))),
    Broken("acl-user-not-a-role", "cluster", "acl-policy", "KafkaUser/flywheel/flywheel-sampler2",
           'KafkaUser "flywheel-sampler2" is not a role of shared/acl.py',
           lambda root: _edit(root, USERS, "KafkaUser", "flywheel-sampler",
                              lambda d: d["metadata"].update(name="flywheel-sampler2"))),
]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.id for b in BROKEN])
def test_a_broken_copy_is_refused_naming_the_rule(checker: Path, tmp_path: Path, broken: Broken) -> None:
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    overlay = str(root / "overlays" / broken.overlay)
    command = [str(checker), "-acl-policy", str(POLICY), overlay]
    intact = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert intact.returncode == 0, f"the unbroken copy must pass:\n{intact.stderr}"
    broken.breakage(root)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    findings = proc.stderr.strip().splitlines()
    assert findings, "refused without a finding"
    # Exactly the broken rule, on the broken object, with the reason.
    assert all(f": {broken.ref}: [{broken.rule}] " in f for f in findings), findings
    assert any(broken.text in f for f in findings), findings


def test_ranks_in_the_shared_config_map_are_refused(checker: Path, tmp_path: Path) -> None:
    """The world size belongs on the StatefulSet, beside the replicas it must equal, not in flywheel-env."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    kustomization = root / "base" / "kustomization.yaml"
    text = kustomization.read_text()
    line = "      - FLYWHEEL_HTTP_PORT=8000\n"
    assert text.count(line) == 1
    kustomization.write_text(text.replace(line, line + "      - FLYWHEEL_TRAINER_WORLD_SIZE=2\n"))
    proc = subprocess.run([str(checker), str(root / "overlays" / "local")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [finding] = proc.stderr.strip().splitlines()
    assert ": ConfigMap/flywheel/flywheel-env-" in finding
    assert "[trainer-ranks] key FLYWHEEL_TRAINER_WORLD_SIZE" in finding


def test_usage_errors_exit_2(checker: Path) -> None:
    proc = subprocess.run([str(checker)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "usage: k8s-check" in proc.stderr


# ---- what the overlays deploy ---------------------------------------------------------------------------

def _resolved_env(docs: list[Doc], container: Doc, secret_value: str) -> dict[str, str]:
    """The environment a container starts with; Secrets (external or generated) read as secret_value."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
        else:
            env.update(AWS_ACCESS_KEY_ID=secret_value, AWS_SECRET_ACCESS_KEY=secret_value)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = secret_value
        elif var["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX:
            env[var["name"]] = "0"  # the pod-index label of pod flywheel-trainer-0
        else:
            env[var["name"]] = "flywheel-trainer-0"  # fieldRef metadata.name
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_gets_settings_the_services_accept(checker: Path, tmp_path: Path, overlay: str) -> None:
    docs = _dump(checker, overlay)
    ca = tmp_path / "ca.crt"
    ca.write_text("not read by load_settings beyond existing\n")
    keys = tmp_path / "keys"
    generate_keys(keys)
    for role in ROLES:
        container = _container(docs, role)
        env = _resolved_env(docs, container, secret_value="s" * 40)
        config = REPO / env.pop("FLYWHEEL_CONFIG").removeprefix("/app/")
        if "FLYWHEEL_KAFKA_SSL_CAFILE" in env:
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            assert any(env["FLYWHEEL_KAFKA_SSL_CAFILE"].startswith(m + "/") for m in mounts), (role, mounts)
            env["FLYWHEEL_KAFKA_SSL_CAFILE"] = str(ca)
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        for var in ("FLYWHEEL_SIGNING_KEYS_FILE", "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE"):
            if var in env:  # a mounted file, pointed at keys laid out as `flywheel keys init` makes them
                assert any(env[var].startswith(m + "/") for m in mounts), (role, var, mounts)
                env[var] = env[var].replace("/keys/", f"{keys}/", 1)
        settings = load_settings(config, environ=env)  # refuses unknown FLYWHEEL_* variables
        assert settings.signing.enabled, f"{role}: signed by default (issue 43)"
        assert startup_problem(role, settings) is None, role
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        assert settings.http.port == port and settings.http.host == "0.0.0.0", role
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, (role, probe)
        if overlay == "cluster":
            assert settings.kafka.security_protocol == "SASL_SSL" and settings.kafka.sasl_username == f"flywheel-{role}"
            assert settings.kafka.replication_factor == 3
        if role == "admin":
            assert settings.admin.token is not None


def test_each_role_reads_only_its_own_secrets(checker: Path) -> None:
    docs = _dump(checker, "cluster")
    users = {d["metadata"]["name"] for d in docs if d["kind"] == "KafkaUser"}
    assert not [d for d in docs if d["kind"] == "Secret"], "the cluster overlay carries no Secret objects"
    for role in ROLES:
        container = _container(docs, role)
        secrets = {s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s}
        secrets |= {v["valueFrom"]["secretKeyRef"]["name"] for v in container["env"]
                    if "valueFrom" in v and "secretKeyRef" in v["valueFrom"]}
        expected = {f"flywheel-{role}-s3", f"flywheel-{role}"}
        if role == "admin":
            expected.add("flywheel-admin-token")
        assert secrets == expected, role
        # Secret volumes: the public signing keys for every role, a private key for the trainer and paramsync only,
        # each its own (issue 43).
        pod = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                   and d["metadata"]["name"] == f"flywheel-{role}")["spec"]["template"]["spec"]
        volumes = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        own = {f"flywheel-{role}-signing-key"} if role in ("trainer", "paramsync") else set()
        assert volumes - {"flywheel-cluster-ca-cert"} == {"flywheel-signing-public", *own}, role
        env = {v["name"]: v.get("value") for v in container["env"]}
        assert env.get("FLYWHEEL_SIGNING_PRIVATE_KEY_FILE") == (
            f"/keys/{role}/{role}.key" if own else None), role
        assert f"flywheel-{role}" in users  # Strimzi writes that Secret for this KafkaUser


# Each image the overlays run: the Dockerfile and target it is built from (docs/kubernetes.md, "Images"). The first
# two are the images docker-compose.yml builds (flywheel-sampler:local, flywheel:local).
K8S_IMAGES = {"flywheel-sampler": ("Dockerfile", "sampler"),   # no torch: samplers
              "flywheel": ("Dockerfile", None),                # the default stage, CPU-only torch
              "flywheel-trainer": ("Dockerfile.trainer", None)}  # CUDA torch: the GPU trainer


def _image_name(image: str) -> str:
    """``registry.example.com/flywheel/flywheel:dev`` -> ``flywheel``."""
    name, tag = image.rsplit("/", 1)[-1].split(":")
    assert tag == "dev", image
    return name


def _image_build(name: str, copies: bool = False) -> str:
    """The stages an image is built from, in file order: its own and those it is FROM (whose ENV and USER it
    inherits); with ``copies``, also those it copies from (COPY --from), which the build runs as well."""
    dockerfile, target = K8S_IMAGES[name]
    stages: dict[str, str] = {}  # stage name -> its text, in file order
    for chunk in ("\n" + (REPO / "deploy" / dockerfile).read_text()).split("\nFROM ")[1:]:
        words = chunk.split("\n", 1)[0].split()
        stages[words[2] if words[1:2] == ["AS"] else f"<stage {len(stages)}>"] = "FROM " + chunk
    wanted, todo = set(), [target or list(stages)[-1]]  # no target: the last stage, docker build's default
    while todo:
        stage = todo.pop()
        if stage in stages and stage not in wanted:
            wanted.add(stage)
            text = stages[stage]
            todo.append(text.split()[1])
            if copies:
                todo += re.findall(r"^COPY --from=(\S+)", text, re.MULTILINE)
    return "\n".join(text for stage, text in stages.items() if stage in wanted)


def test_images_cuda_only_for_the_gpu_trainer(checker: Path) -> None:
    local, gpu, cluster = (_dump(checker, o) for o in OVERLAYS)
    images = {"sampler": "flywheel-sampler", "trainer": "flywheel", "paramsync": "flywheel", "admin": "flywheel"}
    for role in ROLES:
        assert _container(local, role)["image"] == f"{images[role]}:dev", role
    for docs in (gpu, cluster):
        trainer = _container(docs, "trainer")
        assert _image_name(trainer["image"]) == "flywheel-trainer"
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"name": "FLYWHEEL_TRAINER_DEVICE", "value": "cuda"} in trainer["env"]
        for role in ("sampler", "paramsync", "admin"):
            assert _image_name(_container(docs, role)["image"]) == images[role], role
    assert _container(cluster, "paramsync")["image"] == "registry.example.com/flywheel/flywheel:dev"
    assert not (REPO / "deploy" / "Dockerfile.sampler").exists(), "k8s runs deploy/Dockerfile's two images"
    # torch as each image's role needs it, and each build fails when it comes out otherwise.
    sampler, cpu, cuda = (_image_build(n, copies=True) for n in K8S_IMAGES)
    assert "find_spec('torch')" in sampler and "/req/train.txt" not in sampler and "torch.version" not in sampler
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in cpu
    assert "ARG TORCH_CPU_ONLY=1\n" in cpu  # the check is on unless a build lifts it (only make test-compose does)
    assert "os.environ['TORCH_CPU_ONLY'] == '0' or torch.version.cuda is None" in cpu
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in cuda
    assert "assert torch.version.cuda, " in cuda


def test_images_run_under_the_pods_security_context(checker: Path) -> None:
    """Every image the overlays run has a numeric USER (the kubelet verifies runAsNonRoot from the image alone),
    the pods' runAsUser, and writes nothing outside /tmp, the pods' only writable path (read-only root)."""
    seen = set()
    for overlay in OVERLAYS:
        docs = _dump(checker, overlay)
        for role in ROLES:
            pod = _pod(_workload(docs, role))
            [container] = pod["containers"]
            name = _image_name(container["image"])
            seen.add(name)
            users = [line.split()[1] for line in _image_build(name).splitlines() if line.startswith("USER ")]
            assert users and re.fullmatch(r"[1-9][0-9]*:[0-9]+", users[-1]), (name, users)  # numeric, not root
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True, (overlay, role)
            assert users[-1] == f"{context['runAsUser']}:{context['runAsGroup']}" == "10001:10001", (overlay, role)
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, role
            [tmp] = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            [volume] = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
            assert "emptyDir" in volume, (overlay, role)
    assert seen == set(K8S_IMAGES), seen
    for name in K8S_IMAGES:
        build = _image_build(name)
        for env in ("XDG_CACHE_HOME=/tmp/.cache", "MPLCONFIGDIR=/tmp/.matplotlib", "FLYWHEEL_HOME=/tmp/flywheel"):
            assert env in build, (name, env)
        # the user's home is /tmp, the emptyDir: nothing that writes under ~ meets the read-only root
        assert "useradd --system --uid 10001 --gid flywheel --no-create-home --home-dir /tmp " in build, name


def test_trainer_ranks_have_stable_dns_names(checker: Path) -> None:
    docs = _dump(checker, "cluster")
    trainer = _workload(docs, "trainer")
    [svc] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == trainer["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert {"name": "rendezvous", "port": 29500, "targetPort": "rendezvous"} in svc["spec"]["ports"]


@pytest.mark.parametrize(("overlay", "ranks"), [("local", 1), ("gpu", 2), ("cluster", 1)])
def test_trainer_ranks_one_pod_per_rank(checker: Path, overlay: str, ranks: int) -> None:
    docs = _dump(checker, overlay)
    trainer = _workload(docs, "trainer")
    container = _container(docs, "trainer")
    env = {v["name"]: v for v in container["env"]}
    assert trainer["spec"]["replicas"] == ranks and env["FLYWHEEL_TRAINER_WORLD_SIZE"]["value"] == str(ranks)
    assert env["FLYWHEEL_TRAINER_RANK"]["valueFrom"] == {"fieldRef": {"fieldPath": POD_INDEX}}
    assert env["FLYWHEEL_TRAINER_RENDEZVOUS"]["value"] == "flywheel-trainer-0.flywheel-trainer:29500"
    settings = load_settings(REPO / "configs" / "cartpole.yaml", environ={
        "FLYWHEEL_TRAINER_WORLD_SIZE": str(ranks), "FLYWHEEL_TRAINER_RANK": str(ranks - 1),
        "FLYWHEEL_TRAINER_RENDEZVOUS": env["FLYWHEEL_TRAINER_RENDEZVOUS"]["value"]})
    assert settings.kafka.samples_partitions >= ranks  # the trainer refuses fewer partitions than ranks
    if overlay != "local":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one GPU per rank
    # Lockstep: no voluntary eviction of any rank (each would restart the whole group).
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "flywheel-trainer"]
    assert pdb["spec"]["maxUnavailable"] == 0
    # The store's port and the collectives' ephemeral ports, from and to trainer pods only.
    [netpol] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "flywheel-trainer"]
    own = {"podSelector": {"matchLabels": trainer["spec"]["selector"]["matchLabels"]}}
    between = [{"port": 29500, "protocol": "TCP"}, {"port": 32768, "endPort": 60999, "protocol": "TCP"}]
    assert [r for r in netpol["spec"]["ingress"] if r.get("from") == [own]] == [{"from": [own], "ports": between}]
    assert [r for r in netpol["spec"]["egress"] if r.get("to") == [own]] == [{"to": [own], "ports": between}]
    for rules in (netpol["spec"]["ingress"], netpol["spec"]["egress"]):
        opened = [p["port"] for r in rules if r.get("from", r.get("to")) != [own] for p in r.get("ports", [])]
        assert 29500 not in opened and 32768 not in opened


def test_cluster_topics_are_the_ones_the_services_create(checker: Path) -> None:
    docs = _dump(checker, "cluster")
    [env] = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("flywheel-env")]
    settings = load_settings(REPO / env["FLYWHEEL_CONFIG"].removeprefix("/app/"),
                             environ={"FLYWHEEL_KAFKA_REPLICATION_FACTOR": env["FLYWHEEL_KAFKA_REPLICATION_FACTOR"]})
    declared = {d["spec"]["topicName"]: (d["spec"]["partitions"], d["spec"]["replicas"], d["spec"].get("config", {}))
                for d in docs if d["kind"] == "KafkaTopic"}
    wanted = {t.name: (t.num_partitions, t.replication_factor, dict(t.topic_configs)) for t in topic_specs(settings)}
    assert declared == wanted
    # Each role's KafkaUser has exactly the ACLs shared/acl.py grants it for the run the pods use.
    users = {d["metadata"]["name"]: d for d in docs if d["kind"] == "KafkaUser"}
    assert env["FLYWHEEL_RUN"] == settings.run == "cartpole"
    for role, acls in role_acls(settings.run).items():
        assert users.pop(f"flywheel-{role}")["spec"]["authorization"]["acls"] == strimzi_acls(acls), role
    assert not users


def _kafka_container(docs: list[Doc], name: str) -> Doc:
    """Container ``name`` of the local overlay's Kafka StatefulSet (the broker or a sidecar)."""
    [kafka] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kafka"]
    container: Doc = next(c for c in kafka["spec"]["template"]["spec"]["containers"] if c["name"] == name)
    return container


def test_local_kafka_users_are_the_roles_each_service_signs_in_as_its_own(checker: Path) -> None:
    """The local overlay's users sidecar makes a SCRAM user for exactly shared.acl.ROLES, each password from that
    role's Secret, and each service signs in as the user named after its role with that same Secret (as compose's
    kafka-users, held to ROLES by tests/unit/test_compose.py)."""
    from shared.acl import ROLES as ACL_ROLES

    assert ACL_ROLES == ROLES
    docs = _dump(checker, "local")
    users = _kafka_container(docs, "users")
    [loop] = re.findall(r"for role in ([a-z ]+); do", users["args"][0])
    assert tuple(loop.split()) == ROLES
    unhashed = lambda name: re.sub(r"-[a-z0-9]{10}$", "", name)  # noqa: E731 - kustomize's generated-name suffix
    secrets = {v["name"].removeprefix("SCRAM_PASSWORD_"): unhashed(v["valueFrom"]["secretKeyRef"]["name"])
               for v in users["env"] if v["name"].startswith("SCRAM_PASSWORD_")}
    assert secrets == {role: f"flywheel-{role}-kafka" for role in ROLES}
    for role in ROLES:
        env = {v["name"]: v for v in _container(docs, role)["env"]}
        assert env["FLYWHEEL_KAFKA_SASL_USERNAME"]["value"] == role
        ref = env["FLYWHEEL_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (unhashed(ref["name"]), ref["key"]) == (f"flywheel-{role}-kafka", "FLYWHEEL_KAFKA_SASL_PASSWORD"), role


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX sh")
@pytest.mark.parametrize("status", [0, 1, 2])
def test_local_acls_sidecar_runs_kafka_init_and_marks_ready_only_when_it_succeeded(
        checker: Path, tmp_path: Path, status: int) -> None:
    """The local overlay's acls sidecar runs ``python -m shared.kafka_init`` (compose's kafka-init) with the
    services' config on the broker's loopback listener; its readiness file appears only when that exits 0, and any
    other exit ends the container with the same status (the kubelet restarts it), where an inline retry loop had
    retried a refusal for ever. Run with stand-ins for python and sleep."""
    docs = _dump(checker, "local")
    acls = _kafka_container(docs, "acls")
    env = {v["name"]: v for v in acls["env"]}
    assert env["FLYWHEEL_KAFKA_BOOTSTRAP"]["value"] == "127.0.0.1:9092"
    [services_env] = [e["configMapRef"]["name"] for e in _container(docs, "trainer")["envFrom"] if "configMapRef" in e]
    assert env["FLYWHEEL_CONFIG"]["valueFrom"] == {"configMapKeyRef": {"name": services_env, "key": "FLYWHEEL_CONFIG"}}
    assert acls["command"] == ["sh", "-c"] and len(acls["args"]) == 1
    assert "python -m shared.kafka_init" in acls["args"][0]
    assert acls["readinessProbe"]["exec"]["command"] == ["test", "-f", "/provisioned/acls"]
    bin_dir, provisioned = tmp_path / "bin", tmp_path / "provisioned"
    bin_dir.mkdir()
    provisioned.mkdir()
    (provisioned / "acls").touch()  # left from the container's last run: removed before provisioning
    calls = tmp_path / "calls"
    for tool, code in (("python", status), ("sleep", 0)):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\nexit {code}\n')
        (bin_dir / tool).chmod(0o755)
    script = acls["args"][0].replace("/provisioned/", f"{provisioned}/")
    proc = subprocess.run(["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == status, proc.stderr
    assert (provisioned / "acls").exists() == (status == 0)
    ran = calls.read_text().splitlines()
    assert ran[0].startswith("python -m shared.kafka_init --deadline-s ")
    assert ran[1:] == (["sleep infinity"] if status == 0 else [])


def test_local_minio_policy_is_the_compose_one() -> None:
    copy = K8S / "overlays" / "local" / "minio" / "flywheel-bucket-policy.json"
    original = REPO / "deploy" / "minio" / "flywheel-bucket-policy.json"
    assert json.loads(copy.read_text()) == json.loads(original.read_text())


def test_sampler_autoscaler_metric_is_served_by_the_adapter_rules(checker: Path) -> None:
    docs = _dump(checker, "local")
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    [metric] = hpa["spec"]["metrics"]
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    [rule] = values["rules"]["custom"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = rule["seriesQuery"].split("{")[0]
    # The counter the sampler exports.
    assert f'"{series}"' in (REPO / "services" / "sampler" / "service.py").read_text()


# ---- the cluster overlay's Kafka users, ACLs and topics: generated, and held to shared/acl.py ---------------

def _make_k8s_check(root: Path) -> subprocess.CompletedProcess[str]:
    """`make k8s-check` on the cluster overlay of the copy ``root`` (generated-file check, policy, checker)."""
    overlay = root / "overlays" / "cluster"
    return subprocess.run(["make", "--no-print-directory", "k8s-check", f"K8S_OVERLAYS={overlay}",
                           f"K8S_GENERATED={overlay}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    return root


def test_make_k8s_check_refuses_an_overlay_where_the_sampler_may_write_the_policy_topic(
        checker: Path, tmp_path: Path) -> None:
    """The generated users.yaml untouched, the cluster overlay patches Write on <run>.policy into the sampler's
    KafkaUser: make k8s-check fails, naming the user, the role, the operation and the topic."""
    root = _copy(tmp_path)
    assert _make_k8s_check(root).returncode == 0, "the unbroken copy must pass"
    (root / "overlays" / "cluster" / "sampler-acl.yaml").write_text(yaml.safe_dump(
        [{"op": "add", "path": "/spec/authorization/acls/-", "value": POLICY_TOPIC_WRITE}]))
    kustomization = root / "overlays" / "cluster" / "kustomization.yaml"
    k = yaml.safe_load(kustomization.read_text())
    k["patches"].append({"path": "sampler-acl.yaml", "target": {"kind": "KafkaUser", "name": "flywheel-sampler"}})
    kustomization.write_text(yaml.safe_dump(k, sort_keys=False))
    proc = _make_k8s_check(root)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    findings = [line for line in proc.stderr.splitlines() if line.startswith("k8s-check: ")]
    assert len(findings) == 1, proc.stderr
    assert (": KafkaUser/flywheel/flywheel-sampler: [acl-policy] spec.authorization.acls[7]: role sampler "
            '(run cartpole) may Write topic "cartpole.policy" (literal), which shared/acl.py does not grant it'
            in findings[0]), findings


def test_make_k8s_check_refuses_a_hand_edited_generated_file(checker: Path, tmp_path: Path) -> None:
    """Edited in users.yaml itself, the same grant is refused before the checker runs: the file is not the
    generator's output, and the message says how to regenerate it."""
    root = _copy(tmp_path)
    _edit(root, USERS, "KafkaUser", "flywheel-sampler", _sampler_writes_policy)
    proc = _make_k8s_check(root)
    assert proc.returncode != 0
    assert f"{root}/overlays/cluster/users.yaml differs from the generator's output" in proc.stderr, proc.stderr
    again = "regenerate it: python -m shared.k8s_acl generate --config configs/cartpole.yaml --run cartpole"
    assert again in proc.stderr


def test_another_run_is_generated_with_no_cartpole_left(checker: Path, tmp_path: Path) -> None:
    """`generate --run NAME` rewrites the users, ACLs, topics and FLYWHEEL_RUN for that run; make k8s-check passes
    on it, and nothing in the overlay's Kafka objects or its ConfigMap names cartpole any more."""
    root = _copy(tmp_path)
    overlay = root / "overlays" / "cluster"
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "shared.k8s_acl", "generate", "--run", "exp-7",
                    "--out", str(overlay)], cwd=REPO, check=True, capture_output=True, timeout=60)
    proc = _make_k8s_check(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dump = subprocess.run([str(checker), "-acl-policy", str(POLICY), "-dump", str(overlay)], capture_output=True,
                          text=True, timeout=120, check=True)
    docs = [json.loads(line) for line in dump.stdout.splitlines() if line.startswith("{")]
    kafka_objects = [d for d in docs if d["kind"] in ("KafkaUser", "KafkaTopic")]
    assert len(kafka_objects) == len(ROLES) + 6
    assert "cartpole" not in json.dumps(kafka_objects)
    assert {d["spec"]["topicName"] for d in kafka_objects if d["kind"] == "KafkaTopic"} == {
        "exp-7.samples", "exp-7.samples.dlq", "exp-7.policy", "exp-7.control", "exp-7.heartbeats", "exp-7.credits"}
    [env] = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("flywheel-env")]
    assert env["FLYWHEEL_RUN"] == "exp-7"


def test_the_policy_is_shared_acl_py() -> None:
    """What k8s-check holds KafkaUsers to is role_acls, for any run: the sampler reads the policy topic only."""
    from shared.k8s_acl import policy

    p = policy()
    assert set(p["roles"]) == set(ROLES)
    sampler = {(g["resource"], g["name"], g["operation"]) for g in p["roles"]["sampler"]}
    assert ("topic", "{run}.policy", "Read") in sampler and ("topic", "{run}.policy", "Write") not in sampler
    for role, acls in role_acls("{run}").items():
        assert len(p["roles"][role]) == len(acls), role
