"""The weights that ride on announcements (docs/policies.md): paramsync's side of inline policies.

A published version whose weights are at most ``paramsync.inline_max_bytes`` is announced with them
inline (base64, checked against the record's sha256 by every reader), so samplers adopt it without a
store GET; the store keeps every version as before (history, rollbacks, pruning). The encoded
announcement must fit ``kafka.max_message_bytes`` (the producer and the policy topic allow 64 KiB more
for the batch around it) and the policy topic's own ``max.message.bytes`` as read at start (a topic
created before inline policies has the broker's default, about 1 MiB); one that does not goes without them.

Pure: no I/O; paramsync fetches the payload and sends the bytes.
"""

from __future__ import annotations

from shared.marker import VersionRecord
from shared.messages import PolicyMessage

BATCH_OVERHEAD_BYTES = 1024
"""Bound on what Kafka's record batch adds around one record (header, key, varints): kept below a topic's limit."""
ENVELOPE_BYTES = 4096
"""Generous bound on an announcement's JSON around its base64 weights (field names, blob key, sha256)."""


def inline_capacity(max_message_bytes: int) -> int:
    """The largest weights (bytes) whose inline announcement fits ``max_message_bytes`` (base64: 4 per 3)."""
    return max(0, (max_message_bytes - ENVELOPE_BYTES) // 4 * 3)


class InlinePayload:
    """The published version's weights, kept to ride on its announcements and re-announcements.

    Invariants: holds at most one payload, and only one whose sha256 and size match the record it is kept
    for; :meth:`announcement` attaches it only to that record's announcement, and only when the encoded
    announcement is at most ``max_message_bytes``; ``limit`` 0 attaches nothing and keeps nothing.
    """

    def __init__(self, limit: int, max_message_bytes: int) -> None:
        if limit < 0:
            raise ValueError(f"inline limit must be >= 0, got {limit=}")
        self.configured = limit
        self.limit = min(limit, inline_capacity(max_message_bytes))
        """Effective: weights up to this size go inline (lowered by :meth:`refused`)."""
        self.max_message_bytes = max_message_bytes
        self._held: tuple[VersionRecord, bytes] | None = None

    def fits(self, record: VersionRecord) -> bool:
        """``record``'s weights are small enough to ride on its announcement."""
        return 0 < record.size <= self.limit

    def holds(self, record: VersionRecord) -> bool:
        return self._held is not None and self._held[0].sha256 == record.sha256 and self._held[0].size == record.size

    def wants(self, record: VersionRecord) -> bool:
        """``record``'s weights would go inline but are not held (fetch them, then :meth:`keep`)."""
        return self.fits(record) and not self.holds(record)

    def keep(self, record: VersionRecord, data: bytes) -> bool:
        """Hold ``data`` for ``record``'s announcements (replacing what was held) when they fit; True if held.
        ValueError when ``data`` is not what the record's sha256 and size name."""
        if not self.fits(record):
            return False
        PolicyMessage.of("announce", record).with_inline(data)  # checks sha256 and size
        self._held = (record, data)
        return True

    def announcement(self, record: VersionRecord) -> tuple[bytes, bool]:
        """The encoded announcement of ``record``, and whether it carries the weights inline."""
        msg = PolicyMessage.of("announce", record)
        if self._held is not None and self.holds(record) and self.fits(record):
            encoded = msg.with_inline(self._held[1]).to_bytes()
            if len(encoded) <= self.max_message_bytes:
                return encoded, True
        return msg.to_bytes(), False

    def cap(self, max_message_bytes: int) -> None:
        """The policy topic accepts records up to ``max_message_bytes`` (its ``max.message.bytes``, less the
        batch around the record): no announcement larger than that is ever sent."""
        self.max_message_bytes = min(self.max_message_bytes, max_message_bytes)
        self.limit = min(self.limit, inline_capacity(self.max_message_bytes))

    def refused(self, announcement_bytes: int) -> None:
        """A broker refused an inline announcement of this size: from now on only smaller weights go inline."""
        self.limit = min(self.limit, max(0, (announcement_bytes - ENVELOPE_BYTES) // 4 * 3 - 1))
