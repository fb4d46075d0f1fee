"""paramsync: the only writer of the policy marker.

Candidates arrive on ``<run>.policy`` (consumer group ``<run>.paramsync``, committed after each
one is handled). Each is verified — blob present, sha256 and size match, weights load into the
model — then the marker is moved conditionally and the version announced on the same topic.
Heartbeats tell which samplers are live and on which version (sync latency); ``sync`` commands
on ``<run>.control`` re-announce the current version.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from services.paramsync.tracker import SyncTracker
from shared.kafka import Topics, ensure_topics, make_consumer, make_producer
from shared.logging import get_logger
from shared.marker import MarkerConflict, StaleVersion, VersionedStore
from shared.messages import KEY_ANNOUNCE, ControlCommand, ParamsyncBeat, PolicyMessage, SamplerBeat, parse_heartbeat
from shared.rl.envs import fragment_spec
from shared.rl.model import ActorCritic, WeightsError, load_weights
from shared.service import run_until_first_error
from shared.settings import Settings
from shared.store import StoreError, open_store

SYNC_LATENCY = Histogram("flywheel_paramsync_sync_latency_seconds",
                         "From a candidate's receipt to every live sampler acting on it",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PUBLISHED = Gauge("flywheel_paramsync_published_version", "Version behind the marker")
CANDIDATES = Counter("flywheel_paramsync_candidates_total", "Candidates handled", ["outcome"])
LIVE = Gauge("flywheel_paramsync_live_samplers", "Samplers with a recent heartbeat")
PRUNE_EVERY = 10
PUBLISH_SECONDS = Histogram("flywheel_paramsync_publish_seconds", "Verify + marker write + announce")


class Paramsync:
    name = "paramsync"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.id = f"paramsync-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger()
        self.policies = VersionedStore(open_store(settings), settings.run, "policy")
        spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes)
        self.model = ActorCritic.for_spec(spec, settings.trainer.hidden)
        self.tracker = SyncTracker(settings.paramsync.sampler_timeout_s)
        self.producer = make_producer(settings)
        self.candidates = make_consumer(settings, group_id=f"{settings.run}.paramsync")
        self.inbox = make_consumer(settings, group_id=None)
        self.published_version: int | None = None
        self._publishes = 0
        self._started = False

    async def start(self) -> None:
        await ensure_topics(self.settings)
        await self.producer.start()
        await self.candidates.start()
        self.candidates.subscribe([self.topics.policy])
        await self.inbox.start()
        tps = [TopicPartition(self.topics.heartbeats, 0), TopicPartition(self.topics.control, 0)]
        self.inbox.assign(tps)
        await self.inbox.seek_to_end(*tps)
        current = await asyncio.to_thread(self.policies.read_marker)
        if current is not None:
            self.published_version = current[0].version
            PUBLISHED.set(current[0].version)
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        await run_until_first_error(
            self._candidate_loop(stop_event), self._inbox_loop(stop_event), self._beat_loop(stop_event)
        )

    async def stop(self) -> None:
        await self.candidates.stop()
        await self.inbox.stop()
        await self.producer.stop()

    def health(self) -> dict[str, Any]:
        return {"ok": self._started, "published_version": self.published_version}

    # ---- candidates ------------------------------------------------------------------------
    async def _candidate_loop(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            polled = await self.candidates.getmany(timeout_ms=200, max_records=50)
            received = time.monotonic()
            candidates = [msg for records in polled.values() for rec in records
                          if (msg := self._parse_policy_message(rec.value, rec.offset)) is not None
                          and msg.type == "candidate"]
            if candidates:
                # Only the newest of a burst is published: the older ones are already superseded.
                newest = max(candidates, key=lambda m: m.version)
                if len(candidates) > 1:
                    CANDIDATES.labels(outcome="superseded").inc(len(candidates) - 1)
                with PUBLISH_SECONDS.time():
                    outcome = await self._publish(newest)
                CANDIDATES.labels(outcome=outcome).inc()
                if outcome == "published":
                    self.tracker.published(newest.version, received)
            for tp, records in polled.items():
                await self.candidates.commit({tp: records[-1].offset + 1})

    def _parse_policy_message(self, value: bytes | None, offset: int) -> PolicyMessage | None:
        if value is None:
            return None
        try:
            return PolicyMessage.model_validate_json(value)
        except ValueError as exc:
            CANDIDATES.labels(outcome="malformed").inc()
            self.log.warning("candidate_malformed", offset=offset, reason=str(exc)[:300])
            return None

    async def _publish(self, msg: PolicyMessage) -> str:
        record = msg.record()
        try:
            data = await asyncio.to_thread(self.policies.fetch, record)
            load_weights(self.model, data)
        except (StoreError, WeightsError) as exc:
            self.log.warning("candidate_rejected", policy_version=msg.version, reason=str(exc))
            return "rejected"
        for attempt in range(3):
            try:
                await asyncio.to_thread(self.policies.publish_next, record)
                break
            except StaleVersion as exc:
                self.log.info("candidate_stale", policy_version=msg.version, reason=str(exc))
                return "stale"
            except MarkerConflict as exc:
                self.log.warning("marker_conflict", policy_version=msg.version, attempt=attempt, reason=str(exc))
        else:
            return "conflict"
        self.published_version = msg.version
        PUBLISHED.set(msg.version)
        await self._announce(record.version, msg)
        self._publishes += 1
        removed: list[int] = []
        if self._publishes % PRUNE_EVERY == 0:  # pruning lists and reads history: not on every publish
            removed = await asyncio.to_thread(self.policies.prune, self.settings.paramsync.keep_versions)
        self.log.info("policy_published", policy_version=msg.version, sha256=msg.sha256[:12],
                      trainer_step=msg.trainer_step, pruned=removed or None)
        return "published"

    async def _announce(self, version: int, msg: PolicyMessage) -> None:
        ann = PolicyMessage.of("announce", msg.record())
        await self.producer.send_and_wait(self.topics.policy, ann.to_bytes(), key=KEY_ANNOUNCE)

    # ---- heartbeats and control ------------------------------------------------------------
    async def _inbox_loop(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            polled = await self.inbox.getmany(timeout_ms=200)
            for records in polled.values():
                for rec in records:
                    if rec.value is None:
                        continue
                    if rec.topic == self.topics.heartbeats:
                        self._on_heartbeat(rec.value)
                    else:
                        await self._on_control(rec.value)

    def _on_heartbeat(self, value: bytes) -> None:
        try:
            beat = parse_heartbeat(value)
        except ValueError:
            return
        if not isinstance(beat, SamplerBeat):
            return
        for version, latency in self.tracker.heartbeat(beat.id, beat.policy_version, time.monotonic()):
            SYNC_LATENCY.observe(latency)
            self.log.info("policy_synced", policy_version=version, latency_s=round(latency, 4),
                          live_samplers=len(self.tracker.live(time.monotonic())))

    async def _on_control(self, value: bytes) -> None:
        try:
            cmd = ControlCommand.model_validate_json(value)
        except ValueError as exc:
            self.log.warning("control_malformed", reason=str(exc)[:300])
            return
        current = await asyncio.to_thread(self.policies.read_marker)
        if current is None:
            self.log.info("manual_sync_nothing_published", request_id=cmd.request_id)
            return
        rec = current[0]
        await self.producer.send_and_wait(self.topics.policy, PolicyMessage.of("announce", rec).to_bytes(),
                                          key=KEY_ANNOUNCE)
        self.log.info("manual_sync_announced", request_id=cmd.request_id, policy_version=rec.version)

    async def _beat_loop(self, stop_event: asyncio.Event) -> None:
        interval = self.settings.paramsync.heartbeat_interval_s
        while not stop_event.is_set():
            live = self.tracker.live(time.monotonic())
            LIVE.set(len(live))
            beat = ParamsyncBeat(id=self.id, published_version=self.published_version,
                                 sync_latency_p50_s=self.tracker.p(0.5), sync_latency_p95_s=self.tracker.p(0.95),
                                 live_samplers=len(live))
            await self.producer.send(self.topics.heartbeats, beat.to_bytes(), key=self.id.encode())
            try:
                await asyncio.wait_for(stop_event.wait(), timeout=interval)
            except TimeoutError:
                pass

