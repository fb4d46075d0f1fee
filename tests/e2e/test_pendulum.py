"""Pendulum-v1 (continuous actions, gSDE exploration) end to end on the local stack,
real Kafka and real S3, with configs/pendulum.yaml: fragments flow, updates happen, versions are published
and adopted, nothing is dead-lettered. Learning itself is measured in process (bench), not here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import log_events, status

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(360)]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pendulum.yaml"
MIN_VERSIONS = 3


def test_pendulum_trains_end_to_end(make_stack: Any) -> None:
    stack = make_stack(18900)
    stack.config = CONFIG  # make_stack's stacks default to configs/cartpole.yaml
    stack.up(samplers=2, prometheus=False)

    deadline = time.monotonic() + 180  # a guard: an update is ~640 gradient steps (configs/pendulum.yaml)
    s = status(stack)
    while time.monotonic() < deadline:
        s = status(stack)
        versions = [x["policy_version"] or 0 for x in s["samplers"] if x["alive"]]
        # The trainer's count comes from its heartbeat, which can trail the published version by a beat.
        if ((s["policy"]["version"] or 0) >= MIN_VERSIONS and versions and max(versions) >= MIN_VERSIONS
                and s["trainer"]["updates"] >= MIN_VERSIONS):
            break
        time.sleep(1)
    trainer_log = stack.log_path("trainer")
    trained = log_events(trainer_log, "fragment_trained")
    assert trained, "no fragment was trained"
    assert s["trainer"]["updates"] >= MIN_VERSIONS and s["trainer"]["samples_trained"] > 0, s["trainer"]
    assert (s["policy"]["version"] or 0) >= MIN_VERSIONS, s["policy"]
    # Samplers adopted published versions past the first (the weights carry log_std and the observation
    # statistics: a sampler that could not load them would stay on nothing and produce nothing).
    adopted = [e["policy_version"] for i in range(2)
               for e in log_events(stack.log_path("sampler", i), "policy_adopted")]
    assert adopted and max(adopted) >= MIN_VERSIONS, adopted
    assert {e["sampler_id"] for e in trained} == {"sampler-0", "sampler-1"}
    dead = log_events(trainer_log, "fragment_dead_lettered")
    assert not dead, dead[:3]
    returns = s["episode_return"]
    print(f"\nPENDULUM: policy v{s['policy']['version']}, {s['trainer']['updates']} updates, "
          f"{s['trainer']['samples_trained']} env steps trained, samplers on {sorted(set(adopted))[-2:]}, "
          f"episode return {returns}")
    assert returns["count"] > 0 and returns["mean"] is not None and returns["mean"] < 0  # Pendulum's are negative
