"""What Prometheus's alerts did during a row of the partition suite: the stack runs Prometheus (in the root
namespace, scraping every part at its own address) with the production rules of ``deploy/prometheus/alerts.yml``,
unchanged; :class:`AlertWatch` polls its ``/api/v1/alerts`` every ~2 s from the cut until the row's checks are done
(after the heal), and says which alerts went pending or firing and when, counted from the cut.

A rule's ``for:`` is often longer than a cut (FlywheelServiceDegraded 5 min, FlywheelServiceDown 1 min): an alert
that was pending and never fired is reported as such, with the ``for:`` it would have needed. Nothing is shortened
for the suite."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from devstack import hosts as mh

PROMETHEUS = "http://127.0.0.1:9090"
"""The stack's Prometheus (``devstack up``'s default port, root namespace)."""
POLL_S = 2.0
PARTS = [*mh.kafka_names(3), "s3", "trainer", "trainer-1", "paramsync", "admin", "sampler-0", "sampler-1"]
BY_ADDRESS = {mh.address(n): n for n in PARTS}
HIDDEN_LABELS = {"alertname", "severity", "job", "stack"}


def prom_get(path: str, base: str = PROMETHEUS, timeout_s: float = 5.0) -> Any | None:
    """``data`` of a Prometheus HTTP API answer, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=timeout_s) as r:  # noqa: S310 (the test stack's)
            body = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return body.get("data") if body.get("status") == "success" else None


def parse_time(stamp: str) -> float | None:
    """An RFC 3339 time of Prometheus's (nanoseconds, ``Z``) as Unix seconds."""
    try:
        head, _, frac = stamp.rstrip("Z").partition(".")
        base = datetime.fromisoformat(head + "+00:00").timestamp()
        return base + (float(f"0.{frac}") if frac else 0.0)
    except ValueError:
        return None


def alert_key(alert: dict[str, Any]) -> str:
    """``FlywheelServiceDown{trainer}``: the alert's name and its telling labels, part addresses as part names."""
    labels = alert.get("labels") or {}
    shown = []
    for k, v in sorted(labels.items()):
        if k in HIDDEN_LABELS:
            continue
        if k == "instance":
            host = str(v).rpartition(":")[0]
            v = BY_ADDRESS.get(host, v)
        shown.append(str(v) if k in ("instance", "service", "topic") else f"{k}={v}")
    return f"{labels.get('alertname', '?')}{{{','.join(shown)}}}" if shown else str(labels.get("alertname", "?"))


def rule_durations(base: str = PROMETHEUS) -> dict[str, float]:
    """Each alerting rule's ``for:`` in seconds, as Prometheus loaded them."""
    data = prom_get("/api/v1/rules?type=alert", base) or {}
    rules = [r for g in data.get("groups") or [] for r in g.get("rules") or []]
    return {str(r["name"]): float(r.get("duration") or 0) for r in rules if r.get("type") == "alerting"}


def _fmt_for(seconds: float) -> str:
    return f"{seconds / 60:g}m" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g}s"


@dataclass
class Seen:
    key: str
    name: str
    pending_s: float | None = None
    """From the cut to when the alert's condition held (Prometheus's ``activeAt``)."""
    firing_s: float | None = None
    """From the cut to the first poll that saw it firing."""
    before_cut: bool = False
    """Already active when the cut began (left from an earlier row): not this row's."""


class AlertWatch:
    """Polls Prometheus's alerts in a thread from :meth:`start` (the cut) to :meth:`stop`; :meth:`summary` says
    what went pending or firing and when, from the cut; :meth:`heal` marks when the cut ended."""

    def __init__(self, base: str = PROMETHEUS) -> None:
        self.base = base
        self.seen: dict[str, Seen] = {}
        self.polls = 0
        self.failed_polls = 0
        self.cut_at = 0.0
        self.healed_s: float | None = None
        self.stopped_s: float | None = None
        self._durations: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> AlertWatch:
        self.cut_at = time.time()
        self._durations = rule_durations(self.base)
        self._poll(first=True)
        self._thread = threading.Thread(target=self._run, name="alert-watch", daemon=True)
        self._thread.start()
        return self

    def heal(self) -> None:
        self.healed_s = time.time() - self.cut_at

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._poll()
        self.stopped_s = time.time() - self.cut_at

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self, first: bool = False) -> None:
        data = prom_get("/api/v1/alerts", self.base)
        self.polls += 1
        if data is None:
            self.failed_polls += 1
            return
        now = time.time()
        for alert in data.get("alerts") or []:
            key = alert_key(alert)
            name = str((alert.get("labels") or {}).get("alertname"))
            s = self.seen.get(key)
            if s is None:
                active = parse_time(str(alert.get("activeAt") or ""))
                s = self.seen[key] = Seen(key, name, before_cut=first or (active is not None and active < self.cut_at))
                s.pending_s = None if active is None else round(active - self.cut_at, 1)
            if alert.get("state") == "firing" and s.firing_s is None:
                s.firing_s = round(now - self.cut_at, 1)

    def new(self) -> list[Seen]:
        """This row's alerts (not active before the cut), in the order their conditions began to hold."""
        return sorted((s for s in self.seen.values() if not s.before_cut), key=lambda s: (s.pending_s or 0, s.key))

    def fired(self, name: str) -> bool:
        return any(s.name == name and s.firing_s is not None for s in self.new())

    def pending(self, name: str) -> bool:
        return any(s.name == name for s in self.new())

    def summary(self) -> str:
        """One cell: ``firing: X after 71 s; pending only: Y after 12 s (for: 5m, not reached)``; the window."""
        heal = f"{self.healed_s:.0f}" if self.healed_s is not None else "?"
        end = f"{self.stopped_s:.0f}" if self.stopped_s is not None else "?"
        window = f"polled 0-{end} s from the cut (heal at {heal} s)"
        if self.polls and self.failed_polls == self.polls:
            return f"Prometheus did not answer ({window})"
        firing: dict[str, list[str]] = {}
        pending: dict[str, list[str]] = {}
        for s in self.new():  # one entry per alert name and time, its label sets together
            after = "" if self.healed_s is None or (s.pending_s or 0) < self.healed_s else " (after the heal)"
            labels = s.key[len(s.name):].strip("{}")
            if s.firing_s is not None:
                firing.setdefault(f"at {s.firing_s:.0f} s{after}|{s.name}", []).append(labels)
            else:
                need = self._durations.get(s.name)
                fr = f"for: {_fmt_for(need)}, not reached" if need is not None else "never fired"
                pending.setdefault(f"from {s.pending_s:.0f} s{after} ({fr})|{s.name}", []).append(labels)
        def entries(found: dict[str, list[str]]) -> str:
            out = []
            for when_name, labels in found.items():
                when, name = when_name.split("|", 1)
                shown = "; ".join(x for x in labels if x)
                out.append(f"{name}{{{shown}}} {when}" if shown else f"{name} {when}")
            return ", ".join(out)

        parts = []
        if firing:
            parts.append("firing: " + entries(firing))
        if pending:
            parts.append("pending only: " + entries(pending))
        if not parts:
            parts.append("none pending or firing")
        earlier = sorted(s.key for s in self.seen.values() if s.before_cut)
        if earlier:
            parts.append("already active at the cut: " + ", ".join(earlier))
        if self.failed_polls:
            parts.append(f"{self.failed_polls} of {self.polls} polls unanswered")
        return "; ".join(parts) + f" ({window})"
