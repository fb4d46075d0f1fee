"""What the admin service knows: heartbeats (read-only), consumer lag, the marker; and the control producer.

Kafka is reached only through ``shared.bus`` (a :class:`~shared.bus.Bus` passed in, ``kafka_bus`` by default,
``MemoryBus`` in unit tests): a tail of ``<run>.heartbeats`` (from ``HEARTBEAT_HISTORY`` records back, then
as they come, with ``shared.retry.read_forever``), a lag reader asked every ``admin.refresh_interval_s``
(a named ``shared.retry.every`` task), and the publisher of operator commands. Beside the bus, with a real Kafka
(no ``bus`` passed in), a :class:`~services.admin.replication.ReplicationWatch` describes the run's topics every
``admin.refresh_interval_s`` (under-replicated and offline partitions: ``services.kafka`` in ``/status``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

from services.admin.replication import ReplicationWatch
from services.admin.rollbacks import RollbackRequests
from shared.background import Background
from shared.bus import Bus, Headers, Record, kafka_bus
from shared.identity import IdentityCheck, beat_message
from shared.kafka import Topics, trainer_group
from shared.logging import get_logger
from shared.marker import VersionedStore, VersionRecord
from shared.messages import ControlCommand, SamplerBeat, TrainerBeat, parse_heartbeat
from shared.retry import Health, Retrier, describe, every, read_forever, stop_clients
from shared.runtime import AuditLog, RuntimeConfig
from shared.settings import Settings
from shared.signing import PolicyVerifier, Refusals, SignatureRefused, record_audit_params
from shared.store import StoreError, open_store

BACKLOG = Gauge("flywheel_backlog_records", "Records on <run>.samples not yet committed by the trainer group")
BACKLOG_PARTITION = Gauge("flywheel_backlog_partition_records", "Backlog per partition", ["partition"])
HEARTBEAT_HISTORY = 5000
AUDIT_TIMEOUT_S = 10.0
HISTORY_POINTS = 1800
"""Status samples kept for the curves (one per admin.refresh_interval_s: an hour at 2 s)."""


@dataclass
class Seen:
    beat: Any
    at: float  # admin's clock when received


@dataclass
class ClusterView:
    trainer: Seen | None = None
    """Rank 0 (the trainer of a single-process run)."""
    trainer_ranks: dict[int, Seen] = field(default_factory=dict)
    """Every rank of a data-parallel trainer, rank 0 included."""
    paramsync: Seen | None = None
    samplers: dict[str, Seen] = field(default_factory=dict)
    lag: dict[int, int] | None = None
    lag_at: float | None = None
    restarts: dict[str, int] = field(default_factory=dict)
    """Per role (``trainer``, ``paramsync``, ``sampler:<id>``): new process start times seen since the
    heartbeat history admin read at start (a restart, by the supervisor or by hand)."""
    started: dict[str, float] = field(default_factory=dict)


SAMPLER_FORGET_S = 600.0
"""A sampler silent this long is forgotten (per-sampler state must not grow with every restart)."""


class AdminState:
    name = "admin"

    def __init__(self, settings: Settings, bus: Bus | None = None) -> None:
        self.settings = settings
        self.topics = Topics.for_run(settings.run)
        store = open_store(settings)
        self.store = store
        repaired = AuditLog(store, settings.run).repair_hook("admin", "policy", get_logger())
        self.policies = VersionedStore(store, settings.run, "policy", on_repair=repaired)
        self.runtime_config = RuntimeConfig(store, settings.run)
        self.audit = AuditLog(store, settings.run)
        self.rollbacks = RollbackRequests(store, settings.run)
        self.version_returns: dict[int, float] = {}
        """Mean return the trainer reported while each published version was current (last value)."""
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self.bus = bus or kafka_bus(settings)
        self.producer = self.bus.publisher
        self.heartbeats = self.bus.tail(self.topics.heartbeats, history=HEARTBEAT_HISTORY)
        self.lag_reader = self.bus.lag()
        self.view = ClusterView()
        self.log = get_logger()
        self._started = False
        self.background = Background("admin")  # the heartbeat reader
        self.health_state = Health("admin")
        self.retry = Retrier(self.health_state, self.log)
        self._last_published: VersionRecord | None = None
        self.verifier = PolicyVerifier.from_settings(settings)
        self.refusals = Refusals("admin", self.log)
        self.alive_after_s = settings.paramsync.sampler_timeout_s
        # A sampler heartbeat under an id bound to another key is not shown (shared.identity; paramsync audits it).
        self.beat_identity = IdentityCheck("admin", self.log, settings.sampler.identity_handover_s)
        self.replication = ReplicationWatch(settings, list(vars(self.topics).values()), self.log) \
            if bus is None else None
        """None with a bus passed in (``MemoryBus`` in unit tests): no cluster to describe."""

    async def start(self) -> None:
        timeout_s = self.settings.kafka.request_timeout_ms / 1000
        await self.retry(self.bus.create_topics, "create topics", "kafka", timeout_s=timeout_s)
        await self.retry(self.producer.start, "start producer", "kafka", timeout_s=timeout_s)
        await self.retry(self.heartbeats.start, "start heartbeat reader", "kafka", timeout_s=timeout_s)
        await self.retry(self.lag_reader.start, "start lag reader", "kafka", timeout_s=timeout_s)
        self._started = True

    async def run(self, stop_event: asyncio.Event) -> None:
        self.retry.stop_event = stop_event
        periodic = [every(lambda: self.settings.admin.refresh_interval_s, self.refresh_lag, name="lag", log=self.log,
                          stop_event=stop_event)]
        if self.replication is not None:
            periodic.append(every(lambda: self.settings.admin.refresh_interval_s, self.replication.check,
                                  name="replication", log=self.log, stop_event=stop_event))
        self.background.start("heartbeats", read_forever(self.heartbeats, self._on_heartbeat, name="heartbeats",
                                                         log=self.log))
        await self.background.until_done(*periodic)

    async def stop(self) -> None:
        await self.background.stop()
        await stop_clients([self.heartbeats, self.lag_reader, self.producer], self.log)
        if self.replication is not None:
            await self.replication.stop()

    def health(self) -> dict[str, Any]:
        return {"ok": self._started, **self.health_state.as_dict()}

    # ---- feeds -----------------------------------------------------------------------------
    def _on_heartbeat(self, rec: Record) -> None:
        if rec.value is not None:
            self.observe(rec.value, rec.timestamp_ms / 1000.0, rec.headers)

    def observe(self, value: bytes, sent_at: float, headers: Headers | None = None) -> None:
        """Take one heartbeat in. Old ones (replayed at start) are dated by their record time."""
        try:
            beat = parse_heartbeat(value)
        except ValueError:
            return
        seen = Seen(beat, min(time.time(), sent_at))
        if isinstance(beat, SamplerBeat):
            if self.beat_identity.refusal("heartbeat", beat.id, headers, beat_message(value), seen.at) is not None:
                return
            self.view.samplers[beat.id] = seen
            role = f"sampler:{beat.id}"
        elif isinstance(beat, TrainerBeat):
            self.view.trainer_ranks[beat.rank] = seen
            if beat.rank > 0:  # rank 0 speaks for the group; the others show their digests
                role = f"trainer:{beat.rank}"
                self._note_start(role, getattr(beat, "started_at", None))
                return
            self.view.trainer = seen
            role = "trainer"
            if beat.published_version is not None and beat.return_mean is not None:
                self.version_returns[beat.published_version] = beat.return_mean
                while len(self.version_returns) > 10_000:
                    del self.version_returns[min(self.version_returns)]
        else:
            self.view.paramsync = seen
            role = "paramsync"
        self._note_start(role, getattr(beat, "started_at", None))
        self._forget_silent_samplers(seen.at)

    def _note_start(self, role: str, started: float | None) -> None:
        if started is not None:
            last = self.view.started.get(role)
            if last is not None and started > last + 1e-3:
                self.view.restarts[role] = self.view.restarts.get(role, 0) + 1
            if last is None or started > last:
                self.view.started[role] = started

    def _forget_silent_samplers(self, now: float) -> None:
        for sid in [sid for sid, s in self.view.samplers.items() if now - s.at > SAMPLER_FORGET_S]:
            del self.view.samplers[sid]
            self.view.started.pop(f"sampler:{sid}", None)
            self.view.restarts.pop(f"sampler:{sid}", None)

    async def refresh_lag(self) -> None:
        """The trainer group's backlog, and one status sample for the curves (the ``lag`` task). A failure
        keeps the last known lag (``/status`` stays up) and marks admin degraded."""
        try:
            lag = await self.lag_reader.lag(trainer_group(self.settings.run), self.topics.samples)
        except Exception as exc:  # keep serving status with the last known lag
            self.health_state.degraded("kafka", f"lag refresh failed: {describe(exc)}")
            self.log.warning("lag_refresh_failed", error=describe(exc))
            return
        self.view.lag, self.view.lag_at = lag, time.time()
        self.history.append(self.point(time.time()))
        BACKLOG.set(sum(lag.values()))
        for p, n in lag.items():
            BACKLOG_PARTITION.labels(partition=str(p)).set(n)
        self.health_state.recovered("kafka")

    # ---- queries and commands --------------------------------------------------------------
    def alive(self, seen: Seen | None, now: float) -> bool:
        return seen is not None and now - seen.at <= self.alive_after_s

    async def published(self) -> VersionRecord | None:
        """The marker's record; on a store failure, the last one read (logged), so /status stays up. A record
        without paramsync's valid signature is refused (logged, counted, audited once): the last one trusted."""
        try:
            found = await asyncio.to_thread(self.policies.read_marker)
        except StoreError as exc:
            self.log.warning("marker_read_failed", error=str(exc))
            return self._last_published
        if found is not None:
            try:
                self.verifier.check_record(found[0])
            except SignatureRefused as exc:
                if self.refusals.note_record(exc, found[0], "marker"):
                    await self._audit_refusal(record_audit_params(exc, found[0], "marker"))
                return self._last_published
        self._last_published = None if found is None else found[0]
        return self._last_published

    async def _audit_refusal(self, params: dict[str, Any]) -> None:
        await self.append_audit("admin", "policy_signature_refused", params, "refused: not shown as published")

    async def append_audit(self, who: str, action: str, params: dict[str, Any], outcome: str,
                           timeout_s: float = AUDIT_TIMEOUT_S) -> None:
        """One audit entry, best effort: what it records happened (or was refused) either way, so a write that
        fails or takes over ``timeout_s`` is logged (``audit_write_failed``), not raised."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.audit.append, who, action, params, outcome), timeout_s)
        except Exception as exc:
            self.log.error("audit_write_failed", action=action, actor=who, error=describe(exc))

    async def request_sync(self) -> ControlCommand:
        cmd = ControlCommand(command="sync", request_id=uuid.uuid4().hex)
        await self.producer.send_and_wait(self.topics.control, cmd.to_bytes(), key=b"sync")
        self.log.info("manual_sync_requested", request_id=cmd.request_id)
        return cmd

    async def command(self, cmd: ControlCommand) -> None:
        """Send an operator command on ``<run>.control`` (bounded: Kafka down raises, never hangs)."""
        await asyncio.wait_for(self.producer.send_and_wait(self.topics.control, cmd.to_bytes(),
                                                           key=cmd.command.encode()),
                               self.settings.kafka.request_timeout_ms / 1000)
        self.log.info("operator_command_sent", command=cmd.command, request_id=cmd.request_id,
                      sampler=cmd.sampler, version=cmd.version)

    def point(self, now: float) -> dict[str, Any]:
        """One compact status sample for the curves (``/status/history``, the status page)."""
        v = self.view
        tb = v.trainer.beat if v.trainer and self.alive(v.trainer, now) else None
        pb = v.paramsync.beat if v.paramsync else None
        live = [s.beat for s in v.samplers.values() if self.alive(s, now)]
        return {
            "t": now,
            "episode_return": tb.return_mean if tb else None,
            "sampled_steps_per_s": round(sum(b.steps_per_s for b in live), 1),
            "trained_steps_per_s": round(tb.samples_per_s, 1) if tb else None,
            "backlog": sum(v.lag.values()) if v.lag is not None else None,
            "staleness_mean": tb.staleness_mean if tb else None,
            "staleness_p95": tb.staleness_p95 if tb else None,
            "staleness_max": tb.staleness_max if tb else None,
            "sync_p50_s": pb.sync_latency_p50_s if pb else None,
            "sync_p95_s": pb.sync_latency_p95_s if pb else None,
            "policy_version": pb.published_version if pb else None,
        }

    def live_sampler_versions(self, now: float) -> dict[str, int | None]:
        return {sid: s.beat.policy_version for sid, s in self.view.samplers.items() if self.alive(s, now)}
