"""Kafka ACLs per role (shared.acl) enforced by a real broker's StandardAuthorizer.

The module starts its own broker (devstack, KRaft, SASL_PLAINTEXT + SCRAM-SHA-512, the authorizer on, one SCRAM
user per role) in a fresh home on its own ports, so it never touches the shared test stack, and stops it at the
end. The run's topics and ACLs are created by the init step (``provision_run``) as the stack's super user; every
other client authenticates as a role, with settings from the environment as in production.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
)

import devstack
from devstack import InfraEndpoints, StackError
from shared.acl import ROLES, AclError, Op, create_acls, provision_run, role_acls
from shared.kafka import (
    LagProbe,
    Topics,
    client_security,
    ensure_topics,
    make_consumer,
    make_producer,
    topic_max_message_bytes,
    trainer_group,
)
from shared.settings import Settings, load_settings

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(shutil.which("java") is None, reason="the local SASL broker needs Java (none on PATH)"),
]

T = TypeVar("T")
KAFKA_PORT, CONTROLLER_PORT, S3_PORT, SASL_PORT = 19592, 19593, 19500, 19594
REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 30.0
"""Bound on every broker call: a client that waits for a grant it never gets must fail the test, not hang it."""


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfraEndpoints]:
    home = tmp_path_factory.mktemp("kafka-acls")
    try:
        started = time.monotonic()
        ep = devstack.ensure_up(home, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT, s3_port=S3_PORT,
                                kafka_sasl_port=SASL_PORT, kafka_authorizer=True, timeout_s=150,
                                progress=lambda _msg: None)
        print(f"broker with authorizer up in {time.monotonic() - started:.1f} s at {ep.kafka_sasl_bootstrap}")
    except StackError as exc:
        devstack.down(home, progress=lambda _msg: None)
        pytest.fail(f"the broker with the authorizer did not come up:\n{exc}", pytrace=False)
    try:
        yield ep
    finally:
        devstack.down(home, progress=lambda _msg: None)


def settings_as(ep: InfraEndpoints, run: str, role: str | None) -> Settings:
    """``role``'s settings (None: the stack's super user, who runs the init step)."""
    return load_settings(environ={**ep.kafka_sasl_env(role), "FLYWHEEL_RUN": run,
                                  "FLYWHEEL_KAFKA_SAMPLES_PARTITIONS": "1"})


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, STEP_TIMEOUT_S)


async def produce(settings: Settings, topic: str, value: bytes) -> int:
    producer = make_producer(settings)
    try:  # start inside: a refused start must still close what it opened
        await bounded(producer.start())
        offset: int = (await bounded(producer.send_and_wait(topic, value, key=b"k"))).offset
        return offset
    finally:
        await producer.stop()


async def list_topics_as(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, **client_security(settings))
    try:
        await bounded(admin.start())
        return list(await bounded(admin.list_topics()))
    finally:
        await admin.close()


async def read_one(settings: Settings, topic: str, offset: int) -> bytes | None:
    """The record at ``offset`` of partition 0, read without a group (as samplers read policy/control)."""
    consumer = make_consumer(settings, group_id=None)
    try:
        await bounded(consumer.start())
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        value: bytes | None = (await bounded(consumer.getone())).value
        return value
    finally:
        await consumer.stop()


async def test_the_role_users_can_do_nothing_before_the_init_step(acl_broker: InfraEndpoints, run_name: str) -> None:
    t = Topics.for_run(run_name)
    await bounded(ensure_topics(settings_as(acl_broker, run_name, None)))  # topics, but no ACLs yet
    sampler = settings_as(acl_broker, run_name, "sampler")
    # Without Describe the run's topics are invisible to a role.
    assert not [name for name in await list_topics_as(sampler) if name.startswith(f"{run_name}.")]
    assert t.policy in await bounded(list_topics_as(settings_as(acl_broker, run_name, None)))
    # An idempotent producer needs Write on some topic (or IdempotentWrite on the cluster) to get a producer id.
    with pytest.raises(ClusterAuthorizationFailedError):
        await produce(sampler, t.samples, b"x")


async def test_a_sampler_writes_samples_and_reads_policy_but_may_not_read_samples(
    acl_broker: InfraEndpoints, run_name: str
) -> None:
    t = Topics.for_run(run_name)
    granted = await bounded(provision_run(settings_as(acl_broker, run_name, None)))
    assert set(granted) == set(ROLES)
    await bounded(provision_run(settings_as(acl_broker, run_name, None)))  # idempotent: runs on every start
    sampler, trainer, paramsync = (settings_as(acl_broker, run_name, r) for r in ("sampler", "trainer", "paramsync"))

    # Allowed: produce samples and heartbeats; read what paramsync announced and what admin commanded.
    sample_offset = await produce(sampler, t.samples, b"fragment")
    await produce(sampler, t.heartbeats, b"beat")
    announced = await produce(paramsync, t.policy, b"announce-1")
    # paramsync caps inline policies by the policy topic's max.message.bytes (DescribeConfigs on that topic only).
    assert await bounded(topic_max_message_bytes(paramsync, t.policy)) is not None
    assert await bounded(topic_max_message_bytes(paramsync, t.samples)) is None
    assert await read_one(sampler, t.policy, announced) == b"announce-1"
    command = await produce(settings_as(acl_broker, run_name, "admin"), t.control, b"sync")
    assert await read_one(sampler, t.control, command) == b"sync"
    # ... and measure the trainer group's lag (Describe on the group), for its backlog limit.
    probe = LagProbe(sampler)
    await bounded(probe.start())
    try:
        assert await bounded(probe.lag(trainer_group(run_name), t.samples)) == {0: sample_offset + 1}
    finally:
        await probe.stop()

    # Refused: reading samples (fetch), joining the trainer's group, writing a policy.
    with pytest.raises(TopicAuthorizationFailedError):
        await read_one(sampler, t.samples, sample_offset)
    consumer = make_consumer(sampler, t.samples, group_id=trainer_group(run_name))
    try:
        with pytest.raises((GroupAuthorizationFailedError, TopicAuthorizationFailedError)):
            await bounded(consumer.start())
            await bounded(consumer.getone())
    finally:
        await consumer.stop()
    with pytest.raises(TopicAuthorizationFailedError):
        await produce(sampler, t.policy, b"forged-announcement")

    # The trainer reads the sample in its group and commits it.
    consumer = make_consumer(trainer, t.samples, group_id=trainer_group(run_name))
    await bounded(consumer.start())
    try:
        record = await bounded(consumer.getone())
        assert record.value == b"fragment"
        tp = TopicPartition(t.samples, record.partition)
        await bounded(consumer.commit({tp: record.offset + 1}))
    finally:
        await consumer.stop()


async def test_a_role_cannot_grant_itself_more(acl_broker: InfraEndpoints, run_name: str) -> None:
    sampler = settings_as(acl_broker, run_name, "sampler")
    wider = [a for a in role_acls(run_name)["trainer"] if a.op is Op.READ]
    with pytest.raises(AclError, match="refused: ClusterAuthorizationFailedError"):
        await create_acls(sampler, [type(a)("User:sampler", a.resource, a.pattern, a.name, a.op) for a in wider])


def test_the_stack_trains_with_acls_enforced(acl_broker: InfraEndpoints, run_name: str, tmp_path: Path) -> None:
    """trainer, paramsync and two samplers, each as its own role's SCRAM user, on the broker with the authorizer
    on after the init step: the trainer updates, paramsync publishes, the samplers act on published versions, and
    no service logs a refusal."""
    asyncio.run(bounded(provision_run(settings_as(acl_broker, run_name, None))))
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    common = {"FLYWHEEL_CONFIG": str(REPO / "configs" / "cartpole.yaml"), "FLYWHEEL_RUN": run_name,
              "FLYWHEEL_KAFKA_SAMPLES_PARTITIONS": "1", "FLYWHEEL_STORE_BACKEND": "local",
              "FLYWHEEL_STORE_LOCAL_ROOT": str(tmp_path / "store"), "FLYWHEEL_HTTP_HOST": "127.0.0.1",
              "FLYWHEEL_TRACKING_TENSORBOARD": "false", "PYTHONUNBUFFERED": "1"}
    layout = [("trainer", "trainer", 19570, None), ("paramsync", "paramsync", 19571, None),
              ("sampler", "sampler", 19572, "sampler-0"), ("sampler", "sampler", 19573, "sampler-1")]
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for service, role, port, sampler_id in layout:
            env = {**base, **common, **acl_broker.kafka_sasl_env(role), "FLYWHEEL_HTTP_PORT": str(port)}
            if sampler_id:
                env["FLYWHEEL_SAMPLER_ID"] = sampler_id
            log = tmp_path / f"{sampler_id or service}.log"
            with log.open("wb") as out:
                procs.append((sampler_id or service, subprocess.Popen(
                    [sys.executable, "-m", f"services.{service}"], env=env, stdout=out, stderr=subprocess.STDOUT,
                    cwd=REPO), log))

        def health(port: int) -> dict[str, object]:
            try:
                body: dict[str, object] = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=3).json()
                return body
            except (httpx.HTTPError, ValueError):
                return {}

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            dead = [name for name, p, _ in procs if p.poll() is not None]
            assert not dead, f"{dead} exited under ACLs: " + "".join(
                log.read_text(errors="replace")[-2000:] for name, _, log in procs if name in dead)
            trainer, paramsync = health(19570), health(19571)
            if int(str(trainer.get("updates") or 0)) >= 5 and int(str(paramsync.get("published_version") or 0)) >= 3:
                break
            time.sleep(1)
        else:
            pytest.fail("no training under ACLs within 240 s: " + "; ".join(
                f"{name}: {log.read_text(errors='replace')[-800:]}" for name, _, log in procs))
        for name, _, log in procs:
            text = log.read_text(errors="replace")
            refused = "AuthorizationFailed" in text or "TOPIC_AUTHORIZATION_FAILED" in text
            assert not refused, f"{name}: {text[-2000:]}"
    finally:
        for _, p, _ in procs:
            p.terminate()
        for _, p, _ in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
