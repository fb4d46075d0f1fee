"""Operator actions: pause and resume samplers, policy versions and rollback, runtime settings with
revisions, the audit trail, status history. Every mutation needs the bearer token, is validated
(4xx with the reason, never a 5xx for bad input), and is recorded in the append-only audit trail
(``<run>/audit/`` in the object store) with its actor, parameters and outcome."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from typing import Annotated, Any

from aiokafka.errors import KafkaError
from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from services.admin.deps import State, actor, require_token
from shared.marker import VersionRecord
from shared.messages import ControlCommand
from shared.retry import is_transient
from shared.runtime import apply_runtime, read_paused, runtime_values, write_paused
from shared.settings import ConfigError

router = APIRouter()
AUTH: dict[int | str, dict[str, Any]] = {401: {"description": "Missing or wrong bearer token"}}
ROLLBACK_WAIT_S = 5.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplerTarget(_Body):
    sampler: str | None = Field(None, description="One sampler's id; omitted or null: every sampler")


class PauseAccepted(BaseModel):
    request_id: str
    action: str
    sampler: str | None
    command_sent: bool = Field(True, description="False: Kafka was unreachable; the state is stored and samplers "
                                                 "apply it at their next poll of the store (sampler.sync_interval_s)")


class VersionInfo(BaseModel):
    version: int
    sha256: str
    published_at: float
    trainer_step: int
    rollback_of: int | None = Field(description="Set when this version republished an older one's weights")
    return_mean: float | None = Field(description="Mean episode return the trainer reported while it was current")


class Versions(BaseModel):
    current: int | None
    versions: list[VersionInfo] = Field(description="The kept versions (paramsync.keep_versions), oldest first")


class RollbackRequest(_Body):
    version: int = Field(ge=0, description="A kept version whose weights become the newest version")


class RollbackAccepted(BaseModel):
    request_id: str
    version: int
    new_version: int | None = Field(description="The version that now carries its weights (null: not yet seen)")


class ConfigView(BaseModel):
    revision: int = Field(description="0: the config file as the services started with it")
    settings: dict[str, Any]
    at: float | None
    actor: str | None


class ConfigChange(BaseModel):
    revision: int
    settings: dict[str, Any]
    changes: dict[str, dict[str, Any]]


class RevisionInfo(BaseModel):
    revision: int
    settings: dict[str, Any]
    changes: dict[str, dict[str, Any]]
    actor: str | None
    at: float | None
    reverted_from: int | None


class ConfigHistory(BaseModel):
    revisions: list[RevisionInfo]


class RevertRequest(_Body):
    revision: int = Field(ge=0, description="0: the values of the config file the services started with")


class AuditEntryView(BaseModel):
    at: float
    actor: str
    action: str
    params: dict[str, Any]
    outcome: str


class Audit(BaseModel):
    entries: list[AuditEntryView]


def _unavailable(what: str, exc: BaseException) -> HTTPException:
    return HTTPException(status_code=503, detail=f"{what}: {type(exc).__name__}: {exc}"[:300])


async def _store(s: State, what: str, fn: Any, *args: Any) -> Any:
    """Run a store operation in a thread; an outage is a 503 with the reason, never a 500."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as exc:
        if is_transient(exc):
            raise _unavailable(f"the object store is unreachable ({what})", exc) from None
        raise


async def _audit(s: State, request: Request, action: str, params: dict[str, Any], outcome: str) -> None:
    try:
        await asyncio.to_thread(s.audit.append, actor(request), action, params, outcome)
    except Exception as exc:  # the action happened; a lost audit line is logged, not hidden
        s.log.error("audit_write_failed", action=action, error=f"{type(exc).__name__}: {exc}"[:300])


async def _send(s: State, cmd: ControlCommand) -> None:
    try:
        await s.command(cmd)
    except (KafkaError, TimeoutError) as exc:
        raise _unavailable("could not send the command, Kafka is unreachable", exc) from None


# ---- pause / resume -------------------------------------------------------------------------
async def _pause_resume(s: State, request: Request, action: str, target: SamplerTarget) -> PauseAccepted:
    sid = target.sampler
    if sid is not None and sid not in s.view.samplers:
        raise HTTPException(status_code=404, detail=f"unknown sampler {sid!r}; known: {sorted(s.view.samplers)}")
    now = time.time()
    if action == "resume" and sid is not None:
        state = await _store(s, "pause state", read_paused, s.store, s.settings.run)
        if state.get("all"):
            raise HTTPException(status_code=409, detail="every sampler is paused: resume all (no sampler) first, "
                                                        "then pause the ones to keep paused")

    def update() -> None:
        state = read_paused(s.store, s.settings.run)
        if action == "pause":
            if sid is None:
                state["all"] = state.get("all") or now
            else:
                state["samplers"].setdefault(sid, now)
        elif sid is None:
            state = {"all": None, "samplers": {}}
        else:
            state["samplers"].pop(sid, None)
        write_paused(s.store, s.settings.run, state)

    await _store(s, f"{action} state", update)
    cmd = ControlCommand(command=action, request_id=uuid.uuid4().hex, sampler=sid,
                         issued_at=now)
    try:
        await s.command(cmd)
        sent = True
    except (KafkaError, TimeoutError) as exc:  # stored: samplers apply it from the store at their next poll
        s.log.warning("operator_command_not_sent", command=action, error=f"{type(exc).__name__}: {exc}"[:200])
        sent = False
    await _audit(s, request, action, {"sampler": sid},
                 "sent" if sent else "stored; command not sent (Kafka unreachable), applied at the next poll")
    return PauseAccepted(request_id=cmd.request_id, action=action, sampler=sid, command_sent=sent)


@router.post("/samplers/pause", response_model=PauseAccepted, status_code=202, dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Unknown sampler"}, 503: {"description": "Kafka or S3 down"}})
async def pause(s: State, request: Request,
                target: Annotated[SamplerTarget | None, Body()] = None) -> PauseAccepted:
    """Pause every sampler, or one: it produces nothing within a second, keeps its envs and policy, and
    stays paused across restarts (``<run>/ops/paused.json``). The trainer drains what is queued."""
    return await _pause_resume(s, request, "pause", target or SamplerTarget())


@router.post("/samplers/resume", response_model=PauseAccepted, status_code=202,
             dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Unknown sampler"}, 503: {"description": "Kafka or S3 down"}})
async def resume(s: State, request: Request,
                 target: Annotated[SamplerTarget | None, Body()] = None) -> PauseAccepted:
    """Resume every sampler (clears every pause), or one."""
    return await _pause_resume(s, request, "resume", target or SamplerTarget())


# ---- versions and rollback ------------------------------------------------------------------
@router.get("/policy/versions", response_model=Versions, responses={503: {"description": "Object store down"}})
async def versions(s: State) -> Versions:
    records: list[VersionRecord] = await _store(s, "history", s.policies.records)
    current = await s.published()
    return Versions(current=current.version if current else None, versions=[
        VersionInfo(version=r.version, sha256=r.sha256, published_at=r.created_at, trainer_step=r.trainer_step,
                    rollback_of=r.extra.get("rollback_of"), return_mean=s.version_returns.get(r.version))
        for r in records])


@router.post("/policy/rollback", response_model=RollbackAccepted, status_code=202,
             dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Version not kept"}, 409: {"description": "Already current"},
                        503: {"description": "Kafka or S3 down"}})
async def rollback(s: State, request: Request, body: RollbackRequest) -> RollbackAccepted:
    """Make ``version``'s weights the newest version (versions never go backwards; its record says
    ``rollback_of``). paramsync republishes them, samplers act on them within a second, and the trainer
    continues from them with a fresh optimizer; fragments of the abandoned versions are dropped as
    stale, and candidates trained from the abandoned weights are refused. See docs/api.md."""
    records: list[VersionRecord] = await _store(s, "history", s.policies.records)
    target = next((r for r in records if r.version == body.version), None)
    if target is None:
        kept = [r.version for r in records]
        detail = f"version {body.version} is not kept (kept: {kept[0]}..{kept[-1]})" if kept else \
            f"version {body.version} is not kept: nothing published yet"
        raise HTTPException(status_code=404, detail=detail)
    current = await s.published()
    if current is not None and current.sha256 == target.sha256:
        raise HTTPException(status_code=409, detail=f"version {current.version} already has version "
                                                    f"{body.version}'s weights")
    cmd = ControlCommand(command="rollback", request_id=uuid.uuid4().hex, version=body.version)
    await _send(s, cmd)
    new_version = None
    deadline = time.monotonic() + ROLLBACK_WAIT_S
    while time.monotonic() < deadline:
        rec = await s.published()
        if rec is not None and rec.extra.get("rollback_of") == body.version and \
                (current is None or rec.version > current.version):
            new_version = rec.version
            break
        await asyncio.sleep(0.05)
    await _audit(s, request, "rollback", {"version": body.version},
                 f"published as version {new_version}" if new_version is not None else "sent; not seen within 5 s")
    return RollbackAccepted(request_id=cmd.request_id, version=body.version, new_version=new_version)


# ---- runtime settings ---------------------------------------------------------------------
@router.get("/config", response_model=ConfigView, responses={503: {"description": "Object store down"}})
async def get_config(s: State) -> ConfigView:
    """The runtime settings (changeable without a restart) and their revision."""
    latest = await _store(s, "config", s.runtime_config.latest)
    if latest is None:
        return ConfigView(revision=0, settings=runtime_values(s.settings), at=None, actor=None)
    try:
        effective = runtime_values(apply_runtime(s.settings, latest.settings))
    except ConfigError as exc:  # stored, but invalid against this admin's settings: say so, never a 500
        raise HTTPException(status_code=409, detail=f"revision {latest.revision} does not validate: {exc}") from None
    return ConfigView(revision=latest.revision, settings=effective, at=latest.at, actor=latest.actor)


async def _write_config(s: State, request: Request, values: dict[str, Any], reverted_from: int | None) -> ConfigChange:
    try:
        rev = await _store(s, "config", s.runtime_config.write, s.settings, values, actor(request), reverted_from)
    except ConfigError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    try:
        await s.command(ControlCommand(command="config", request_id=uuid.uuid4().hex, version=rev.revision))
    except (KafkaError, TimeoutError) as exc:  # stored: services still pick it up by polling
        s.log.warning("config_command_not_sent", revision=rev.revision, error=f"{type(exc).__name__}: {exc}"[:200])
    action = "config_revert" if reverted_from is not None else "config_change"
    params: dict[str, Any] = {"changes": rev.changes}
    if reverted_from is not None:
        params["revision"] = reverted_from
    await _audit(s, request, action, params, f"revision {rev.revision}")
    return ConfigChange(revision=rev.revision, settings=rev.settings, changes=rev.changes)


@router.patch("/config", response_model=ConfigChange, dependencies=[Depends(require_token)],
              responses={**AUTH, 422: {"description": "A value is invalid or not a runtime setting (names it)"},
                         503: {"description": "Object store down"}})
async def patch_config(s: State, request: Request,
                       values: Annotated[dict[str, Any], Body(examples=[{"trainer.learning_rate": 0.0005}])]
                       ) -> ConfigChange:
    """Change runtime settings, validated like the config file; the services apply the new revision
    within a few seconds. Keys: sampler.max_backlog, sampler.sync_interval_s, trainer.learning_rate,
    trainer.learning_rate_end, trainer.clip_coef_end, trainer.max_staleness, trainer.target_kl, trainer.publish_every,
    trainer.flow_window (``shared.runtime.RUNTIME_KEYS``)."""
    if not values:
        raise HTTPException(status_code=422, detail="no settings given")
    return await _write_config(s, request, values, None)


@router.get("/config/history", response_model=ConfigHistory, responses={503: {"description": "Object store down"}})
async def config_history(s: State) -> ConfigHistory:
    revisions = await _store(s, "config history", s.runtime_config.history)
    return ConfigHistory(revisions=[RevisionInfo(**asdict(r)) for r in revisions])


@router.post("/config/revert", response_model=ConfigChange, dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "No such revision"}, 503: {"description": "Object store down"}})
async def config_revert(s: State, request: Request, body: RevertRequest) -> ConfigChange:
    """Make revision ``revision``'s settings current again, as a new revision."""
    if body.revision == 0:
        return await _write_config(s, request, runtime_values(s.settings), 0)
    revisions = await _store(s, "config history", s.runtime_config.history)
    target = next((r for r in revisions if r.revision == body.revision), None)
    if target is None:
        raise HTTPException(status_code=404, detail=f"revision {body.revision} does not exist "
                                                    f"(have {[r.revision for r in revisions]})")
    return await _write_config(s, request, target.settings, body.revision)


# ---- audit, history ---------------------------------------------------------------------------
@router.get("/audit", response_model=Audit, responses={503: {"description": "Object store down"}})
async def audit(s: State, limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> Audit:
    """Operator and automatic actions, newest last: time, actor, parameters, outcome. Append-only."""
    entries = await _store(s, "audit", s.audit.entries, limit)
    return Audit(entries=[AuditEntryView(**asdict(e)) for e in entries])


@router.get("/status/history")
async def status_history(s: State) -> dict[str, Any]:
    """Compact status samples (one per ``admin.refresh_interval_s``, the last hour) for the curves."""
    return {"points": list(s.history)}


@router.get("/trace/{sample_id}", responses={404: {"description": "Not found, or the logs are not reachable"}})
async def trace(s: State, sample_id: str) -> dict[str, Any]:
    """One sample's path: produced by which sampler on which version into which partition and offset,
    consumed, trained in which update (or dropped as stale, or dead-lettered and why), from the
    services' log files (``admin.log_dir``; the local stack sets it). Elsewhere use the CLI on piped
    logs: ``docker compose logs --no-color | flywheel trace ID -``."""
    from services.admin.trace import log_lines, trace_json

    log_dir = s.settings.admin.log_dir
    if log_dir is None or not log_dir.is_dir():
        raise HTTPException(status_code=404, detail="the services' logs are not reachable from the admin "
                            "(admin.log_dir unset); use: docker compose logs --no-color | flywheel trace ID -")
    if not sample_id.isalnum() or len(sample_id) > 64:
        raise HTTPException(status_code=422, detail="sample_id: expected the hex id from the logs")
    result: dict[str, Any] = await asyncio.to_thread(lambda: trace_json(sample_id, log_lines(log_dir)))
    if not result.get("found"):
        raise HTTPException(status_code=404, detail=f"sample {sample_id} is not in the logs under {log_dir}")
    return result

