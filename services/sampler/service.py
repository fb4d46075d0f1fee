"""The sampler service: policy in (announcements, S3 marker), fragments out (Kafka).

Between fragments it adopts newer policies (announcements on ``<run>.policy``, the marker polled
every ``sync_interval_s`` as a fallback, ``sync`` commands on ``<run>.control``); it never changes
policy mid-fragment. An announcement that carries the weights inline is adopted without a store GET
once they match its sha256; other versions are fetched from the store no more often than
``min_adoption_interval_s`` (services.sampler.adoption decides, docs/policies.md). Sends are bounded
by ``max_in_flight`` and optionally rate-capped.

Flow control is credit-based (shared.credits): the sampler keeps at most the window the trainer grants
of fragments in flight that the trainer has not consumed; ``max_backlog`` (the group's measured lag) is
an optional second limit.

Kafka is reached only through ``shared.bus`` (a :class:`~shared.bus.Bus` passed in, ``kafka_bus`` by
default, ``MemoryBus`` in unit tests). Named background tasks keep slow or blocking reads out of the
loop: ``announcements`` reads ``<run>.policy`` from ``POLICY_HISTORY`` records before its end (a late
starter finds the newest announcement, with its inline weights, on the compacted topic), ``inbox`` reads
credit grants and ``commands`` control commands as they arrive (all three ``shared.retry.read_forever``; each
reads one partition, so an idle one asks the broker twice a second: ``kafka.tail_fetch_max_wait_ms``); ``marker`` reads
the marker and the operator state every ``sync_interval_s`` or at once on a ``config`` command,
``backlog`` measures the trainer's backlog every ``backlog_check_interval_s`` (only while ``max_backlog`` is
on), ``heartbeats`` beats every ``heartbeat_interval_s`` (``shared.retry.every``).
They set ``_wake``, on which the loop waits while flow control pauses it (or, in ``mode: sync``, while
it waits for the next version), so a paused sampler adopts a new policy as soon as it is announced.
Nothing here imports torch: MLP policies run in numpy, CNN policies in onnxruntime (``sampler.inference`` auto;
torch only when it says torch, rollout.py).
A fragment whose payload would exceed ``kafka.max_message_bytes`` is split in time into fragments that
each fit (``shared.fragment.encode_fitting``), each its own record with its own sequence number (so a
split fragment may hold up to its piece count less one beyond the credit window until consumed).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
import zlib
from collections import deque
from typing import Any

from prometheus_client import Counter, Gauge

from services.sampler.adoption import AdoptInline, AdoptionPlan, FetchFromStore
from services.sampler.backlog import BacklogGate
from services.sampler.rollout import RolloutWorker
from services.sampler.sender import FragmentSender
from shared.background import Background
from shared.bus import Bus, Record, kafka_bus
from shared.credits import CreditGate, shard_of
from shared.identity import SamplerKey, beat_message
from shared.kafka import Topics
from shared.logging import get_logger
from shared.marker import BadPayload, VersionedStore, VersionRecord
from shared.messages import ControlCommand, CreditGrant, InlineMismatch, PolicyMessage, SamplerBeat
from shared.retry import (
    CLIENT_STOP_TIMEOUT_S,
    Health,
    Retrier,
    describe,
    every,
    is_transient,
    read_forever,
    stop_clients,
)
from shared.rl.policy_np import WeightsError
from shared.runtime import (
    AuditLog,
    RuntimeApplier,
    RuntimeConfig,
    RuntimeWatcher,
    paused_since,
    read_paused,
    runtime_values,
)
from shared.settings import Settings
from shared.signing import PolicyVerifier, Refusals, SignatureRefused
from shared.store import StoreError, open_store

VERSION = Gauge("flywheel_sampler_policy_version", "Policy version the sampler acts with", ["sampler"])
ADOPTIONS = Counter("flywheel_sampler_policy_adoptions_total", "Policy versions adopted", ["sampler", "trigger"])
CREDIT_WAIT = Counter("flywheel_sampler_credit_wait_seconds_total",
                      "Seconds waiting for flow-control credits (the trainer has not consumed enough yet)",
                      ["sampler"])
CREDITS_IN_FLIGHT = Gauge("flywheel_sampler_credits_in_flight",
                          "Fragments sent that the trainer has not consumed yet (as of its last grant)", ["sampler"])
SETTLED = Counter("flywheel_sampler_credits_settled_unconsumed_total",
                  "Fragments the trainer's position passed without consuming them (they left the log before it "
                  "read them, or were unreadable): released from the credit window, never trained", ["sampler"])
PAUSED = Gauge("flywheel_sampler_paused", "1 while an operator has paused the sampler", ["sampler"])
POLICY_FETCHES = Counter("flywheel_sampler_policy_fetches_total",
                         "Policy weights obtained: inline (from the announcement, no store GET) or store (one GET of "
                         "the blob)", ["sampler", "source"])
INLINE_REFUSED = Counter("flywheel_sampler_inline_policy_refused_total",
                         "Inline weights that did not match their sha256 and size (fetched from the store instead)",
                         ["sampler"])

WAKE_TIMEOUT_S = 0.05
"""Longest a paused (or, in sync mode, waiting) loop sleeps before re-checking on its own."""
POLICY_HISTORY = 8
"""Records of ``<run>.policy`` read before its end at start: the newest announcement is among them unless the
trainer sent that many candidates since (then the marker, and the store, cover it)."""
FIRST_MARKER_READ_S = 0.5
"""While no policy is adopted yet, the marker is read this often."""


def sampler_seed(base: int | None, sampler_id: str) -> int | None:
    """A seed per sampler: reproducible from ``sampler.seed``, different for every sampler id
    (one shared seed would make samplers acting on the same version produce identical data)."""
    if base is None:
        return None
    return (base * 1_000_003 + zlib.crc32(sampler_id.encode())) % 2**31


def default_sampler_id() -> str:
    return os.environ.get("FLYWHEEL_SAMPLER_ID") or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def sampler_identity(settings: Settings, log: Any) -> SamplerKey | None:
    """This process's identity key (``sampler.identity``; docs/security.md, "Sampler identity"), or None when off
    (``protection_off`` at start: readers then bind nothing to this sampler's id)."""
    s = settings.sampler
    if not s.identity:
        return None
    key = SamplerKey.generate() if s.identity_key_file is None else SamplerKey.load_or_create(s.identity_key_file)
    log.info("sampler_identity", key_id=key.key_id, kept_in=None if s.identity_key_file is None
             else str(s.identity_key_file))
    return key


class Sampler:
    name = "sampler"

    def __init__(self, settings: Settings, sampler_id: str | None = None, bus: Bus | None = None) -> None:
        self.settings = settings
        self.id = sampler_id or default_sampler_id()
        self.topics = Topics.for_run(settings.run)
        self.log = get_logger(sampler_id=self.id)
        store = open_store(settings)
        self.store = store
        repaired = AuditLog(store, settings.run).repair_hook("sampler", "policy", self.log)
        self.policies = VersionedStore(store, settings.run, "policy", on_repair=repaired)
        # Announcements and marker records must carry paramsync's signature (docs/security.md); a refusal is
        # logged and counted once per policy (the trainer, which reads the same topic and marker, audits it).
        self.verifier = PolicyVerifier.from_settings(settings)
        self.refusals = Refusals("sampler", self.log)
        self.base_settings = settings
        # Runtime settings: the latest revision's overrides on this sampler's own settings; a revision
        # that does not validate here is refused, and the heartbeat reports the last one applied.
        self.runtime = RuntimeApplier(RuntimeWatcher(RuntimeConfig(store, settings.run)), settings,
                                      self._apply_runtime, self.log, "sampler")
        self._paused_since: float | None = None
        self._last_command_at = 0.0  # issued_at of the last pause/resume command applied
        self._poll_now = asyncio.Event()
        self.worker = RolloutWorker.from_settings(settings, self.id, sampler_seed(settings.sampler.seed, self.id))
        self.bus = bus or kafka_bus(settings)
        self.producer = self.bus.publisher
        # Commands and grants from now on; announcements from a few records back (the newest may carry weights).
        # Grants: only this sampler's own credits partition (shared.credits.shard_of), whatever the swarm's size.
        self.credits_partition = shard_of(self.id, settings.kafka.credits_partitions)
        # Two readers of one partition each rather than one of both: a one-partition reader may wait long at the
        # broker (answered the moment a record comes), a reader of two may not (shared.settings, fetch waits).
        self.inbox = self.bus.tail(self.topics.credits, partitions={self.topics.credits: (self.credits_partition,)})
        self.commands = self.bus.tail(self.topics.control)
        self.announcements = self.bus.tail(self.topics.policy, history=POLICY_HISTORY)
        # Always measured: max_backlog can be turned on at run time (PATCH /config).
        self.lag_probe = self.bus.lag()
        self._wake = asyncio.Event()  # backlog dropped to the limit, a policy was announced, or a command came
        self.credits = CreditGate(self.id)
        self.credit_wait_s = 0.0  # finished waits; plus the one in progress since _credit_wait_since
        self._credit_wait_since: float | None = None
        self.background = Background(f"sampler-{self.id}")
        self.adopted_at: float | None = None
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.plan = AdoptionPlan()  # which version next, inline or from the store
        self._sync_requested = False
        self._labels = {"sampler": self.id}
        self.health_state = Health("sampler")
        self.retry = Retrier(self.health_state, self.log)
        self.identity = sampler_identity(settings, self.log)
        self.sender = FragmentSender(self.producer, self.topics.samples, self.credits, settings,
                                     health=self.health_state, retry=self.retry, log=self.log, labels=self._labels,
                                     identity=self.identity)
        self.backlog = BacklogGate(self.lag_probe, self.topics.samples, lambda: self.settings, self._wake,
                                   log=self.log, labels=self._labels)
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        timeout_s = self.settings.kafka.request_timeout_ms / 1000
        await self.retry(self.bus.create_topics, "create topics", "kafka", timeout_s=timeout_s)
        await self.retry(self.producer.start, "start producer", "kafka", timeout_s=timeout_s)
        await self.retry(self.inbox.start, "start inbox", "kafka", timeout_s=timeout_s)
        await self.retry(self.commands.start, "start command reader", "kafka", timeout_s=timeout_s)
        await self.retry(self.announcements.start, "start announcement reader", "kafka", timeout_s=timeout_s)
        await self.retry(self.lag_probe.start, "start lag probe", "kafka", timeout_s=timeout_s)
        # A restarted sampler comes back paused if it was, and with the latest runtime settings.
        await self.retry(self._refresh_operator_state, "read operator state", "store", timeout_s=timeout_s)

    async def run(self, stop_event: asyncio.Event) -> None:
        self.retry.stop_event = stop_event
        # Starting the background readers does not wait; the loop itself begins with the first policy.
        self._start_background(stop_event)
        await self._wait_for_first_policy(stop_event)
        # Heartbeats from the first policy on (adopting one beats at once: paramsync measures sync latency).
        self.background.start("heartbeats", every(lambda: self.settings.sampler.heartbeat_interval_s, self._heartbeat,
                                             name="heartbeats", log=self.log, stop_event=stop_event))
        next_send = time.monotonic()
        cap = self.settings.sampler.max_fragments_per_s
        while not stop_event.is_set():
            self.background.raise_if_ended(stop_event.is_set())
            await self._refresh_policy()
            await self._respect_pause(stop_event)
            await self.backlog.respect(stop_event, self._wait_and_refresh)
            await self._respect_credits(stop_event)
            if stop_event.is_set():  # the waits end on stop too: no fragment beyond the limits
                break
            frag = await asyncio.to_thread(self.worker.collect)
            await self._respect_pause(stop_event)  # paused while collecting: hold the fragment until resumed
            if self._paused_since is not None:  # stopped while paused: the held fragment is never sent
                break
            await self.sender.send(frag)
            if self.settings.mode == "sync":
                await self._wait_for_newer(frag.policy_version, stop_event)
            self.recent_returns.extend(float(r) for r in frag.episode_returns)
            if cap > 0:
                next_send += 1.0 / cap
                delay = next_send - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    next_send = time.monotonic()

    async def stop(self) -> None:
        await self.background.stop()
        if self.sender.pending:
            await asyncio.wait(self.sender.pending, timeout=CLIENT_STOP_TIMEOUT_S)
        # The producer flushes what is buffered.
        await stop_clients([self.producer, self.inbox, self.commands, self.announcements, self.lag_probe], self.log)
        self.worker.close()

    def health(self) -> dict[str, Any]:
        return {"ok": True, "id": self.id, "policy_version": self.worker.policy_version,
                "fragments": self.sender.fragments, **self.health_state.as_dict()}

    def _start_background(self, stop_event: asyncio.Event) -> None:
        """The readers of the inbox, commands and announcements, the marker poll and the backlog check: a task of
        them that ends stops the sampler with its error (``raise_if_ended`` each pass), instead of leaving it
        running without announcements, flow control or heartbeats."""
        log = self.log
        self.background.start("inbox", read_forever(self.inbox, self._on_inbox, name="inbox", log=log))
        self.background.start("commands", read_forever(self.commands, self._on_inbox, name="commands", log=log))
        self.background.start("announcements", read_forever(self.announcements, self._on_announcement,
                                                            name="announcements", log=log))
        self.background.start("marker", every(lambda: self.settings.sampler.sync_interval_s, self._poll_marker,
                                              name="marker", log=log, stop_event=stop_event, wake=self._poll_now))
        self.background.start("backlog", every(lambda: self.settings.sampler.backlog_check_interval_s,
                                               self.backlog.measure, name="backlog", log=log, stop_event=stop_event))

    async def _wait_wake(self, timeout: float) -> None:
        """Until ``_wake`` is set or ``timeout`` passed; then clear it."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        self._wake.clear()

    @property
    def fragments(self) -> int:
        """Fragments Kafka acknowledged."""
        return self.sender.fragments

    async def _wait_and_refresh(self) -> None:
        """One step of a flow-control wait: until woken (or ``WAKE_TIMEOUT_S``), then adopt a newer policy."""
        await self._wait_wake(WAKE_TIMEOUT_S)
        await self._refresh_policy()

    def _credits_on(self) -> bool:
        return self.settings.sampler.credits and self.settings.mode == "async"

    async def _respect_credits(self, stop_event: asyncio.Event) -> None:
        """Credit flow control (shared.credits): wait while this sampler has its window of fragments in
        flight that the trainer has not consumed. The inbox task applies grants and sets ``_wake``."""
        if not self._credits_on() or self.credits.open():
            return
        waited_from = self._credit_wait_since = time.monotonic()
        self.log.debug("credit_wait", in_flight=self.credits.in_flight, window=self.credits.allowed,
                       turns=self.credits.turns)
        # A wait longer than a Kafka request's timeout is no longer flow control: the trainer (or the brokers
        # its grants come through) is away. Say so until a grant opens the window again.
        degraded_after = self.settings.kafka.request_timeout_ms / 1000
        try:
            while not stop_event.is_set() and not self.credits.open() and self._credits_on():
                await self._wait_wake(WAKE_TIMEOUT_S)
                await self._refresh_policy()
                now = time.monotonic()
                waited = now - waited_from
                if waited > degraded_after:  # the reason says what was observed, and follows it as it changes
                    reason = self.credits.waiting_reason(now, waited)
                    if "credits" not in self.health_state.reasons:
                        self.log.warning("credits_starved", reason=reason, in_flight=self.credits.in_flight,
                                         window=self.credits.allowed, settled=self.credits.settled)
                    self.health_state.degraded("credits", reason)
        finally:
            if "credits" in self.health_state.reasons:
                self.health_state.recovered("credits")
            waited = time.monotonic() - waited_from
            self._credit_wait_since = None
            self.credit_wait_s += waited
            CREDIT_WAIT.labels(**self._labels).inc(waited)

    def _report_settled(self) -> None:
        """Fragments the trainer's position passed without consuming them (removed from the log before it read
        them, or unreadable): no longer in flight, never trained. Logged with where they were (the
        ``fragment_produced`` lines name their sample ids at the same partition and offset) and counted."""
        regressed, self.credits.newly_regressed = self.credits.newly_regressed, []
        for part, offset, seen in regressed:
            self.log.warning("credits_offsets_went_backwards", partition=part, offset=offset, trainer_position=seen,
                             hint="Kafka acknowledged a fragment below the trainer's position on this partition (the "
                                  "topic recreated, or its log truncated): its fragments now count until consumed")
        settled, self.credits.newly_settled = self.credits.newly_settled, []
        if settled:
            SETTLED.labels(**self._labels).inc(len(settled))
            self.log.warning("fragments_settled_unconsumed", count=len(settled),
                             at=[f"{p}:{o}" for _, p, o in settled[:20]],
                             hint="the trainer's position passed them unread: they left the log before it read "
                                  "them (retention, deleteRecords) or were unreadable; their credits are released")

    async def _wait_for_newer(self, version: int, stop_event: asyncio.Event) -> None:
        """Synchronous baseline: after sending, wait for the version trained on what was sent."""
        while not stop_event.is_set():
            await self._refresh_policy()
            current = self.worker.policy_version
            if current is not None and current > version:
                return
            await self._wait_wake(WAKE_TIMEOUT_S)

    # ---- policy ----------------------------------------------------------------------------
    async def _wait_for_first_policy(self, stop_event: asyncio.Event) -> None:
        """Until a policy is adopted: the newest announcement (inline weights: no store GET) or the marker's
        version, read every ``FIRST_MARKER_READ_S`` (from the store as :class:`AdoptionPlan` allows)."""
        started = time.monotonic()
        next_read = logged = started
        while not stop_event.is_set():
            now = time.monotonic()
            if now >= next_read:
                next_read = now + FIRST_MARKER_READ_S
                await self._read_marker_for_start(now)
            await self._refresh_policy()
            if self.worker.policy_version is not None:
                return
            if now >= logged:
                logged = now + 5.0
                self.log.info("waiting_for_policy", marker=self.policies.marker_key)
            await self._wait_wake(WAKE_TIMEOUT_S)  # an announcement wakes it early

    async def _read_marker_for_start(self, now: float) -> None:
        try:
            marker = await asyncio.to_thread(self.policies.read_marker)
        except StoreError as exc:  # the store is down or the marker unrepairable: an announcement may still come
            self.log.warning("marker_read_rejected", keeping_version=None, reason=describe(exc))
            return
        if marker is not None and self._trusted(marker[0]):
            self.plan.found_behind_marker(marker[0].version, now, trigger="start")

    def _trusted(self, record: VersionRecord, source: str = "marker") -> bool:
        """``record`` (read from the store) carries paramsync's signature; a refusal is logged and counted."""
        try:
            self.verifier.check_record(record)
        except SignatureRefused as exc:
            self.refusals.note_record(exc, record, source, keeping_version=self.worker.policy_version)
            return False
        return True

    def _load_from_store(self, have: int | None) -> tuple[VersionRecord, bytes] | None:
        """The marker's version and its payload from the store when newer than ``have`` (runs in a thread).
        Missing or corrupt payloads and unreadable markers are logged and give None (keep what we have)."""
        try:
            current = self.policies.read_marker()
            if current is None or (have is not None and current[0].version <= have):
                return None
            if not self._trusted(current[0]):
                return None
            POLICY_FETCHES.labels(source="store", **self._labels).inc()
            return current[0], self.policies.fetch(current[0])
        except StoreError as exc:
            self.log.warning("marker_read_rejected", keeping_version=have, reason=describe(exc))
            return None

    async def _adopt_latest(self, trigger: str) -> bool:
        """Load the marker's version from the store if newer than ours. True if a policy was adopted."""
        self.plan.fetched_from_store(time.monotonic())
        found = await asyncio.to_thread(self._load_from_store, self.worker.policy_version)
        if found is None:
            return False
        record, data = found
        return await self._install(record, data, trigger)

    async def _adopt_inline(self, msg: PolicyMessage) -> bool:
        """Adopt the weights an announcement carries, once they match its sha256 and size; corrupt ones are
        logged, counted and dropped (that version is then fetched from the store). True if adopted."""
        try:
            data = msg.inline_weights()
        except InlineMismatch as exc:
            INLINE_REFUSED.labels(**self._labels).inc()
            self.log.warning("inline_policy_refused", policy_version=msg.version, reason=str(exc))
            self.plan.inline_refused(msg.version)
            return False
        assert data is not None  # the plan offers only announcements with inline weights
        POLICY_FETCHES.labels(source="inline", **self._labels).inc()
        return await self._install(msg.record(), data, "announce")

    async def _install(self, record: VersionRecord, data: bytes, trigger: str) -> bool:
        try:
            self.worker.set_policy(record.version, data)
        except WeightsError as exc:
            self.log.warning("policy_rejected", version=record.version, reason=str(exc))
            self.plan.weights_refused(record.version)  # not retried on every announcement check
            return False
        self.adopted_at = time.time()
        VERSION.labels(**self._labels).set(record.version)
        ADOPTIONS.labels(trigger=trigger, **self._labels).inc()
        self.log.info("policy_adopted", policy_version=record.version, trigger=trigger, sha256=record.sha256[:12])
        await self._heartbeat()  # paramsync measures sync latency from this
        return True

    async def _refresh_policy(self) -> None:
        """Between fragments: adopt when something newer was announced (or found behind the marker by
        :meth:`_poll_marker`), inline or from the store as :class:`AdoptionPlan` says, or a sync command came
        (from the store at once)."""
        if self._sync_requested:
            self._sync_requested = False
            await self._adopt_latest("control")
            return
        step = self.plan.next(self.worker.policy_version, time.monotonic(),
                              self.settings.sampler.min_adoption_interval_s)
        if isinstance(step, AdoptInline):
            if not await self._adopt_inline(step.message):
                step = self.plan.next(self.worker.policy_version, time.monotonic(),
                                      self.settings.sampler.min_adoption_interval_s)
        if isinstance(step, FetchFromStore):
            await self._adopt_latest(step.trigger)

    async def _poll_marker(self) -> None:
        """Read the marker and the operator state (the ``marker`` task: every ``sync_interval_s``, at once
        on a ``config`` command; covers lost announcements and commands). A store that is down costs this
        task, never the loop: the sampler keeps producing with the policy it has, degraded, and catches up
        when the store answers again."""
        try:
            marker = await asyncio.to_thread(self.policies.read_marker)
            await self._refresh_operator_state()
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.health_state.degraded("store", f"marker read failed: {describe(exc)}")
            return
        self.health_state.recovered("store")
        if marker is not None and self._trusted(marker[0]) and self.plan.found_behind_marker(marker[0].version,
                                                                                              time.monotonic()):
            self._wake.set()

    # ---- operator state: pause, runtime settings --------------------------------------------
    def _pause(self, since: float, why: str) -> None:
        if self._paused_since is None:
            self._paused_since = since
            PAUSED.labels(**self._labels).set(1)
            self.log.info("sampler_paused", request_id=why)

    def _resume(self, why: str) -> None:
        if self._paused_since is not None:
            self._paused_since = None
            PAUSED.labels(**self._labels).set(0)
            self.log.info("sampler_resumed", request_id=why)

    async def _respect_pause(self, stop_event: asyncio.Event) -> None:
        """While an operator has paused this sampler: produce nothing, keep envs and policy, adopt new
        versions, send heartbeats (they say paused since when)."""
        while self._paused_since is not None and not stop_event.is_set():
            await self._wait_wake(0.2)
            await self._refresh_policy()

    async def _refresh_operator_state(self) -> None:
        """The durable pause state and the runtime settings, from the object store (the control topic is
        the fast path; this covers lost commands and restarts)."""
        state = await asyncio.to_thread(read_paused, self.store, self.settings.run)
        # A command newer than this state wins (the read may have started before the command came).
        if float(state.get("updated_at") or 0) >= self._last_command_at:
            since = paused_since(state, self.id)
            if since is None:
                self._resume("durable state")
            else:
                self._pause(since, "durable state")
        try:
            handled = await asyncio.to_thread(self.runtime.poll_once)
        except BadPayload as exc:  # no readable revision (nor history to repair from): keep the settings we have
            if "config" not in self.health_state.reasons:  # logged once per episode, not every poll
                self.log.error("runtime_config_unreadable", applied_revision=self.runtime.revision,
                               error=describe(exc))
            self.health_state.degraded("config", f"runtime settings unreadable: {describe(exc)}")
            return
        if "config" in self.health_state.reasons:
            self.health_state.recovered("config")
        if handled is not None:
            self._wake.set()  # a paused loop re-checks its limits now

    def _apply_runtime(self, settings: Settings, revision: int) -> dict[str, Any]:
        """Install validated runtime settings (called by :class:`RuntimeApplier`); the sampler's changes."""
        old = runtime_values(self.settings)
        self.settings = self.sender.settings = settings  # reference swaps: the loop sees old or new whole
        new = runtime_values(settings)
        return {k: {"old": old[k], "new": new[k]} for k in new if k.startswith("sampler.") and old[k] != new[k]}

    def _on_announcement(self, rec: Record) -> None:
        """One record of ``<run>.policy``: an announcement is noted (adoption itself happens in the loop, between
        fragments); candidates are paramsync's business. A malformed one is logged and ignored."""
        if rec.value is None:
            return
        try:
            msg = PolicyMessage.model_validate_json(rec.value)
        except ValueError as exc:
            self.log.warning("inbox_message_ignored", topic=rec.topic, reason=str(exc)[:200])
            return
        if msg.type != "announce":
            return
        try:
            self.verifier.check_message(msg)
        except SignatureRefused as exc:  # never known as a version, so never adopted nor fetched
            self.refusals.note_message(exc, msg, offset=rec.offset, keeping_version=self.worker.policy_version)
            return
        if self.plan.announced(msg, time.monotonic()):
            self._wake.set()

    def _on_inbox(self, rec: Record) -> None:
        """One record of the inbox (a credit grant) or of the command reader (a command). A malformed one is
        logged and ignored."""
        topic, value = rec.topic, rec.value
        try:
            if topic == self.topics.control and value is not None:
                cmd = ControlCommand.model_validate_json(value)
                if cmd.sampler not in (None, self.id):
                    return
                if cmd.command == "sync":
                    self._sync_requested = True
                elif cmd.command == "pause":
                    self._last_command_at = max(self._last_command_at, cmd.issued_at)
                    self._pause(cmd.issued_at, cmd.request_id)
                elif cmd.command == "resume":
                    self._last_command_at = max(self._last_command_at, cmd.issued_at)
                    self._resume(cmd.request_id)
                elif cmd.command == "config":
                    self._poll_now.set()
                self._wake.set()
                self.log.info("control_received", command=cmd.command, request_id=cmd.request_id)
            elif topic == self.topics.credits and value is not None:
                self.credits.grant(CreditGrant.model_validate_json(value), time.monotonic())
                self._report_settled()
                CREDITS_IN_FLIGHT.labels(**self._labels).set(self.credits.in_flight)
                if self.credits.open():
                    self._wake.set()
        except ValueError as exc:
            self.log.warning("inbox_message_ignored", topic=topic, reason=str(exc)[:200])

    # ---- fragments -------------------------------------------------------------------------
    # ---- heartbeats ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        beat = SamplerBeat(
            id=self.id,
            policy_version=self.worker.policy_version,
            adopted_at=self.adopted_at, paused_since=self._paused_since,
            max_backlog=self.settings.sampler.max_backlog,
            credits_window=self.credits.allowed if self._credits_on() else None,
            credits_in_flight=self.credits.in_flight if self._credits_on() else None,
            credits_settled_unconsumed=self.credits.settled,
            credit_wait_s=round(self.credit_wait_s + (time.monotonic() - self._credit_wait_since
                                                      if self._credit_wait_since is not None else 0.0), 3),
            config_revision=self.runtime.revision,
            steps_per_s=self.sender.steps_rate.rate(),
            fragments=self.sender.fragments,
            env_steps=self.sender.env_steps,
            recent_return_mean=sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None,
            health=self.health_state.as_dict(), started_at=self.started_at,
        )
        value = beat.to_bytes()
        headers = [] if self.identity is None else self.identity.headers(beat_message(value))
        try:
            await self.producer.send(self.topics.heartbeats, value, key=self.id.encode(), headers=headers)
        except Exception as exc:  # not worth stopping for: the next beat retries
            if not is_transient(exc):
                raise
            self.log.debug("heartbeat_failed", error=describe(exc))
