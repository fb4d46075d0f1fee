"""What a sampler's Kafka identity may not do, probed from inside a running sampler (issue 43): the compose suite runs
it in the sampler container, the Kubernetes suite in a sampler pod. ``python -c SAMPLER_PROBE <broker host>``, with
the sampler's own FLYWHEEL_KAFKA_* settings, prints one JSON line that :func:`assert_sampler_refused` reads."""
from __future__ import annotations

import json
from typing import Any

SAMPLER_PROBE = """
import asyncio, json, os, socket, sys
from aiokafka import AIOKafkaProducer
from aiokafka.errors import TopicAuthorizationFailedError

async def main():
    out = {}
    p = AIOKafkaProducer(bootstrap_servers=os.environ["FLYWHEEL_KAFKA_BOOTSTRAP"],
                         security_protocol=os.environ["FLYWHEEL_KAFKA_SECURITY_PROTOCOL"],
                         # unset: the settings' default (compose sets it, the Kubernetes overlays do not)
                         sasl_mechanism=os.environ.get("FLYWHEEL_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
                         sasl_plain_username=os.environ["FLYWHEEL_KAFKA_SASL_USERNAME"],
                         sasl_plain_password=os.environ["FLYWHEEL_KAFKA_SASL_PASSWORD"])
    await p.start()
    try:
        # What a sampler must never write: candidates and announcements, credit grants, operators' commands.
        for topic in ("policy", "credits", "control"):
            try:
                await p.send_and_wait(f"cartpole.{topic}", b"not a " + topic.encode())
                out[topic] = "WRITTEN as " + os.environ["FLYWHEEL_KAFKA_SASL_USERNAME"]
            except TopicAuthorizationFailedError as exc:
                out[topic] = f"REFUSED {os.environ['FLYWHEEL_KAFKA_SASL_USERNAME']} {type(exc).__name__}"
    finally:
        await p.stop()
    # Without credentials on the services' listener: the broker closes a connection that does not authenticate.
    anon = AIOKafkaProducer(bootstrap_servers=os.environ["FLYWHEEL_KAFKA_BOOTSTRAP"], request_timeout_ms=5000)
    try:
        await asyncio.wait_for(anon.start(), 60)
        out["anonymous"] = "CONNECTED"
    except Exception as exc:  # KafkaConnectionError (Unable to bootstrap) expected; any failure is a refusal
        out["anonymous"] = f"REFUSED {type(exc).__name__}: {exc}"
    try:
        await anon.stop()
    except Exception:
        pass
    # The broker's listeners without authentication (PLAINTEXT 9092, CONTROLLER 9093), on its own name (argv[1]).
    for port in (9092, 9093):
        try:
            socket.create_connection((sys.argv[1], port), timeout=5).close()
            out[str(port)] = "OPEN"
        except OSError as exc:
            out[str(port)] = f"CLOSED {type(exc).__name__}"
    print(json.dumps(out))

asyncio.run(main())
"""


def assert_sampler_refused(stdout: str) -> dict[str, Any]:
    """The probe's verdict: the sampler refused on the policy, credits and control topics, a client without
    credentials refused, and the unauthenticated listeners closed to it. Returns what the probe saw."""
    got: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    for topic in ("policy", "credits", "control"):
        assert got[topic] == "REFUSED sampler TopicAuthorizationFailedError", (topic, got)
    assert got["anonymous"].startswith("REFUSED"), got
    assert got["9092"].startswith("CLOSED") and got["9093"].startswith("CLOSED"), got
    return got
