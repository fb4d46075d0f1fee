"""Operator actions on the real stack: pause/resume, a runtime settings change and its revert, rollback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.kafka import Topics
from shared.marker import VersionedStore
from tests.e2e.conftest import log_events, status, wait_until
from tests.faults.conftest import s3_store

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


async def _pause_while_watching(bootstrap: str, topic: str, pause: Callable[[], httpx.Response],
                                watch_s: float = 5.0) -> tuple[bool, float]:
    """Watch the topic's end offsets (every ~50 ms, one consumer) for a second, send the pause request, watch
    ``watch_s`` more. Returns whether they moved in the second before, and the seconds from the request to
    their last move after it (0 when they never moved again)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or set()]
        assert tps, f"no partitions for {topic}"

        async def ends() -> int:
            return sum((await consumer.end_offsets(tps)).values())

        first, t_end = await ends(), time.monotonic() + 1.0
        last = first
        while time.monotonic() < t_end:
            last = await ends()
            await asyncio.sleep(0.05)
        r = await asyncio.to_thread(pause)
        sent = time.monotonic()  # the request's answer: every sampler has been told (202)
        assert r.status_code == 202, r.text
        last_move = 0.0
        while time.monotonic() < sent + watch_s:
            now = await ends()
            if now != last:
                last, last_move = now, time.monotonic() - sent
            await asyncio.sleep(0.05)
        return last > first or last_move > 0, last_move
    finally:
        await consumer.stop()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    return wait_until(pred, timeout_s, what, interval=0.1)


def test_pause_config_and_rollback_on_the_real_stack(make_stack: Any, run_name: str, kafka_bootstrap: str) -> None:
    stack = make_stack(18800)
    stack.up(samplers=2, prometheus=False)
    url, auth = stack.admin_url, {"Authorization": f"Bearer {stack.admin_token}"}
    topic = Topics.for_run(run_name).samples
    _wait(lambda: (status(stack)["policy"]["version"] or 0) >= 5 and len(status(stack)["samplers"]) == 2,
          120, "training to start")

    # ---- pause: the samples topic's end offsets stop moving within a second of the request, and stay put ----
    moved_before, last_move = asyncio.run(_pause_while_watching(
        kafka_bootstrap, topic, lambda: httpx.post(f"{url}/samplers/pause", json={}, headers=auth, timeout=10)))
    assert moved_before, "the samplers produced nothing in the second before the pause: the check proves nothing"
    assert last_move <= 1.0, f"the samples topic still grew {last_move:.2f} s after the pause request"
    frozen = asyncio.run(_end_offsets(kafka_bootstrap, topic))
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
    # The trainer's next published versions descend from the rollback (their lineage, stored in each version
    # record, names it), not from the abandoned weights (paramsync refuses those): read from the store, as
    # every reader of a version record does.
    _wait(lambda: status(stack)["policy"]["version"] > new_version, 30, "a version trained after the rollback")
    records = VersionedStore(s3_store(stack.endpoints()), run_name, "policy")
    after = [r for r in records.records() if r.version > new_version]
    assert after, "no version record after the rollback"
    assert all(int(r.extra.get("lineage") or 0) == new_version for r in after), [(r.version, r.extra) for r in after]
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
