"""Faults injected into the real local stack from outside its processes (see conftest.py).

Marked ``faults``: the quick subset that ``make test`` runs. ``faults_full``: only ``make test-faults``.
The tests share one stack and run in file order; each ends by accounting for every record so far.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from shared.fragment import Fragment, encode_fragment
from shared.kafka import Topics, trainer_group
from tests.faults.accounting import read_events, read_topic
from tests.faults.conftest import LOG_CAP, RECOVERY_GOAL_S, FaultEnv, Row
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
    env.check_accounting("poison records (9 classes)", recover, "each dead-lettered with its reason")


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
        env.stack.kill("trainer")
        t0 = time.monotonic()
        deadline = t0 + 90
        while env.stack.restarts().get("trainer", 0) < before + i + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert env.stack.restarts().get("trainer", 0) == before + i + 1, "the supervisor did not restart the trainer"
        env.stack.wait_healthy("trainer", timeout_s=90)
        env.wait_version_advances(version, timeout_s=90)
        worst = max(worst, time.monotonic() - t0)
    # Each restart is an automatic action in the run's audit trail, by the supervisor.
    import httpx

    audit = httpx.get(f"{env.stack.admin_url}/audit", params={"limit": 10_000}, timeout=30).json()["entries"]
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
    env.stack.kill(name)
    t0 = time.monotonic()
    while env.stack.restarts().get(name, 0) <= before and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert env.stack.restarts().get(name, 0) == before + 1
    service, _, replica = name.partition("-")
    env.stack.wait_healthy(service, int(replica or 0), timeout_s=60)
    env.wait_version_advances(version, timeout_s=60)
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


@pytest.mark.faults
def test_rebalance_mid_batch(fault_env: FaultEnv) -> None:
    env = fault_env
    topics = Topics.for_run(env.run)
    restarts_before = env.restarts()
    received: dict[tuple[int, int], float] = {}
    for i in range(2):
        time.sleep(env.rng.uniform(0.5, 3.0))
        _, got = asyncio.run(_intrude(env.endpoints.kafka_bootstrap, trainer_group(env.run), topics.samples,
                                      hold_s=env.rng.uniform(6.0, 10.0)))
        env.say(f"rebalance {i + 1}: the second member took {len(got)} records and left")
        received.update(got)
    version = env.published()
    recover = env.wait_version_advances(version, timeout_s=60)
    assert env.restarts() == restarts_before, "a rebalance crashed a service"
    events = [e for run in _trainer_runs(env) for e in run]
    assert any(e.get("event") == "partitions_revoked" for e in events), "no rebalance reached the trainer"
    # What the second member received was not committed by the trainer: the trainer may train it only
    # after getting it back, never before it lost the partition (that would be trained twice).
    trained_at = {}
    for e in events:
        if e.get("event") == "fragment_trained":
            trained_at.setdefault((int(e["partition"]), int(e["offset"])), e["timestamp"])
    import datetime as dt

    early = [k for k, at in received.items() if k in trained_at
             and dt.datetime.fromisoformat(str(trained_at[k]).replace("Z", "+00:00")).timestamp() < at]
    assert not early, f"records trained by the trainer before the second member received them: {early[:5]}"
    env.check_accounting("rebalance mid-batch (a second member joins and leaves, x2)", recover,
                         f"{len(received)} records went to the other member; none trained by both")


def _broker_outage(env: FaultEnv, down_s: float) -> None:
    restarts_before = env.restarts()
    version = env.published()
    env.kill_kafka()
    time.sleep(down_s)
    restarted = time.monotonic()
    env.start_kafka()  # returns once the broker answers a produce/consume round trip
    back = time.monotonic()
    env.wait_version_advances(version, timeout_s=RECOVERY_GOAL_S + 30)
    recover = time.monotonic() - back
    env.say(f"policy version advanced {recover:.1f} s after the broker answered again "
            f"({time.monotonic() - restarted:.1f} s after its process was started)")
    assert recover <= RECOVERY_GOAL_S, f"training resumed {recover:.1f} s after the broker's return"
    assert env.restarts() == restarts_before, f"a service exited during the outage: {env.restarts()}"
    env.check_accounting(f"broker kill -9, back after {down_s:.0f} s", round(recover, 1),
                         f"no service exited; resumed unaided ({time.monotonic() - restarted:.0f} s after the "
                         f"broker process was started, which itself took {back - restarted:.0f} s to answer)")


async def _end_offsets(bootstrap: str, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 (as accounting.read_topic)
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        assert tps, f"no partitions for {topic}"
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


@pytest.mark.faults
def test_trainer_down_samplers_stop_after_one_credit_window(fault_env: FaultEnv) -> None:
    """Credit flow control: with no trainer consuming, the samplers send at most their window and wait,
    instead of filling Kafka with fragments that would be dropped as stale; training resumes after."""
    env = fault_env
    topic = Topics.for_run(env.run).samples
    window = 4  # configs/cartpole.yaml: trainer.flow_window unset -> 2 batches of 2 fragments
    env.stack.stop("trainer")  # not wanted any more: the supervisor leaves it down
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
    env.wait_version_advances(version + 2, timeout_s=90)
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
    env.say("S3 endpoint down (connections refused)")
    degraded_seen = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        time.sleep(5)
        services = env.status().get("services", {})
        degraded_seen = degraded_seen or any(s.get("state") == "degraded" for s in services.values())
    env.proxy.up()
    back = time.monotonic()
    env.wait_version_advances(max(version, env.published()), timeout_s=RECOVERY_GOAL_S + 30)
    recover = time.monotonic() - back
    assert recover <= RECOVERY_GOAL_S, f"training resumed {recover:.1f} s after S3 came back"
    assert env.restarts() == restarts_before, f"a service exited during the S3 outage: {env.restarts()}"
    assert degraded_seen, "no service reported itself degraded while S3 was down"
    env.check_accounting("S3 endpoint down 60 s", round(recover, 1), "services degraded, none exited")


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
    acc = env.check_accounting("drained: every record produced", None, "backlog 0 at the end")
    assert acc.produced > 0 and not acc.missing
    assert sum(acc.outcomes.values()) >= acc.produced


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
    env.rows.append(Row(f"log files under a {LOG_CAP // 1024} KiB cap for {minutes:.1f} min", "ok", None, 0, 0,
                        env.restarts(), f"rotated: {', '.join(rotated)}"))


def _self_rotated(path: Path) -> bool:
    """A service's own JSON log (or one of its rotated copies): rotated between lines, never over the cap."""
    return ".log" in path.name and path.name.split(".")[0] in ("trainer", "paramsync", "admin") or \
        (path.name.startswith("sampler-") and ".log" in path.name)
