"""The measured attack of issue 32, replayed on the real local stack with signed policies on (the devstack
default, docs/security.md): the newest announcement on ``<run>.policy`` is copied with its version raised by
1,000 and written back (key ``announce``, the same headers) by a plain producer with write access. No sampler
adopts it: their versions stay at or below the published one for 30 s while real versions keep being adopted;
the trainer does not take it as published (its staleness reference is not fooled); the refusal is audited,
logged and counted."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from devstack import LocalStack
from shared.kafka import Topics
from shared.messages import KEY_ANNOUNCE
from tests.e2e.conftest import log_events, status, wait_until
from tests.policy_topic import announcements, produce

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(600)]
WATCH_S = 30.0
RAISE = 1000


def _sampler_versions(st: dict[str, Any]) -> dict[str, int | None]:
    return {s["id"]: s["policy_version"] for s in st["samplers"] if s["alive"]}


def test_a_copied_announcement_with_its_version_raised_is_refused_everywhere(make_stack: Any, run_name: str,
                                                                              kafka_bootstrap: str) -> None:
    stack: LocalStack = make_stack(18700)
    assert stack.service_env("paramsync")["FLYWHEEL_SIGNING_PRIVATE_KEY_FILE"], "the local stack signs its policies"
    assert stack.service_env("sampler")["FLYWHEEL_SIGNING_ENABLED"] == "true"
    assert "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE" not in stack.service_env("sampler"), "a sampler holds no private key"
    stack.up(samplers=2, prometheus=False)
    wait_until(lambda: (st := status(stack))["trainer"]["updates"] >= 5 and len(_sampler_versions(st)) == 2
               and all(v is not None for v in _sampler_versions(st).values()), 180,
               "5 updates and both samplers acting on a policy")

    topic = Topics.for_run(run_name).policy
    newest = asyncio.run(announcements(kafka_bootstrap, topic))[-1]
    value, headers = newest.value, list(newest.headers or [])
    ann: dict[str, Any] = json.loads(value)
    assert ann.get("signature") and ann.get("key_id"), "paramsync's announcements are signed"
    forged_version = int(ann["version"]) + RAISE
    forged = json.dumps({**ann, "version": forged_version}).encode()
    before = status(stack)
    asyncio.run(produce(kafka_bootstrap, topic, [(KEY_ANNOUNCE, forged, headers)]))
    forged_at = time.monotonic()

    seen: list[tuple[float, int | None, dict[str, int | None], int | None]] = []
    while time.monotonic() - forged_at < WATCH_S:
        st = status(stack)
        published = st["policy"]["version"]
        versions = _sampler_versions(st)
        seen.append((round(time.monotonic() - forged_at, 1), published, versions, st["trainer"]["published_version"]))
        assert all(v is None or v <= published for v in versions.values()), seen[-1]
        assert st["staleness"]["ahead"] is None and st["staleness"]["ahead_samplers"] == [], st["staleness"]
        tpub = st["trainer"]["published_version"]
        assert tpub is None or tpub < forged_version, seen[-1]
        time.sleep(1)
    after = status(stack)
    start_versions, end_versions = _sampler_versions(before), _sampler_versions(after)
    print(f"\nforged version {forged_version} (newest announcement {ann['version']} + {RAISE}); published "
          f"{before['policy']['version']} -> {after['policy']['version']} over {WATCH_S:.0f} s; samplers "
          f"{start_versions} -> {end_versions}; trainer published_version {before['trainer']['published_version']} "
          f"-> {after['trainer']['published_version']}, staleness {after['staleness']}")
    # Real versions kept being adopted meanwhile.
    assert after["policy"]["version"] > before["policy"]["version"]
    for sid, v in end_versions.items():
        assert v is not None and v < forged_version and v > (start_versions.get(sid) or -1), (sid, v)

    # Refused by each reader: audited (the trainer), logged with the record's offset, counted.
    audit = httpx.get(f"{stack.admin_url}/audit", headers={"Authorization": f"Bearer {stack.admin_token}"},
                      timeout=10).json()
    entries = [e for e in audit["entries"] if e["action"] == "policy_signature_refused"]
    assert [(e["actor"], e["params"]["version"], e["params"]["reason"], e["params"]["source"]) for e in entries] \
        == [("trainer", forged_version, "bad_signature", "announcement")], entries
    for service, replica in (("sampler", 0), ("sampler", 1), ("trainer", 0)):
        refused = log_events(stack.log_path(service, replica), "policy_signature_refused")
        assert [(e["policy_version"], e["reason"]) for e in refused] == [(forged_version, "bad_signature")], \
            (service, replica, refused)
        assert "offset" in refused[0]
    for replica in (0, 1):
        metrics = httpx.get(f"http://127.0.0.1:{stack.port('sampler', replica)}/metrics", timeout=10).text
        line = ('flywheel_policy_signature_refused_total{reason="bad_signature",role="sampler",'
                'source="announcement"} 1.0')
        assert line in metrics, [m for m in metrics.splitlines() if "signature_refused" in m]
