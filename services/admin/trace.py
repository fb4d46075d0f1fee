"""One sample's way through the system, from the services' JSON log lines (``flywheel trace``).

Every line that touches a fragment carries its ``sample_id`` (shared/logging.py), so a timeline is
what the logs say about one id, in time order:

    produced       sampler ``fragment_produced``: sampler_id, policy_version, partition, offset
    consumed       trainer ``fragment_consumed``
    trained        trainer ``fragment_trained`` (update N, staleness), with that update's ``update_done``
    dropped_stale  trainer ``fragment_dropped_stale`` (staleness, reference_version)
    dead_lettered  trainer ``fragment_dead_lettered`` (reason, error)

plus any other line with the id (e.g. ``fragment_send_failed``). A process *run* starts at its
``config_resolved`` line; when one process appears in several runs (a trainer that crashed after
consuming the sample and consumed it again after its restart), a ``restart`` step marks the boundary.

Lines may carry a prefix before the JSON (``docker compose logs``: ``trainer-1  | {...}``): the text
before ``|`` names the process, and lines without one are told apart by their ``service`` field.
:func:`log_lines` prefixes each line of a log directory with its file's name the same way. Everything
here is pure (no clock, no I/O but :func:`log_lines`), for the CLI and the admin API alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

KINDS = {
    "fragment_produced": "produced",
    "fragment_consumed": "consumed",
    "fragment_trained": "trained",
    "fragment_dropped_stale": "dropped_stale",
    "fragment_dead_lettered": "dead_lettered",
}
OUTCOMES = ("trained", "dropped_stale", "dead_lettered")
RUN_START = "config_resolved"
UPDATE_DONE = "update_done"
_RANK = {"produced": 0, "consumed": 1, "restart": 1, "trained": 2, "dropped_stale": 2, "dead_lettered": 2}
_NOISE = {"event", "timestamp", "level", "service", "run", "sample_id", "logger"}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LOG_NAME = re.compile(r"(.+)\.log(?:\.(\d+))?")

ProcessKey = tuple[str, str]  # (source label, service)


@dataclass(frozen=True)
class LogEvent:
    """One parsed log line: ``process`` says which process wrote it, ``run`` which of its lifetimes
    (0 before the first ``config_resolved`` read, then 1, 2, ...)."""

    source: str
    service: str
    run: int
    record: dict[str, Any]
    update: dict[str, Any] | None = None  # for fragment_trained: the update_done line of that update

    @property
    def process(self) -> ProcessKey:
        return (self.source, self.service)

    @property
    def event(self) -> str:
        return str(self.record.get("event", ""))


@dataclass(frozen=True)
class TraceStep:
    """One step of a sample's timeline. ``at`` is Unix seconds (None when the line had no timestamp)."""

    at: float | None
    timestamp: str | None
    kind: str  # produced, consumed, trained, dropped_stale, dead_lettered, restart, or another event name
    event: str
    source: str
    service: str
    run: int
    fields: dict[str, Any] = field(default_factory=dict)
    update: dict[str, Any] | None = None

    @property
    def who(self) -> str:
        return self.source or self.service or "?"

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "timestamp": self.timestamp, "kind": self.kind, "event": self.event,
                "source": self.source, "service": self.service, "run": self.run, "fields": dict(self.fields),
                "update": None if self.update is None else dict(self.update), "summary": describe(self)}


def parse_line(line: str) -> tuple[str, dict[str, Any]] | None:
    """(source label, record) of one log line, or None when it holds no JSON object.

    Anything before the first ``{`` is a prefix (``trainer-1  | `` from ``docker compose logs``); its
    part before ``|``, without colour codes and spaces, is the source label ("" without a prefix).
    """
    start = line.find("{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start:])
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    prefix = _ANSI.sub("", line[:start])
    return prefix.split("|", 1)[0].strip() if "|" in prefix else prefix.strip(), record


def events_for(sample_id: str, lines: Iterable[str]) -> list[LogEvent]:
    """Every line about ``sample_id``, in input order, each with its process run; the ``update_done``
    of each update that trained it; and the ``config_resolved`` lines that start a later run of a
    process between two of its lines about the sample (restarts to mark). One pass: ``lines`` may be
    a stream. Each process's lines must come in the order it wrote them (rotated files oldest first)."""
    runs: dict[ProcessKey, int] = {}
    starts: dict[tuple[ProcessKey, int], LogEvent] = {}
    found: list[LogEvent] = []
    waiting: dict[tuple[ProcessKey, int, Any], int] = {}  # (process, run, update) -> index in found
    for line in lines:
        if sample_id not in line and RUN_START not in line and UPDATE_DONE not in line:
            continue  # cheap filter: most lines are about other samples
        parsed = parse_line(line)
        if parsed is None:
            continue
        source, record = parsed
        service = str(record.get("service", ""))
        key = (source, service)
        event = record.get("event")
        if event == RUN_START:
            runs[key] = runs.get(key, 0) + 1
            starts[(key, runs[key])] = LogEvent(source, service, runs[key], {"event": RUN_START,
                                                                              "timestamp": record.get("timestamp")})
            continue
        run = runs.get(key, 0)
        if event == UPDATE_DONE:
            index = waiting.pop((key, run, record.get("update")), None)
            if index is not None:
                e = found[index]
                found[index] = LogEvent(e.source, e.service, e.run, e.record, update=record)
            continue
        if record.get("sample_id") != sample_id:
            continue
        if event == "fragment_trained":
            waiting[(key, run, record.get("update"))] = len(found)
        found.append(LogEvent(source, service, run, record))
    return found + _restarts_between(found, starts)


def _restarts_between(found: list[LogEvent], starts: dict[tuple[ProcessKey, int], LogEvent]) -> list[LogEvent]:
    spans: dict[ProcessKey, tuple[int, int]] = {}
    for e in found:
        lo, hi = spans.get(e.process, (e.run, e.run))
        spans[e.process] = (min(lo, e.run), max(hi, e.run))
    return [start for (key, run), start in starts.items() if key in spans and spans[key][0] < run <= spans[key][1]]


def unix_time(timestamp: Any) -> float | None:
    """A log line's ISO-8601 ``timestamp`` (structlog, UTC) as Unix seconds; None if absent or unreadable."""
    if not isinstance(timestamp, str):
        return None
    try:
        return datetime.fromisoformat(timestamp).timestamp()
    except ValueError:
        return None


def timeline(events: Iterable[LogEvent]) -> list[TraceStep]:
    """The events as steps in time order, ``produced`` first: the sampler logs it once Kafka acknowledged
    the record, which can be after the trainer consumed it. Lines without a time go last; at equal
    times consumed comes before an outcome, then input order."""
    steps = []
    for e in events:
        kind = "restart" if e.event == RUN_START else KINDS.get(e.event, e.event or "?")
        fields = {} if kind == "restart" else {k: v for k, v in e.record.items() if k not in _NOISE}
        ts = e.record.get("timestamp")
        steps.append(TraceStep(unix_time(ts), ts if isinstance(ts, str) else None, kind, e.event, e.source,
                               e.service, e.run, fields, e.update))
    order = sorted(range(len(steps)), key=lambda i: (steps[i].kind != "produced", steps[i].at is None,
                                                      steps[i].at or 0.0, _RANK.get(steps[i].kind, 1), i))
    return [steps[i] for i in order]


def outcome(steps: Iterable[TraceStep]) -> str | None:
    """The sample's last outcome (trained, dropped_stale, dead_lettered), or None while it has none."""
    last = None
    for s in steps:
        if s.kind in OUTCOMES:
            last = s.kind
    return last


def _kv(fields: dict[str, Any], *keys: str) -> str:
    return ", ".join(f"{k} {fields[k]}" for k in keys if fields.get(k) is not None)


def describe(step: TraceStep) -> str:
    """One line in words: what happened to the sample at this step."""
    f = step.fields
    where = _kv(f, "partition", "offset")
    if step.kind == "produced":
        extra = _kv(f, "steps", "episodes")
        return (f"produced by {f.get('sampler_id') or step.who} with policy v{f.get('policy_version')}"
                + (f", {where}" if where else "") + (f" ({extra})" if extra else ""))
    if step.kind == "consumed":
        return "consumed" + (f" from {where}" if where else "")
    if step.kind == "trained":
        text = f"trained in update {f.get('update')}" + (f", staleness {f['staleness']}" if "staleness" in f else "")
        if step.update is not None:
            u = _kv(step.update, "fragments", "env_steps", "policy_loss", "value_loss", "entropy", "approx_kl",
                    "clip_fraction", "learning_rate", "seconds")
            text += f" ({u})" if u else ""
        return text
    if step.kind == "dropped_stale":
        return "dropped as stale: " + _kv(f, "staleness", "max_staleness", "reference_version")
    if step.kind == "dead_lettered":
        return f"dead-lettered: {f.get('reason')}" + (f" ({f['error']})" if f.get("error") else "")
    if step.kind == "restart":
        return f"{step.who} restarted (run {step.run})"
    rest = {k: v for k, v in f.items() if k not in ("sampler_id", "policy_version")}
    return step.kind + (" " + json.dumps(rest, default=str) if rest else "")


def steps_json(sample_id: str, steps: list[TraceStep]) -> dict[str, Any]:
    """``{"sample_id", "found", "outcome", "steps": [...]}``, JSON-serialisable."""
    return {"sample_id": sample_id, "found": bool(steps), "outcome": outcome(steps),
            "steps": [s.to_dict() for s in steps]}


def trace_json(sample_id: str, lines: Iterable[str]) -> dict[str, Any]:
    """One sample's timeline from ``lines`` as :func:`steps_json` (``GET /trace/{sample_id}``;
    ``found`` is false when no line mentions it). E.g. ``trace_json(id, log_lines(home / "logs"))``."""
    return steps_json(sample_id, timeline(events_for(sample_id, lines)))


def log_files(directory: Path, name: str | None = None) -> list[Path]:
    """Every ``*.log`` in ``directory`` (only ``<name>.log`` when ``name`` is given) with its rotated
    copies, each log oldest first (``trainer.log.3``, ``trainer.log.2``, ``trainer.log.1``,
    ``trainer.log``), logs by name."""
    groups: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.glob("*.log*"):
        m = _LOG_NAME.fullmatch(path.name)
        if m and path.is_file() and (name is None or m[1] == name):
            groups.setdefault(m[1], []).append((int(m[2] or 0), path))
    return [p for base in sorted(groups) for _, p in sorted(groups[base], key=lambda x: -x[0])]


def log_lines(directory: Path) -> Iterator[str]:
    """The lines of every log in ``directory`` (see :func:`log_files`), each prefixed ``<log name> | ``
    so that :func:`events_for` tells apart processes of one service (``sampler-0``, ``sampler-1``)."""
    for path in log_files(directory):
        m = _LOG_NAME.fullmatch(path.name)
        label = m[1] if m else path.name
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    yield f"{label} | {line}"
        except FileNotFoundError:  # rotated away meanwhile
            continue
