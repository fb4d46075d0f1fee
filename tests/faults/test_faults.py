"""Faults injected into the real local stack from outside its processes (see conftest.py).

Marked ``faults``: the quick subset that ``make test`` runs. ``faults_full``: only ``make test-faults``
(CI runs both: ``.ci/run``). The tests share one stack and run in file order. Each first asserts that its
fault really happened (the process was replaced, the broker was gone, records moved to the other member, the
marker was unreadable, the request was refused), then that training went on, and ends by accounting for
every record so far and running ``flywheel verify`` (``FaultEnv.check_accounting``): a test whose fault
did not happen would otherwise pass without proving anything.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from shared.fragment import Fragment, encode_fragment
from shared.kafka import Topics, trainer_group
from shared.marker import VersionedStore, VersionRecord
from shared.settings import load_settings
from shared.store import ObjectStore, PreconditionFailed
from tests.faults.accounting import committed, lost_spans, read_events, read_topic
from tests.faults.conftest import ADMIN_PORT, LOG_CAP, RECOVERY_GOAL_S, REPO, FaultEnv, lost_line
from tests.fragments import blank_fragment

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.e2e, pytest.mark.timeout(900)]


def _fragment(version: int, env_id: str = "CartPole-v1", sample_id: str | None = None) -> Fragment:
    return blank_fragment(version, steps=8, envs=2, sampler_id="poisoner", env_id=env_id, sample_id=sample_id)


def _bf16_payload() -> bytes:
    header = {"rewards": {"dtype": "BF16", "shape": [8, 2], "data_offsets": [0, 32]}}
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"\x00\x3f" * 16


def _poison(version: int) -> list[tuple[str, set[str], list[tuple[str, bytes]], bytes]]:
    """(name, accepted dlq reasons, headers, payload) of every poison class."""
    out = []
    headers, _ = encode_fragment(_fragment(version))
    out.append(("unknown dtype (BF16)", {"undecodable", "bad_dtype", "missing_tensor"}, headers, _bf16_payload()))
    for name, field_, value in [("huge finite reward", "rewards", 3e38), ("+inf reward", "rewards", np.inf),
                                ("-inf observation", "obs", -np.inf)]:
        f = _fragment(version)
        getattr(f, field_)[1, 1] = value
        out.append((name, {"out_of_range", "non_finite"}, *encode_fragment(f)))
    out.append(("future version", {"future_version"}, *encode_fragment(_fragment(999_999_999))))
    out.append(("env-id mismatch", {"env_mismatch"}, *encode_fragment(_fragment(version, env_id="Acrobot-v1"))))
    h, p = encode_fragment(_fragment(version))
    out.append(("NaN created-at", {"bad_header"}, [(k, b"nan" if k == "created-at" else v) for k, v in h], p))
    h, _ = encode_fragment(_fragment(version))
    out.append(("oversize", {"oversize"}, h, b"\x00" * (4 * 1024 * 1024 + 16 * 1024)))
    # Two identities: a second sample-id header (a fragment must have exactly one; the first copy is the one
    # the dead letter is found by, the second names another, valid-looking sample).
    h, p = encode_fragment(_fragment(version))
    out.append(("duplicate sample-id header", {"ambiguous_header"}, [*h, ("sample-id", uuid.uuid4().hex.encode())], p))
    long_id = "a" * 65  # one over MAX_SAMPLE_ID_BYTES: /trace could not look it up
    out.append(("65-character sample id", {"bad_header"}, *encode_fragment(_fragment(version, sample_id=long_id))))
    return out


async def _produce(bootstrap: str, topic: str, records: list[tuple[list[tuple[str, bytes]], bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=8 << 20)
    await producer.start()
    try:
        for headers, payload in records:
            await producer.send_and_wait(topic, payload, headers=headers)
    finally:
        await producer.stop()


@pytest.mark.faults
def test_poison_records_are_dead_lettered_and_training_goes_on(fault_env: FaultEnv) -> None:
    env = fault_env
    topics = Topics.for_run(env.run)
    version = env.published()
    poison = _poison(version)
    # A duplicate: the same valid fragment (same sample id) twice; the second copy is refused.
    dup_headers, dup_payload = encode_fragment(_fragment(version))
    records = [(h, p) for _, _, h, p in poison] + [(dup_headers, dup_payload), (dup_headers, dup_payload)]
    restarts_before = env.restarts()
    asyncio.run(_produce(env.endpoints.kafka_bootstrap, topics.samples, records))
    watch = env.watch_samplers()  # the samplers' records queue behind the poison: they must go on producing
    env.say(f"produced {len(poison)} poison records and one duplicate pair at version {version}")

    wanted = {dict(h).get("sample-id", b"").decode(): (name, reasons) for name, reasons, h, _ in poison}
    dup_id = dict(dup_headers)["sample-id"].decode()
    deadline = time.monotonic() + 60
    found: dict[str, str] = {}
    while time.monotonic() < deadline:
        dlq = asyncio.run(read_topic(env.endpoints.kafka_bootstrap, topics.dlq))
        found = {h.get("sample-id", ""): h.get("dlq-reason", "") for h in dlq.values()}
        if all(sid in found for sid in wanted) and found.get(dup_id) == "duplicate":
            break
        time.sleep(2)
    for sid, (name, reasons) in wanted.items():
        assert sid in found, f"{name}: not dead-lettered"
        assert found[sid] in reasons, f"{name}: dead-lettered with reason {found[sid]!r}, want one of {reasons}"
    assert found.get(dup_id) == "duplicate", "the duplicate sample id was not refused"
    # Weights stay finite: paramsync verifies every candidate and keeps publishing new versions.
    recover = env.wait_version_advances(env.published() + 2, timeout_s=60)
    assert env.restarts() == restarts_before, "a poison record crashed a service"
    env.samplers_back(watch)
    env.check_accounting(f"poison records ({len(poison) + 1} classes, duplicate included)", recover,
                         "each dead-lettered with its reason")


def _trainer_runs(env: FaultEnv) -> list[list[dict[str, object]]]:
    from tests.faults.accounting import split_runs

    return split_runs(read_events(env.stack.log_path("trainer")))


def _kill_trainer_at_random_points(env: FaultEnv, kills: int) -> None:
    before = env.stack.restarts().get("trainer", 0)
    worst = 0.0
    for i in range(kills):
        delay = env.rng.uniform(1.0, 6.0)
        env.say(f"trainer kill {i + 1}/{kills} in {delay:.2f} s")
        time.sleep(delay)
        version = env.published()
        pid = env.stack.pid("trainer")
        env.stack.kill("trainer")
        t0 = time.monotonic()
        after = env.wait_restarted({"trainer": before + i}, timeout_s=90)
        assert after.get("trainer", 0) == before + i + 1, "the supervisor did not restart the trainer"
        env.stack.wait_healthy("trainer", timeout_s=90)
        watch = env.watch_samplers()  # the heal: the new trainer answers, and grants credits again
        assert env.stack.pid("trainer") not in (None, pid), "the trainer was not replaced by a new process"
        env.wait_version_advances(version, timeout_s=90)
        worst = max(worst, time.monotonic() - t0)
        env.samplers_back(watch)
    # Each restart is an automatic action in the run's audit trail, by the supervisor.
    audit = env.audit()
    restarts = [e for e in audit if e["actor"] == "supervisor" and e["action"] == "restart"
                and e["params"]["process"] == "trainer"]
    assert len(restarts) >= kills, f"{len(restarts)} trainer restarts in the audit, {kills} kills"
    runs = _trainer_runs(env)
    for run in runs[-kills:]:
        events = [e.get("event") for e in run]
        assert "checkpoint_restored" in events, "a restarted trainer did not restore its checkpoint (silent reset)"
        assert "resumed_from_ledger_offset" in events, "a restarted trainer did not seek to its checkpoint"
    env.check_accounting(f"trainer kill -9 at {kills} random points", round(worst, 1),
                         "restarted by the supervisor; resumes from the checkpoint's offsets")


@pytest.mark.faults
def test_trainer_kill9_at_random_points_quick(fault_env: FaultEnv) -> None:
    _kill_trainer_at_random_points(fault_env, 2)


@pytest.mark.faults_full
def test_trainer_kill9_at_five_random_points(fault_env: FaultEnv) -> None:
    _kill_trainer_at_random_points(fault_env, 5)


@pytest.mark.faults_full
@pytest.mark.parametrize("name", ["paramsync", "sampler-0", "admin"])
def test_other_services_kill9_are_restarted(fault_env: FaultEnv, name: str) -> None:
    env = fault_env
    before = env.stack.restarts().get(name, 0)
    version = env.published()
    pid = env.stack.pid(name)
    env.stack.kill(name)
    t0 = time.monotonic()
    assert env.wait_restarted({name: before}, timeout_s=60).get(name, 0) == before + 1
    service, _, replica = name.partition("-")
    env.stack.wait_healthy(service, int(replica or 0), timeout_s=60)
    watch = env.watch_samplers()  # the killed process answers again
    assert env.stack.pid(name) not in (None, pid), f"{name} was not replaced by a new process"
    env.wait_version_advances(version, timeout_s=60)
    env.samplers_back(watch)
    env.check_accounting(f"{name} kill -9", round(time.monotonic() - t0, 1), "restarted by the supervisor")


async def _intrude(bootstrap: str, group: str, topic: str, hold_s: float) -> tuple[float, dict[tuple[int, int], float]]:
    """Join the trainer's group as a second member, take records (never commit), leave."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                                session_timeout_ms=6000, heartbeat_interval_ms=2000)
    await consumer.start()
    got: dict[tuple[int, int], float] = {}
    joined = time.time()
    try:
        end = time.monotonic() + hold_s
        while time.monotonic() < end:
            for tp, recs in (await consumer.getmany(timeout_ms=500, max_records=5)).items():
                for rec in recs:
                    got.setdefault((tp.partition, rec.offset), time.time())
    finally:
        await consumer.stop()
    return joined, got


def _when(event: dict[str, object]) -> float:
    return dt.datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


@pytest.mark.faults
def test_rebalance_mid_batch(fault_env: FaultEnv) -> None:
    env = fault_env
    topics = Topics.for_run(env.run)
    restarts_before = env.restarts()
    trainer_pid = env.stack.pid("trainer")
    received: dict[tuple[int, int], float] = {}
    first_join = time.time()
    rounds = 0
    # Two rounds at random points; more (at most 5) while the other member has received nothing: with
    # credit flow control few records are in flight, and a round that moved none proves nothing.
    while rounds < 2 or (not received and rounds < 5):
        rounds += 1
        time.sleep(env.rng.uniform(0.5, 3.0))
        _, got = asyncio.run(_intrude(env.endpoints.kafka_bootstrap, trainer_group(env.run), topics.samples,
                                      hold_s=env.rng.uniform(6.0, 10.0)))
        env.say(f"rebalance {rounds}: the second member took {len(got)} records and left")
        received.update(got)
    # The fault happened: records really moved to the other member, and the trainer really lost partitions
    # (a revoke that names some; every first join logs an empty one, which proves nothing).
    watch = env.watch_samplers()  # the other member left: the trainer owns every partition again
    assert received, f"the second member received no records in {rounds} rounds: no record moved"
    events = [e for run in _trainer_runs(env) for e in run]
    revokes = [e for e in events if e.get("event") == "partitions_revoked" and e.get("partitions")
               and _when(e) >= first_join - 1.0]
    assert revokes, "the trainer logged no non-empty revoke while the other member joined: no rebalance reached it"
    version = env.published()
    recover = env.wait_version_advances(version, timeout_s=60)
    assert env.restarts() == restarts_before and env.stack.pid("trainer") == trainer_pid, \
        "a rebalance crashed a service"
    # What the second member received was not committed by the trainer: the trainer may train it only
    # after getting it back, never before it lost the partition (that would be trained twice).
    trained_at: dict[tuple[int, int], float] = {}
    for e in events:
        if e.get("event") == "fragment_trained":
            trained_at.setdefault((int(str(e["partition"])), int(str(e["offset"]))), _when(e))
    early = [k for k, at in received.items() if k in trained_at and trained_at[k] < at]
    assert not early, f"records trained by the trainer before the second member received them: {early[:5]}"
    env.samplers_back(watch)
    env.check_accounting(f"rebalance mid-batch (a second member joins and leaves, x{rounds})", recover,
                         f"{len(received)} records went to the other member, {len(revokes)} non-empty revokes; "
                         "none trained by both")


def _broker_outage(env: FaultEnv, down_s: float) -> None:
    restarts_before = env.restarts()
    version = env.published()
    pid = env.kafka_pid()
    env.kill_kafka()
    assert env.kafka_pid() is None, "the broker is still running after SIGKILL"
    time.sleep(down_s)
    restarted = time.monotonic()
    env.start_kafka()  # returns once the broker answers a produce/consume round trip
    back = time.monotonic()
    watch = env.watch_samplers()
    assert env.kafka_pid() not in (None, pid), "the broker was not restarted as a new process"
    env.wait_version_advances(version, timeout_s=RECOVERY_GOAL_S + 30)
    recover = time.monotonic() - back
    env.say(f"policy version advanced {recover:.1f} s after the broker answered again "
            f"({time.monotonic() - restarted:.1f} s after its process was started)")
    assert recover <= RECOVERY_GOAL_S, f"training resumed {recover:.1f} s after the broker's return"
    assert env.restarts() == restarts_before, f"a service exited during the outage: {env.restarts()}"
    env.samplers_back(watch)
    env.check_accounting(f"broker kill -9, back after {down_s:.0f} s", round(recover, 1),
                         f"no service exited; resumed unaided ({time.monotonic() - restarted:.0f} s after the "
                         f"broker process was started, which itself took {back - restarted:.0f} s to answer)")


async def _log_ends(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition of ``topic``: its log end offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 (as accounting.read_topic)
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        assert tps, f"no partitions for {topic}"
        return {tp.partition: end for tp, end in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def _end_offsets(bootstrap: str, topic: str) -> int:
    return sum((await _log_ends(bootstrap, topic)).values())


@pytest.mark.faults
def test_trainer_down_samplers_stop_after_one_credit_window(fault_env: FaultEnv) -> None:
    """Credit flow control: with no trainer consuming, the samplers send at most their window and wait,
    instead of filling Kafka with fragments that would be dropped as stale; training resumes after."""
    env = fault_env
    topic = Topics.for_run(env.run).samples
    window = 4  # configs/cartpole.yaml: trainer.flow_window unset -> 2 batches of 2 fragments
    env.stack.stop("trainer")  # not wanted any more: the supervisor leaves it down
    assert env.stack.pid("trainer") is None, "the trainer still runs"
    time.sleep(3.0)  # the last grants and sends land
    before = asyncio.run(_end_offsets(env.endpoints.kafka_bootstrap, topic))
    time.sleep(12.0)
    grew = asyncio.run(_end_offsets(env.endpoints.kafka_bootstrap, topic)) - before
    samplers = [x for x in env.status()["samplers"] if x["alive"]]
    env.say(f"trainer down 15 s: the samples topic grew by {grew} records; samplers {samplers}")
    # Without credits a sampler makes ~50 fragments/s here. With them, at most the window in all (the
    # trainer's last grant may arrive after ``before``), and the samplers say they are waiting.
    assert grew <= window, f"samplers kept producing with no trainer: {grew} records in 12 s"
    assert samplers and all(x["credits_window"] and x["credit_wait_s"] > 5 for x in samplers), samplers
    version = env.published()
    t0 = time.monotonic()
    env.stack.start("trainer")
    env.stack.wait_healthy("trainer", timeout_s=90)
    watch = env.watch_samplers()
    env.wait_version_advances(version + 2, timeout_s=90)
    env.samplers_back(watch)
    env.check_accounting("trainer down 15 s (credits)", round(time.monotonic() - t0, 1),
                         f"samplers sent {grew} records meanwhile (window {window}), then resumed")


@pytest.mark.faults
def test_broker_kill9_back_after_5s(fault_env: FaultEnv) -> None:
    _broker_outage(fault_env, 5)


@pytest.mark.faults_full
def test_broker_kill9_back_after_60s(fault_env: FaultEnv) -> None:
    _broker_outage(fault_env, 60)


@pytest.mark.faults_full
def test_s3_endpoint_down_60s(fault_env: FaultEnv) -> None:
    env = fault_env
    restarts_before = env.restarts()
    version = env.published()
    env.proxy.down()
    with pytest.raises(httpx.ConnectError):
        httpx.get(env.proxy.endpoint, timeout=5)  # the fault is real: the endpoint refuses connections
    env.say("S3 endpoint down (connections refused)")
    degraded_seen = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        time.sleep(5)
        services = env.status().get("services", {})
        degraded_seen = degraded_seen or any(s.get("state") == "degraded" for s in services.values())
    env.proxy.up()
    back = time.monotonic()
    watch = env.watch_samplers()
    env.wait_version_advances(max(version, env.published()), timeout_s=RECOVERY_GOAL_S + 30)
    recover = time.monotonic() - back
    assert recover <= RECOVERY_GOAL_S, f"training resumed {recover:.1f} s after S3 came back"
    assert env.restarts() == restarts_before, f"a service exited during the S3 outage: {env.restarts()}"
    assert degraded_seen, "no service reported itself degraded while S3 was down"
    env.samplers_back(watch)
    env.check_accounting("S3 endpoint down 60 s", round(recover, 1), "services degraded, none exited")


def _overwrite_first_byte(store: ObjectStore, key: str) -> bytes:
    """Write one byte over the start of ``key`` (conditionally: a writer that moves it meanwhile wins and we
    try again); the bytes now stored, which no reader can parse."""
    for _ in range(50):
        obj = store.get(key)
        assert obj is not None, f"{key} does not exist"
        data = b"\xff" + obj.data[1:]
        try:
            store.put(key, data, if_match=obj.etag)
            return data
        except PreconditionFailed:
            time.sleep(0.05)
    raise AssertionError(f"{key} kept moving: could not overwrite it")


def _logged_repairs(env: FaultEnv, kind: str) -> list[str]:
    """Which service logged a repair of the ``kind`` marker (for the failure message: who did not audit it)."""
    return [f"{log.name}: {e.get('timestamp')}" for log in sorted((env.stack.home / "logs").glob("*.log"))
            for e in read_events(log) if e.get("event") == "marker_repaired" and e.get("kind") == kind]


def _repairs(env: FaultEnv, kind: str) -> list[dict[str, Any]]:
    return [e for e in env.audit() if e["action"] == "marker_repaired" and e["params"].get("marker") == kind]


@pytest.mark.faults_full
@pytest.mark.parametrize("kind", ["checkpoints", "policy"])
def test_corrupt_marker_is_repaired_from_history(fault_env: FaultEnv, kind: str) -> None:
    env = fault_env
    store = env.store()
    markers = VersionedStore(store, env.run, kind)
    trainer_restarts = env.stack.restarts().get("trainer", 0)
    repairs_before = len(_repairs(env, kind))
    version = env.published()
    data = _overwrite_first_byte(store, markers.marker_key)
    t0 = time.monotonic()
    watch = env.watch_samplers()  # a sampler reads the policy marker too: it must go on producing
    with pytest.raises(ValueError):  # the fault is real: what is stored is not a record
        VersionRecord.from_json(data)
    env.say(f"one byte written over {markers.marker_key}")
    repairs: list[dict[str, Any]] = []
    while time.monotonic() - t0 < 60 and len(repairs := _repairs(env, kind)) <= repairs_before:
        time.sleep(1)
    assert len(repairs) > repairs_before, (f"no marker_repaired audit entry for the {kind} marker within 60 s; "
                                           f"repairs logged: {_logged_repairs(env, kind)}")
    env.say(f"repair audited: {repairs[-1]}")
    assert "unreadable" in str(repairs[-1]["params"].get("reason")), repairs[-1]
    assert markers.read_marker(repair=False) is not None, f"the {kind} marker is still unreadable"
    recover = env.wait_version_advances(version, timeout_s=max(1.0, 60 - (time.monotonic() - t0)))
    restarts = env.stack.restarts().get("trainer", 0) - trainer_restarts
    assert restarts <= 1, f"the trainer restarted {restarts} times after the {kind} marker was corrupted"
    env.samplers_back(watch)
    env.check_accounting(f"one byte over {kind}/LATEST", round(time.monotonic() - t0, 1),
                         f"repaired from history by {repairs[-1]['actor']} (audited), {restarts} trainer restarts; "
                         f"training advanced {recover:.1f} s after the repair was seen")


def _versions(env: FaultEnv) -> dict[str, Any]:
    r = httpx.get(f"{env.stack.admin_url}/policy/versions", timeout=30)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.faults_full
def test_rollback_while_paramsync_is_down(fault_env: FaultEnv) -> None:
    env = fault_env
    env.stack.stop("paramsync")  # not wanted any more: the supervisor leaves it down
    try:
        _rollback_while_paramsync_is_down(env)
    finally:  # never leave the run without paramsync for the tests after this one
        env.stack.start("paramsync")
        env.stack.wait_healthy("paramsync", timeout_s=90)


def _rollback_while_paramsync_is_down(env: FaultEnv) -> None:
    assert env.stack.pid("paramsync") is None, "paramsync still runs"
    before = _versions(env)  # read with paramsync down: nothing moves the marker now
    current = int(before["current"])
    ordinary = [int(v["version"]) for v in before["versions"]
                if v["rollback_of"] is None and int(v["version"]) < current - 1]
    assert ordinary, f"no earlier ordinary version to roll back to: {before['versions']}"
    target = max(ordinary)
    deadline = time.monotonic() + 60
    while env.status()["services"].get("paramsync", {}).get("alive") and time.monotonic() < deadline:
        time.sleep(1)
    assert not env.status()["services"]["paramsync"]["alive"], "the admin still sees paramsync alive"
    res = env.cli("rollback", str(target))
    env.say(f"flywheel rollback {target} with paramsync down: exit {res.returncode}: {res.stdout.strip()}")
    assert res.returncode == 3, f"want exit 3 (pending), got {res.returncode}: {res.stdout}{res.stderr}"
    assert "pending: paramsync not running" in res.stdout, res.stdout
    pending = _versions(env)
    assert pending["current"] == current, "the marker moved while paramsync was down"
    assert [p for p in pending["pending_rollbacks"] if int(p["version"]) == target], pending["pending_rollbacks"]

    t0 = time.monotonic()
    env.stack.start("paramsync")
    env.stack.wait_healthy("paramsync", timeout_s=90)
    watch = env.watch_samplers()  # paramsync back: the samplers adopt the rollback and produce on
    rolled: list[dict[str, Any]] = []
    while time.monotonic() - t0 < 90 and not rolled:
        body = _versions(env)
        rolled = [v for v in body["versions"] if v["rollback_of"] == target and int(v["version"]) > current]
        time.sleep(0.5)
    assert rolled, f"paramsync did not apply the pending rollback to {target} within 90 s of its start"
    new_version = int(rolled[0]["version"])
    assert not [p for p in _versions(env)["pending_rollbacks"] if int(p["version"]) == target], \
        "the request is still pending after it was applied"
    applied_s = time.monotonic() - t0
    # The trainer follows it: it adopts the rollback's weights and trains on from them (its lineage).
    followed: list[dict[str, object]] = []
    while time.monotonic() - t0 < 120 and not followed:
        followed = [e for e in _trainer_runs(env)[-1] if str(e.get("event", "")).startswith("rollback_followed")
                    and int(str(e.get("policy_version") or 0)) >= new_version]
        time.sleep(0.5)
    assert followed, f"the trainer did not follow the rollback to {target} (v{new_version})"
    env.wait_version_advances(new_version, timeout_s=90)
    markers = VersionedStore(env.store(), env.run, "policy")
    after = [r for r in markers.records() if r.version > new_version]
    assert after and all(int(r.extra.get("lineage") or 0) >= new_version for r in after), \
        [(r.version, r.extra) for r in after]
    env.samplers_back(watch)
    env.check_accounting("rollback requested while paramsync is down", round(applied_s, 1),
                         f"CLI exit 3 (pending: paramsync not running); applied as v{new_version} "
                         f"{applied_s:.1f} s after paramsync started; the trainer followed it")


@pytest.mark.faults_full
def test_second_trainer_is_refused(fault_env: FaultEnv, tmp_path: Path) -> None:
    env = fault_env
    first = env.stack.pid("trainer")
    assert first is not None
    restarts_before = env.stack.restarts().get("trainer", 0)
    version = env.published()
    second_env = env.stack.service_env("trainer")
    second_env["FLYWHEEL_HTTP_PORT"] = str(ADMIN_PORT + 5)
    second_env["FLYWHEEL_LOG_FILE"] = str(tmp_path / "second-trainer.log")  # out of the stack's logs
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.trainer"], env=second_env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    took = time.monotonic() - t0
    log = tmp_path / "second-trainer.log"
    out = proc.stdout + proc.stderr + (log.read_text(errors="replace") if log.exists() else "")
    events = read_events(log)
    # The refusal's own latency: from the moment the process is up (its HTTP port listens; before that it
    # imports torch and builds the model: 5-80 s on a loaded 2-core machine, bounded by the subprocess
    # timeout) to its last line (it stops).
    up = [e for e in events if e.get("event") == "http_listening"]
    refused_s = _when(events[-1]) - _when(up[0]) if up else took
    env.say(f"second trainer exited {proc.returncode} after {took:.1f} s, {refused_s:.1f} s after it listened: "
            f"{[e.get('event') for e in events]}")
    assert proc.returncode != 0, f"a second trainer for the run was not refused:\n{out[-3000:]}"
    assert "is running for this run" in out and f"-{first}'" in out, \
        f"the refusal does not name the running trainer (pid {first}):\n{out[-3000:]}"
    assert refused_s <= 15, f"the second trainer was refused {refused_s:.1f} s after it was up:\n{out[-3000:]}"
    assert env.stack.pid("trainer") == first and env.stack.restarts().get("trainer", 0) == restarts_before, \
        "the first trainer did not keep running"
    watch = env.watch_samplers()  # the second trainer is gone: the first one's grants go on
    recover = env.wait_version_advances(max(version, env.published()), timeout_s=60)
    env.samplers_back(watch)
    env.check_accounting("a second trainer for the run", round(took, 1),
                         f"refused {refused_s:.1f} s after it was up ({took:.1f} s with imports) naming the running "
                         "trainer's lease; the first trained on "
                         f"(next version {recover:.1f} s later)")


RECOVERED_WITHIN_S = 300.0
"""The guard row's bound, from the change to the last-100 return back within ``drop`` of the best (one manual
run on the local stack: rolled back after 9 s, back at 486 of 500 after 69 s)."""


class HistorySeen(threading.Thread):
    """Every policy history record seen in the store, read every ``every_s``: paramsync prunes unpinned versions
    past ``paramsync.keep_versions``, which on this stack is a couple of seconds of publishing, so a record read
    once after the fact may be gone already (the landing CI's guard row failed on such a read)."""

    def __init__(self, history: VersionedStore, every_s: float = 0.2) -> None:
        super().__init__(name="history-seen", daemon=True)
        self.history, self.every_s = history, every_s
        self.seen: dict[int, VersionRecord] = {}
        self.errors = 0
        self._lock = threading.Lock()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                records = self.history.records()
            except Exception:  # the store answered late or not at all: the next read tries again
                self.errors += 1
            else:
                with self._lock:
                    for rec in records:
                        self.seen.setdefault(rec.version, rec)
            self._done.wait(self.every_s)

    def get(self, version: int) -> VersionRecord | None:
        with self._lock:
            return self.seen.get(version)

    def find(self, match: Callable[[VersionRecord], bool]) -> VersionRecord | None:
        with self._lock:
            return next((rec for rec in self.seen.values() if match(rec)), None)

    def stop(self) -> None:
        self._done.set()
        self.join(10)


@pytest.mark.faults_full
@pytest.mark.timeout(1200)  # the stack, up to 300 s to reach the level, up to 300 s to recover, the accounting
def test_guard_rolls_back_a_learning_rate_that_breaks_the_policy(fault_env: FaultEnv) -> None:
    """The rollback guard, end to end: a runtime change that breaks a solved policy is rolled back to a version
    that held the best (republished as the newest, its weights those of the version it names), the trainer
    follows, and the last-100 return comes back within ``drop`` of the best (out of what the guard calls a fall).
    A trainer without the guard wired fails here, and so does a rollback that does not bring the return back
    within ``RECOVERED_WITHIN_S`` (once reported as a known gap: its cause, the trainer following the rollback
    before it applied the remedy, is fixed in ``Trainer.guard_check``)."""
    env = fault_env
    guard = load_settings(environ=env.stack.service_env("trainer")).trainer.guard
    assert guard.enabled, "trainer.guard.enabled is off in the suite's config"
    # The change breaks a *solved* policy (CartPole's 475): at the plateau the best cannot rise any more. A
    # change that lands while the return still rises is another case: the last-100 return lags the weights,
    # versions trained under the change can post a new best, and the guard (by design, test_guard.py's
    # test_a_version_that_held_a_lower_best_is_not_restored) restores the newest holder, which may already
    # carry the change. Measured once on a fresh stack (best 202 -> 265 after the change): not recovered.
    level = max(2 * guard.drop, 475.0)
    t0 = time.monotonic()
    ret: dict[str, Any] = {}
    while time.monotonic() - t0 < 420:
        ret = env.status()["episode_return"]
        if (ret.get("mean") or 0) >= level and ret.get("count", 0) >= guard.min_episodes:
            break
        time.sleep(2)
    assert (ret.get("mean") or 0) >= level, f"the last-100 return did not reach {level} within 420 s: {ret}"
    version = env.published()
    # Both ends of the schedule: once trainer.anneal_env_steps have been trained (a long fault suite gets there),
    # the rate in use is learning_rate_end, and learning_rate alone would change nothing.
    env.say(f"last-100 return {ret['mean']:.0f} >= {level:.0f} at v{version}: setting trainer.learning_rate(_end)=1.0")
    auth = {"Authorization": f"Bearer {env.stack.admin_token}"}
    before = len([e for e in env.audit() if e["action"] == "auto_rollback"])
    history = HistorySeen(VersionedStore(env.store(), env.run, "policy"))
    history.start()  # before the change: the guard's target and the version republished for it are seen
    r = httpx.patch(f"{env.stack.admin_url}/config", json={"trainer.learning_rate": 1.0,
                                                          "trainer.learning_rate_end": 1.0}, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    revision = int(r.json()["revision"])
    t1 = time.monotonic()
    recovered = False
    means: list[float] = []  # the last-100 return as /status showed it since the change

    def watch() -> None:
        mean = env.status()["episode_return"].get("mean")
        if mean is not None:
            means.append(float(mean))

    try:
        rollbacks: list[dict[str, Any]] = []
        while time.monotonic() - t1 < 90 and not rollbacks:
            watch()
            rollbacks = [e for e in env.audit() if e["action"] == "auto_rollback"][before:]
            time.sleep(1)
        assert rollbacks, "no auto_rollback audit entry within 90 s of trainer.learning_rate(_end)=1.0"
        decided_s = time.monotonic() - t1
        params = rollbacks[-1]["params"]
        target, request_id = int(params["to_version"]), str(params["request_id"])
        # The target as the guard requested it: a version paramsync published (one it passed over is replaced by an
        # older one, named_version then), whose sha256 it audits. The republished version carries those weights.
        env.say(f"auto_rollback audited {decided_s:.1f} s after the change: to v{target} (named "
                f"v{params.get('named_version', target)}), {params.get('reason')}, "
                f"{params.get('remedy')}; best {params.get('best')}, mean {params.get('mean')}")
        republished = None
        while time.monotonic() - t1 < 150 and republished is None:
            watch()
            republished = history.find(lambda rec: rec.extra.get("rollback_request") == request_id)
            time.sleep(0.5)
        held = history.get(target)
        assert held is not None, f"v{target}, the version the guard restored, was never seen in the history"
        assert held.sha256 == params["to_sha256"], f"the guard audited other weights than v{target}'s: {params}"
        assert republished is not None, f"no version was published for the guard's rollback request to v{target}"
        assert republished.extra.get("rollback_of") == target and republished.version > version, republished
        assert republished.sha256 == held.sha256, f"v{republished.version} does not carry v{target}'s weights"
        followed: list[dict[str, object]] = []
        while time.monotonic() - t1 < 180 and not followed:
            watch()
            followed = [e for e in _trainer_runs(env)[-1] if e.get("event") == "rollback_followed"
                        and int(str(e.get("policy_version") or 0)) >= republished.version]
            time.sleep(0.5)
        assert followed, f"the trainer did not follow the rollback to v{target} (v{republished.version})"
        rolled_s = time.monotonic() - t1
        samplers = env.watch_samplers()  # the rollback followed: the samplers act on the restored weights

        # The return recovered: the last-100 mean, once fallen below the best the guard held minus ``drop`` (the
        # fault is real), is back above it.
        floor = float(params["best"]) - guard.drop
        if params.get("mean") is not None:
            means.insert(0, float(params["mean"]))
        while True:
            recovered = any(m < floor for m in means) and means[-1] >= floor
            recover_s = time.monotonic() - t1
            if recovered or recover_s >= RECOVERED_WITHIN_S:
                break
            time.sleep(1)
            watch()
        lowest = min(means, default=float("nan"))
        assert lowest < floor, (f"the last-100 return never fell below {floor:.0f} (best {params['best']} - drop "
                                f"{guard.drop}) after the change: lowest {lowest}")
        # Once a known gap (xfail): the trainer followed the rollback before its next runtime poll applied the
        # remedy, so updates at learning_rate 1.0 broke the restored weights again (return stuck at 9). The trainer
        # now applies the remedy with the decision (Trainer.guard_check), and a return that does not come back fails.
        assert recovered, (f"the guard rolled back to v{target} but the last-100 return was not back at {floor:.0f} "
                           f"(best {params['best']} - drop {guard.drop}) within {RECOVERED_WITHIN_S:.0f} s of the "
                           f"change at published v{version}: now {means[-1]:.0f}, lowest {lowest:.0f}")
    finally:
        history.stop()
        if not recovered:  # leave the run as it was for the tests after this one
            httpx.post(f"{env.stack.admin_url}/config/revert", json={"revision": revision - 1}, headers=auth,
                       timeout=30)
    env.say(f"last-100 return {lowest:.0f} -> {means[-1]:.0f} (>= {floor:.0f}) {recover_s:.1f} s after the change")
    env.samplers_back(samplers)
    env.check_accounting(
        "learning_rate(_end)=1.0 after solving (the guard)", round(recover_s, 1),
        f"auto_rollback ({params.get('reason')}, {params.get('remedy')}) {decided_s:.1f} s after the change; "
        f"v{target} republished as v{republished.version}, followed {rolled_s:.1f} s after the change; last-100 "
        f"return {lowest:.0f} -> {means[-1]:.0f} (best {float(params['best']):.0f} - drop {guard.drop:.0f}) "
        f"{recover_s:.1f} s after the change")


async def _delete_records(bootstrap: str, topic: str, before: dict[int, int]) -> dict[int, int]:
    """Kafka's deleteRecords: every record of each partition below ``before[p]`` leaves the log (as retention
    would); the new log start offsets."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        low = await admin.delete_records({TopicPartition(topic, p): RecordsToDelete(before_offset=end)
                                          for p, end in before.items()})
        return {tp.partition: int(offset) for tp, offset in low.items()}
    finally:
        await admin.close()


LOST_WINDOW = 16
"""The lost-records row's trainer.flow_window (configs/cartpole.yaml's default is 4)."""


@pytest.mark.faults_full
def test_records_deleted_before_training_samplers_produce_again(fault_env: FaultEnv) -> None:
    """With the trainer stopped, every untrained record of every partition of ``<run>.samples`` leaves the log
    (``deleteRecords`` up to each log end); the trainer, restarted, reads past them: it logs
    ``records_lost_before_training`` for exactly those spans, and every sampler produces again (the fragments
    deleted unread held their credits: they must stop counting as in flight), and ``flywheel verify`` exits 1
    naming exactly those partitions and spans (and keeps naming them: the later rows expect that)."""
    env = fault_env
    auth = {"Authorization": f"Bearer {env.stack.admin_token}"}
    # A window of 16 fragments in flight instead of 4 (a runtime setting, reverted after): the records left
    # untrained when the trainer stops then fall on several partitions, each holding credits of both samplers.
    r = httpx.patch(f"{env.stack.admin_url}/config", json={"trainer.flow_window": LOST_WINDOW}, headers=auth,
                    timeout=30)
    assert r.status_code == 200, r.text
    revision = int(r.json()["revision"])
    try:
        _lose_every_untrained_record(env, revision)
    finally:
        r = httpx.post(f"{env.stack.admin_url}/config/revert", json={"revision": revision - 1}, headers=auth,
                       timeout=30)
        env.say(f"trainer.flow_window reverted: {r.status_code}")


def _lose_every_untrained_record(env: FaultEnv, revision: int) -> None:
    topic = Topics.for_run(env.run).samples
    bootstrap = env.endpoints.kafka_bootstrap
    deadline = time.monotonic() + 60
    while int((env.status().get("trainer") or {}).get("config_revision") or 0) < revision:
        assert time.monotonic() < deadline, f"the trainer did not apply trainer.flow_window={LOST_WINDOW} in 60 s"
        time.sleep(1)
    time.sleep(3)  # the samplers get the wider window with the next grants
    env.stack.stop("trainer")  # SIGTERM: commits and checkpoints what it trained; the supervisor leaves it down
    assert env.stack.pid("trainer") is None, "the trainer still runs"
    # The samplers spend the credits they hold, then wait: the log ends settle.
    ends, deadline = asyncio.run(_log_ends(bootstrap, topic)), time.monotonic() + 30
    while True:
        time.sleep(3)
        now = asyncio.run(_log_ends(bootstrap, topic))
        if now == ends or time.monotonic() > deadline:
            ends = now
            break
        ends = now
    frontier = asyncio.run(committed(bootstrap, trainer_group(env.run)))
    untrained = {p: (frontier.get(p, 0), end) for p, end in sorted(ends.items()) if end > frontier.get(p, 0)}
    n = sum(hi - lo for lo, hi in untrained.values())
    env.say(f"trainer stopped: log ends {ends}, committed {frontier}: untrained {untrained}")
    # Every partition's untrained records are deleted; with 16 in flight at least two partitions hold some.
    assert len(untrained) >= 2, f"untrained records on {len(untrained)} partition(s) only (ends {ends}, committed " \
                                f"{frontier}): the fault would not reach several partitions"
    low = asyncio.run(_delete_records(bootstrap, topic, ends))  # every partition, up to its end
    assert low == ends, f"deleteRecords left log starts {low}, asked {ends}"
    env.say(f"deleted every record below the log ends {ends}: {n} untrained on partitions {sorted(untrained)}")

    runs_before = len(_trainer_runs(env))
    env.stack.start("trainer")
    env.stack.wait_healthy("trainer", timeout_s=90)
    watch = env.watch_samplers()  # the heal: the trainer is back; the deleted fragments' credits must come back
    lost: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        lost = lost_spans([e for run in _trainer_runs(env)[runs_before:] for e in run])
        if {p for p, _, _ in lost} >= set(untrained):
            break
        time.sleep(1)
    env.samplers_back(watch)
    got = {p: (lo, hi) for p, lo, hi in lost}
    assert len(got) == len(lost) and got == untrained, \
        f"the trainer logged records_lost_before_training {lost}, want exactly {untrained}"
    env.deleted = {p: [span] for p, span in untrained.items()}
    # Verify reads the newest checkpoint: wait for one whose ledger reaches past every lost span.
    def past_the_loss(e: dict[str, object]) -> bool:
        offsets = e.get("offsets")
        return e.get("event") == "checkpoint_written" and isinstance(offsets, dict) and \
            all(int(offsets.get(f"{topic}:{p}", 0)) >= hi for p, (_, hi) in untrained.items())

    written: list[dict[str, object]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not written:
        written = [e for run in _trainer_runs(env)[runs_before:] for e in run if past_the_loss(e)]
        time.sleep(1)
    assert written, "no checkpoint past the lost records within 120 s"
    code, out = env.verify()
    assert code == 1, f"flywheel verify exited {code} with records lost before training:\n{out}"
    for p, (lo, hi) in untrained.items():
        assert f"{topic}:{p} [" in out and lost_line([(lo, hi)]) in out, f"verify does not name partition {p}:\n{out}"
    env.check_accounting(
        "every untrained record of every partition deleted (deleteRecords) with the trainer stopped", None,
        f"trainer.flow_window {LOST_WINDOW} for the row; {n} untrained records on partitions "
        f"{', '.join(map(str, sorted(untrained)))} of {len(ends)} deleted unread (every partition's log emptied); the "
        "trainer logged records_lost_before_training for exactly those spans, and verify names them (exit 1)", lost=n)


@pytest.mark.faults
def test_zz_drained_every_record_accounted_for(fault_env: FaultEnv) -> None:
    """Stop producing, let the trainer drain, then every record on the topic has an outcome."""
    env = fault_env
    for replica in range(2):
        env.stack.hold("sampler", replica)
        env.stack.stop("sampler", replica)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        backlog = env.status()["backlog"]["records"]
        if backlog == 0:
            break
        time.sleep(1)
    assert env.status()["backlog"]["records"] == 0, "the trainer did not drain the backlog"
    # drained: every record on the topic, counted as distinct records (not outcome lines: a record with two
    # outcomes cannot cover one with none), and a second outcome only a refused re-delivery or a re-processing
    # after a restore.
    acc = env.check_accounting("drained: every record produced", None, "backlog 0 at the end", drained=True,
                               samplers_na="the row stops both samplers to drain the backlog")
    assert acc.produced > 0 and not acc.missing
    assert acc.accounted == acc.produced and not acc.unaccounted, (acc.accounted, acc.produced)


@pytest.mark.faults
def test_zz_log_files_stay_under_their_cap(fault_env: FaultEnv) -> None:
    """Every log file the stack wrote, current or rotated, stayed under the cap for the whole run (a
    rotated copy holds what the file reached before rotation). The services rotate their own JSON
    logs between lines; the supervisor copy-truncates the rest within a second of passing the cap."""
    env = fault_env
    logs = env.stack.home / "logs"
    files = [p for p in logs.iterdir() if p.is_file()]
    assert files
    slack = 256 * 1024  # copy-truncate acts on the supervisor's next tick (1 s of output)
    over = {p.name: p.stat().st_size for p in files
            if p.stat().st_size > LOG_CAP + (0 if _self_rotated(p) else slack)}
    rotated = sorted({p.name.split(".")[0] for p in files if p.suffix[1:].isdigit()})
    minutes = (time.monotonic() - env.started) / 60
    env.say(f"log files after {minutes:.1f} min: {len(files)}, rotated: {rotated}, total "
            f"{sum(p.stat().st_size for p in files) / 1e6:.1f} MB")
    assert not over, f"log files over the {LOG_CAP} byte cap: {over}"
    assert "trainer" in rotated, "the trainer's log never reached the cap: the check proved nothing"
    # The row's lost / trained-twice figures are measured, not written: the accounting reads the trainer's log
    # across every rotated copy, so an outcome line lost at a rotation shows as a record with no outcome.
    copies = len([p for p in files if p.name.startswith("trainer.log")])
    env.check_accounting(f"log files under a {LOG_CAP // 1024} KiB cap for {minutes:.1f} min", None,
                         f"rotated: {', '.join(rotated)}; records accounted across the trainer log's {copies} files",
                         samplers_na="no fault; the samplers were stopped by the drained row")


def _self_rotated(path: Path) -> bool:
    """A service's own JSON log (or one of its rotated copies): rotated between lines, never over the cap."""
    return ".log" in path.name and path.name.split(".")[0] in ("trainer", "paramsync", "admin") or \
        (path.name.startswith("sampler-") and ".log" in path.name)
