"""Structured logging: one JSON object a line, always with ``service`` and ``run``.

Where a fragment is handled, bind its identity with :func:`fragment_context` so every line
carries ``sample_id``, ``sampler_id``, ``policy_version`` (and on the trainer ``partition`` and
``offset``); ``grep <sample_id>`` then follows one fragment from production to its update.

Flywheel's own (structlog) events are written as they come: every fragment outcome is a line.
Libraries' stdlib ``logging`` records go through :class:`LibraryHandler`: at most one line per
message template (logger, level, ``msg`` before formatting) per interval (30 s), then one
``library_log_suppressed`` line with the count; a Kafka client's connection and metadata errors are
written at WARNING (a broker outage is reported by the services' health, as ``degraded``; at ERROR,
hundreds of reconnect lines a second buried everything else).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog


class RotatingFile:
    """A text stream that writes whole lines to ``path`` and rotates it by size, in this process.

    Rotation renames ``path`` to ``path.1`` (shifting older copies up to ``backups``) before a line
    that would take the file past ``max_bytes``, then reopens ``path``: no line is lost or split, which
    copy-and-truncate rotation from outside cannot promise. Thread-safe (uvicorn, to_thread workers).
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the process lifetime
        self._size = self.path.stat().st_size

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "replace")
        with self._lock:
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._fh.write(text)
            self._fh.flush()
            self._size += len(data)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._fh.flush()

    def _rotate(self) -> None:
        self._fh.close()
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._size = 0


LIBRARY_LOG_INTERVAL_S = 30.0
"""A library's message template is written at most once per this many seconds (then a count)."""

KAFKA_NETWORK_NOISE = (
    'Unable connect to "',  # aiokafka: a bootstrap server refused the connection
    "Unable connect to node",
    "Unable to update metadata",
    "Failed fetch messages from",
    "Failed fetch offsets from",
    "Heartbeat send request failed",
    "Group Coordinator Request failed",
    "FindCoordinator Request failed",
)
"""Message templates (prefixes) of a Kafka client's connection and metadata errors: retried by the
client itself, and while they last the service reports itself degraded. Written at WARNING."""
_KAFKA_LOGGERS = ("aiokafka", "kafka")


def is_kafka_network_noise(record: logging.LogRecord) -> bool:
    """A Kafka client's record about a connection or metadata failure it retries by itself."""
    return (record.name.split(".", 1)[0] in _KAFKA_LOGGERS and isinstance(record.msg, str)
            and record.msg.startswith(KAFKA_NETWORK_NOISE))


LogKey = tuple[str, int, str]
"""(logger name, level, message template): what makes two library records "the same line"."""


@dataclass(frozen=True)
class Suppressed:
    """``count`` records of ``key`` were not written in the interval that began at ``since``."""

    key: LogKey
    count: int
    since: float


@dataclass
class _Window:
    start: float
    suppressed: int = 0


class LogLimiter:
    """Which library records to write: the first of each key per ``interval_s``, then none until the
    interval ends; pure (the caller passes the clock's time).

    Invariants: a key is tracked from the record that opened its interval until :meth:`expired` or the
    next record of the key past the interval closes it; closing an interval that suppressed records
    yields exactly one :class:`Suppressed`. At most ``max_keys`` keys are tracked; records of further
    keys are written (never silently lost).
    """

    def __init__(self, interval_s: float = LIBRARY_LOG_INTERVAL_S, max_keys: int = 10_000) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._windows: dict[LogKey, _Window] = {}

    def offer(self, key: LogKey, now: float) -> tuple[bool, Suppressed | None]:
        """Whether a record of ``key`` is written now, and the interval it closed (its summary goes first)."""
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) < self.max_keys:
                self._windows[key] = _Window(now)
            return True, None
        if now - w.start < self.interval_s:
            w.suppressed += 1
            return False, None
        self._windows[key] = _Window(now)
        return True, Suppressed(key, w.suppressed, w.start) if w.suppressed else None

    def expired(self, now: float) -> list[Suppressed]:
        """Close the intervals that have ended; the summaries of those that suppressed records."""
        done = [k for k, w in self._windows.items() if now - w.start >= self.interval_s]
        return [s for s in (self._close(k) for k in done) if s is not None]

    def drain(self) -> list[Suppressed]:
        """Close every interval (at shutdown): nothing suppressed goes uncounted."""
        return [s for s in (self._close(k) for k in list(self._windows)) if s is not None]

    def _close(self, key: LogKey) -> Suppressed | None:
        w = self._windows.pop(key)
        return Suppressed(key, w.suppressed, w.start) if w.suppressed else None


class LibraryHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The bridge of stdlib ``logging`` (libraries: aiokafka, botocore, uvicorn) into the JSON lines:
    Kafka network noise lowered to WARNING, then rate-limited per template by a :class:`LogLimiter`.

    Summary lines are records of the same logger and level, event ``library_log_suppressed``, with
    ``template``, ``suppressed`` (the count), ``interval_s`` and ``logger``; they carry ``service`` and
    ``run`` themselves (the flusher thread has no context). Thread-safe: all under the handler's lock.
    """

    SWEEP_EVERY_S = 1.0

    def __init__(self, stream: Any, limiter: LogLimiter, clock: Callable[[], float] = time.monotonic,
                 fields: dict[str, Any] | None = None) -> None:
        super().__init__(stream)
        self.limiter = limiter
        self.clock = clock
        self.fields = dict(fields or {})
        self._last_sweep = float("-inf")

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno > logging.WARNING and is_kafka_network_noise(record):
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        now = self.clock()
        key: LogKey = (record.name, record.levelno, str(record.msg))
        with self.lock:  # type: ignore[union-attr]
            summaries = []
            if now - self._last_sweep >= self.SWEEP_EVERY_S:
                self._last_sweep = now
                summaries = self.limiter.expired(now)
            passes, closed = self.limiter.offer(key, now)
            for s in [*summaries, *([closed] if closed else [])]:
                super().emit(self._summary(s))
            if passes:
                super().emit(record)

    def flush_expired(self) -> None:
        """Write the summaries of intervals that have ended (called periodically, and by ``emit``)."""
        with self.lock:  # type: ignore[union-attr]
            for s in self.limiter.expired(self.clock()):
                super().emit(self._summary(s))

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            for s in self.limiter.drain():
                super().emit(self._summary(s))
        super().close()

    def _summary(self, s: Suppressed) -> logging.LogRecord:
        name, level, template = s.key
        record = logging.LogRecord(name, level, __file__, 0, "library_log_suppressed", None, None)
        extra = {**self.fields, "logger": name, "template": template, "suppressed": s.count,
                 "interval_s": self.limiter.interval_s}
        record.__dict__.update(extra)
        return record


_SUMMARY_FIELDS = ("service", "run", "logger", "template", "suppressed", "interval_s")
_flusher_started = False
_flusher_lock = threading.Lock()


def _flush_library_summaries() -> None:
    """Background (daemon): write the summaries of ended intervals even when no library logs any more."""
    while True:
        time.sleep(1.0)
        for h in list(logging.getLogger().handlers):
            if isinstance(h, LibraryHandler):
                try:
                    h.flush_expired()
                except Exception:  # noqa: BLE001 - logging must never take the process down
                    pass


def _start_flusher() -> None:
    global _flusher_started
    with _flusher_lock:
        if not _flusher_started:
            threading.Thread(target=_flush_library_summaries, name="log-summaries", daemon=True).start()
            _flusher_started = True


def configure_logging(service: str, run: str, level: str = "INFO", stream: TextIO | Any | None = None,
                      library_interval_s: float = LIBRARY_LOG_INTERVAL_S,
                      clock: Callable[[], float] = time.monotonic) -> None:
    """Route structlog (and stdlib logging, e.g. aiokafka's) to JSON lines on ``stream``; library records
    are rate-limited per template over ``library_interval_s`` (:class:`LibraryHandler`), by ``clock``."""
    stream = stream if stream is not None else sys.stdout
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # WriteLogger writes a line and its newline in one write(): with RotatingFile and the stdlib
        # handler sharing the stream, lines never interleave or split across files.
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, run=run)
    handler = LibraryHandler(stream, LogLimiter(library_interval_s), clock, {"service": service, "run": run})
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder(allow=_SUMMARY_FIELDS)],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, LibraryHandler):
            old.close()  # its pending counts are written, not lost
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # third-party libraries: warnings and up
    _start_flusher()


def get_logger(**bound: Any) -> Any:
    """A structlog logger with ``bound`` key-values on every line."""
    return structlog.get_logger().bind(**bound)


def fragment_fields(
    sample_id: str,
    sampler_id: str,
    policy_version: int,
    partition: int | None = None,
    offset: int | None = None,
) -> dict[str, Any]:
    """The key-values that identify one fragment in a log line."""
    fields: dict[str, Any] = {"sample_id": sample_id, "sampler_id": sampler_id, "policy_version": policy_version}
    if partition is not None:
        fields["partition"] = partition
    if offset is not None:
        fields["offset"] = offset
    return fields


def fragment_context(
    sample_id: str,
    sampler_id: str,
    policy_version: int,
    partition: int | None = None,
    offset: int | None = None,
) -> Any:
    """Context manager binding a fragment's identity to every log line inside it."""
    return structlog.contextvars.bound_contextvars(
        **fragment_fields(sample_id, sampler_id, policy_version, partition, offset)
    )
