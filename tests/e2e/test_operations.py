"""Operator actions on the real stack: pause/resume, a runtime settings change and its revert, rollback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.kafka import Topics
from tests.e2e.conftest import log_events, status

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(600)]


async def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer._client.force_metadata_update()  # noqa: SLF001
            parts = consumer.partitions_for_topic(topic) or set()
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        await consumer.stop()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_pause_config_and_rollback_on_the_real_stack(make_stack: Any, run_name: str, kafka_bootstrap: str) -> None:
    stack = make_stack(18800)
    stack.up(samplers=2, prometheus=False)
    url, auth = stack.admin_url, {"Authorization": f"Bearer {stack.admin_token}"}
    topic = Topics.for_run(run_name).samples
    _wait(lambda: (status(stack)["policy"]["version"] or 0) >= 5 and len(status(stack)["samplers"]) == 2,
          120, "training to start")

    # ---- pause: the samples topic's end offsets stop moving within 2 s and stay put ----
    r = httpx.post(f"{url}/samplers/pause", json={}, headers=auth, timeout=10)
    assert r.status_code == 202, r.text
    time.sleep(2.0)
    frozen = asyncio.run(_end_offsets(kafka_bootstrap, topic))
    time.sleep(3.0)
    assert asyncio.run(_end_offsets(kafka_bootstrap, topic)) == frozen, "samplers produced while paused"
    s = status(stack)
    assert all(x["paused"] and x["paused_since"] for x in s["samplers"]), s["samplers"]
    r = httpx.post(f"{url}/samplers/resume", json={}, headers=auth, timeout=10)
    assert r.status_code == 202
    _wait(lambda: asyncio.run(_end_offsets(kafka_bootstrap, topic)) != frozen, 10, "production to resume")
    _wait(lambda: not any(x["paused"] for x in status(stack)["samplers"]), 5, "heartbeats to show resumed")

    # ---- runtime settings: applied by the running services, audited with old and new, reverted ----
    r = httpx.patch(f"{url}/config", json={"trainer.learning_rate": 0.00042, "trainer.target_kl": None,
                                           "sampler.max_backlog": 11}, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    rev = r.json()["revision"]

    def applied() -> bool:
        s = status(stack)
        return s["trainer"]["config_revision"] == rev and all(
            x["config_revision"] == rev and x["max_backlog"] == 11 for x in s["samplers"])

    _wait(applied, 10, "the services to apply the new settings")
    # The config anneals from learning_rate towards learning_rate_end (1e-5): the new base bounds it now.
    _wait(lambda: 1e-5 <= (status(stack)["trainer"]["learning_rate"] or 1) <= 0.00042, 10, "the learning rate")
    audit = httpx.get(f"{url}/audit", timeout=10).json()["entries"]
    change = [e for e in audit if e["action"] == "config_change"][-1]
    assert change["params"]["changes"]["sampler.max_backlog"]["new"] == 11
    assert change["params"]["changes"]["trainer.learning_rate"]["new"] == 0.00042
    r = httpx.post(f"{url}/config/revert", json={"revision": rev - 1}, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    reverted = r.json()["revision"]
    _wait(lambda: status(stack)["trainer"]["config_revision"] == reverted and all(
        x["max_backlog"] != 11 for x in status(stack)["samplers"]), 10, "the revert to apply")

    # ---- rollback: a new version with V's weights within 1 s; samplers act on it; the trainer follows ----
    # Pause first (what an operator would do): no new versions meanwhile, so the target stays kept
    # (paramsync keeps the last paramsync.keep_versions); paused samplers still adopt new versions.
    assert httpx.post(f"{url}/samplers/pause", json={}, headers=auth, timeout=10).status_code == 202
    time.sleep(3.0)  # the trainer drains what was queued
    versions = httpx.get(f"{url}/policy/versions", timeout=10).json()
    target = versions["versions"][len(versions["versions"]) // 2]
    r = httpx.post(f"{url}/policy/rollback", json={"version": target["version"]}, headers=auth, timeout=10)
    assert r.status_code == 202, r.text
    new_version = r.json()["new_version"]
    assert new_version is not None and new_version > versions["current"]
    t0 = time.monotonic()
    s = _wait(lambda: (x := status(stack))["policy"]["version"] >= new_version and x, 5, "the rollback to publish")
    published = httpx.get(f"{url}/policy/versions", timeout=10).json()["versions"]
    rolled = next(v for v in published if v["version"] == new_version)
    assert rolled["sha256"] == target["sha256"] and rolled["rollback_of"] == target["version"]
    _wait(lambda: all((x["policy_version"] or 0) >= new_version for x in status(stack)["samplers"]), 5,
          "every sampler to act on the rollback")
    acted_s = time.monotonic() - t0
    assert httpx.post(f"{url}/samplers/resume", json={}, headers=auth, timeout=10).status_code == 202
    events = _wait(lambda: [e for e in log_events(stack.log_path("trainer"), "rollback_followed")], 10,
                   "the trainer to follow the rollback")
    assert events[0]["rollback_of"] == target["version"]
    # The trainer's next published version descends from the rollback (its lineage), not from the
    # abandoned weights: paramsync refuses those.
    _wait(lambda: status(stack)["policy"]["version"] > new_version, 30, "a version trained after the rollback")
    after = httpx.get(f"{url}/policy/versions", timeout=10).json()["versions"]
    assert all(v["rollback_of"] is None for v in after if v["version"] > new_version)
    print(f"samplers acted on the rollback {acted_s:.2f} s after it was published")  # noqa: T201
    actions = [e["action"] for e in httpx.get(f"{url}/audit", timeout=10).json()["entries"]]
    assert {"pause", "resume", "config_change", "rollback", "trainer_followed_rollback"} <= set(actions), actions

    # ---- trace: one trained sample, from the sampler to its update, through the admin ----
    trained = log_events(stack.log_path("trainer"), "fragment_trained")[-1]
    r = httpx.get(f"{url}/trace/{trained['sample_id']}", timeout=30)
    assert r.status_code == 200, r.text
    kinds = [step["kind"] for step in r.json()["steps"]]
    assert "produced" in kinds and "trained" in kinds, kinds
    assert r.json()["outcome"] == "trained"
    assert httpx.get(f"{url}/trace/{'0' * 32}", timeout=30).status_code == 404
