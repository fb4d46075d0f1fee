"""Settings that change without a restart: validated revisions stored with the run, an audit trail.

Runtime settings (``RUNTIME_KEYS``) are changed by an operator (``PATCH /config``), validated like
the config file (a bad value names its field), and stored durably as numbered revisions behind a
marker in the object store (``<run>/config/``, the same protocol as policies: payload first, marker
last, conditional writes). Every service polls the marker and applies a new revision within a few
seconds (:class:`RuntimeApplier`); a restarted service starts from the latest revision.

A revision stores only the operator's *overrides* (the keys someone set, ever, until a revert drops
them), never the values the writer happened to see for the other keys: each service applies the
overrides on its own base settings, so a key nobody overrode keeps each service's own value (its
config file and environment). Revisions written before this rule (``overrides_only`` false) stored
every key; services still apply them whole, and the next write keeps of them only the keys that differ
from the writer's base.

The pause state (``<run>/ops/paused.json``) is one small object changed only by
:func:`update_paused` (read with etag, change, conditional write, retried). It has no history: an
unreadable one reads as "nothing paused" (logged as ``pause_state_unreadable``) and the next update
replaces it.

The audit trail (``<run>/audit/``) is append-only: one object per entry, created with
``If-None-Match`` under a key that sorts by time; nothing ever rewrites or deletes one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from shared.logging import get_logger
from shared.marker import MarkerConflict, RepairHook, VersionedStore, VersionRecord
from shared.retry import describe
from shared.settings import ConfigError, Settings
from shared.store import ObjectStore, PreconditionFailed

RUNTIME_KEYS = (
    "sampler.max_backlog",
    "sampler.sync_interval_s",
    "trainer.learning_rate",
    "trainer.learning_rate_end",
    "trainer.clip_coef_end",
    "trainer.max_staleness",
    "trainer.target_kl",
    "trainer.publish_every",
    "trainer.flow_window",
    "trainer.guard.enabled",
    "trainer.guard.drop",
    "trainer.guard.window",
    "trainer.guard.lr_factor",
    "trainer.guard.max_per_hour",
    "trainer.guard.cooldown_s",
)
"""What can change while the services run (everything else needs a restart)."""


def runtime_values(settings: Settings) -> dict[str, Any]:
    return {key: functools.reduce(getattr, key.split("."), settings) for key in RUNTIME_KEYS}


def apply_runtime(settings: Settings, values: dict[str, Any]) -> Settings:
    """``settings`` with ``values`` applied, validated like the config file; raises ConfigError naming the field."""
    unknown = sorted(set(values) - set(RUNTIME_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a runtime setting (runtime settings: {', '.join(RUNTIME_KEYS)})")
    data = settings.model_dump()
    for key, value in values.items():
        *path, name = key.split(".")  # section.name, or section.sub.name (trainer.guard.drop)
        node = data
        for part in path:
            node = node[part]
        node[name] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "<root>"
            problems.append(f"{loc}: {e['msg']}")
        raise ConfigError("; ".join(problems)) from None


@dataclass(frozen=True)
class Revision:
    revision: int
    settings: dict[str, Any]
    """The operator's overrides (``overrides_only``), or, in revisions written before that rule, every
    runtime key as the writer saw it."""
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{key: {"old", "new"}}`` as the writer saw them (its base plus the previous overrides)."""
    actor: str | None = None
    at: float | None = None
    reverted_from: int | None = None
    overrides_only: bool = False
    """True for revisions that store only overrides; absent (False) in older stored revisions."""

    def overrides(self, base: Settings) -> dict[str, Any]:
        """The overrides this revision stands for: ``settings`` itself, or for an older full revision
        the keys whose value differs from ``base`` (what an operator must have set)."""
        if self.overrides_only:
            return dict(self.settings)
        seen = runtime_values(base)
        return {k: v for k, v in self.settings.items() if k not in seen or seen[k] != v}


class RuntimeConfig:
    """Numbered revisions of the runtime settings behind ``<run>/config/LATEST``."""

    def __init__(self, store: ObjectStore, run: str, on_repair: RepairHook | None = None) -> None:
        self.versions = VersionedStore(store, run, "config", on_repair=on_repair)

    def _load(self, record: VersionRecord) -> Revision:
        return Revision(**json.loads(self.versions.fetch(record)))

    def latest(self) -> Revision | None:
        """The newest revision; store errors propagate (an outage is never taken for "no revision")."""
        current = self.versions.read_marker()
        if current is None:
            return None
        return self._load(current[0])

    def history(self) -> list[Revision]:
        out = []
        for rec in self.versions.records():
            try:
                out.append(self._load(rec))
            except Exception:  # noqa: S112 - a pruned or damaged revision is skipped, the rest stays readable
                continue
        return out

    def write(self, base: Settings, values: dict[str, Any], actor: str, reverted_from: int | None = None) -> Revision:
        """Store the next revision: the latest overrides updated with ``values`` (or, for a revert,
        ``values`` as the complete overrides; a revert to revision 0 has none, whatever ``values`` say),
        validated against ``base``; ConfigError names the key.

        Conditional on the marker read: a concurrent writer makes this re-read and re-validate.
        """
        for _ in range(5):
            current = self.versions.read_marker()
            latest = None if current is None else self._load(current[0])
            previous = latest.overrides(base) if latest else {}
            try:
                before = runtime_values(apply_runtime(base, previous))
            except ConfigError:  # the stored overrides no longer validate here: compare with the base
                before = runtime_values(base)
            if reverted_from is None:
                overrides = {**previous, **values}
            else:  # revision 0 is the services' own settings: no overrides
                overrides = {} if reverted_from == 0 else dict(values)
            after = runtime_values(apply_runtime(base, overrides))
            changes = {k: {"old": before[k], "new": after[k]} for k in after if after[k] != before[k]}
            rev = Revision(revision=(current[0].version if current else 0) + 1, settings=overrides, changes=changes,
                           actor=actor, at=time.time(), reverted_from=reverted_from, overrides_only=True)
            data = json.dumps(asdict(rev), sort_keys=True).encode()
            key, sha = self.versions.put_blob(data)
            record = VersionRecord(version=rev.revision, blob=key, sha256=sha, size=len(data), trainer_step=0)
            try:
                self.versions.publish(record, None if current is None else current[1])
            except MarkerConflict:
                continue  # another operator wrote first: re-read, re-validate, try again
            return rev
        raise ConfigError("config: too many concurrent changes, try again")

    def revert(self, base: Settings, revision: int, actor: str) -> Revision:
        """A new revision whose overrides are revision ``revision``'s (0: none, the services' own
        settings). Raises LookupError when that revision is not kept."""
        if revision == 0:
            return self.write(base, {}, actor, reverted_from=0)
        target = next((r for r in self.history() if r.revision == revision), None)
        if target is None:
            raise LookupError(f"revision {revision} does not exist")
        return self.write(base, target.overrides(base), actor, reverted_from=revision)


@dataclass(frozen=True)
class AuditEntry:
    at: float
    actor: str
    action: str
    params: dict[str, Any]
    outcome: str


class AuditLog:
    """Append-only operator and automatic actions under ``<run>/audit/``."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.store = store
        self.prefix = f"{run}/audit/"

    def append(self, actor: str, action: str, params: dict[str, Any], outcome: str) -> AuditEntry:
        entry = AuditEntry(at=time.time(), actor=actor, action=action, params=params, outcome=outcome)
        key = f"{self.prefix}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        self.store.put(key, json.dumps(asdict(entry), sort_keys=True, default=str).encode(), if_none_match=True)
        return entry

    def repair_hook(self, actor: str, kind: str, log: Any) -> Callable[[Any, str], None]:
        """For ``VersionedStore(on_repair=...)``: audit a marker repaired from its history as
        ``marker_repaired`` (called in the store's thread, so written synchronously; a failed write is
        logged and the repair stands)."""
        def hook(rec: Any, reason: str) -> None:
            try:
                self.append(actor, "marker_repaired", {"marker": kind, "restored": rec.version,
                                                       "reason": reason[:300]}, "repaired from history")
            except Exception as exc:
                log.warning("audit_write_failed", action="marker_repaired", error=f"{type(exc).__name__}: {exc}")
        return hook

    def entries(self, limit: int = 100) -> list[AuditEntry]:
        """The newest ``limit`` entries, oldest first."""
        keys = self.store.list(self.prefix)[-limit:]
        out = []
        for key in keys:
            obj = self.store.get(key)
            if obj is None:
                continue
            try:
                out.append(AuditEntry(**json.loads(obj.data)))
            except (ValueError, TypeError):  # not ours, or damaged: the rest stays readable
                continue
        return out


class Auditor:
    """A service's automatic actions into the run's audit trail, best effort: an audit write never stops the
    service (a failure is logged ``audit_write_failed``; the action stands)."""

    def __init__(self, audit: AuditLog, log: Any, actor: str) -> None:
        self.audit = audit
        self.log = log
        self.actor = actor

    async def __call__(self, action: str, params: dict[str, Any], outcome: str) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self.audit.append, self.actor, action, params, outcome), 10)
        except Exception as exc:
            self.log.warning("audit_write_failed", action=action, error=describe(exc))

    def repair_hook(self, kind: str) -> Callable[[Any, str], None]:
        """For ``VersionedStore(on_repair=...)``: the repair is audited (``AuditLog.repair_hook``)."""
        return self.audit.repair_hook(self.actor, kind, self.log)


class RuntimeWatcher:
    """A service's view of the runtime settings: :meth:`poll` returns a revision newer than the last one
    it returned (or None). Store errors propagate: the caller reports itself degraded and polls again."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.revision = 0

    def poll(self) -> Revision | None:
        """A revision newer than the last one acknowledged, or None. Call :meth:`ack` once applied."""
        current = self.config.versions.read_marker()
        if current is None or current[0].version <= self.revision:
            return None
        rev = self.config.latest()
        if rev is None or rev.revision <= self.revision:
            return None
        return rev

    def ack(self, rev: Revision) -> None:
        self.revision = max(self.revision, rev.revision)


class RuntimeApplier:
    """The one way a service applies runtime settings: the latest revision's overrides on ``base``, the
    service's own settings at start (config file and environment).

    :meth:`poll_once` polls the watcher; a new revision that does not validate against ``base`` is
    refused (logged ``runtime_config_refused``, kept in ``refused``, ``apply`` not called); otherwise
    ``apply(settings, revision)`` installs it and returns the changes for ``runtime_config_applied``.
    Either way the revision is acknowledged, so it is not offered again. ``revision`` is the last
    revision *applied* (what a heartbeat may report), never a refused one. Store errors propagate (the
    caller reports itself degraded and polls again); so does an error from ``apply`` (not acknowledged).
    """

    def __init__(self, watcher: RuntimeWatcher, base: Settings, apply: Callable[[Settings, int], dict[str, Any]],
                 log: Any, component: str) -> None:
        self.watcher = watcher
        self.base = base
        self.apply = apply
        self.log = log
        self.component = component
        self.revision = 0
        self.refused: dict[int, str] = {}

    def poll_once(self) -> Revision | None:
        """The new revision it handled (applied or refused), or None when there was none."""
        return self.handle(self.watcher.poll())

    def handle(self, rev: Revision | None) -> Revision | None:
        """Apply (or refuse) a revision the caller polled itself (no I/O here: a service may hold a lock
        around this that it could not hold around a store read)."""
        if rev is None:
            return None
        try:
            settings = apply_runtime(self.base, rev.settings)
        except ConfigError as exc:  # does not validate against this service's settings: skip it
            self.refused[rev.revision] = str(exc)[:300]
            self.log.error("runtime_config_refused", revision=rev.revision, error=str(exc)[:300],
                           applied_revision=self.revision, runtime_component=self.component)
        else:
            changes = self.apply(settings, rev.revision)
            self.revision = rev.revision
            self.log.info("runtime_config_applied", revision=rev.revision, changes=changes or None,
                          runtime_component=self.component)
        self.watcher.ack(rev)
        return rev


PAUSE_KEY = "ops/paused.json"


PAUSE_ATTEMPTS = 20
"""Conditional-write attempts of :func:`update_paused` before it gives up (each loss: another writer)."""
PAUSE_BACKOFF_S = (0.01, 0.2)
"""First and largest jittered wait between attempts."""


class PauseStateConflict(RuntimeError):
    """:func:`update_paused` lost every attempt to concurrent writers."""


def _not_paused() -> dict[str, Any]:
    return {"all": None, "samplers": {}, "updated_at": None}


def _parse_paused(data: bytes) -> dict[str, Any]:
    raw = json.loads(data)
    if not isinstance(raw, dict):
        raise ValueError(f"not an object: {type(raw).__name__}")
    samplers = raw.get("samplers") or {}
    if not isinstance(samplers, dict):
        raise ValueError(f"samplers is not an object: {type(samplers).__name__}")
    since_all = raw.get("all")
    return {"all": None if since_all is None else float(since_all),
            "samplers": {str(k): float(v) for k, v in samplers.items()},
            "updated_at": None if raw.get("updated_at") is None else float(raw["updated_at"])}


def _read_paused_with_etag(store: ObjectStore, run: str) -> tuple[dict[str, Any], str | None]:
    obj = store.get(f"{run}/{PAUSE_KEY}")
    if obj is None:
        return _not_paused(), None
    try:
        return _parse_paused(obj.data), obj.etag
    except (ValueError, TypeError) as exc:
        get_logger(component="runtime").error("pause_state_unreadable", key=f"{run}/{PAUSE_KEY}",
                                              reason=str(exc)[:200], treated_as="not paused")
        return _not_paused(), obj.etag


def read_paused(store: ObjectStore, run: str) -> dict[str, Any]:
    """``{"all": since | None, "samplers": {id: since}, "updated_at"}``: who an operator paused (durable
    across restarts). An unreadable state object reads as nothing paused (logged); store errors propagate."""
    return _read_paused_with_etag(store, run)[0]


def update_paused(store: ObjectStore, run: str, change: Callable[[dict[str, Any]], dict[str, Any]],
                  *, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Read-modify-write of the pause state: ``change`` gets the current state (a fresh copy) and returns
    the new one, stored only if nobody wrote in between (``If-Match``, or ``If-None-Match`` when absent);
    otherwise re-read and ``change`` again, up to ``PAUSE_ATTEMPTS`` times with a short jittered backoff.
    Returns the state stored. Raises :class:`PauseStateConflict` when every attempt lost."""
    key = f"{run}/{PAUSE_KEY}"
    wait = PAUSE_BACKOFF_S[0]
    for _ in range(PAUSE_ATTEMPTS):
        state, etag = _read_paused_with_etag(store, run)
        new = {**change(state), "updated_at": time.time()}
        data = json.dumps(new, sort_keys=True).encode()
        try:
            if etag is None:
                store.put(key, data, if_none_match=True)
            else:
                store.put(key, data, if_match=etag)
            return new
        except PreconditionFailed:
            sleep(random.uniform(0, wait))  # noqa: S311 - jitter, not cryptography
            wait = min(wait * 2, PAUSE_BACKOFF_S[1])
    raise PauseStateConflict(f"{key}: {PAUSE_ATTEMPTS} concurrent changes in a row won over this one; try again")


def write_paused(store: ObjectStore, run: str, state: dict[str, Any]) -> None:
    """Unconditional write, for tests and tools only: read-modify-write goes through :func:`update_paused`."""
    state = {**state, "updated_at": time.time()}
    store.put(f"{run}/{PAUSE_KEY}", json.dumps(state, sort_keys=True).encode())


def paused_since(state: dict[str, Any], sampler_id: str) -> float | None:
    since = state.get("all") or (state.get("samplers") or {}).get(sampler_id)
    return None if since is None else float(since)
