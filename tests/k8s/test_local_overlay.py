"""deploy/k8s/overlays/local applied to a real cluster (issue 44): every Deployment and StatefulSet rolls out,
CartPole trains with the admin API reached through its Service, a deleted trainer pod comes back and training
resumes from its checkpoint, a deleted sampler pod is replaced, `flywheel verify` passes, pods run under the
declared security contexts, and a node drain stops at the trainer's disruption budget. The tests share one
deployment and run in file order."""
from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.k8s.conftest import NAMESPACE, OVERLAY, Cluster, wait_until
from tests.kafka_probe import SAMPLER_PROBE, assert_sampler_refused

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(1800)]

WORKLOADS = ["statefulset/kafka", "deployment/minio", "statefulset/flywheel-trainer", "deployment/flywheel-paramsync",
             "deployment/flywheel-admin", "deployment/flywheel-sampler"]
TRAINER = "app.kubernetes.io/component=trainer"
SAMPLER = "app.kubernetes.io/component=sampler"
# Each claim of the overlay, bound ahead to a hostPath volume owned by the user its pod runs as (the cluster has no
# provisioner; a laptop cluster's makes the same kind of volume).
CLAIMS = {"minio-data": 10001, "data-kafka-0": 1000}


def progress(s: dict[str, Any]) -> tuple[int, int]:
    """(trainer updates, published policy version) from /status."""
    return int((s.get("trainer") or {}).get("updates") or 0), int((s.get("policy") or {}).get("version") or 0)


def advancing(c: Cluster, after: tuple[int, int], timeout_s: float, what: str) -> tuple[int, int]:
    def check() -> tuple[int, int] | None:
        now = progress(c.status())
        return now if now[0] > after[0] and now[1] > after[1] else None
    got: tuple[int, int] = wait_until(check, timeout_s, what, interval=3)
    return got


def adapt_to_this_node(objects: list[dict[str, Any]]) -> list[str]:
    """The two changes made to the overlay's objects before they are applied here, each said in the report:
    MinIO's image is the stand-in (deploy/standins/minio: moto's S3 server, not MinIO), which serves no
    /minio/health/* path, so its probes become TCP checks of the same port; and the node has 2 CPUs, where the
    overlay's pods request 2.4 (docs/kubernetes.md: a laptop cluster needs 4), so the trainer requests 600m instead
    of 1100m (its limit stays 1150m)."""
    done = []
    for o in objects:
        name = (o["kind"], o["metadata"]["name"])
        containers = o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        for c in containers:
            if name == ("Deployment", "minio"):
                for probe in ("livenessProbe", "readinessProbe"):
                    c[probe].pop("httpGet")
                    c[probe]["tcpSocket"] = {"port": "s3"}
                done.append("minio: liveness and readiness probes TCP on s3 instead of GET /minio/health/*")
            if name == ("StatefulSet", "flywheel-trainer"):
                done.append(f"trainer: CPU request {c['resources']['requests']['cpu']} -> 600m")
                c["resources"]["requests"]["cpu"] = "600m"
    assert len(done) == 2, done
    return done


def rolled_out(c: Cluster, timeout_s: int) -> None:
    for w in WORKLOADS:
        c.ns("rollout", "status", w, f"--timeout={timeout_s}s", timeout=timeout_s + 30)


def test_the_local_overlay_applies_and_rolls_out(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.kubectl("create", "namespace", NAMESPACE)
    volumes = []
    for claim, uid in CLAIMS.items():
        path = cluster.run("mktemp", "-d", f"{cluster.bin.parent}/pv-{claim}.XXXX").stdout.strip()
        cluster.run("chown", f"{uid}:{uid}", path)
        volumes.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"flywheel-{claim}"},
                        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                                 "persistentVolumeReclaimPolicy": "Retain",
                                 "hostPath": {"path": path, "type": "Directory"},
                                 "claimRef": {"namespace": NAMESPACE, "name": claim}}})
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": volumes}))
    cluster.ns("create", "secret", "generic", "flywheel-admin-token", f"--from-literal=token={cluster.token}")
    cluster.run("deploy/k8s/signing-keys.sh", NAMESPACE)
    # The overlay as `kubectl apply -k` builds it, applied with two changes this machine needs, both reported:
    objects = json.loads(cluster.kubectl("apply", "-k", OVERLAY, "--dry-run=client", "-o", "json").stdout)["items"]
    changes = adapt_to_this_node(objects)
    applied = cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                     "items": objects}))
    cluster.report(f"- `kubectl apply -k {OVERLAY}`'s objects applied ({len(applied.stdout.splitlines())}), "
                   f"changed only in: {'; '.join(changes)}")
    cluster.ns("wait", "--for=condition=complete", "job/minio-init", "--timeout=600s", timeout=630)
    rolled_out(cluster, 900)
    pods = cluster.get("pods")["items"]
    lines = sorted(f"{p['metadata']['name']} {p['status']['phase']}" for p in pods)
    cluster.report(f"- every Deployment and StatefulSet rolled out ({', '.join(WORKLOADS)}) and minio-init complete "
                   f"{time.monotonic() - t0:.0f} s after the apply; pods: {'; '.join(lines)}")
    assert all(p["status"]["phase"] == ("Succeeded" if "job-name" in p["metadata"]["labels"] else "Running")
               for p in pods), lines


def test_cartpole_trains_through_the_admin_service(cluster: Cluster) -> None:
    t0 = time.monotonic()
    first = wait_until(lambda: (s := cluster.status()) and progress(s)[1] > 0 and s, 600,
                       "a published policy in /status", interval=5)
    now = advancing(cluster, progress(first), 300, "updates and versions advancing")
    s = cluster.status()
    er = s.get("episode_return") or {}
    cluster.report(f"- training through the Service {cluster.admin_url()}: updates/version {progress(first)} -> {now} "
                   f"({time.monotonic() - t0:.0f} s); episode return mean {er.get('mean')} over {er.get('count')} "
                   f"episodes; samplers alive {sum(1 for x in s.get('samplers') or [] if x.get('alive'))}")


def test_each_role_is_its_own_kafka_user_and_the_sampler_is_refused(cluster: Cluster) -> None:
    """Per-role identities in the local overlay (issue 43, item 2), as in `docker compose up`: the services train
    as Kafka users of their own on the SASL listener (the test above), the sampler's user may not write the policy,
    credits or control topics, a client without credentials cannot use that listener, and the listeners where
    User:ANONYMOUS is a super user are closed to other pods."""
    env = cluster.ns("exec", "deploy/flywheel-sampler", "--", "sh", "-c", "echo $FLYWHEEL_KAFKA_SASL_USERNAME "
                     "$FLYWHEEL_KAFKA_BOOTSTRAP $FLYWHEEL_KAFKA_SECURITY_PROTOCOL", timeout=60).stdout
    assert env.split() == ["sampler", "kafka:9094", "SASL_PLAINTEXT"], env
    out = cluster.ns("exec", "deploy/flywheel-sampler", "--", "python", "-c", SAMPLER_PROBE, "kafka-0.kafka",
                     timeout=180, check=False)
    print(f"sampler probe: {(out.stdout + out.stderr).strip()[-800:]}")
    got = assert_sampler_refused(out.stdout)
    provisioned = {c: cluster.ns("logs", "kafka-0", "-c", c, timeout=60).stdout.strip().splitlines()[-1:]
                   for c in ("acls", "users")}
    assert "topics and ACLs in place" in "".join(provisioned["acls"]), provisioned  # python -m shared.kafka_init
    cluster.report(f"- per-role Kafka users: the sampler pod (user `sampler`) refused on policy, credits and control "
                   f"({got['policy'].split()[-1]}); without credentials: {got['anonymous'][:60]}; "
                   f"kafka-0.kafka:9092 {got['9092'].split()[0]}, :9093 {got['9093'].split()[0]}; "
                   f"provisioned: {provisioned}")


def test_a_deleted_trainer_pod_comes_back_and_resumes(cluster: Cluster) -> None:
    before = cluster.pod(TRAINER)
    at = progress(cluster.status())
    t0 = time.monotonic()
    cluster.ns("delete", "pod", before["metadata"]["name"], "--wait=true", timeout=120)
    wait_until(lambda: (p := cluster.pod(TRAINER))["metadata"]["uid"] != before["metadata"]["uid"]
               and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])),
               600, "a new trainer pod, ready")
    # Resumed, not restarted: the new pod's trainer restores the newest checkpoint (its log says which update).
    name = before["metadata"]["name"]
    restored = wait_until(lambda: [json.loads(line) for line in cluster.ns("logs", name, "-c", "trainer").stdout
                                   .splitlines() if '"checkpoint_restored"' in line], 300, "checkpoint_restored")
    now = advancing(cluster, at, 600, "training to go on after the trainer pod was deleted")
    cluster.report(f"- trainer pod {name} deleted at updates/version {at}: the new pod restored the checkpoint of "
                   f"update {restored[0].get('update')} and trained on to {now}, {time.monotonic() - t0:.0f} s after "
                   "the delete")
    assert int(restored[0]["update"]) > 0, restored


def test_a_deleted_sampler_pod_is_replaced(cluster: Cluster) -> None:
    names = lambda: sorted(p["metadata"]["name"] for p in cluster.get("pods", "-l", SAMPLER)["items"]  # noqa: E731
                           if p["status"]["phase"] == "Running" and not p["metadata"].get("deletionTimestamp"))
    before = names()
    at = progress(cluster.status())
    cluster.ns("delete", "pod", before[0], "--wait=true", timeout=120)
    after = wait_until(lambda: (n := names()) and len(n) == len(before) and before[0] not in n and n, 300,
                       "the sampler Deployment back to its replicas")
    cluster.ns("rollout", "status", "deployment/flywheel-sampler", "--timeout=300s", timeout=330)
    now = advancing(cluster, at, 600, "training to go on after the sampler pod was deleted")
    cluster.report(f"- sampler pod {before[0]} deleted: samplers {before} -> {after}, updates/version {at} -> {now}")


def test_a_node_drain_respects_the_disruption_budgets(cluster: Cluster) -> None:
    """`kubectl drain` of the only node: the trainer's budget (maxUnavailable 0) refuses its eviction, the samplers'
    (minAvailable 50% of 2) lets one go and then refuses the other, the rest are evicted; drain gives up at its
    timeout, saying so. After `kubectl uncordon` everything rolls out again and training goes on, in the same
    trainer pod."""
    node = json.loads(cluster.kubectl("get", "nodes", "-o", "json", timeout=30).stdout)["items"][0]["metadata"]["name"]
    pods = {p["metadata"]["uid"]: p for p in cluster.get("pods", "--field-selector=status.phase=Running")["items"]}

    def component(p: dict[str, Any]) -> str:
        labels = p["metadata"]["labels"]
        return str(labels.get("app.kubernetes.io/component") or labels.get("app.kubernetes.io/name"))

    def by(where: list[str], what: str) -> list[str]:
        return [x for x in where if x.startswith(what + " ")]

    at = progress(cluster.status())
    t0 = time.monotonic()
    drain = cluster.kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s",
                            timeout=180, check=False)
    try:
        after = {p["metadata"]["uid"] for p in cluster.get("pods")["items"]
                 if not p["metadata"].get("deletionTimestamp")}
        kept = sorted(f"{component(p)} {p['metadata']['name']}" for uid, p in pods.items() if uid in after)
        evicted = sorted(f"{component(p)} {p['metadata']['name']}" for uid, p in pods.items() if uid not in after)
        refused = drain.stderr.count("violate the pod's disruption budget")
        cluster.report(f"- `kubectl drain {node}` (timeout 60 s): exit {drain.returncode} after "
                       f"{time.monotonic() - t0:.0f} s, {refused} evictions refused for a disruption budget; "
                       f"evicted: {', '.join(evicted)}; kept: {', '.join(kept)}")
        assert drain.returncode != 0, drain.stdout[-2000:]
        assert refused > 0, drain.stderr[-2000:]
        assert len(by(kept, "trainer")) == 1, kept                     # maxUnavailable 0
        assert len(by(kept, "sampler")) == 1 and len(by(evicted, "sampler")) == 1, (kept, evicted)  # minAvailable 50%
        for what in ("admin", "paramsync", "kafka", "minio"):           # maxUnavailable 1: let go
            assert len(by(evicted, what)) == 1, (what, evicted)
    finally:
        cluster.kubectl("uncordon", node, timeout=60)
    rolled_out(cluster, 900)
    now = advancing(cluster, at, 900, "training to go on after the drain and uncordon")
    trainer_uid = [uid for uid, p in pods.items() if component(p) == "trainer"]
    assert cluster.pod(TRAINER)["metadata"]["uid"] in trainer_uid
    cluster.report(f"- `kubectl uncordon {node}`: every workload rolled out again and training went on in the same "
                   f"trainer pod, updates/version {at} -> {now}, {time.monotonic() - t0:.0f} s after the drain began")


def test_pods_run_under_their_security_contexts(cluster: Cluster) -> None:
    """Each container's uid is the one its pod declares, and its root filesystem refuses a write."""
    seen = []
    for p in cluster.get("pods", "--field-selector=status.phase=Running")["items"]:
        name = p["metadata"]["name"]
        want = str(p["spec"]["securityContext"]["runAsUser"])
        uid = cluster.ns("exec", name, "--", "id", "-u", timeout=60).stdout.strip()
        write = cluster.ns("exec", name, "--", "sh", "-c", "touch /flywheel-k8s-probe", timeout=60, check=False)
        seen.append(f"{name} uid {uid}, root fs write exit {write.returncode}")
        assert uid == want, (name, uid, want)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, (name, write.stderr)
    cluster.report(f"- security contexts: {'; '.join(seen)}")


def test_flywheel_verify_passes(cluster: Cluster) -> None:
    code, out = cluster.verify()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    cluster.report(f"- `flywheel verify` in the admin pod: exit {code}: {last}")
    assert code == 0, out[-3000:]
