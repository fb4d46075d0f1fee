"""paramsync: the only writer of the policy marker.

Candidates arrive on ``<run>.policy`` (consumer group ``<run>.paramsync``, committed after each
one is handled). Each is verified — blob present, sha256 and size match, weights load into the
model — then the marker is moved conditionally and the version announced on the same topic, with its
weights inline when they fit ``paramsync.inline_max_bytes`` (:mod:`services.paramsync.inline`, docs/policies.md).
Heartbeats tell which samplers are live and on which version (sync latency); ``sync`` commands
on ``<run>.control`` re-announce the current version.

Rollbacks are durable requests in the store (``<run>/ops/rollback/``, :mod:`services.paramsync.rollbacks`):
paramsync applies the pending ones in request order at start, every ``ROLLBACK_POLL_S`` and at once
on a ``rollback`` command, and records each as ``applied`` (with its new version) or ``refused``
(with the reason), so a rollback requested while paramsync was down is applied when it comes back.

Kafka is reached only through ``shared.bus`` (a :class:`~shared.bus.Bus` passed in, ``kafka_bus`` with the
group by default, ``MemoryBus`` in unit tests). One loop handles candidates; the inbox is one
``shared.retry.read_forever`` reader; heartbeats, re-announcements and rollbacks are named periodic tasks
(``shared.retry.every``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
from prometheus_client import Counter, Gauge, Histogram

from services.paramsync.inline import BATCH_OVERHEAD_BYTES, InlinePayload
from services.paramsync.rollbacks import RollbackQueue, RollbackRequest, Status, republish
from services.paramsync.tracker import SyncTracker
from shared.background import Background
from shared.bus import Bus, Headers, Record, kafka_bus
from shared.identity import IdentityCheck, beat_message, record_time
from shared.kafka import BROKER_DEFAULT_MESSAGE_BYTES, Topics, topic_max_message_bytes
from shared.logging import get_logger
from shared.marker import BadPayload, MarkerConflict, StaleVersion, VersionedStore, VersionRecord
from shared.messages import KEY_ANNOUNCE, ControlCommand, ParamsyncBeat, PolicyMessage, SamplerBeat, parse_heartbeat
from shared.retry import Health, Retrier, describe, every, is_transient, poll_or_pause, read_forever, stop_clients
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.rl.model import ActorCritic, WeightsError, load_weights
from shared.runtime import AuditLog, Auditor
from shared.settings import Settings
from shared.signing import (
    PolicyVerifier,
    Refusals,
    SignatureRefused,
    Signer,
    message_audit_params,
    record_audit_params,
)
from shared.store import open_store

SYNC_LATENCY = Histogram("flywheel_paramsync_sync_latency_seconds",
                         "From a candidate's receipt to every live sampler acting on it",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PUBLISHED = Gauge("flywheel_paramsync_published_version", "Version behind the marker")
CANDIDATES = Counter("flywheel_paramsync_candidates_total", "Candidates handled", ["outcome"])
LIVE = Gauge("flywheel_paramsync_live_samplers", "Samplers with a recent heartbeat")
SAMPLER_VERSION = Gauge("flywheel_paramsync_sampler_policy_version",
                        "Policy version each sampler last reported (series removed once the tracker forgets it)",
                        ["sampler"])
ROLLBACKS = Counter("flywheel_paramsync_rollbacks_total", "Rollback requests decided", ["outcome"])
ROLLBACK_POLL_S = 2.0
"""How often paramsync looks for pending rollback requests in the store (besides the command)."""
PRUNE_EVERY = 10
PUBLISH_SECONDS = Histogram("flywheel_paramsync_publish_seconds", "Verify + marker write + announce")
REANNOUNCED = Counter("flywheel_paramsync_reannouncements_total", "Periodic re-announcements of the published version")
ANNOUNCEMENTS = Counter("flywheel_paramsync_announcements_total",
                        "Announcements sent (re-announcements included), by where readers get the weights",
                        ["payload"])  # inline: in the message; store: a GET of the blob


class AbandonedLineage(Exception):
    """A candidate trained from weights a rollback abandoned (the marker's lineage is newer)."""

    def __init__(self, lineage: int) -> None:
        super().__init__(f"the published lineage is {lineage}")
        self.lineage = lineage


class Paramsync:
    name = "paramsync"

    def __init__(self, settings: Settings, bus: Bus | None = None,
                 policy_topic_limit: Callable[[], Awaitable[int | None]] | None = None) -> None:
        """``policy_topic_limit``: reads the policy topic's ``max.message.bytes`` at start (inline announcements
        are capped by it); with the real bus (``bus`` None) the broker is asked, with a bus passed in nothing is."""
        self.settings = settings
        self.id = f"paramsync-{socket.gethostname()}-{os.getpid()}"
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger()
        store = open_store(settings)
        self.audit = Auditor(AuditLog(store, settings.run), self.log, "paramsync")
        repaired = self.audit.repair_hook("policy")
        self.policies = VersionedStore(store, settings.run, "policy", on_repair=repaired)
        # Publishes only candidates the trainer signed, and signs every record it publishes and every announcement
        # with its own key (docs/security.md); None: signing is off.
        self.signer = Signer.from_settings(settings, "paramsync")
        self.verifier = PolicyVerifier.from_settings(settings)
        self.refusals = Refusals("paramsync", self.log)
        self.rollbacks = RollbackQueue(store, settings.run)
        self._rollback_wanted = asyncio.Event()
        spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes, settings.env.frame_stack)
        self.model = ActorCritic.for_arch(spec, PolicyArch.of(settings.trainer))
        self.tracker = SyncTracker(settings.paramsync.sampler_timeout_s)
        # A heartbeat under an id bound to another key is not believed (shared.identity): no sync latency, no
        # liveness for the id from it.
        self.beat_identity = IdentityCheck("paramsync", self.log, settings.sampler.identity_handover_s)
        self.inline = InlinePayload(settings.paramsync.inline_max_bytes, settings.kafka.max_message_bytes)
        if policy_topic_limit is None and bus is None:
            policy_topic_limit = lambda: topic_max_message_bytes(settings, self.topics.policy)  # noqa: E731
        self._policy_topic_limit = policy_topic_limit
        self.bus = bus or kafka_bus(settings, group=paramsync_group(settings.run))
        self.producer = self.bus.publisher
        self.candidates = self.bus.source  # the group's member on <run>.policy, committed after each poll
        self.inbox = self.bus.tail(self.topics.heartbeats, self.topics.control)  # from the end
        self.published_version: int | None = None
        self.published_record: VersionRecord | None = None
        self.lineage_required = 0  # the last rollback published: older lineages are abandoned weights
        self._marker_lock = asyncio.Lock()  # candidates and rollbacks move the marker one at a time
        self.health_state = Health("paramsync")
        self.retry = Retrier(self.health_state, self.log)
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._publishes = 0
        self.background = Background("paramsync")  # the inbox reader and, now and then, a pruning
        self._prune_task: asyncio.Task[None] | None = None
        self._started = False

    async def start(self) -> None:
        await self.retry(self.bus.create_topics, "create topics", "kafka")
        await self.retry(self.producer.start, "start producer", "kafka")
        await self.retry(self.candidates.start, "start candidate consumer", "kafka")
        self.candidates.subscribe(self.topics.policy, _nothing, _nothing)  # nothing in hand to commit on revoke
        await self.retry(self.inbox.start, "start inbox", "kafka")
        current = await self.retry(lambda: asyncio.to_thread(self.policies.read_marker), "read marker", "store")
        if current is not None and await self._signed_by_paramsync(current[0]):
            self._set_published(current[0])
        if self._policy_topic_limit is not None and self.inline.limit > 0:
            limit = await self.retry(self._policy_topic_limit, "read the policy topic's message limit", "kafka",
                                     timeout_s=self.settings.kafka.request_timeout_ms / 1000)
            self.inline.cap((limit or BROKER_DEFAULT_MESSAGE_BYTES) - BATCH_OVERHEAD_BYTES)
        if self.inline.limit < self.inline.configured:
            self.log.warning("inline_limit_capped", inline_max_bytes=self.inline.configured, limit=self.inline.limit,
                             reason="an inline announcement must fit kafka.max_message_bytes and the policy "
                                    "topic's max.message.bytes")
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        self._stop = self.retry.stop_event = stop_event
        cfg, log = self.settings.paramsync, self.log
        self.background.start("inbox", read_forever(self.inbox, self._on_inbox, name="inbox", log=log))
        await self.background.until_done(
            self._candidate_loop(stop_event),
            every(lambda: cfg.heartbeat_interval_s, self._beat, name="heartbeats", log=log, stop_event=stop_event),
            self._reannouncements(stop_event),
            every(lambda: ROLLBACK_POLL_S, self._apply_pending_rollbacks, name="rollbacks", log=log,
                  stop_event=stop_event, wake=self._rollback_wanted),
        )

    async def stop(self) -> None:
        if self._prune_task is not None and not self._prune_task.done():
            try:
                await asyncio.wait_for(self._prune_task, 10)
            except Exception as exc:  # housekeeping: the next start prunes again
                self.log.warning("prune_unfinished_at_stop", error=describe(exc))
        await self.background.stop()
        await stop_clients((self.candidates, self.inbox, self.producer), self.log)

    def health(self) -> dict[str, Any]:
        return {"ok": self._started, "published_version": self.published_version, **self.health_state.as_dict()}

    def _set_published(self, record: VersionRecord) -> None:
        self.published_version = record.version
        self.published_record = record
        self.lineage_required = max(self.lineage_required, record.lineage)
        PUBLISHED.set(record.version)

    # ---- candidates ------------------------------------------------------------------------
    async def _candidate_loop(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            polled = await poll_or_pause(lambda: self.candidates.poll(max_records=50, timeout_ms=200),
                                         what="candidate poll", health=self.health_state)
            if polled is None:
                continue
            received = time.monotonic()
            candidates = [msg for records in polled.values() for rec in records
                          if (msg := self._parse_policy_message(rec.value, rec.offset)) is not None
                          and msg.type == "candidate" and await self._trainer_signed(msg, rec.offset)]
            if candidates:
                # Only the newest of a burst is published: the older ones are already superseded.
                newest = max(candidates, key=lambda m: m.version)
                if len(candidates) > 1:
                    CANDIDATES.labels(outcome="superseded").inc(len(candidates) - 1)
                with PUBLISH_SECONDS.time():
                    async with self._marker_lock:
                        outcome = await self._publish(newest)
                CANDIDATES.labels(outcome=outcome).inc()
                if outcome == "published":
                    self.tracker.published(newest.version, received)
            await self._commit({tp: records[-1].offset + 1 for tp, records in polled.items()})

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit handled candidates. A failure (rebalance, coordinator gone, broker down) only means the
        candidates come again after a restart, where they are refused as stale: logged, never fatal."""
        if not offsets:
            return
        try:
            await asyncio.wait_for(self.candidates.commit(offsets), self.settings.kafka.request_timeout_ms / 1000)
        except (KafkaError, TimeoutError) as exc:
            if isinstance(exc, KafkaError) and not is_transient(exc) and type(exc).__name__ not in (
                    "CommitFailedError", "IllegalStateError"):
                raise
            self.log.warning("candidate_commit_failed", error=describe(exc))

    async def _signed_by_paramsync(self, record: VersionRecord) -> bool:
        """The marker found at start is re-announced (signed again with the current key) only when a paramsync
        signed it: one written into the store by anyone else is refused, audited, and never announced."""
        try:
            self.verifier.check_record(record)
            return True
        except SignatureRefused as exc:
            if self.refusals.note_record(exc, record, "marker"):
                await self.audit("policy_signature_refused", record_audit_params(exc, record, "marker"),
                                  "not announced")
            return False

    async def _trainer_signed(self, msg: PolicyMessage, offset: int) -> bool:
        """False when ``msg`` lacks the trainer's valid signature: never published, never supersedes one that has
        it; logged, counted and audited once (docs/security.md)."""
        try:
            self.verifier.check_candidate(msg)
            return True
        except SignatureRefused as exc:
            CANDIDATES.labels(outcome="signature_refused").inc()
            if self.refusals.note_message(exc, msg, offset=offset):
                await self.audit("candidate_refused", message_audit_params(exc, msg, offset=offset), "not published")
            return False

    def _parse_policy_message(self, value: bytes | None, offset: int) -> PolicyMessage | None:
        if value is None:
            return None
        try:
            return PolicyMessage.model_validate_json(value)
        except ValueError as exc:
            CANDIDATES.labels(outcome="malformed").inc()
            self.log.warning("candidate_malformed", offset=offset, reason=str(exc)[:300])
            return None

    def _signed(self, record: VersionRecord) -> VersionRecord:
        """``record`` signed with the current key (signing off: as it is)."""
        return record if self.signer is None else self.signer.sign_record(record)

    async def _publish(self, msg: PolicyMessage) -> str:
        record = self._signed(msg.record())
        if msg.lineage < self.lineage_required:
            self.log.info("candidate_abandoned", policy_version=msg.version, lineage=msg.lineage,
                          reason=f"trained from weights abandoned by the rollback to lineage {self.lineage_required}")
            return "abandoned"
        try:
            data = await self.retry(lambda: asyncio.to_thread(self.policies.fetch, record), "fetch candidate", "store")
            load_weights(self.model, data)
            self.inline.keep(record, data)  # verified: it rides on the announcement if it fits
        except (BadPayload, WeightsError) as exc:
            self.log.warning("candidate_rejected", policy_version=msg.version, reason=str(exc))
            return "rejected"
        def publish_on_current_lineage() -> None:
            """Move the marker unless it moved past this candidate: a newer version, or a rollback this
            candidate's weights do not descend from. Checked against the marker read for the conditional
            write, so a rollback published meanwhile (by another task or process) is never overtaken."""
            current = self.policies.read_marker()
            lineage = current[0].lineage if current is not None else 0
            if msg.lineage < lineage:
                raise AbandonedLineage(lineage)
            if current is not None and record.version <= current[0].version:
                raise StaleVersion(f"version {record.version} is not newer than published {current[0].version}")
            self.policies.publish(record, None if current is None else current[1])

        for attempt in range(3):
            try:
                await self.retry(lambda: asyncio.to_thread(publish_on_current_lineage), "move marker", "store")
                break
            except AbandonedLineage as exc:
                self.lineage_required = max(self.lineage_required, exc.lineage)
                self.log.info("candidate_abandoned", policy_version=msg.version, lineage=msg.lineage,
                              reason=f"trained from weights abandoned by the rollback to lineage {exc.lineage}")
                return "abandoned"
            except StaleVersion as exc:
                self.log.info("candidate_stale", policy_version=msg.version, reason=str(exc))
                return "stale"
            except MarkerConflict as exc:
                # A retried conditional PUT that had in fact succeeded answers 412: then the marker is ours.
                now = await self.retry(lambda: asyncio.to_thread(self.policies.read_marker), "read marker", "store")
                if now is not None and now[0].version == record.version and now[0].sha256 == record.sha256:
                    break
                self.log.warning("marker_conflict", policy_version=msg.version, attempt=attempt, reason=str(exc))
        else:
            return "conflict"
        self._set_published(record)
        await self._announce(record)
        self._publishes += 1
        # Pruning lists, reads and deletes history (a second or more on a slow store): in the background,
        # one at a time, so the next candidate is published meanwhile. A slow publish makes the trainer
        # wait (it never runs more than max_staleness versions ahead of the published policy).
        if self._publishes % PRUNE_EVERY == 0 and (self._prune_task is None or self._prune_task.done()):
            self._prune_task = self.background.start("prune", self._prune(), once=True)  # its error stops paramsync
        self.log.info("policy_published", policy_version=msg.version, sha256=msg.sha256[:12],
                      trainer_step=msg.trainer_step)
        return "published"

    async def _prune(self) -> None:
        try:
            removed = await asyncio.to_thread(self.policies.prune, self.settings.paramsync.keep_versions)
        except Exception as exc:  # housekeeping: tried again at the next PRUNE_EVERY
            if not is_transient(exc):
                raise  # the background's watch (``until_done``) raises it and stops paramsync
            self.log.warning("prune_failed", error=describe(exc))
            return
        if removed:
            self.log.info("versions_pruned", versions=removed)

    async def _announce(self, record: VersionRecord, *, quiet: bool = False) -> None:
        """Announce ``record`` (inline when its weights fit) and wait for the acknowledgement, retried while
        Kafka is away (``quiet``: once; a transient error is raised). Inline announcements are sized below the
        policy topic's limit read at start; should a broker still refuse one as too large (the topic altered
        since), only smaller weights go inline from now on and the announcement is sent without them (an
        idempotent producer may be out of sequence after a refusal: then that send fails and paramsync stops,
        to restart with a fresh producer and the topic's limit read again)."""
        record = self._signed(record)  # the current key, even for a marker signed with one rotated out since
        await self._hold_inline(record)
        ann, inline = self.inline.announcement(record)
        try:
            await self._send_announcement(ann, quiet)
        except (MessageSizeTooLargeError, RecordListTooLargeError) as exc:
            if not inline:
                raise
            self.inline.refused(len(ann))
            self.log.warning("inline_announcement_refused", policy_version=record.version, bytes=len(ann),
                             limit=self.inline.limit, error=describe(exc))
            ann, inline = self.inline.announcement(record)
            await self._send_announcement(ann, quiet)
        ANNOUNCEMENTS.labels(payload="inline" if inline else "store").inc()

    async def _send_announcement(self, value: bytes, quiet: bool) -> None:
        timeout_s = self.settings.kafka.request_timeout_ms / 1000
        if quiet:
            await asyncio.wait_for(self.producer.send_and_wait(self.topics.policy, value, key=KEY_ANNOUNCE), timeout_s)
            return
        await self.retry(lambda: self.producer.send_and_wait(self.topics.policy, value, key=KEY_ANNOUNCE),
                         "announce", "kafka", timeout_s=timeout_s)

    async def _hold_inline(self, record: VersionRecord) -> None:
        """Fetch ``record``'s weights to announce them inline, when they fit and are not held (a rollback, a
        restarted paramsync's marker). A store that fails is not worth waiting for: announced without them."""
        if not self.inline.wants(record):
            return
        try:
            data = await asyncio.wait_for(asyncio.to_thread(self.policies.fetch, record),
                                          self.settings.kafka.request_timeout_ms / 1000)
            self.inline.keep(record, data)
        except Exception as exc:
            if not (is_transient(exc) or isinstance(exc, BadPayload | ValueError)):
                raise
            self.log.warning("inline_payload_unavailable", policy_version=record.version, error=describe(exc))

    # ---- heartbeats and control ------------------------------------------------------------
    async def _on_inbox(self, rec: Record) -> None:
        if rec.value is None:
            return
        if rec.topic == self.topics.heartbeats:
            await self._on_heartbeat(rec.value, rec.headers, record_time(rec))
        else:
            await self._on_control(rec.value)

    async def _on_heartbeat(self, value: bytes, headers: Headers, at: float) -> None:
        try:
            beat = parse_heartbeat(value)
        except ValueError:
            return
        if not isinstance(beat, SamplerBeat):
            return
        refused = self.beat_identity.refusal("heartbeat", beat.id, headers, beat_message(value), at)
        if refused is not None:
            if refused.news:
                await self.audit("sampler_identity_refused", refused.audit, "heartbeat ignored")
            return
        if beat.policy_version is not None:
            SAMPLER_VERSION.labels(sampler=beat.id).set(beat.policy_version)
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
        if cmd.command == "rollback":
            self._rollback_wanted.set()  # the request itself is in the store: apply it now
            return
        if cmd.command != "sync":
            return  # pause, resume, config: the samplers' and trainer's business
        try:
            current = await asyncio.wait_for(asyncio.to_thread(self.policies.read_marker), 30)
        except Exception as exc:  # the store is down: announce what we last published, if anything
            if not is_transient(exc):
                raise
            self.log.warning("manual_sync_marker_unreadable", request_id=cmd.request_id, error=describe(exc))
            current = None if self.published_record is None else (self.published_record, "")
        if current is None:
            self.log.info("manual_sync_nothing_published", request_id=cmd.request_id)
            return
        rec = current[0]
        await self._announce(rec)
        self.log.info("manual_sync_announced", request_id=cmd.request_id, policy_version=rec.version)

    # ---- rollbacks ---------------------------------------------------------------------------
    async def _apply_pending_rollbacks(self) -> None:
        """The pending rollback requests, oldest first (the ``rollbacks`` task: at start, every
        ``ROLLBACK_POLL_S`` and at once on a command). Reading them is retried while the store is down
        (degraded meanwhile); stopping ends the retries with the last error, which the task logs."""
        pending = await self.retry(lambda: asyncio.to_thread(self.rollbacks.pending), "read rollback requests",
                                   "store", timeout_s=60)
        for req, etag in pending:
            if self._stop.is_set():
                return
            await self._apply_rollback(req, etag)

    async def _apply_rollback(self, req: RollbackRequest, etag: str) -> None:
        """Apply one pending request and record the outcome (``applied`` or ``refused``) on it. Records
        keep the lineage semantics: the new version starts lineage N, so candidates trained from the
        abandoned weights are refused from now on. A store outage leaves the request pending."""
        try:
            async with self._marker_lock:
                for attempt in range(3):
                    try:
                        record = await self.retry(
                            lambda: asyncio.to_thread(republish, self.policies, self.model, req, self._signed,
                                                      self.verifier.check_record),
                            "rollback", "store", timeout_s=60)
                        # At once, under the lock: no candidate of the abandoned lineage slips in after it.
                        self.lineage_required = max(self.lineage_required, record.lineage)
                        break
                    except MarkerConflict:  # another writer (a second paramsync?) moved it: read again
                        if attempt == 2:
                            raise
        except (LookupError, BadPayload, WeightsError, MarkerConflict, SignatureRefused) as exc:
            reason = str(exc)[:300]
            self.log.warning("rollback_refused", request_id=req.request_id, version=req.version, reason=reason)
            await self._decide(req, etag, "refused", reason=reason)
            return
        except Exception as exc:  # transient and stopping: still pending, applied at the next start
            if not is_transient(exc):
                raise
            self.log.warning("rollback_deferred", request_id=req.request_id, error=describe(exc))
            return
        await self._decide(req, etag, "applied", new_version=record.version)
        if self.published_version is not None and record.version <= self.published_version:
            return  # applied before (the marker says so): nothing new to announce
        self._set_published(record)
        self.tracker.published(record.version, time.monotonic())
        await self._announce(record)
        self.log.warning("policy_rolled_back", request_id=req.request_id, rollback_of=req.version,
                         policy_version=record.version, sha256=record.sha256[:12])

    async def _decide(self, req: RollbackRequest, etag: str, status: Status, *, new_version: int | None = None,
                      reason: str | None = None) -> None:
        ROLLBACKS.labels(outcome=status).inc()
        try:
            won = await self.retry(lambda: asyncio.to_thread(
                self.rollbacks.decide, req, etag, status, new_version=new_version, reason=reason),
                "record rollback outcome", "store", timeout_s=60)
        except Exception as exc:  # transient and stopping: the next start finds it applied (idempotent)
            if not is_transient(exc):
                raise
            self.log.warning("rollback_outcome_unrecorded", request_id=req.request_id, error=describe(exc))
            return
        if not won:
            self.log.info("rollback_decided_elsewhere", request_id=req.request_id)

    async def _beat(self) -> None:
        """One heartbeat (the ``heartbeats`` task); samplers silent for long are forgotten first."""
        for sid in self.tracker.forget(time.monotonic()):
            with contextlib.suppress(KeyError):  # never reported a version
                SAMPLER_VERSION.remove(sid)
        live = self.tracker.live(time.monotonic())
        LIVE.set(len(live))
        beat = ParamsyncBeat(id=self.id, published_version=self.published_version,
                             sync_latency_p50_s=self.tracker.p(0.5), sync_latency_p95_s=self.tracker.p(0.95),
                             live_samplers=len(live), health=self.health_state.as_dict(), started_at=self.started_at)
        await self._send_quietly(self.topics.heartbeats, beat.to_bytes(), self.id.encode())

    async def _reannouncements(self, stop_event: asyncio.Event) -> None:
        """The ``reannounce`` task: :meth:`_reannounce` every ``reannounce_interval_s``, the first one an
        interval after start (what was published before is announced already)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), self.settings.paramsync.reannounce_interval_s)
        await every(lambda: self.settings.paramsync.reannounce_interval_s, self._reannounce, name="reannounce",
                    log=self.log, stop_event=stop_event)

    async def _reannounce(self) -> None:
        """Announce the published version again: a sampler or a trainer that missed an announcement (a broker
        restart, a late start) catches up."""
        if self.published_record is None:
            return
        try:
            await self._announce(self.published_record, quiet=True)
        except Exception as exc:  # not worth stopping for: the next period announces again
            if not is_transient(exc):
                raise
            self.log.debug("reannounce_failed", error=describe(exc))
            return
        REANNOUNCED.inc()

    async def _send_quietly(self, topic: str, value: bytes, key: bytes) -> bool:
        """Send without waiting for the acknowledgement; a transient failure is not worth stopping for (the
        next period sends again): False."""
        try:
            await self.producer.send(topic, value, key=key)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.log.debug("heartbeat_failed", topic=topic, error=describe(exc))
            return False
        return True


async def _nothing(_partitions: set[TopicPartition]) -> None:
    """paramsync's rebalance callbacks: each poll's candidates are handled and committed before the next."""


def paramsync_group(run: str) -> str:
    """The consumer group of paramsync's candidate reader on ``<run>.policy``."""
    return f"{run}.paramsync"
