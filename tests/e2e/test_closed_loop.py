"""The closed loop on the local stack, real Kafka and real S3: it learns CartPole and can be operated.

One stack run serves several checks, in order: learning, manual sync and its auth, a sampler
restart, dead letters, and following one sample id through the logs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from safetensors.numpy import save as st_save

from shared.fragment import Fragment, encode_fragment
from shared.kafka import Topics
from tests.e2e.conftest import log_events, status, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(900)]
SOLVE_GUARD_S = 600


def test_closed_loop_learns_and_can_be_operated(make_stack: Any, run_name: str, kafka_bootstrap: str) -> None:
    stack = make_stack(18500)
    t0 = time.monotonic()
    stack.up(samplers=2, prometheus=False)

    # ---- learning: last-100 mean return >= 475 as /status reports it -----------------------
    def solved() -> dict[str, Any] | None:
        s = status(stack)
        er = s["episode_return"]
        return s if er["count"] >= 100 and er["mean"] is not None and er["mean"] >= 475 else None

    first = status(stack)
    s = wait_until(solved, SOLVE_GUARD_S, "CartPole-v1 last-100 mean >= 475", interval=2.0)
    wall = time.monotonic() - t0
    print(f"\nSOLVED: mean {s['episode_return']['mean']:.1f} after {wall:.0f}s wall, "
          f"{s['trainer']['samples_trained']} env steps trained, policy v{s['policy']['version']}, "
          f"{s['trainer']['updates']} updates, staleness {s['staleness']}")
    assert s["policy"]["version"] > (first["policy"]["version"] or 0)
    alive = [x for x in s["samplers"] if x["alive"]]
    assert len(alive) == 2, s["samplers"]
    for x in alive:  # both act on a recent version
        assert x["policy_version"] >= s["policy"]["version"] - 4, (x, s["policy"])
    assert s["trainer"]["alive"] and s["backlog"]["records"] is not None
    # ---- flow control: credits keep the lag at training time within the bound, so (almost) nothing
    # is dropped as stale; both samplers run under a window the trainer granted ---------------------
    st = s["staleness"]
    assert st["max"] is not None and st["max"] <= 8, st  # configs/cartpole.yaml: max_staleness 8
    assert st["dropped_fraction"] is not None and st["dropped_fraction"] <= 0.05, st
    assert all(x["credits_window"] is not None and x["credits_window"] >= 1 for x in alive), alive

    # ---- manual sync: 401 without the token, 403 with a wrong one; with it, every sampler on the latest within 1 s
    url = f"{stack.admin_url}/policy/sync"
    assert httpx.post(url, timeout=10).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 403
    assert httpx.post(url, params={"wait_s": -1}, headers={"Authorization": f"Bearer {stack.admin_token}"},
                      timeout=10).status_code == 422
    r = httpx.post(url, params={"wait_s": 1.0}, headers={"Authorization": f"Bearer {stack.admin_token}"}, timeout=10)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["synced"] is True and body["waited_s"] <= 1.0, body
    assert len(body["samplers"]) == 2 and all(v >= body["policy_version"] for v in body["samplers"].values())

    # ---- a restarted sampler loads the latest published policy before producing ------------
    log1 = stack.log_path("sampler", 1)
    stack.stop("sampler", 1)
    before = len(log_events(log1))
    published_at_restart = status(stack)["policy"]["version"]
    stack.start("sampler", 1)
    stack.wait_healthy("sampler", 1)
    wait_until(lambda: [e for e in log_events(log1)[before:] if e["event"] == "fragment_produced"], 60,
          "the restarted sampler's first fragment")
    after = log_events(log1)[before:]
    first_produce = next(i for i, e in enumerate(after) if e["event"] == "fragment_produced")
    adopted = [e for e in after[:first_produce] if e["event"] == "policy_adopted"]
    # At start a sampler adopts from the store's marker ("start") or from the inline weights of the newest
    # announcements it reads back from the policy topic ("announce", docs/policies.md); either way the
    # version it produces with is at least the one published when it restarted.
    assert adopted and {e["trigger"] for e in adopted} <= {"start", "announce"}, after[:first_produce]
    assert max(e["policy_version"] for e in adopted) >= published_at_restart, (adopted, published_at_restart)
    assert after[first_produce]["policy_version"] >= published_at_restart

    # ---- bad records go to the dead-letter topic with reasons; training goes on --------------
    updates_before = status(stack)["trainer"]["updates"]
    reasons = asyncio.run(_inject_bad_records(kafka_bootstrap, run_name))
    assert reasons == {"garbage": "undecodable", "schema": "unknown_schema", "shape": "bad_shape",
                       "nan": "non_finite"}, reasons
    wait_until(lambda: status(stack)["trainer"]["updates"] > updates_before + 5, 60, "training to go on")
    dead = log_events(stack.log_path("trainer"), "fragment_dead_lettered")
    assert {e["reason"] for e in dead} >= {"undecodable", "unknown_schema", "bad_shape", "non_finite"}

    # ---- one sample id, from production to the update that trained it ------------------------
    trained = log_events(stack.log_path("trainer"), "fragment_trained")
    assert trained
    t = trained[len(trained) // 2]
    sid = t["sample_id"]
    produced = [e for i in range(2) for e in log_events(stack.log_path("sampler", i), "fragment_produced")
                if e["sample_id"] == sid]
    consumed = [e for e in log_events(stack.log_path("trainer"), "fragment_consumed") if e["sample_id"] == sid]
    assert len(produced) == 1 and len(consumed) == 1
    assert produced[0]["partition"] == consumed[0]["partition"] == t["partition"]
    assert produced[0]["offset"] == consumed[0]["offset"] == t["offset"]
    assert t["update"] >= 1 and t["policy_version"] == produced[0]["policy_version"]


async def _inject_bad_records(bootstrap: str, run: str) -> dict[str, str]:
    """Produce four malformed records straight into <run>.samples; return {tag: DLQ reason}."""
    from shared.kafka import make_producer
    from shared.settings import KafkaSettings, Settings

    topics = Topics.for_run(run)
    good = Fragment(
        obs=np.zeros((2, 1, 4), np.float32), actions=np.zeros((2, 1), np.int64), logp=np.full((2, 1), -0.7, np.float32),
        rewards=np.ones((2, 1), np.float32), terminated=np.zeros((2, 1), np.uint8),
        truncated=np.zeros((2, 1), np.uint8), trunc_obs=np.zeros((0, 4), np.float32),
        last_obs=np.zeros((1, 4), np.float32), episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32), policy_version=10**6, sampler_id="injector", env_id="CartPole-v1",
    )
    headers, payload = encode_fragment(good)
    t = {k: getattr(good, k) for k in ("obs", "actions", "logp", "rewards", "terminated", "truncated", "trunc_obs",
                                        "last_obs", "episode_returns", "episode_lengths")}
    bad_shape = st_save({**t, "obs": np.zeros((2, 1, 9), np.float32)})
    nan_rewards = st_save({**t, "rewards": np.array([[np.nan], [1.0]], np.float32)})
    old_schema = [(k, b"0" if k == "flywheel-schema" else v) for k, v in headers]
    records = {"garbage": (headers, b"\xde\xad\xbe\xef" * 64), "schema": (old_schema, payload),
               "shape": (headers, bad_shape), "nan": (headers, nan_rewards)}
    producer = make_producer(Settings(run=run, kafka=KafkaSettings(bootstrap=bootstrap)))
    await producer.start()
    try:
        for tag, (h, value) in records.items():
            await producer.send_and_wait(topics.samples, value, key=tag.encode(), headers=h)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    found: dict[str, str] = {}
    try:
        tp = TopicPartition(topics.dlq, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(found) < len(records):
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for rec in recs:
                    h = dict(rec.headers)
                    if rec.key and rec.key.decode() in records:
                        assert h["dlq-source"].startswith(topics.samples.encode())
                        assert rec.value == records[rec.key.decode()][1]  # the original bytes, kept
                        found[rec.key.decode()] = h["dlq-reason"].decode()
    finally:
        await consumer.stop()
    return found
