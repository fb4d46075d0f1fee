"""docker-compose.yml run for real (issue 31): CartPole learns through the containers, crashes heal by the
restart policy with `flywheel verify` ok, `down`/`up` resumes the run, `--scale sampler=4` gives four samplers,
candidates the trainer did not sign are never published (signing is on by default, issue 43), and every service
runs under its own Kafka identity by default (issue 43): the sampler's is refused writing the policy topic, and no
container but the broker's reaches a listener without authentication. Three of them are red-team rows (refused,
audited, training goes on, `flywheel verify` ok), written into docs/security.md under `make test-compose`: the forged
candidate, a sampler reading a private key, the sampler's Kafka user writing what it may not. The tests share one
stack and run in file order."""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from tests.compose.conftest import Compose, wait_until
from tests.kafka_probe import SAMPLER_PROBE, assert_sampler_refused
from tests.security.report import AttackRow

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

IMAGES = ["flywheel:local", "flywheel-sampler:local", "apache/kafka:4.1.1",
          "quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z", "prom/prometheus:v3.5.0"]
FLYWHEEL = ["trainer", "paramsync", "admin", "sampler"]


def progress(s: dict[str, Any]) -> tuple[int, int]:
    """(trainer updates, published policy version) from /status."""
    return int((s.get("trainer") or {}).get("updates") or 0), int((s.get("policy") or {}).get("version") or 0)


def live_samplers(s: dict[str, Any]) -> list[str]:
    return sorted(x["id"] for x in s.get("samplers") or [] if x.get("alive"))


def advancing(c: Compose, after: tuple[int, int], timeout_s: float, what: str) -> tuple[int, int]:
    """Until both the trainer's updates and the published version passed ``after``."""
    def check() -> tuple[int, int] | None:
        now = progress(c.status())
        return now if now[0] > after[0] and now[1] > after[1] else None
    got: tuple[int, int] = wait_until(check, timeout_s, what)
    return got


def test_images_run_as_non_root(compose: Compose) -> None:
    """Every container but MinIO's runs as a non-root user. The upstream MinIO image runs as root and
    docker-compose.yml sets no user for it; its stand-in does the same, so nothing is claimed for it here."""
    sizes = {}
    for image in IMAGES:
        size, user = (compose.docker("image", "inspect", image, "--format", "{{.Size}} {{.Config.User}}").stdout.split()
                      + [""])[:2]
        sizes[image] = int(size)
        print(f"{image}: user {user or '(root)'}")
    print("image sizes: " + ", ".join(f"{k} {v / 1e6:,.0f} MB" for k, v in sizes.items()))
    uids = {service: compose.exec(service, "id", "-u").stdout.strip() for service in
            FLYWHEEL + ["kafka", "prometheus", "minio"]}
    print(f"uids: {uids}")
    assert all(uid not in ("", "0") for service, uid in uids.items() if service != "minio"), uids


def test_flywheel_image_starts_with_a_read_only_root_filesystem(compose: Compose) -> None:
    """The flywheel image's services import and read their config with nothing writable but /tmp (as the
    Kubernetes pods run it); the compose file itself does not set read_only."""
    out = compose.docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python", "flywheel:local",
                         "-c", "import services.trainer.__main__, services.sampler.__main__, "
                         "services.paramsync.__main__, services.admin.__main__; "
                         "from shared.settings import load_settings; "
                         "from services.trainer.tracking import Tracker; "
                         "s = load_settings('/app/configs/cartpole.yaml', {}); Tracker.from_settings(s); "
                         "print(s.run)", timeout=300)
    assert out.stdout.strip().endswith("cartpole"), out.stdout + out.stderr


def test_sampler_image_has_no_torch_and_refuses_torch_inference_in_one_line(compose: Compose) -> None:
    """The samplers' image (deploy/Dockerfile's `sampler` target) has no torch; a sampler there runs (CartPole's
    numpy policy, and onnxruntime for a CNN without torch), and one asked for sampler.inference torch stops at start
    with one line naming the extra, before it connects to anything."""
    out = compose.docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python",
                         "flywheel-sampler:local", "-c",
                         "import importlib.util; print('torch' if importlib.util.find_spec('torch') else 'no torch')",
                         timeout=120)
    assert out.stdout.strip() == "no torch", out.stdout + out.stderr
    refused = compose.docker("run", "--rm", "--read-only", "--tmpfs", "/tmp", "-e", "FLYWHEEL_SAMPLER_INFERENCE=torch",
                             "flywheel-sampler:local", "services.sampler", timeout=120, check=False)
    print(f"sampler.inference torch in the sampler image: exit {refused.returncode}: {refused.stderr.strip()}")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "pip install 'flywheel[train]'" in refused.stderr.strip().splitlines()[-1], refused.stderr


def test_cartpole_learns_through_the_containers(compose: Compose) -> None:
    t0 = time.monotonic()
    first = wait_until(lambda: (s := compose.status())["episode_return"]["count"] >= 20 and s, 600,
                       "20 CartPole episodes in /status")
    start_mean, start_count = first["episode_return"]["mean"], first["episode_return"]["count"]

    def learned() -> dict[str, Any] | None:
        s = compose.status()
        er = s["episode_return"]
        return s if er["count"] >= 100 and er["mean"] is not None and er["mean"] >= 200 else None
    s = wait_until(learned, 900, "CartPole last-100 mean >= 200 through compose", interval=5)
    # The stack may have trained before this test first looked, so the first figure is not a random policy's;
    # the bar is: CartPole's random policy averages about 22, far below 200.
    print(f"\nLEARNED through compose: mean of the trainer's last (up to 100) episodes {start_mean:.1f} over "
          f"{start_count} when first seen -> {s['episode_return']['mean']:.1f} over {s['episode_return']['count']} in "
          f"{time.monotonic() - t0:.0f} s, against about 22 for a random policy; updates {progress(s)[0]}, "
          f"policy version {progress(s)[1]}, samplers {live_samplers(s)}")
    assert progress(s)[1] > 0


@pytest.mark.parametrize("service", ["trainer", "sampler", "kafka"])
def test_a_crash_heals_by_the_restart_policy(compose: Compose, service: str) -> None:
    """The container's main process killed with SIGKILL (a crash, an OOM kill): the engine restarts it by
    `restart: unless-stopped`, it turns healthy, training goes on, and `flywheel verify` passes."""
    container = compose.containers(service)[0]
    before = compose.inspect(container)
    pid, restarts = before["State"]["Pid"], before["RestartCount"]
    at = progress(compose.status())
    os.kill(pid, signal.SIGKILL)
    after = wait_until(lambda: (i := compose.inspect(container))["RestartCount"] > restarts
                       and i["State"]["Running"] and i["State"].get("Health", {}).get("Status") == "healthy" and i,
                       300, f"{service} restarted by its policy and healthy")
    now = advancing(compose, at, 600, f"training to go on after {service} crashed")
    code, out = compose.verify()
    print(f"\n{service}: killed pid {pid} -> restarts {restarts} -> {after['RestartCount']}, healthy; "
          f"updates/version {at} -> {now}; flywheel verify exit {code}:\n{out[-1200:]}")
    assert code == 0, out[-3000:]


def test_docker_kill_is_a_manual_stop_and_up_brings_it_back(compose: Compose) -> None:
    """`docker kill` counts as a manual stop for the engine: `unless-stopped` does not restart it (Docker's
    documented behaviour, seen on this engine); `docker compose up -d` brings it back and the run goes on."""
    container = compose.containers("trainer")[0]
    at = progress(compose.status())
    compose.docker("kill", container)
    time.sleep(15)
    state = compose.inspect(container)["State"]
    print(f"\ntrainer after docker kill, 15 s: {state['Status']} (exit {state['ExitCode']})")
    assert not state["Running"], "the engine restarted a container stopped with docker kill"
    compose.up()
    now = advancing(compose, at, 600, "training to go on after docker kill + up")
    code, out = compose.verify()
    print(f"trainer back by `up`: updates/version {at} -> {now}; flywheel verify exit {code}")
    assert code == 0, out[-3000:]


def test_down_then_up_resumes_the_run(compose: Compose) -> None:
    at = progress(compose.status())
    compose.run("down", "--timeout", "60", timeout=300)
    assert not compose.containers("trainer")
    compose.up()
    first = wait_until(lambda: (p := progress(compose.status()))[0] > 0 and p, 600, "the trainer to report after up")
    now = advancing(compose, at, 600, "updates and version to pass their values at down")
    print(f"\ndown/up: updates/version at down {at}, first after up {first}, then {now}")
    # Resumed from the checkpoint (every 50 updates) and the published marker, not from zero.
    assert first[0] >= at[0] - 60 and first[1] >= at[1] - 60, (at, first)
    code, out = compose.verify()
    assert code == 0, out[-3000:]


def test_scale_to_four_samplers(compose: Compose) -> None:
    compose.up("--scale", "sampler=4")
    assert len(compose.containers("sampler")) == 4

    def four() -> dict[str, Any] | None:
        st = compose.status()
        return st if len(live_samplers(st)) >= 4 else None
    s = wait_until(four, 300, "four live samplers in /status")
    print(f"\nscaled: live samplers {live_samplers(s)}")
    assert len(live_samplers(s)) == 4
    compose.up("--scale", "sampler=1")


FORGE = """
import asyncio, json, os, time
from shared.kafka import make_producer
from shared.messages import KEY_CANDIDATE, PolicyMessage
from shared.marker import VersionedStore
from shared.settings import load_settings
from shared.signing import KeyRing, Signer, new_key
from shared.store import open_store

async def main():
    settings = load_settings(None)
    policies = VersionedStore(open_store(settings), settings.run, "policy")
    current = policies.read_marker()[0]
    old = policies.records()[0]
    # A forged rollback: a newer version naming an old kept version's blob, signed with a trainer key of its own
    # making (not listed), and the same unsigned.
    private, public = new_key("trainer")
    forger = Signer(settings.run, KeyRing({public.key_id: public}, private))
    forged = PolicyMessage(type="candidate", version=current.version + 5, blob=old.blob, sha256=old.sha256,
                           size=old.size, trainer_step=old.trainer_step, created_at=time.time(),
                           lineage=current.version + 5, rollback_of=old.version)
    p = make_producer(settings)  # the Kafka identity of the environment: the trainer's, given by the test
    await p.start()
    try:
        for msg in (forged, forger.sign_message(forged.model_copy(update={"version": current.version + 6}))):
            await p.send_and_wait(f"{settings.run}.policy", msg.to_bytes(), key=KEY_CANDIDATE)
    finally:
        await p.stop()
    print(json.dumps({"forged": [current.version + 5, current.version + 6], "current": current.version}))

asyncio.run(main())
"""


def training_after(c: Compose, before: tuple[int, int], what: str) -> str:
    """The *training after* cell: updates and published version before the attack and once both advanced."""
    now = advancing(c, before, 600, f"training to go on after {what}")
    return f"updates {before[0]} -> {now[0]}, published v{before[1]} -> v{now[1]}"


def verified(c: Compose, what: str) -> str:
    """The *verify* cell; ``flywheel verify`` must exit 0."""
    code, out = c.verify()
    print(f"flywheel verify after {what}: exit {code}\n{out[-600:]}")
    assert code == 0, out[-2000:]
    return "ok"


def test_signed_by_default_a_candidate_the_trainer_did_not_sign_is_never_published(
        compose: Compose, redteam: list[AttackRow]) -> None:
    """`docker compose up` signs by default (issue 43): the sampler container holds the public keys only. Its own
    Kafka identity may not write the policy topic (the last test), so the forger here also holds the trainer's Kafka
    password (a stolen credential, not the trainer's key): a forged candidate it sends on the policy topic (a
    rollback to an old kept version's blob, unsigned, and the same signed with a trainer key of its own making) is
    refused by paramsync with an audit entry, never published, and training goes on with the published versions
    signed by paramsync's key."""
    keys = compose.exec("sampler", "sh", "-c", "ls -A /keys; ls -A /keys/public; env | grep ^FLYWHEEL_SIGNING_ | sort")
    assert keys.stdout.split() == ["public", "public.keys", "FLYWHEEL_SIGNING_ENABLED=true",
                                   "FLYWHEEL_SIGNING_KEYS_FILE=/keys/public/public.keys"], keys.stdout
    s = compose.status()
    assert s["policy"]["signed"] is True and str(s["policy"]["signed_by"]).startswith("paramsync-"), s["policy"]
    password = compose.exec("trainer", "printenv", "FLYWHEEL_KAFKA_SASL_PASSWORD").stdout.strip()
    at = progress(s)
    out = compose.exec("sampler", "python", "-c", FORGE, timeout=120,
                       env={"FLYWHEEL_KAFKA_SASL_USERNAME": "trainer", "FLYWHEEL_KAFKA_SASL_PASSWORD": password})
    sent = json.loads(out.stdout.strip().splitlines()[-1])

    def refused() -> list[dict[str, Any]] | None:
        r = httpx.get(f"{compose.admin}/audit", headers={"Authorization": f"Bearer {compose.token}"}, timeout=10)
        r.raise_for_status()
        body = r.json()
        entries = body.get("entries", body) if isinstance(body, dict) else body
        found = [e for e in entries if e.get("action") == "candidate_refused"
                 and (e.get("params") or {}).get("version") in sent["forged"]]
        return found if len(found) == 2 else None
    entries = wait_until(refused, 120, "paramsync's two candidate_refused audit entries")
    training = training_after(compose, at, "the forged candidates")
    s = compose.status()
    now = progress(s)
    versions = httpx.get(f"{compose.admin}/policy/versions", headers={"Authorization": f"Bearer {compose.token}"},
                         timeout=10).json()
    print(f"\nforged candidates {sent['forged']} (published was {sent['current']}): "
          f"{[(e['params']['version'], e['params']['reason']) for e in entries]}; training {at} -> {now}, "
          f"published {s['policy']['version']} signed by {s['policy']['signed_by']}")
    assert sorted(e["params"]["reason"] for e in entries) == ["unknown_key", "unsigned"], entries
    listed = versions.get("versions", versions) if isinstance(versions, dict) else versions
    forged_published = [v for v in listed if v.get("version") in sent["forged"] and v.get("rollback_of") is not None]
    assert not forged_published, forged_published
    assert s["policy"]["signed_by"].startswith("paramsync-")
    redteam.append(AttackRow(
        "forged candidate, from the sampler container with the trainer's stolen Kafka password: a rollback to an old "
        "kept version's blob at version current+5 on `<run>.policy`, unsigned, and at current+6 signed with a "
        "made-up trainer key", "ok",
        f"paramsync: never published (no rollback among versions {sent['forged']}); published "
        f"v{s['policy']['version']} signed by {s['policy']['signed_by']}",
        "paramsync `candidate_refused` x2: reasons " + ", ".join(sorted(e["params"]["reason"] for e in entries)),
        training, verified(compose, "the forged candidates")))


KEY_PROBE = """
import json, os, sys
out = {"uid": os.getuid(), "keys_dir": sorted(os.path.relpath(os.path.join(d, f), "/keys")
                                               for d, _, fs in os.walk("/keys") for f in fs)}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            out[path] = "READ %d bytes" % len(f.read())
    except OSError as exc:
        out[path] = "REFUSED " + type(exc).__name__
print(json.dumps(out))
"""


def test_a_sampler_cannot_read_a_private_key(compose: Compose, redteam: list[AttackRow]) -> None:
    """The red-team row the local stack cannot refuse (its services share one OS user): in compose each private key
    is in a volume that only its own service (and the one-shot keys job that made it) mounts, so from the sampler
    container, as its user, the trainer's and paramsync's key files are not there to open, and /keys holds the
    public list only."""
    at = progress(compose.status())
    paths = [compose.exec(svc, "printenv", "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE").stdout.strip()
             for svc in ("trainer", "paramsync")]
    assert paths == ["/keys/trainer/trainer.key", "/keys/paramsync/paramsync.key"], paths
    got = json.loads(compose.exec("sampler", "python", "-c", KEY_PROBE, *paths).stdout.strip().splitlines()[-1])
    print(f"\nkey probe from the sampler container: {got}")
    assert got["keys_dir"] == ["public/public.keys"], got
    for path in paths:
        assert got[path] == "REFUSED FileNotFoundError", (path, got)
    mounted: dict[str, set[str]] = {}  # key volume -> the services whose containers mount it (running or exited)
    for cid in compose.run("ps", "-a", "-q").stdout.split():
        info = compose.inspect(cid)
        service = info["Config"]["Labels"]["com.docker.compose.service"]
        for m in info["Mounts"]:
            if m.get("Type") == "volume" and m["Name"].endswith(("_trainer-key", "_paramsync-key")):
                mounted.setdefault(m["Name"].rsplit("_", 1)[1], set()).add(service)
    assert mounted == {"trainer-key": {"trainer", "keys"}, "paramsync-key": {"paramsync", "keys"}}, mounted
    training = training_after(compose, at, "the key read")
    redteam.append(AttackRow(
        "a sampler reads a signing key: from the sampler container, as its OS user (uid "
        f"{got['uid']}), open the trainer's and paramsync's private key files at the paths those services use", "ok",
        f"not there to read: {', '.join(f'{p} {got[p]}' for p in paths)}; /keys holds {got['keys_dir']}; the key "
        "volumes are mounted only by " + "; ".join(f"{v}: {', '.join(sorted(s))}" for v, s in sorted(mounted.items())),
        "none expected (nothing reached a service)", training, verified(compose, "the key read"),
        "the local stack's row stays a known gap (one OS user for every service)"))


def test_per_role_identities_by_default_refuse_the_sampler_and_anonymous_clients(
        compose: Compose, redteam: list[AttackRow]) -> None:
    """`docker compose up` runs each service as its own Kafka user (issue 43, item 2): the sampler's container has
    the sampler's identity on the SASL listener, which may not write the policy, credits or control topics; a client
    without credentials cannot use that listener; and the broker's unauthenticated listeners, where User:ANONYMOUS is
    a super user, do not answer on the compose network. Training went on under these identities (the tests above)."""
    env = compose.exec("sampler", "sh", "-c", "echo $FLYWHEEL_KAFKA_SASL_USERNAME $FLYWHEEL_KAFKA_BOOTSTRAP "
                       "$FLYWHEEL_KAFKA_SECURITY_PROTOCOL $AWS_ACCESS_KEY_ID").stdout
    assert env.split() == ["sampler", "kafka:9094", "SASL_PLAINTEXT", "flywheel-sampler"], env
    at = progress(compose.status())
    out = compose.exec("sampler", "python", "-c", SAMPLER_PROBE, "kafka", timeout=120, check=False)
    print(f"\nper-role identities from the sampler container: {(out.stdout + out.stderr).strip()[-800:]}")
    got = assert_sampler_refused(out.stdout)

    def denials() -> dict[str, str] | None:  # the broker's authorizer log: Denied at INFO
        lines = compose.run("logs", "--no-color", "kafka", check=False).stdout.splitlines()
        found = {t: next((ln for ln in lines if "User:sampler" in ln and "denied" in ln.lower()
                          and f"cartpole.{t}" in ln), "") for t in ("policy", "credits", "control")}
        return found if all(found.values()) else None
    denied = wait_until(denials, 60, "the broker's authorizer to log the sampler's three denials")
    print(f"authorizer: {denied}")
    training = training_after(compose, at, "the sampler's writes")
    redteam.append(AttackRow(
        "a sampler identity writes `<run>.policy`, `<run>.credits` and `<run>.control`: from the sampler container "
        "with its own Kafka user; then a client without credentials, and the broker's unauthenticated listeners",
        "ok", f"Kafka: {got['policy'].split()[-1]} on all three topics; without credentials "
        f"{got['anonymous'][:60]}; kafka:9092 {got['9092'].split()[0]}, :9093 {got['9093'].split()[0]}",
        "the broker's authorizer: `" + denied["policy"].split("Principal = ", 1)[-1][:150] + "` (and for credits, "
        "control)", training, verified(compose, "the sampler's writes")))
    inits = {step: compose.run("logs", "--no-color", step, check=False).stdout.strip().splitlines()[-1:]
             for step in ("kafka-users", "kafka-init", "minio-init")}
    print(f"init steps' last lines: {inits}")
