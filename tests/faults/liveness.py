"""Liveness after a fault: every live, unpaused sampler produces again within a bound after the heal.

Training advancing (the policy version moving) does not show that every sampler came back: one sampler alone can
keep the trainer fed while another waits forever (for credits, a broker, a policy). :class:`SamplersBack` reads each
sampler's own ``/healthz`` (``fragments``: fragments Kafka acknowledged since the process started; ``reasons``: why
it is degraded) from the heal on, every ``POLL_S``, in a thread of its own (so the row's other waits run meanwhile),
and :meth:`SamplersBack.result` gives each sampler's seconds from the heal to the first read whose count differs from
its first read after the heal (a restarted process counts from 0 again: any other non-zero count is a fragment
acknowledged since), or fails naming the samplers that did not and what their ``/healthz`` said.

Samplers a row paused are left out by name (``paused=``) and the report says so; a row where no sampler should
produce says why with :func:`not_applicable`. Used by the fault suite (``tests/faults``, after every row's heal) and
by the partition suite and the soak (``tests/hosts``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

BOUND_S = 60.0
"""Default bound from the heal to a sampler's first acknowledged fragment (generous: a sampler needs a credit grant
from the trainer and a connection to a broker; a healthy one produces every few tenths of a second)."""
POLL_S = 0.5

PAGE_TEXT = (
    "*samplers back*: seconds from the heal (the dependency back, the killed process answering `/healthz`, the cut "
    "healed) until each live sampler's own `/healthz` count of fragments acknowledged by Kafka rose (read every "
    f"{POLL_S:g} s; `tests/faults/liveness.py`): every live sampler must produce again within {BOUND_S:.0f} s, or "
    "the row fails naming it with its `/healthz` reasons. A sampler the row paused is excluded and named so; "
    "*n/a* says why a row has no such check."
)
"""The column's explanation, for every page that shows it."""


@dataclass
class Back:
    """What :meth:`SamplersBack.result` found."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Each sampler that produced again: seconds from the heal."""
    late: dict[str, str] = field(default_factory=dict)
    """Each sampler that did not within the bound: what its ``/healthz`` said last."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Samplers left out by the row, with why (paused)."""
    bound_s: float = BOUND_S

    @property
    def ok(self) -> bool:
        return not self.late

    def cell(self) -> str:
        """``sampler-0 3.1, sampler-1 2.4``, then the ones not back and the ones left out, each named."""
        parts = [f"{name} {s:.1f}" for name, s in sorted(self.seconds.items())]
        parts += [f"{name} NOT back within {self.bound_s:.0f} s ({why})" for name, why in sorted(self.late.items())]
        parts += [f"{name} {why} (excluded)" for name, why in sorted(self.excluded.items())]
        return ", ".join(parts) or "-"

    def worst(self, other: Back) -> Back:
        """Per sampler the longer of two measurements (rows with several faults report each sampler's worst)."""
        out = Back(dict(self.seconds), {**self.late, **other.late}, {**self.excluded, **other.excluded},
                   max(self.bound_s, other.bound_s))
        for name, s in other.seconds.items():
            out.seconds[name] = max(s, out.seconds.get(name, 0.0))
        for name in out.late:
            out.seconds.pop(name, None)
        return out


def not_applicable(why: str) -> str:
    """The cell of a row without the check, saying why (never silently missing)."""
    return f"n/a: {why}"


def read_healthz(url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """A sampler's ``/healthz`` JSON, or ``{"error": ...}`` when it does not answer."""
    try:
        r = httpx.get(url, timeout=timeout_s)
        body: dict[str, Any] = r.json()
        return body
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def describe(body: dict[str, Any]) -> str:
    """What a ``/healthz`` answer says about a sampler that is not producing."""
    if "error" in body:
        return f"/healthz did not answer: {body['error']}"
    reasons = "; ".join(f"{k}: {v}" for k, v in (body.get("reasons") or {}).items())
    return (f"/healthz {body.get('state', '?')}, fragments {body.get('fragments')}"
            + (f", reasons: {reasons[:300]}" if reasons else ", no reasons"))


class SamplersBack(threading.Thread):
    """Started at the heal: watches each sampler's ``/healthz`` (``urls``: name -> URL) until every one not in
    ``paused`` produced again. :meth:`result` waits for that within ``bound_s`` of the heal."""

    def __init__(self, urls: Mapping[str, str], *, paused: Mapping[str, str] | Iterable[str] = (),
                 bound_s: float = BOUND_S) -> None:
        super().__init__(name="samplers-back", daemon=True)
        excluded = dict(paused) if isinstance(paused, Mapping) else {n: "paused by the row" for n in paused}
        unknown = set(excluded) - set(urls)
        assert not unknown, f"paused samplers {sorted(unknown)} are not among {sorted(urls)}"
        self.urls = {n: u for n, u in urls.items() if n not in excluded}
        self.excluded = excluded
        self.bound_s = bound_s
        self.healed = time.monotonic()
        self.first: dict[str, int] = {}
        self.back: dict[str, float] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.is_set() and time.monotonic() - self.healed <= self.bound_s:
            for name, url in self.urls.items():
                if name in self.back:
                    continue
                body = read_healthz(url)
                at = time.monotonic() - self.healed
                with self._lock:
                    self.last[name] = body
                    count = body.get("fragments")
                    if not isinstance(count, int):
                        continue
                    if name not in self.first:
                        self.first[name] = count
                    elif count != self.first[name] and count > 0:
                        self.back[name] = at
            with self._lock:
                if len(self.back) == len(self.urls):
                    return
            self._done.wait(POLL_S)

    def result(self) -> Back:
        """Each sampler's seconds to its first fragment after the heal, waiting until every one produced or
        ``bound_s`` from the heal passed (the thread stops then)."""
        self.join(max(0.0, self.healed + self.bound_s - time.monotonic()))
        self._done.set()
        self.join(10)
        with self._lock:
            late = {n: describe(self.last.get(n) or {"error": "never read"}) for n in self.urls if n not in self.back}
            return Back({n: round(s, 1) for n, s in self.back.items()}, late, dict(self.excluded), self.bound_s)


def assert_back(back: Back, row: str) -> None:
    """Fail the row when a live, unpaused sampler did not produce within the bound, naming it and its reasons."""
    assert back.ok, (f"{row}: sampler(s) {', '.join(sorted(back.late))} did not produce within {back.bound_s:.0f} s "
                     f"of the heal: {back.cell()}")
