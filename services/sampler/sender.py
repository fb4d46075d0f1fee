"""Sending fragments: encode (compressed per ``sampler.compression``, split to fit the topic's message
limit), take a credit sequence number, sign (the sampler's identity key, ``shared.identity``), take an in-flight
slot, send without waiting, and account for the acknowledgement (counted and logged with the fragment's identity)
or its failure (the credit is given back, the fragment is lost before it existed: counted, logged, the sampler
degraded until a send works).

Explicit inputs only; it never calls back into the sampler.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import Counter, Gauge

from shared.bus import Publisher
from shared.credits import H_SAMPLER_SEQ, CreditGate, seq_value
from shared.fragment import FragmentTooLarge, Headers, encode_fitting
from shared.identity import SamplerKey, fragment_message
from shared.logging import fragment_fields
from shared.retry import Health, Retrier, describe
from shared.service import RateMeter
from shared.settings import Settings

ENV_STEPS = Counter("flywheel_sampler_env_steps_total", "Env steps taken", ["sampler"])
FRAGMENTS = Counter("flywheel_sampler_fragments_produced_total", "Fragments acknowledged by Kafka", ["sampler"])
SEND_ERRORS = Counter("flywheel_sampler_send_errors_total", "Fragments Kafka refused", ["sampler"])
IN_FLIGHT = Gauge("flywheel_sampler_in_flight_fragments", "Fragments sent, not yet acknowledged", ["sampler"])


class FragmentSender:
    def __init__(self, producer: Publisher, topic: str, credits: CreditGate, settings: Settings, *,
                 health: Health, retry: Retrier, log: Any, labels: dict[str, str],
                 identity: SamplerKey | None = None) -> None:
        self.producer = producer
        self.identity = identity  # signs every record: readers bind this sampler's id to it (shared.identity)
        self.topic = topic
        self.credits = credits
        self.settings = settings  # replaced by the sampler when runtime settings change
        self.health_state = health
        self.retry = retry
        self.log = log
        self._labels = labels
        self.in_flight = asyncio.Semaphore(settings.sampler.max_in_flight)
        self.pending: set[asyncio.Future[Any]] = set()
        self.fragments = 0
        self.env_steps = 0
        self.steps_rate = RateMeter()

    async def send(self, frag: Any) -> None:
        """Encode ``frag`` (compressed per ``sampler.compression``, split to fit the topic) and send it."""
        compression = self.settings.sampler.compression
        try:
            pieces = encode_fitting(frag, self.settings.kafka.max_message_bytes,
                                    None if compression == "none" else compression)
        except FragmentTooLarge as exc:
            self.log.error("fragment_too_large", error=str(exc), sample_id=frag.sample_id)
            raise
        if len(pieces) > 1:
            self.log.info("fragment_split", pieces=len(pieces), steps=frag.steps, sample_id=frag.sample_id,
                          sample_ids=[p.sample_id for p, _, _ in pieces])
        for piece, headers, payload in pieces:
            await self._send_record(piece, headers, payload)

    async def _send_record(self, frag: Any, headers: Headers, payload: bytes) -> None:
        seq = self.credits.next_seq()
        headers.append((H_SAMPLER_SEQ, seq_value(self.credits.incarnation, seq)))
        if self.identity is not None:
            headers.extend(self.identity.headers(fragment_message(headers, payload)))
        await self.in_flight.acquire()
        IN_FLIGHT.labels(**self._labels).inc()
        # No key: the partitioner spreads fragments over all partitions, so two samplers never share
        # one partition while others idle (ordering across fragments does not matter). While the broker
        # is unreachable the send is retried (the sampler is degraded, producing nothing meanwhile).
        try:
            fut = await self.retry(lambda: self.producer.send(self.topic, payload, key=None, headers=headers),
                                   "send fragment", "kafka", timeout_s=self.settings.kafka.request_timeout_ms / 1000)
        except BaseException:
            self.credits.lost(seq)
            self.in_flight.release()
            IN_FLIGHT.labels(**self._labels).dec()
            raise
        self.pending.add(fut)
        ids = fragment_fields(frag.sample_id, frag.sampler_id, frag.policy_version)

        def done(f: asyncio.Future[Any]) -> None:
            self.pending.discard(f)
            self.in_flight.release()
            IN_FLIGHT.labels(**self._labels).dec()
            if f.cancelled() or f.exception() is not None:
                # Never acknowledged, so never on the topic: this fragment is lost before it existed
                # (counted and logged with its id); the loop goes on with the next.
                self.credits.lost(seq)  # never consumed: it must not hold a credit for good
                SEND_ERRORS.labels(**self._labels).inc()
                error = "cancelled" if f.cancelled() else describe(f.exception())  # type: ignore[arg-type]
                self.health_state.degraded("kafka", f"fragment send failed: {error}")
                self.log.error("fragment_send_failed", error=error, **ids)
                return
            if "kafka" in self.health_state.reasons:
                self.health_state.recovered("kafka")
            meta = f.result()
            if self.settings.sampler.credits:  # settled once the trainer's position passes it (shared.credits)
                self.credits.placed(seq, meta.partition, meta.offset)
            self.fragments += 1
            self.env_steps += frag.steps
            self.steps_rate.add(frag.steps)
            FRAGMENTS.labels(**self._labels).inc()
            ENV_STEPS.labels(**self._labels).inc(frag.steps)
            self.log.info("fragment_produced", steps=frag.steps, episodes=len(frag.episode_returns),
                          partition=meta.partition, offset=meta.offset, **{k: v for k, v in ids.items()})

        fut.add_done_callback(done)
