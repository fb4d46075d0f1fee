"""Settings that change without a restart: validated revisions stored with the run, an audit trail.

Runtime settings (``RUNTIME_KEYS``) are changed by an operator (``PATCH /config``), validated like
the config file (a bad value names its field), and stored durably as numbered revisions behind a
marker in the object store (``<run>/config/``, the same protocol as policies: payload first, marker
last, conditional writes). Every service polls the marker and applies a new revision within a few
seconds; a restarted service starts from the latest revision.

The audit trail (``<run>/audit/``) is append-only: one object per entry, created with
``If-None-Match`` under a key that sorts by time; nothing ever rewrites or deletes one.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from shared.marker import MarkerConflict, VersionedStore, VersionRecord
from shared.settings import ConfigError, Settings
from shared.store import ObjectStore

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
)
"""What can change while the services run (everything else needs a restart)."""


def runtime_values(settings: Settings) -> dict[str, Any]:
    return {key: getattr(getattr(settings, key.split(".")[0]), key.split(".")[1]) for key in RUNTIME_KEYS}


def apply_runtime(settings: Settings, values: dict[str, Any]) -> Settings:
    """``settings`` with ``values`` applied, validated like the config file; raises ConfigError naming the field."""
    unknown = sorted(set(values) - set(RUNTIME_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a runtime setting (runtime settings: {', '.join(RUNTIME_KEYS)})")
    data = settings.model_dump()
    for key, value in values.items():
        section, name = key.split(".")
        data[section][name] = value
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
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    actor: str | None = None
    at: float | None = None
    reverted_from: int | None = None


class RuntimeConfig:
    """Numbered revisions of the runtime settings behind ``<run>/config/LATEST``."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.versions = VersionedStore(store, run, "config")

    def latest(self) -> Revision | None:
        """The newest revision; store errors propagate (an outage is never taken for "no revision")."""
        current = self.versions.read_marker()
        if current is None:
            return None
        return Revision(**json.loads(self.versions.fetch(current[0])))

    def history(self) -> list[Revision]:
        out = []
        for rec in self.versions.records():
            try:
                out.append(Revision(**json.loads(self.versions.fetch(rec))))
            except Exception:  # noqa: S112 - a pruned or damaged revision is skipped, the rest stays readable
                continue
        return out

    def write(self, base: Settings, values: dict[str, Any], actor: str, reverted_from: int | None = None) -> Revision:
        """Validate ``values`` against ``base`` (+ the latest revision) and store them as the next revision."""
        for _ in range(5):
            current = self.versions.read_marker()
            latest = None if current is None else Revision(**json.loads(self.versions.fetch(current[0])))
            effective = apply_runtime(base, latest.settings if latest else {})
            before = runtime_values(effective)
            after = runtime_values(apply_runtime(effective, values))
            changes = {k: {"old": before[k], "new": after[k]} for k in after if after[k] != before[k]}
            rev = Revision(revision=(current[0].version if current else 0) + 1, settings=after, changes=changes,
                           actor=actor, at=time.time(), reverted_from=reverted_from)
            data = json.dumps(asdict(rev), sort_keys=True).encode()
            key, sha = self.versions.put_blob(data)
            record = VersionRecord(version=rev.revision, blob=key, sha256=sha, size=len(data), trainer_step=0)
            try:
                self.versions.publish(record, None if current is None else current[1])
            except MarkerConflict:
                continue  # another operator wrote first: re-read, re-validate, try again
            return rev
        raise ConfigError("config: too many concurrent changes, try again")


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


PAUSE_KEY = "ops/paused.json"


def read_paused(store: ObjectStore, run: str) -> dict[str, Any]:
    """``{"all": since | None, "samplers": {id: since}}``: who an operator paused (durable across restarts)."""
    obj = store.get(f"{run}/{PAUSE_KEY}")
    if obj is None:
        return {"all": None, "samplers": {}, "updated_at": None}
    data = json.loads(obj.data)
    return {"all": data.get("all"), "samplers": dict(data.get("samplers") or {}),
            "updated_at": data.get("updated_at")}


def write_paused(store: ObjectStore, run: str, state: dict[str, Any]) -> None:
    state = {**state, "updated_at": time.time()}
    store.put(f"{run}/{PAUSE_KEY}", json.dumps(state, sort_keys=True).encode())


def paused_since(state: dict[str, Any], sampler_id: str) -> float | None:
    since = state.get("all") or (state.get("samplers") or {}).get(sampler_id)
    return None if since is None else float(since)
