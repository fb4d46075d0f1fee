"""Publication: the trainer's candidates on their way to paramsync.

A candidate is the weights blob in the store plus a ``candidate`` message on the policy topic;
paramsync verifies it and moves the marker. A transient fault *defers* a candidate (it is retried with
back-off, newest only, from the trainer's loop: an async trainer that is ``max_staleness`` versions ahead
of publication trains no further update that would send a newer one); a candidate paramsync has not
published in time is re-sent. Each candidate names the checkpoint its weights descend from.

Explicit inputs only; it never calls back into the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from services.trainer.telemetry import DEFERRED, RECOVERIES, VERSION
from shared.bus import Publisher, Record
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_CANDIDATE, PolicyMessage
from shared.retry import Health, Retrier, describe, is_transient
from shared.runtime import Auditor

PUBLISH_RETRY_MIN_S, PUBLISH_RETRY_MAX_S = 1.0, 10.0  # back-off of a deferred candidate's retries


class Publication:
    def __init__(self, policies: VersionedStore, producer: Publisher, *, policy_topic: str, kafka_timeout_s: float,
                 health: Health, retry: Retrier, audit: Auditor, log: Any,
                 sign: Callable[[PolicyMessage], PolicyMessage] | None = None) -> None:
        """``sign``: the trainer's signature on each candidate (``Signer.sign_message``; None: signing off)."""
        self.policies = policies
        self.sign = sign
        self.producer = producer
        self.policy_topic = policy_topic
        self.kafka_timeout_s = kafka_timeout_s
        self.health = health
        self.retry = retry
        self.audit = audit
        self.log = log
        self.candidate: tuple[PolicyMessage, float] | None = None  # the newest sent, and when
        self.deferred: tuple[int, bytes, int, dict[str, Any]] | None = None  # version, weights, update, extra
        self.retry_at = 0.0
        self.backoff_s = PUBLISH_RETRY_MIN_S
        self.resent = 0

    async def publish(self, version: int, data: bytes, update: int, extra: dict[str, Any],
                      required: bool = False) -> None:
        """Write the weights blob and send a candidate (``extra``: lineage, the checkpoint it descends
        from). A transient failure defers it unless ``required``."""
        async def write_and_send() -> PolicyMessage:
            key, sha = await asyncio.to_thread(self.policies.put_blob, data)
            rec = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=update,
                                extra=dict(extra))
            msg = PolicyMessage.of("candidate", rec)
            if self.sign is not None:
                msg = self.sign(msg)
            await asyncio.wait_for(self.producer.send_and_wait(self.policy_topic, msg.to_bytes(), key=KEY_CANDIDATE),
                                   self.kafka_timeout_s)
            return msg

        try:
            msg = await (self.retry(write_and_send, "publish candidate", "publish") if required else write_and_send())
        except Exception as exc:
            if required or not is_transient(exc):
                raise
            DEFERRED.labels(what="publish").inc()
            self.health.degraded("publish", f"candidate {version} not sent: {describe(exc)}")
            self.log.warning("publish_deferred", policy_version=version, update=update, error=describe(exc))
            newer = self.deferred is None or version > self.deferred[0]
            self.backoff_s = PUBLISH_RETRY_MIN_S if newer else min(PUBLISH_RETRY_MAX_S, self.backoff_s * 2)
            self.deferred = (version, data, update, dict(extra))
            self.retry_at = time.monotonic() + self.backoff_s
            return
        self.health.recovered("publish")
        if self.deferred is not None and self.deferred[0] <= version:
            self.deferred = None
        self.candidate = (msg, time.monotonic())
        VERSION.set(version)
        self.log.info("candidate_sent", policy_version=version, sha256=msg.sha256[:12], update=update,
                      checkpoint=extra.get("checkpoint"))

    def retry_due(self, now: float) -> bool:
        return self.deferred is not None and now >= self.retry_at

    async def retry_deferred(self) -> None:
        if self.deferred is not None:
            self.log.info("publish_retry", policy_version=self.deferred[0], automatic_action=True)
            await self.publish(*self.deferred)

    def resend_due(self, published: int | None, now: float, after_s: float) -> bool:
        if self.candidate is None:
            return False
        msg, sent_at = self.candidate
        return (published if published is not None else -1) < msg.version and now - sent_at > after_s

    async def resend(self, why: str, published: int | None) -> None:
        """Send the newest candidate again (paramsync missed it, or training stalled waiting for it)."""
        if self.candidate is None:
            return
        msg = self.candidate[0]
        try:
            await asyncio.wait_for(self.producer.send_and_wait(self.policy_topic, msg.to_bytes(), key=KEY_CANDIDATE),
                                   self.kafka_timeout_s)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.warning("candidate_resend_failed", policy_version=msg.version, error=describe(exc))
        else:
            self.resent += 1
            RECOVERIES.labels(action="resend_candidate").inc()
            if why == "training stalled" or self.resent % 10 == 1:
                await self.audit("candidate_resent", {"version": msg.version, "why": why}, "sent")
            self.log.warning("candidate_resent", policy_version=msg.version, reason=why,
                             published_version=published, automatic_action=True)
        self.candidate = (msg, time.monotonic())

    def abandon(self) -> None:
        """A rollback: what is pending belongs to an abandoned trajectory."""
        self.candidate = None
        self.deferred = None

    async def read_marker(self) -> tuple[VersionRecord, str] | None:
        """The published marker, bounded (store errors propagate: the caller marks itself degraded)."""
        return await asyncio.wait_for(asyncio.to_thread(self.policies.read_marker), 10)


def announcement(rec: Record) -> PolicyMessage | None:
    """An ``announce`` message from the policy topic, or None (candidates, or something unreadable)."""
    try:
        msg = PolicyMessage.model_validate_json(rec.value or b"")
    except ValueError:
        return None
    return msg if msg.type == "announce" else None
