"""JSON messages on the ``policy``, ``control`` and ``heartbeats`` topics (fragments: shared.fragment).

Every message is one pydantic model; unknown fields are ignored so newer senders do not break
older readers. Keys: policy messages are keyed ``candidate`` / ``announce`` (the topic is
compacted: the latest of each survives, so the newest announcement, with its inline weights, stays
readable by a reader that starts late), heartbeats by the sender's id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.marker import VersionRecord

KEY_CANDIDATE = b"candidate"
KEY_ANNOUNCE = b"announce"
SIGNATURE_FIELD = "ed25519"
"""The field of a record's ``extra["signature"]`` holding the hex signature (``shared.signing``)."""


def record_signature(rec: VersionRecord) -> tuple[str | None, str | None]:
    """``(key id, hex signature)`` of ``rec.extra["signature"]``; ``(None, None)`` where it is missing or malformed."""
    sig = rec.extra.get("signature")
    if not isinstance(sig, dict):
        return None, None
    key_id, value = sig.get("key_id"), sig.get(SIGNATURE_FIELD)
    return (key_id if isinstance(key_id, str) else None), (value if isinstance(value, str) else None)


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class InlineMismatch(ValueError):
    """An announcement's inline weights are not the ones its sha256 and size name (corrupt or forged)."""


class PolicyMessage(_Msg):
    """A candidate (trainer -> paramsync) or an announcement (paramsync -> samplers).

    ``sha256`` and ``size`` are those of the weights (the blob ``blob`` names in the store, and ``inline``
    when set). Encoded without the ``inline`` key when it is None, so candidates and store-only
    announcements are byte for byte what readers before inline policies know.
    """

    type: Literal["candidate", "announce"]
    version: int
    blob: str
    sha256: str
    size: int
    trainer_step: int
    created_at: float
    sent_at: float = Field(default_factory=time.time)
    lineage: int = 0
    """The newest rollback this policy descends from (0: none). paramsync refuses a candidate whose
    lineage is older than the last rollback it published: it was trained from abandoned weights."""
    rollback_of: int | None = None
    """On an announcement made by a rollback: the version whose weights this one republishes."""
    inline: str | None = None
    """On an announcement: the weights themselves, base64 (standard alphabet, padded), when they fit
    ``paramsync.inline_max_bytes`` and ``kafka.max_message_bytes``; their sha256 and size are ``sha256`` and
    ``size``. None: fetch ``blob`` from the store. Readers that do not know the field ignore it."""
    key_id: str | None = None
    """The id of the key that signed it (``shared.signing``): the trainer's on a candidate, paramsync's on an
    announcement; None: unsigned."""
    signature: str | None = None
    """Ed25519 signature (hex) of the policy's claims (run, version, sha256, size, trainer step, lineage,
    rollback_of) under ``key_id``. With signing on, paramsync refuses a candidate without the trainer's valid one
    and readers refuse an announcement without paramsync's."""

    def to_bytes(self) -> bytes:
        unset = {name for name in ("inline", "key_id", "signature") if getattr(self, name) is None}
        return self.model_dump_json(exclude=unset or None).encode()

    def with_inline(self, data: bytes) -> PolicyMessage:
        """This message carrying ``data`` inline; ValueError unless ``data`` is what ``sha256`` and ``size`` name."""
        if len(data) != self.size or hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"inline weights of version {self.version} do not match its sha256 and size")
        return self.model_copy(update={"inline": base64.b64encode(data).decode("ascii")})

    def inline_weights(self) -> bytes | None:
        """The inline weights, checked against ``sha256`` and ``size``; None when there are none.

        Raises :class:`InlineMismatch` when they are not valid base64 or do not match: never act on them.
        """
        if self.inline is None:
            return None
        try:
            data = base64.b64decode(self.inline, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InlineMismatch(f"inline weights of version {self.version} are not base64: {exc}") from exc
        sha = hashlib.sha256(data).hexdigest()
        if sha != self.sha256 or len(data) != self.size:
            raise InlineMismatch(f"inline weights of version {self.version} are corrupt: sha256 {sha[:12]}.. "
                                 f"size {len(data)}, want {self.sha256[:12]}.. size {self.size}")
        return data

    @classmethod
    def of(cls, type_: Literal["candidate", "announce"], rec: VersionRecord) -> PolicyMessage:
        """The message of ``rec``; an announcement carries the record's signature (``extra["signature"]``)."""
        key_id, signature = record_signature(rec) if type_ == "announce" else (None, None)
        return cls(type=type_, version=rec.version, blob=rec.blob, sha256=rec.sha256, size=rec.size,
                   trainer_step=rec.trainer_step, created_at=rec.created_at,
                   lineage=rec.lineage, rollback_of=rec.extra.get("rollback_of"),
                   key_id=key_id, signature=signature)

    def record(self) -> VersionRecord:
        """The version record this message names, with its signature when it carries one: an announcement's
        (paramsync's) as ``extra["signature"]``, a candidate's (the trainer's) as ``extra["candidate_signature"]``,
        kept on the published record as the trainer's word for its weights."""
        extra: dict[str, Any] = {"lineage": self.lineage} if self.lineage else {}
        if self.rollback_of is not None:
            extra["rollback_of"] = self.rollback_of
        if self.key_id is not None and self.signature is not None:
            field = "signature" if self.type == "announce" else "candidate_signature"
            extra[field] = {"key_id": self.key_id, SIGNATURE_FIELD: self.signature}
        return VersionRecord(version=self.version, blob=self.blob, sha256=self.sha256, size=self.size,
                             trainer_step=self.trainer_step, created_at=self.created_at, extra=extra)


class ControlCommand(_Msg):
    """An operator's command from the admin API on ``<run>.control``.

    ``sync``: samplers reload the latest policy now, paramsync re-announces it. ``pause`` / ``resume``:
    every sampler, or the one named by ``sampler``, stops or resumes producing (the durable state is
    ``<run>/ops/paused.json``). ``rollback``: paramsync republishes ``version``'s weights as the newest
    version. ``config``: services re-read the runtime settings now (revision ``version``).
    """

    command: Literal["sync", "pause", "resume", "rollback", "config"]
    request_id: str
    sampler: str | None = None
    version: int | None = None
    issued_at: float = Field(default_factory=time.time)


class CreditGrant(_Msg):
    """The trainer's flow-control grant on partition ``shard`` of ``<run>.credits`` (shared.credits): how
    far it has consumed the fragments of that shard's samplers and how many each may have in flight
    beyond that."""

    type: Literal["credits"] = "credits"
    trainer: str
    window: int
    """Fragments each sampler may have sent but not yet consumed by the trainer; 0: the samplers take
    turns, and only those in ``limits`` may send."""
    consumed: dict[str, int]
    """``"<sampler id>/<incarnation>"`` -> the highest sequence number consumed of that sampler process
    (this shard's samplers only)."""
    limits: dict[str, int] = Field(default_factory=dict)
    """Taking turns (``window`` 0): per sampler process holding a turn, the count of fragments (lost sends
    not counted) up to which it may have sent."""
    shard: int = 0
    """The credits partition this grant is for: its samplers are those with ``shard_of(id, shards)``."""
    shards: int = 1
    allocates: bool = True
    """False from a data-parallel rank other than rank 0: only its consumed counts count."""
    live_samplers: int = 0
    seen: dict[int, int] = Field(default_factory=dict)
    """Per partition of ``<run>.samples`` this trainer reads: the offset below which every record has reached
    it (consumed, whatever its outcome) or left the log before it could (retention, ``deleteRecords``). A
    sampler's fragment at an offset below it is no longer in flight, even when it never counted as consumed:
    credits cannot leak to records the trainer will never see."""
    sent_at: float = Field(default_factory=time.time)


class SamplerBeat(_Msg):
    kind: Literal["sampler"] = "sampler"
    id: str
    policy_version: int | None
    adopted_at: float | None = None
    """When this sampler started acting on ``policy_version`` (its clock)."""
    steps_per_s: float = 0.0
    fragments: int = 0
    env_steps: int = 0
    recent_return_mean: float | None = None
    paused_since: float | None = None
    """Set while an operator has paused this sampler (it produces nothing)."""
    max_backlog: int | None = None
    credits_window: int | None = None
    """Credit flow control: fragments this sampler may have in flight (None: credits off)."""
    credits_in_flight: int | None = None
    """Fragments sent that the trainer has not consumed yet, as of the last grant."""
    credit_wait_s: float = 0.0
    """Seconds spent waiting for credits since the process started."""
    credits_settled_unconsumed: int = 0
    """Fragments this process sent that the trainer's position passed without consuming them (they left the
    log before it read them, or were unreadable): released from the window, not trained."""
    config_revision: int = 0
    """The runtime-settings revision this sampler applied (PATCH /config)."""
    health: dict[str, Any] | None = None
    """``{"state": "ok"|"degraded", "reasons": {component: reason}, "degraded_since"}``."""
    started_at: float | None = None
    """When this process started (a new value for the same role = a restart)."""
    ts: float = Field(default_factory=time.time)


class TrainerBeat(_Msg):
    kind: Literal["trainer"] = "trainer"
    id: str
    policy_version: int
    updates: int
    env_steps_trained: int
    fragments_trained: int
    samples_per_s: float
    last_update_at: float | None
    staleness_mean: float | None
    staleness_max: int | None
    return_mean: float | None
    return_count: int
    fragments_dropped_stale: int
    fragments_dead_lettered: int
    records_lost: int = 0
    """Records of this run that left ``<run>.samples`` before the trainer read them (retention,
    ``deleteRecords``), from its ledger (restarts keep them): never trained; ``flywheel verify`` names them."""
    records_lost_partitions: list[int] = Field(default_factory=list)
    """The partitions those records were on."""
    learner_busy_fraction: float | None = None
    """Fraction of the last minute's wall time this trainer spent in updates (1.0: the learner never waited)."""
    compute: dict[str, Any] | None = None
    """The torch threads and precision the trainer chose, why, the CPU model and flags, and the timed figures
    behind an ``auto`` precision (services/trainer/compute.py ``Compute``)."""
    staleness_p95: float | None = None
    published_version: int | None = None
    """The newest published version the trainer knows of (its staleness reference is the older of it
    and its own version)."""
    stalled_since: float | None = None
    stalled_reason: str | None = None
    nonfinite_steps_skipped: int = 0
    candidates_resent: int = 0
    learning_rate: float | None = None
    config_revision: int = 0
    dropped_fraction: float | None = None
    """Fragments dropped as stale / (trained + dropped) by this trainer process."""
    staleness_per_sampler: dict[str, dict[str, Any]] | None = None
    """Per sampler id: ``{"mean", "p95", "max", "dropped", "dropped_fraction"}`` (staleness as trained)."""
    health: dict[str, Any] | None = None
    started_at: float | None = None
    rank: int = 0
    """Data-parallel trainers: this process's rank (rank 0 publishes and checkpoints)."""
    world_size: int = 1
    weights_digest: str | None = None
    """sha256 (first 16 hex digits) of the weights after update ``digest_update``: every rank's is equal."""
    digest_update: int | None = None
    ts: float = Field(default_factory=time.time)


class ParamsyncBeat(_Msg):
    kind: Literal["paramsync"] = "paramsync"
    id: str
    published_version: int | None
    sync_latency_p50_s: float | None
    sync_latency_p95_s: float | None
    live_samplers: int
    health: dict[str, Any] | None = None
    started_at: float | None = None
    ts: float = Field(default_factory=time.time)


Heartbeat = SamplerBeat | TrainerBeat | ParamsyncBeat


class _AnyBeat(BaseModel):
    beat: Heartbeat = Field(discriminator="kind")


def parse_heartbeat(data: bytes) -> Heartbeat:
    """Decode a heartbeat; raises pydantic.ValidationError or ValueError when malformed."""
    import json

    return _AnyBeat.model_validate({"beat": json.loads(data)}).beat
