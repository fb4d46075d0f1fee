"""The admin REST API. ``GET /status`` is a stable contract (docs/api.md); mutations need an operator's bearer token,
and so do reads unless ``admin.public_reads`` (``services/admin/deps.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from aiokafka.errors import KafkaError
from fastapi import Depends, FastAPI, HTTPException, Query, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel, Field

from services.admin.deps import AUTH_RESPONSES, Operators, State, require_reader, require_token
from services.admin.errors import allow_all_methods, declare_errors
from services.admin.ops import reads as ops_reads
from services.admin.ops import router as ops_router
from services.admin.pages import mount_pages
from services.admin.refusals import RequestRefusals
from services.admin.state import SAMPLER_FORGET_S, AdminState
from shared.posture import protections_off

SYNC_ACK_WAIT_S = 5.0
"""Longest ``POST /policy/sync`` waits for Kafka to take the command before it answers 503 (the CLI waits 12 s)."""

class PolicyStatus(BaseModel):
    version: int | None = Field(description="Version behind the marker; null before the first publish")
    sha256: str | None
    published_at: float | None = Field(description="Unix time the version's record was created")
    signed: bool = Field(description="Whether signing is on here (signing.enabled): only versions paramsync signed "
                         "are shown, and paramsync publishes only candidates the trainer signed")
    signed_by: str | None = Field(None, description="The id of the paramsync key that signed the version shown")


class ServiceHealth(BaseModel):
    alive: bool
    state: str = Field(description="ok, degraded (retrying a dependency: see reasons), or unknown (no heartbeat)")
    reasons: dict[str, str] = Field(description="Per dependency, why it is degraded")
    restarts: int = Field(description="Process restarts seen (new start time in the heartbeats)")


class StallStatus(BaseModel):
    since: float | None
    reason: str


class RankStatus(BaseModel):
    rank: int
    alive: bool
    updates: int
    weights_digest: str | None = Field(description="sha256 prefix of the weights after update digest_update")
    digest_update: int | None
    world_size: int


class TrainerStatus(BaseModel):
    alive: bool
    step: int = Field(description="Trainer step: optimizer updates done (the checkpoint step)")
    updates: int
    samples_trained: int = Field(description="Env steps used in updates")
    samples_per_s: float = Field(description="Env steps trained per second, last 10 s")
    last_update_at: float | None
    policy_version: int | None = Field(
        description="Version of the trainer's current weights (sent as a candidate right after the update "
                    "that made them)")
    published_version: int | None = Field(
        None, description="Newest published version the trainer knows of; staleness is measured from the older "
                          "of this and policy_version")
    stalled: StallStatus | None = Field(
        None, description="Set while records arrive but no update happens (why, and since when)")
    learning_rate: float | None = Field(None, description="For the next update (schedule and runtime settings)")
    config_revision: int = Field(0, description="The runtime-settings revision the trainer applied")
    records_lost: int = Field(0, description="Records of this run that left <run>.samples before the trainer read "
                                             "them (retention, deleteRecords): never trained; flywheel verify "
                                             "fails naming them")
    records_lost_partitions: list[int] = Field(default_factory=list, description="The partitions they were on")
    learner_busy_fraction: float | None = Field(
        None, description="Fraction of the last minute's wall time the trainer spent in updates (1.0: its learner "
                          "never waited for data)")
    compute: dict[str, Any] | None = Field(
        None, description="What the trainer computes with and why: threads (and threads_reason), precision (fp32 "
                          "or bf16, and precision_reason), device, cpus (the CPUs it runs on, after "
                          "trainer.dedicated_cores), cpu_model, cpu_flags, native_bf16, and for an auto precision on "
                          "a CPU with native bf16 the timed fp32_samples_per_s and bf16_samples_per_s")
    ranks: list[RankStatus] = Field(
        default_factory=list, description="Data-parallel ranks (trainer.world_size > 1): each rank's weights "
                                          "digest at a common update; equal digests mean identical weights")


class SamplerStatus(BaseModel):
    id: str
    alive: bool
    policy_version: int | None
    steps_per_s: float
    last_seen: float
    paused: bool = Field(False, description="An operator paused it: it produces nothing (POST /samplers/pause)")
    paused_since: float | None = None
    max_backlog: int | None = Field(None, description="Its backlog limit (a runtime setting; 0: off)")
    credits_window: int | None = Field(
        None, description="Credit flow control: fragments it may have in flight unconsumed (None: credits off)")
    credits_in_flight: int | None = Field(None, description="Its fragments the trainer had not consumed, "
                                                            "as of the last grant")
    credit_wait_s: float = Field(0.0, description="Seconds it waited for credits since it started")
    credits_settled_unconsumed: int = Field(
        0, description="Its fragments the trainer's position passed without consuming them (they left the log "
                       "before it read them, or were unreadable): released from its window, never trained")
    config_revision: int = Field(0, description="The runtime-settings revision it applied")
    ahead_of_published: int | None = Field(
        None, description="Versions its policy is ahead of the published one (the marker's, signature checked): a "
                          "version that was never published, e.g. a forged announcement; null when not ahead")


class BacklogStatus(BaseModel):
    records: int | None = Field(description="Consumer lag of the trainer group on <run>.samples")
    per_partition: dict[str, int]


class SyncStatus(BaseModel):
    latency_p50_s: float | None
    latency_p95_s: float | None


class StalenessStatus(BaseModel):
    mean: float | None = Field(description="Mean policy lag (versions) of recently trained fragments, "
                                           "measured when their batch was formed")
    max: int | None
    p95: float | None = None
    dropped_fraction: float | None = Field(
        None, description="Fragments dropped as stale / (trained + dropped) by the running trainer process")
    per_sampler: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per sampler: mean, p95, max staleness of its trained fragments, "
                                          "dropped and dropped_fraction")
    ahead: int | None = Field(
        None, description="The largest lead, in versions, of a live sampler's behaviour version over the published "
                          "version; null when none is ahead. Such a sampler acts on a policy that was never "
                          "published: reported here (and per sampler), never counted as staleness 0")
    ahead_samplers: list[str] = Field(
        default_factory=list, description="Live samplers whose behaviour version is ahead of the published one")


class ReturnStatus(BaseModel):
    mean: float | None = Field(description="Mean return of the last episodes the trainer saw (window 100)")
    count: int


class ProtectionOff(BaseModel):
    setting: str = Field(description="The setting that turned it off, as section.field=value")
    leaves: str = Field(description="What it leaves open")


class SecurityStatus(BaseModel):
    protections_off: list[ProtectionOff] = Field(
        description="The protections this admin runs without under its settings (shared.posture; every service "
        "logs its own as protection_off at start): empty when nothing is turned off")


class Status(BaseModel):
    run: str
    policy: PolicyStatus
    trainer: TrainerStatus
    samplers: list[SamplerStatus]
    backlog: BacklogStatus
    sync: SyncStatus
    staleness: StalenessStatus
    episode_return: ReturnStatus
    services: dict[str, ServiceHealth] = Field(
        default_factory=dict, description="trainer, paramsync and sampler:<id>: alive, ok or degraded, restarts; "
        "kafka: the run's topics as admin describes them (degraded: a partition under-replicated or offline, named in "
        "reasons.replication; unknown: not described for 30 s)")
    security: SecurityStatus | None = None


class SyncAccepted(BaseModel):
    request_id: str
    policy_version: int = Field(description="The published version samplers are asked to load")
    synced: bool | None = Field(description="With wait_s > 0: whether every live sampler reached it in time")
    waited_s: float
    samplers: dict[str, int | None] = Field(description="Live samplers and their versions at reply time")


class HealthBody(BaseModel):
    ok: bool


def _signer_of(rec: Any) -> str | None:
    sig = rec.extra.get("signature")
    key_id = sig.get("key_id") if isinstance(sig, dict) else None
    return key_id if isinstance(key_id, str) else None


def create_app(state: AdminState, operators: Operators | None = None) -> FastAPI:
    """The API of ``state``; ``operators`` default to those of ``state.settings.admin`` (read here: a bad tokens
    file is a ConfigError naming ``admin.tokens_file``). With ``admin.public_reads`` false every read endpoint
    needs an operator's token too, and the schema says so (``/healthz``, ``/metrics`` and the pages stay open)."""
    app = FastAPI(title="Flywheel admin", version="1", docs_url=None,
                  description="Status of a Flywheel run and manual policy sync. See docs/api.md.")
    app.state.admin = state
    app.state.operators = operators if operators is not None else Operators.from_settings(state.settings.admin)
    app.state.request_refusals = RequestRefusals()
    closed_reads = not state.settings.admin.public_reads
    read_auth = [Depends(require_reader)] if closed_reads else []
    read_responses = dict(AUTH_RESPONSES) if closed_reads else {}

    @app.get("/healthz", response_model=HealthBody,
             responses={503: {"model": HealthBody, "description": "Not started yet (Kafka unreachable at start)"}})
    def healthz(s: State) -> Response:
        ok = s.health()["ok"]
        return Response('{"ok": %s}' % ("true" if ok else "false"), status_code=200 if ok else 503,
                        media_type="application/json")

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format 0.0.4",
        "content": {CONTENT_TYPE_PLAIN_0_0_4: {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @app.get("/status", response_model=Status, dependencies=read_auth, responses=read_responses)
    async def status(s: State) -> Status:
        now = time.time()
        rec = await s.published()
        v = s.view
        tb = v.trainer.beat if v.trainer else None
        pb = v.paramsync.beat if v.paramsync else None
        def ahead(version: int | None) -> int | None:
            """How far ``version`` is ahead of the published one (None: not ahead, or nothing to compare)."""
            if rec is None or version is None or version <= rec.version:
                return None
            return version - rec.version

        samplers = [
            SamplerStatus(id=sid, alive=s.alive(seen, now), policy_version=seen.beat.policy_version,
                          ahead_of_published=ahead(seen.beat.policy_version),
                          steps_per_s=round(seen.beat.steps_per_s, 1), last_seen=seen.at,
                          paused=seen.beat.paused_since is not None, paused_since=seen.beat.paused_since,
                          max_backlog=seen.beat.max_backlog, config_revision=seen.beat.config_revision,
                          credits_window=seen.beat.credits_window, credits_in_flight=seen.beat.credits_in_flight,
                          credit_wait_s=seen.beat.credit_wait_s,
                          credits_settled_unconsumed=seen.beat.credits_settled_unconsumed)
            for sid, seen in sorted(v.samplers.items()) if now - seen.at <= SAMPLER_FORGET_S
        ]
        def health(role: str, seen: object) -> ServiceHealth:
            beat = getattr(seen, "beat", None)
            h = getattr(beat, "health", None) or {}
            alive = s.alive(seen, now)  # type: ignore[arg-type]
            return ServiceHealth(alive=alive, state=str(h.get("state", "unknown")) if alive else "down",
                                 reasons=dict(h.get("reasons") or {}), restarts=v.restarts.get(role, 0))

        services = {"trainer": health("trainer", v.trainer), "paramsync": health("paramsync", v.paramsync)}
        services.update({f"sampler:{sid}": health(f"sampler:{sid}", seen) for sid, seen in sorted(v.samplers.items())})
        if s.replication is not None:  # the run's topics as the cluster's metadata says (admin describes them)
            kstate, kreasons = s.replication.health(now)
            services["kafka"] = ServiceHealth(alive=True, state=kstate, reasons=kreasons, restarts=0)
        return Status(
            run=s.settings.run,
            services=services,
            policy=PolicyStatus(version=rec.version if rec else None, sha256=rec.sha256 if rec else None,
                                published_at=rec.created_at if rec else None, signed=s.verifier.enabled,
                                signed_by=_signer_of(rec) if rec and s.verifier.enabled else None),
            trainer=TrainerStatus(
                alive=s.alive(v.trainer, now), step=tb.updates if tb else 0, updates=tb.updates if tb else 0,
                samples_trained=tb.env_steps_trained if tb else 0,
                samples_per_s=round(tb.samples_per_s, 1) if tb else 0.0,
                last_update_at=tb.last_update_at if tb else None, policy_version=tb.policy_version if tb else None,
                published_version=tb.published_version if tb else None,
                learning_rate=tb.learning_rate if tb else None, config_revision=tb.config_revision if tb else 0,
                records_lost=tb.records_lost if tb else 0,
                records_lost_partitions=tb.records_lost_partitions if tb else [],
                compute=tb.compute if tb else None,
                learner_busy_fraction=tb.learner_busy_fraction if tb else None,
                stalled=StallStatus(since=tb.stalled_since, reason=tb.stalled_reason)
                if tb and tb.stalled_reason and s.alive(v.trainer, now) else None,
                ranks=[RankStatus(rank=r, alive=s.alive(seen, now), updates=seen.beat.updates,
                                  weights_digest=seen.beat.weights_digest, digest_update=seen.beat.digest_update,
                                  world_size=seen.beat.world_size)
                       for r, seen in sorted(v.trainer_ranks.items())
                       if tb is not None and tb.world_size > 1 and r < tb.world_size]),
            samplers=samplers,
            backlog=BacklogStatus(records=sum(v.lag.values()) if v.lag is not None else None,
                                  per_partition={str(p): n for p, n in sorted((v.lag or {}).items())}),
            sync=SyncStatus(latency_p50_s=pb.sync_latency_p50_s if pb else None,
                            latency_p95_s=pb.sync_latency_p95_s if pb else None),
            staleness=StalenessStatus(
                mean=tb.staleness_mean if tb else None, max=tb.staleness_max if tb else None,
                p95=tb.staleness_p95 if tb else None,
                dropped_fraction=tb.dropped_fraction if tb else None,
                per_sampler=(tb.staleness_per_sampler or {}) if tb else {},
                ahead=max((a for sm in samplers if sm.alive and (a := sm.ahead_of_published) is not None),
                          default=None),
                ahead_samplers=[sm.id for sm in samplers if sm.alive and sm.ahead_of_published is not None]),
            episode_return=ReturnStatus(mean=tb.return_mean if tb else None, count=tb.return_count if tb else 0),
            security=SecurityStatus(protections_off=[ProtectionOff(**o.as_dict())
                                                     for o in protections_off("admin", s.settings)]),
        )

    @app.post("/policy/sync", response_model=SyncAccepted, status_code=202,
              dependencies=[Depends(require_token)],
              responses={**AUTH_RESPONSES,
                         409: {"description": "No policy has been published yet"},
                         503: {"description": "Kafka is unreachable: the command could not be sent"}})
    async def policy_sync(
        s: State, wait_s: Annotated[float, Query(ge=0, le=30, description="Wait up to this long for samplers")] = 0.0
    ) -> SyncAccepted:
        """Ask every sampler to load the latest published policy now (via ``<run>.control``)."""
        rec = await s.published()
        if rec is None:
            raise HTTPException(status_code=409, detail="no policy has been published yet")
        try:
            # Bounded well inside the CLI's time limit: a sync stores nothing, so an operator told 503 in time can
            # simply ask again (one not acknowledged in time may still reach the samplers).
            cmd = await asyncio.wait_for(s.request_sync(), min(SYNC_ACK_WAIT_S, s.settings.kafka.request_timeout_ms
                                                               / 1000))
        except (KafkaError, TimeoutError) as exc:
            why = f"not acknowledged within {SYNC_ACK_WAIT_S:g} s" if isinstance(exc, TimeoutError) else \
                f"{type(exc).__name__}: {exc}"
            raise HTTPException(status_code=503, detail=f"could not send the sync command, Kafka is unreachable: "
                                                        f"{why}"[:300]) from None
        t0 = time.monotonic()
        synced: bool | None = None
        if wait_s > 0:
            synced = False
            while time.monotonic() - t0 < wait_s:
                versions = s.live_sampler_versions(time.time())
                if versions and all(x is not None and x >= rec.version for x in versions.values()):
                    synced = True
                    break
                await asyncio.sleep(0.02)
        return SyncAccepted(request_id=cmd.request_id, policy_version=rec.version, synced=synced,
                            waited_s=round(time.monotonic() - t0, 3), samplers=s.live_sampler_versions(time.time()))

    app.include_router(ops_router)
    app.include_router(ops_reads, dependencies=read_auth, responses=read_responses)
    mount_pages(app)
    declare_errors(app)
    allow_all_methods(app)
    return app
