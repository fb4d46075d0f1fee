"""Structured logging: one JSON object a line, always with ``service`` and ``run``.

Where a fragment is handled, bind its identity with :func:`fragment_context` so every line
carries ``sample_id``, ``sampler_id``, ``policy_version`` (and on the trainer ``partition`` and
``offset``); ``grep <sample_id>`` then follows one fragment from production to its update.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
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


def configure_logging(service: str, run: str, level: str = "INFO", stream: TextIO | Any | None = None) -> None:
    """Route structlog (and stdlib logging, e.g. aiokafka's) to JSON lines on ``stream``."""
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
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # third-party libraries: warnings and up


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
