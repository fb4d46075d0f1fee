"""Operator actions: pause and resume samplers, policy versions and rollback, runtime settings with
revisions, the audit trail, status history. Every mutation needs an operator's bearer token, is validated
(4xx with the reason, never a 5xx for bad input), and is recorded in the append-only audit trail
(``<run>/audit/`` in the object store) with its actor (the operator's name), parameters and outcome. ``router``
holds the mutations, ``reads`` the read endpoints: the app includes it behind a token unless ``admin.public_reads``."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, HTTPException, Path, Query, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from services.admin.config_body import body_schema, check_types
from services.admin.deps import AUTH_RESPONSES, State, actor, require_token
from services.admin.outbox import ACK_WAIT_S, CommandOutbox
from services.admin.rollbacks import new_request_id
from services.admin.state import AdminState
from shared.marker import VersionRecord
from shared.messages import ControlCommand
from shared.retry import is_transient
from shared.runtime import PauseStateConflict, apply_runtime, runtime_values, update_paused
from shared.settings import ConfigError

router = APIRouter()
"""The mutations: each needs an operator's token (``require_token``)."""
reads = APIRouter()
"""The read endpoints: behind ``require_reader`` unless ``admin.public_reads`` (``create_app``)."""
AUTH: dict[int | str, dict[str, Any]] = AUTH_RESPONSES
ROLLBACK_WAIT_S = 5.0
"""How long ``POST /policy/rollback`` waits for paramsync to apply the request before answering pending."""


def integral(value: Any) -> Any:
    """JSON has one kind of number: ``3.0`` is the integer 3, as JSON Schema's ``integer`` says (schemathesis
    sent ``{"revision": 71452.0}``, valid by the schema, and got a 422). ``3.5``, ``"3"`` and ``true`` are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeNumber = Annotated[int, BeforeValidator(integral)]
"""An ``integer`` in the schema: a JSON number without a fractional part, never a string or a boolean."""


class _Body(BaseModel):
    # strict: JSON's true is not the revision 1 nor "3" the version 3 (schemathesis found `{"revision": false}`
    # accepted); an unknown field is an error, not ignored. Integer fields are WholeNumber (3.0 is 3).
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplerTarget(_Body):
    sampler: str | None = Field(None, description="One sampler's id; omitted or null: every sampler")


class PauseAccepted(BaseModel):
    request_id: str
    action: str
    sampler: str | None
    status: Literal["sent", "pending"] = Field(
        "sent", description="sent: stored, and Kafka acknowledged the control command; pending: stored, but Kafka did "
                            "not acknowledge the command in time (reason says what was seen): admin keeps sending it, "
                            "and samplers apply the stored state at their next poll of the store "
                            "(sampler.sync_interval_s); the audit trail says when it is sent (command_sent)")
    reason: str | None = Field(None, description="With status pending: why")
    command_sent: bool = Field(True, description="False: not acknowledged by Kafka in time (status pending)")


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
    pending_rollbacks: list[PendingRollback] = Field(
        default_factory=list, description="Rollback requests paramsync has not applied yet, oldest first")


class RollbackRequest(_Body):
    version: WholeNumber = Field(ge=0, description="A kept version whose weights become the newest version")


class RollbackAccepted(BaseModel):
    request_id: str = Field(description="Names the stored request, <run>/ops/rollback/<request_id>.json")
    version: int
    status: Literal["applied", "pending"] = Field(
        description="applied: paramsync published it as new_version; pending: not applied within the wait "
                    "(paramsync down or busy); the stored request is applied when paramsync runs")
    new_version: int | None = Field(description="The version that now carries its weights (null: pending)")
    reason: str | None = Field(None, description="With status pending: why (paramsync not running / not answering; "
                                                 "and when the control command was not acknowledged, what Kafka did)")
    command_sent: bool = Field(True, description="False: Kafka did not acknowledge the control command within the "
                                                 "wait; admin keeps sending it, and paramsync finds the request in "
                                                 "the store at its next poll")


class PendingRollback(BaseModel):
    request_id: str
    version: int
    requested_at: float


class ConfigView(BaseModel):
    revision: int = Field(description="0: the config file as the services started with it")
    settings: dict[str, Any]
    at: float | None
    actor: str | None


class ConfigChange(BaseModel):
    revision: int
    settings: dict[str, Any]
    changes: dict[str, dict[str, Any]]
    request_id: str | None = Field(None, description="The control command announcing the revision")
    status: Literal["sent", "pending"] = Field(
        "sent", description="sent (200): stored, and Kafka acknowledged the control command; pending (202): stored, "
                            "but Kafka did not acknowledge it in time (reason): admin keeps sending it, and the "
                            "services apply the revision at their next poll of the store")
    reason: str | None = Field(None, description="With status pending: why")
    command_sent: bool = Field(True, description="False: not acknowledged by Kafka in time (status pending)")


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
    revision: WholeNumber = Field(ge=0, description="0: the values of the config file the services started with")


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
    await s.append_audit(actor(request), action, params, outcome)


_outboxes: weakref.WeakKeyDictionary[AdminState, CommandOutbox] = weakref.WeakKeyDictionary()


def outbox(s: AdminState) -> CommandOutbox:
    """The admin's one :class:`CommandOutbox`: its sender is a background task of the admin (cancelled at stop),
    its late outcomes are audited by ``admin``."""
    box = _outboxes.get(s)
    if box is None:
        async def audit(action: str, params: dict[str, Any], outcome: str) -> None:
            await s.append_audit("admin", action, params, outcome)

        box = _outboxes[s] = CommandOutbox(s.command, audit, lambda name, job: s.background.start(name, job, once=True),
                                           s.log, kafka_health=lambda: s.health_state.reasons.get("kafka"))
    return box


def _announced(cmd: ControlCommand, request: Request, **params: Any) -> dict[str, Any]:
    """What the audit entries of a command sent (or given up) after the request answered name: the request."""
    return {"command": cmd.command, "request_id": cmd.request_id, "requested_by": actor(request), **params}


# ---- pause / resume -------------------------------------------------------------------------
class _AllPaused(Exception):
    """Resuming one sampler while every sampler is paused: refused (409)."""


async def _pause_resume(s: State, request: Request, action: str, target: SamplerTarget) -> PauseAccepted:
    sid = target.sampler
    if sid is not None and sid not in s.view.samplers:
        raise HTTPException(status_code=404, detail=f"unknown sampler {sid!r}; known: {sorted(s.view.samplers)}")
    now = time.time()

    def change(state: dict[str, Any]) -> dict[str, Any]:
        """The new pause state from the current one (run again if another writer won the race)."""
        if action == "pause":
            if sid is None:
                state["all"] = state.get("all") or now
            else:
                state["samplers"].setdefault(sid, now)
        elif sid is None:
            state = {"all": None, "samplers": {}}
        elif state.get("all"):
            raise _AllPaused
        else:
            state["samplers"].pop(sid, None)
        return state

    try:
        await _store(s, f"{action} state", update_paused, s.store, s.settings.run, change)
    except _AllPaused:
        raise HTTPException(status_code=409, detail="every sampler is paused: resume all (no sampler) first, "
                                                    "then pause the ones to keep paused") from None
    except PauseStateConflict as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    cmd = ControlCommand(command=action, request_id=uuid.uuid4().hex, sampler=sid,
                         issued_at=now)
    # stored: samplers apply it from the store at their next poll even if Kafka never takes the command
    pending = await outbox(s).deliver(cmd, _announced(cmd, request, sampler=sid))
    await _audit(s, request, action, {"sampler": sid, "request_id": cmd.request_id},
                 "sent" if pending is None else f"pending: {pending}")
    return PauseAccepted(request_id=cmd.request_id, action=action, sampler=sid,
                         status="sent" if pending is None else "pending", reason=pending, command_sent=pending is None)


@router.post("/samplers/pause", response_model=PauseAccepted, status_code=202, dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Unknown sampler"},
                        503: {"description": "Object store down: the state could not be stored"}})
async def pause(s: State, request: Request,
                target: Annotated[SamplerTarget | None, Body()] = None) -> PauseAccepted:
    """Pause every sampler, or one: it produces nothing within a second, keeps its envs and policy, and
    stays paused across restarts (``<run>/ops/paused.json``). The trainer drains what is queued. The state is
    stored first; when Kafka does not acknowledge the control command within ``ACK_WAIT_S`` the answer says
    ``pending`` and why, and admin keeps sending it (audited as ``command_sent`` when it goes)."""
    return await _pause_resume(s, request, "pause", target or SamplerTarget())


@router.post("/samplers/resume", response_model=PauseAccepted, status_code=202,
             dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Unknown sampler"},
                        503: {"description": "Object store down: the state could not be stored"}})
async def resume(s: State, request: Request,
                 target: Annotated[SamplerTarget | None, Body()] = None) -> PauseAccepted:
    """Resume every sampler (clears every pause), or one."""
    return await _pause_resume(s, request, "resume", target or SamplerTarget())


# ---- versions and rollback ------------------------------------------------------------------
@reads.get("/policy/versions", response_model=Versions, responses={503: {"description": "Object store down"}})
async def versions(s: State) -> Versions:
    records: list[VersionRecord] = await _store(s, "history", s.policies.records)
    pending: list[dict[str, Any]] = await _store(s, "rollback requests", s.rollbacks.pending)
    current = await s.published()
    return Versions(current=current.version if current else None,
                    pending_rollbacks=[PendingRollback(**p) for p in pending], versions=[
        VersionInfo(version=r.version, sha256=r.sha256, published_at=r.created_at, trainer_step=r.trainer_step,
                    rollback_of=r.extra.get("rollback_of"), return_mean=s.version_returns.get(r.version))
        for r in records])


@router.post("/policy/rollback", response_model=RollbackAccepted, status_code=202,
             dependencies=[Depends(require_token)],
             responses={**AUTH, 404: {"description": "Version not kept"},
                        409: {"description": "Already current, or refused by paramsync (the reason is in detail)"},
                        503: {"description": "Object store down: the request could not be stored"}})
async def rollback(s: State, request: Request, body: RollbackRequest) -> RollbackAccepted:
    """Make ``version``'s weights the newest version (versions never go backwards; its record says
    ``rollback_of``). paramsync republishes them, samplers act on them within a second, and the trainer
    continues from them with a fresh optimizer; fragments of the abandoned versions are dropped as
    stale, and candidates trained from the abandoned weights are refused. The request is stored
    (``<run>/ops/rollback/<request_id>.json``, ``pending``) before the command is sent, so paramsync applies
    it even if it is down now, or Kafka is; the reply waits up to ``ROLLBACK_WAIT_S`` for the outcome and
    otherwise says ``pending`` and why (a control command Kafka has not acknowledged is sent on in the background,
    audited as ``command_sent``). See docs/api.md."""
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
    request_id = new_request_id()
    await _store(s, "rollback request", s.rollbacks.create, request_id, body.version, actor(request))
    cmd = ControlCommand(command="rollback", request_id=request_id, version=body.version)
    # stored: paramsync finds it at its next poll of the store even if Kafka never takes the command
    sending = outbox(s).submit(cmd, _announced(cmd, request, version=body.version))
    decided: dict[str, Any] | None = None
    asked = time.monotonic()
    deadline = asked + ROLLBACK_WAIT_S
    while time.monotonic() < deadline:
        try:
            got = await asyncio.to_thread(s.rollbacks.get, request_id)
        except Exception as exc:  # a blip while waiting: the request is stored, keep waiting
            if not is_transient(exc):
                raise
            got = None
        if got is not None and got.get("status") != "pending":
            decided = got
            break
        await asyncio.sleep(0.1)
    await outbox(s).wait(sending, asked + ACK_WAIT_S - time.monotonic())  # paramsync may decide before the ack
    unsent = outbox(s).settle(sending)
    sent = unsent is None
    params = {"version": body.version, "request_id": request_id}
    if decided is not None and decided.get("status") == "refused":
        await _audit(s, request, "rollback", params, f"refused by paramsync: {decided.get('reason')}")
        raise HTTPException(status_code=409, detail=f"rollback to version {body.version} refused by paramsync: "
                                                    f"{decided.get('reason')}")
    if decided is not None:
        new_version = int(decided["new_version"])
        await _audit(s, request, "rollback", params, f"published as version {new_version}")
        return RollbackAccepted(request_id=request_id, version=body.version, status="applied",
                                new_version=new_version, command_sent=sent)
    reason = "paramsync not answering" if s.alive(s.view.paramsync, time.time()) else "paramsync not running"
    if unsent is not None:
        reason += f"; {unsent}"
    await _audit(s, request, "rollback", params, f"pending: {reason}; applied when paramsync runs")
    return RollbackAccepted(request_id=request_id, version=body.version, status="pending", new_version=None,
                            reason=reason, command_sent=sent)


# ---- runtime settings ---------------------------------------------------------------------
@reads.get("/config", response_model=ConfigView, responses={503: {"description": "Object store down"}})
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


async def _write_config(s: State, request: Request, response: Response, values: dict[str, Any],
                        reverted_from: int | None) -> ConfigChange:
    try:
        rev = await _store(s, "config", s.runtime_config.write, s.settings, values, actor(request), reverted_from)
    except ConfigError as exc:  # each value matches its schema; together with the other settings they do not
        raise HTTPException(status_code=409, detail=f"conflicts with the other settings: {exc}") from None
    cmd = ControlCommand(command="config", request_id=uuid.uuid4().hex, version=rev.revision)
    # stored: the services pick the revision up by polling even if Kafka never takes the command
    pending = await outbox(s).deliver(cmd, _announced(cmd, request, revision=rev.revision))
    action = "config_revert" if reverted_from is not None else "config_change"
    params: dict[str, Any] = {"changes": rev.changes}
    if reverted_from is not None:
        params["revision"] = reverted_from
    params["request_id"] = cmd.request_id
    await _audit(s, request, action, params,
                 f"revision {rev.revision}" + ("" if pending is None else f"; pending: {pending}"))
    if pending is not None:
        response.status_code = 202
    # The revision stores the operators' overrides only; the response shows them applied on admin's settings.
    return ConfigChange(revision=rev.revision, settings=runtime_values(apply_runtime(s.settings, rev.settings)),
                        changes=rev.changes, request_id=cmd.request_id, status="sent" if pending is None else "pending",
                        reason=pending, command_sent=pending is None)


CONFIG_PENDING: dict[int | str, dict[str, Any]] = {202: {
    "model": ConfigChange, "description": "Stored, but Kafka did not acknowledge the control command within "
                                          "ACK_WAIT_S: status pending, with the reason"}}


@router.patch("/config", response_model=ConfigChange, dependencies=[Depends(require_token)],
              responses={**AUTH, **CONFIG_PENDING,
                         422: {"description": "A key is not a runtime setting, or a value does not match its "
                                                 "schema (names it)"},
                         409: {"description": "The values together with the other settings do not validate "
                                            "(e.g. trainer.guard.drop not above trainer.guard.hold_tolerance)"},
                         503: {"description": "Object store down"}})
async def patch_config(s: State, request: Request, response: Response,
                       values: Annotated[dict[str, Any], Body(min_length=1, description="At least one setting",
                                                              examples=[{"trainer.learning_rate": 0.0005}],
                                                              json_schema_extra=body_schema())]
                       ) -> ConfigChange:
    """Change runtime settings, validated like the config file; the services apply the new revision
    within a few seconds. Keys: sampler.max_backlog, sampler.sync_interval_s, trainer.learning_rate,
    trainer.learning_rate_end, trainer.clip_coef_end, trainer.max_staleness, trainer.target_kl, trainer.publish_every,
    trainer.flow_window, trainer.guard.* (``shared.runtime.RUNTIME_KEYS``); each typed in the schema."""
    try:
        typed = check_types(values)
    except ConfigError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    return await _write_config(s, request, response, typed, None)


@reads.get("/config/history", response_model=ConfigHistory, responses={503: {"description": "Object store down"}})
async def config_history(s: State) -> ConfigHistory:
    revisions = await _store(s, "config history", s.runtime_config.history)
    return ConfigHistory(revisions=[RevisionInfo(**asdict(r)) for r in revisions])


@router.post("/config/revert", response_model=ConfigChange, dependencies=[Depends(require_token)],
             responses={**AUTH, **CONFIG_PENDING, 404: {"description": "No such revision"},
                        409: {"description": "The revision does not validate with the current settings"},
                        503: {"description": "Object store down"}})
async def config_revert(s: State, request: Request, response: Response, body: RevertRequest) -> ConfigChange:
    """Make revision ``revision``'s settings current again, as a new revision."""
    if body.revision == 0:  # no overrides: every service on its own settings
        return await _write_config(s, request, response, {}, 0)
    revisions = await _store(s, "config history", s.runtime_config.history)
    target = next((r for r in revisions if r.revision == body.revision), None)
    if target is None:
        raise HTTPException(status_code=404, detail=f"revision {body.revision} does not exist "
                                                    f"(have {[r.revision for r in revisions]})")
    return await _write_config(s, request, response, target.overrides(s.settings), body.revision)


# ---- audit, history ---------------------------------------------------------------------------
@reads.get("/audit", response_model=Audit, responses={503: {"description": "Object store down"}})
async def audit(s: State, limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> Audit:
    """Operator and automatic actions, newest last: time, actor, parameters, outcome. Append-only."""
    entries = await _store(s, "audit", s.audit.entries, limit)
    return Audit(entries=[AuditEntryView(**asdict(e)) for e in entries])


@reads.get("/status/history")
async def status_history(s: State) -> dict[str, Any]:
    """Compact status samples (one per ``admin.refresh_interval_s``, the last hour) for the curves."""
    return {"points": list(s.history)}


SAMPLE_ID_PATTERN = "^[0-9A-Za-z._-]{1,128}$"
"""A sample id is 32 hex digits; any id-like token is looked up (a sampler id such as ``sampler-1`` or
``host-41-ab12`` is not found: 404, not 422; schemathesis's stateful phase sent one from ``GET /status``)."""


@reads.get("/trace/{sample_id}", responses={404: {"description": "Not found, or the logs are not reachable"}})
async def trace(s: State, sample_id: Annotated[str, Path(pattern=SAMPLE_ID_PATTERN,
                                                          description="The hex id from the logs")]
                ) -> dict[str, Any]:
    """One sample's path: produced by which sampler on which version into which partition and offset,
    consumed, trained in which update (or dropped as stale, or dead-lettered and why), from the
    services' log files (``admin.log_dir``; the local stack sets it). Elsewhere use the CLI on piped
    logs: ``docker compose logs --no-color | flywheel trace ID -``."""
    from services.admin.trace import log_lines, trace_json

    log_dir = s.settings.admin.log_dir
    if log_dir is None or not log_dir.is_dir():
        raise HTTPException(status_code=404, detail="the services' logs are not reachable from the admin "
                            "(admin.log_dir unset); use: docker compose logs --no-color | flywheel trace ID -")
    result: dict[str, Any] = await asyncio.to_thread(lambda: trace_json(sample_id, log_lines(log_dir)))
    if not result.get("found"):
        raise HTTPException(status_code=404, detail=f"sample {sample_id} is not in the logs under {log_dir}")
    return result

