"""How ``flywheel`` shows the admin API's answers: plain text, coloured only on a terminal.

Every function takes the decoded JSON as the API returns it (docs/api.md) and tolerates missing
fields (an older server), and ``now`` for the "ago" columns so that tests can fix the clock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, TextIO

from services.admin.trace import TraceStep, describe


class Style:
    """ANSI colours, or nothing at all (``color=False``: pipes, files, ``NO_COLOR``, ``TERM=dumb``)."""

    def __init__(self, color: bool = False) -> None:
        self.color = color

    @classmethod
    def for_stream(cls, stream: TextIO) -> Style:
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(tty and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb")

    def _paint(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def bad(self, text: str) -> str:
        return self._paint("1;31", text)

    def warn(self, text: str) -> str:
        return self._paint("33", text)

    def good(self, text: str) -> str:
        return self._paint("32", text)

    def bold(self, text: str) -> str:
        return self._paint("1", text)

    def dim(self, text: str) -> str:
        return self._paint("2", text)


PLAIN = Style(False)


def fmt(x: Any, spec: str = ".3g") -> str:
    """A number in ``spec``, or ``-`` for null."""
    if x is None:
        return "-"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "never"
    d = max(0.0, (time.time() if now is None else now) - ts)
    if d < 120:
        return f"{d:.1f}s ago"
    if d < 7200:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago" if d < 172800 else f"{d / 86400:.1f}d ago"


def when(ts: float | None, ms: bool = False) -> str:
    """A Unix time as local date and time (``-`` for null)."""
    if ts is None:
        return "-"
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    return f"{text}.{int(ts * 1000) % 1000:03d}" if ms else text


def value(v: Any) -> str:
    """A setting's value as JSON (strings quoted), so that ``config set`` reads it back unchanged."""
    return json.dumps(v)


# ---- status ------------------------------------------------------------------------------------
def render_status(s: dict[str, Any], now: float | None = None, style: Style = PLAIN) -> str:
    """``GET /status`` in words: one line per part, samplers and services below their headings."""
    p, t, b = s.get("policy") or {}, s.get("trainer") or {}, s.get("backlog") or {}
    sy, st, er = s.get("sync") or {}, s.get("staleness") or {}, s.get("episode_return") or {}
    samplers = s.get("samplers") or []
    alive = style.good("alive") if t.get("alive") else style.bad("DOWN")
    lines = [
        f"run        {s.get('run', '-')}",
        f"policy     v{fmt(p.get('version'), 'd')}  sha256 {(p.get('sha256') or '-')[:12]}"
        f"  published {ago(p.get('published_at'), now)}",
        f"trainer    {alive}  updates {t.get('updates', 0)}  weights v{fmt(t.get('policy_version'), 'd')}"
        f"  {fmt(t.get('samples_per_s') or 0.0, '.0f')} steps/s  {t.get('samples_trained', 0)} steps trained"
        f"  last update {ago(t.get('last_update_at'), now)}",
    ]
    compute = t.get("compute") or {}
    if compute:
        busy = t.get("learner_busy_fraction")
        lines.append(f"           {compute.get('precision', '-')}, {compute.get('threads', '-')} thread(s) on "
                     f"{compute.get('device', '-')}" + (f" (CPUs {compute['cpus']})" if compute.get("cpus") else "")
                     + (f", learner busy {busy:.0%} of the last minute" if busy is not None else "")
                     + f" ({compute.get('precision_reason', '')})")
    if t.get("records_lost"):
        lines.append(f"           {style.bad('LOST')} {t['records_lost']} record(s) left the log before training, "
                     f"partitions {', '.join(str(p) for p in t.get('records_lost_partitions') or [])} "
                     "(flywheel verify names them)")
    stalled = t.get("stalled")
    if stalled:
        since = f" since {ago(stalled.get('since'), now)}" if stalled.get("since") is not None else ""
        lines.append(f"           {style.bad('STALLED')}{since}: {stalled.get('reason', '')}")
    n_alive = sum(1 for x in samplers if x.get("alive"))
    n_paused = sum(1 for x in samplers if x.get("paused"))
    lines.append(f"samplers   {n_alive} alive" + (f", {n_paused} paused" if n_paused else "")
                 + (f" of {len(samplers)}" if len(samplers) != n_alive else ""))
    width = max([len(str(x.get("id", ""))) for x in samplers] + [10])
    for x in samplers:
        if not x.get("alive"):
            state = style.bad("gone  ")
        else:
            state = style.warn("paused") if x.get("paused") else style.good("alive ")
        paused = f"  paused {ago(x['paused_since'], now)}" if x.get("paused") and x.get("paused_since") else ""
        lines.append(f"  {x.get('id', '?'):<{width}}  {state}  v{fmt(x.get('policy_version'), 'd'):<5}"
                     f" {fmt(x.get('steps_per_s') or 0.0, '.0f'):>6} steps/s  seen {ago(x.get('last_seen'), now)}"
                     f"{paused}")
    per = b.get("per_partition") or {}
    parts = ", ".join(f"p{k} {v}" for k, v in sorted(per.items(), key=lambda kv: int(kv[0])
                                                     if str(kv[0]).isdigit() else 0))
    lines += [
        f"backlog    {fmt(b.get('records'), 'd')} records" + (f"  ({parts})" if parts else ""),
        f"sync       p50 {fmt(sy.get('latency_p50_s'))}s  p95 {fmt(sy.get('latency_p95_s'))}s",
        f"staleness  mean {fmt(st.get('mean'))}  p95 {fmt(st.get('p95'))}  max {fmt(st.get('max'), 'd')} versions"
        f"  dropped {fmt(st.get('dropped_fraction'), '.1%')}",
        f"return     mean {fmt(er.get('mean'), '.1f')} over {er.get('count', 0)} episodes",
    ]
    services = s.get("services") or {}
    if services:
        lines.append("services")
        width = max(len(k) for k in services)
        for name, h in services.items():
            state = str(h.get("state", "unknown"))
            painted = style.good(state) if state == "ok" else style.warn(state) if state == "degraded" else \
                style.bad(state)
            restarts = h.get("restarts", 0)
            lines.append(f"  {name:<{width}}  {painted}{' ' * max(2, 10 - len(state))}"
                         f"{restarts} restart{'' if restarts == 1 else 's'}")
            lines += [f"    {dep}: {why}" for dep, why in sorted((h.get("reasons") or {}).items())]
    off = (s.get("security") or {}).get("protections_off") or []
    if off:
        lines.append(f"security   {style.warn(f'{len(off)} protection(s) off')} (the admin's settings; each service "
                     "logs its own as protection_off)")
        lines += [f"  {o.get('setting', '?')}: {o.get('leaves', '')}" for o in off]
    return "\n".join(lines)


# ---- actions -----------------------------------------------------------------------------------
def render_sync(body: dict[str, Any]) -> str:
    state = {True: "all live samplers on it", False: "NOT all samplers reached it in time", None: "requested"}
    lines = [f"sync to version {body.get('policy_version')}: {state.get(body.get('synced'), '?')}"
             f" ({body.get('waited_s')} s)"]
    lines += [f"  {sid}: v{fmt(v, 'd')}" for sid, v in sorted((body.get("samplers") or {}).items())]
    return "\n".join(lines)


KEEPS_SENDING = "admin keeps sending the command until Kafka takes it (flywheel audit shows when: command_sent)"


def pending(body: dict[str, Any], then: str) -> str:
    """A stored command's ``pending`` answer in words: why, then what happens next."""
    return f"pending: {body.get('reason') or 'not applied yet'}; {then}"


def render_pause(body: dict[str, Any]) -> str:
    who = f"sampler {body['sampler']}" if body.get("sampler") else "every sampler"
    text = f"{body.get('action', '?')} requested for {who} (request {body.get('request_id')})"
    if body.get("status") == "pending":
        text += ": " + pending(body, f"samplers apply it from the store at their next poll; {KEEPS_SENDING}")
    return text


def render_rollback(body: dict[str, Any]) -> str:
    new = body.get("new_version")
    if body.get("status") == "pending" or new is None:
        then = pending(body, "paramsync applies it when it runs (flywheel versions lists pending rollbacks)")
    else:
        then = f"published as v{new}"
    return f"rollback to v{body.get('version')} requested (request {body.get('request_id')}): {then}"


def render_versions(body: dict[str, Any]) -> str:
    """``GET /policy/versions``: newest first, ``*`` on the current one."""
    current = body.get("current")
    versions = sorted(body.get("versions") or [], key=lambda v: -int(v.get("version") or 0))
    if not versions:
        return "no policy has been published yet"
    lines = [f"  {'version':>7}  {'published':<19}  {'step':>7}  {'sha256':<12}  {'return':>7}"]
    for v in versions:
        mark = "*" if v.get("version") == current else " "
        note = f"  rollback of v{v['rollback_of']}" if v.get("rollback_of") is not None else ""
        lines.append(f"{mark} {fmt(v.get('version'), 'd'):>7}  {when(v.get('published_at')):<19}"
                     f"  {fmt(v.get('trainer_step'), 'd'):>7}  {(v.get('sha256') or '-')[:12]:<12}"
                     f"  {fmt(v.get('return_mean'), '.1f'):>7}{note}")
    for p in body.get("pending_rollbacks") or []:
        lines.append(f"  pending rollback to v{p.get('version')} (request {p.get('request_id')}, "
                     f"requested {when(p.get('requested_at'))})")
    return "\n".join(lines)


# ---- config ------------------------------------------------------------------------------------
def render_config(body: dict[str, Any]) -> str:
    """``GET /config``: the revision, then ``key = value`` (values as JSON)."""
    by = f" by {body['actor']}" if body.get("actor") else ""
    at = f" at {when(body['at'])}" if body.get("at") is not None else ""
    settings = body.get("settings") or {}
    width = max([len(k) for k in settings] + [1])
    return "\n".join([f"revision {body.get('revision')}{at}{by}"]
                     + [f"  {k:<{width}} = {value(v)}" for k, v in sorted(settings.items())])


def changes_text(changes: dict[str, Any]) -> list[str]:
    return [f"{k}: {value((c or {}).get('old'))} -> {value((c or {}).get('new'))}" for k, c in sorted(changes.items())]


def render_config_change(body: dict[str, Any]) -> str:
    """The answer of ``PATCH /config`` and ``POST /config/revert``."""
    changes = changes_text(body.get("changes") or {})
    head = f"revision {body.get('revision')}" + ("" if changes else ": nothing changed")
    lines = [head] + [f"  {c}" for c in changes]
    if body.get("status") == "pending":
        lines.append(pending(body, f"the services apply revision {body.get('revision')} at their next poll of the "
                                   f"store; {KEEPS_SENDING}"))
    return "\n".join(lines)


def render_config_history(body: dict[str, Any]) -> str:
    revisions = body.get("revisions") or []
    if not revisions:
        return "no revisions"
    lines = []
    for r in revisions:
        head = f"r{r.get('revision')}  {when(r.get('at'))}  {r.get('actor') or '-'}"
        if r.get("reverted_from") is not None:
            head += f"  (revert to r{r['reverted_from']})"
        changes = changes_text(r.get("changes") or {})
        lines.append(head + (f"  {changes[0]}" if len(changes) == 1 else "" if changes else "  (no change)"))
        if len(changes) > 1:
            lines += [f"    {c}" for c in changes]
    return "\n".join(lines)


def render_audit(body: dict[str, Any]) -> str:
    entries = body.get("entries") or []
    if not entries:
        return "no audit entries"
    width = max([len(str(e.get("actor") or "-")) for e in entries] + [5])
    awidth = max([len(str(e.get("action") or "-")) for e in entries] + [6])
    lines = []
    for e in entries:
        params = " ".join(f"{k}={value(v)}" for k, v in (e.get("params") or {}).items())
        lines.append(f"{when(e.get('at'))}  {str(e.get('actor') or '-'):<{width}}  {str(e.get('action')):<{awidth}}"
                     f"  {e.get('outcome') or '-'}" + (f"  {params}" if params else ""))
    return "\n".join(lines)


# ---- trace -------------------------------------------------------------------------------------
def render_trace(sample_id: str, steps: list[TraceStep], outcome: str | None, style: Style = PLAIN) -> str:
    """A sample's timeline: local time, seconds since it was produced, the process, what happened."""
    t0 = next((s.at for s in steps if s.at is not None), None)
    width = max([len(s.who) for s in steps] + [7])
    lines = [style.bold(f"sample {sample_id}: {(outcome or 'no outcome yet').replace('_', ' ')}")]
    for s in steps:
        rel = f"+{s.at - t0:.3f}s" if s.at is not None and t0 is not None else ""
        text = describe(s)
        if s.kind == "restart":
            lines.append(style.warn(f"---- {when(s.at, ms=True)}  {text} ----"))
            continue
        if s.kind == "dead_lettered":
            text = style.bad(text)
        elif s.kind == "dropped_stale":
            text = style.warn(text)
        lines.append(f"{when(s.at, ms=True):<23}  {rel:>9}  {s.who:<{width}}  {text}")
    return "\n".join(lines)
