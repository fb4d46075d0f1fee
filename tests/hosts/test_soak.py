"""The soak: partitions and ``kill -9`` at random on the multi-host stack for ``SOAK_MINUTES`` (default 10), then the
partition rows' checks on everything that happened (``make test-soak``; outside CI: ~10 min of faults plus ~3 min to
set up and check; 12.8 min in all at its first run).

A seeded schedule (the seed is printed and written to the report; ``FLYWHEEL_SOAK_SEED`` replays the same sequence of
events, though the timing of a live stack varies) of events, one after another with a few seconds between them:

- *cut*: one part (a trainer rank, a sampler, paramsync, admin, a broker, S3) cut from some of its peers (every
  broker, S3, the other rank, the other brokers, or a random few parts) for 10-40 s with ``iptables`` inside its
  namespace (``devstack hosts cut``), then healed;
- *kill*: ``kill -9`` of one process (a trainer rank, a sampler, paramsync, admin, or a broker); the supervisor
  restarts it (its new pid is waited for);
- *cut + kill*: both at once: a kill of another part in the middle of a cut (never two brokers at once).

Per event: what ``/status`` showed first, how long the killed process took to be back, how long until training and
publishing advanced again, and the lost / trained-twice records whose writes fall in the event's window. After the
schedule everything is healed, training must advance, and the partition rows' checks run on the whole run:
records lost 0, trained twice 0, ``flywheel verify`` ok on a checkpoint after the last event. Prometheus's alerts
(the production rules) are watched over the whole soak. ``docs/reliability-soak.md`` is written from it."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest

from devstack import hosts as mh
from tests.faults.accounting import read_events
from tests.hosts.alerts import AlertWatch
from tests.hosts.conftest import CHECKPOINT_EVERY
from tests.hosts.net import Net, NetRow, not_ok, reaches, run_py
from tests.hosts.report import write_soak

pytestmark = [pytest.mark.soak]

MINUTES = float(os.environ.get("SOAK_MINUTES", "10"))
RECOVER_S = 180.0
"""Bound on training advancing after an event (a rank killed or cut re-forms the group: one rendezvous timeout,
60 s, plus a restart)."""
RESTART_S = 120.0
"""Bound on the supervisor bringing a killed process back."""
S3_PORT = 9000
KILL_WATCH_S = 15.0
"""How long ``/status`` is watched after a kill alone (a dead process shows as down after the heartbeat timeout)."""
RANKS = ["trainer", "trainer-1"]
SAMPLERS = ["sampler-0", "sampler-1"]
BROKERS = mh.kafka_names(3)
SERVICES = [*RANKS, *SAMPLERS, "paramsync", "admin"]
CUTTABLE = [*SERVICES, *BROKERS, "s3"]


# ---- the schedule (pure: a seed gives the same events) ---------------------------------------------------------
@dataclass
class Planned:
    kind: str
    """``cut``, ``kill`` or ``cut+kill``."""
    cut: str | None = None
    peers: list[str] = field(default_factory=list)
    hold_s: float = 0.0
    kill: str | None = None
    kill_after_s: float = 0.0
    """Into the cut, for ``cut+kill``."""
    gap_s: float = 5.0
    """Pause after the event (once training advanced)."""

    def describe(self) -> str:
        out = []
        if self.cut:
            out.append(f"cut {self.cut} from {', '.join(self.peers)} for {self.hold_s:.0f} s")
        if self.kill:
            at = f" {self.kill_after_s:.0f} s into the cut" if self.cut else ""
            out.append(f"kill -9 {self.kill}{at}")
        return "; ".join(out)


def _peers(rng: random.Random, part: str) -> list[str]:
    if part in BROKERS:
        others = [b for b in BROKERS if b != part]
        return rng.choice([others, [*others, *SERVICES], [rng.choice(others)], [*others, *RANKS]])
    options = [list(BROKERS), ["s3"], [*BROKERS, "s3"]]
    if part in RANKS:
        options.append([r for r in RANKS if r != part])
    if part == "s3":
        options = [[*RANKS, "paramsync"], ["paramsync"], list(RANKS)]
    options.append(rng.sample([p for p in CUTTABLE if p != part], rng.randint(1, 3)))
    return rng.choice(options)


def _kill_target(rng: random.Random, avoid: str | None = None) -> str:
    choices = [p for p in [*SERVICES, *SERVICES, *BROKERS] if p != avoid]  # services twice as likely as brokers
    if avoid in BROKERS:
        choices = [p for p in choices if p not in BROKERS]  # never two brokers away at once
    return rng.choice(choices)


def plan(rng: random.Random) -> Planned:
    """The next event of the schedule."""
    kind = rng.choices(["cut", "kill", "cut+kill"], weights=[4, 3, 2])[0]
    ev = Planned(kind, gap_s=round(rng.uniform(3, 12), 1))
    if kind in ("cut", "cut+kill"):
        ev.cut = rng.choice(CUTTABLE)
        ev.peers = _peers(rng, ev.cut)
        ev.hold_s = round(rng.uniform(10, 40), 1)
    if kind in ("kill", "cut+kill"):
        ev.kill = _kill_target(rng, avoid=ev.cut)
        ev.kill_after_s = round(rng.uniform(2, max(3.0, ev.hold_s - 5)), 1) if ev.cut else 0.0
    return ev


def test_schedule_is_replayed_by_its_seed() -> None:
    a, b = random.Random(7), random.Random(7)
    events = [plan(a) for _ in range(50)]
    assert [e.describe() for e in events] == [plan(b).describe() for _ in range(50)]
    for e in events:
        assert e.cut or e.kill
        assert not (e.cut in BROKERS and e.kill in BROKERS), "two brokers away at once"
        assert e.cut != e.kill or e.cut is None
        assert e.cut is None or (10 <= e.hold_s <= 40 and e.peers and e.cut not in e.peers)
    assert {e.kind for e in events} == {"cut", "kill", "cut+kill"}


# ---- running it ---------------------------------------------------------------------------------------------
@dataclass
class SoakEvent:
    index: int
    plan: Planned
    start_s: float = 0.0
    """From the soak's start."""
    end_s: float = 0.0
    cut_shown: str = "-"
    detect_s: float | None = None
    detected: str = "-"
    restart_s: float | None = None
    """From the kill until the supervisor's new process ran."""
    recover_s: float | None = None
    """From the heal (or the kill) until training and publishing both advanced."""
    samplers: str = "not measured: the event failed before its heal's check"
    """Each sampler's seconds from the heal (or the restart) to its first fragment after it."""
    lost: int = 0
    twice: int = 0
    alerts: str = "-"
    problems: list[str] = field(default_factory=list)


def _pids(net: Net) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in run_py(net.home, "-m", "devstack", "hosts", check=False).stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 4 and cols[3].isdigit():
            out[cols[0]] = int(cols[3])
    return out


def _kill(net: Net, ev: SoakEvent, part: str) -> int | None:
    """SIGKILL ``part``'s process (waiting up to 30 s for one: it may be restarting); its pid, or None (noted)."""
    deadline = time.monotonic() + 30
    while (pid := _pids(net).get(part)) is None:
        if time.monotonic() > deadline:
            ev.problems.append(f"{part} had no running process to kill for 30 s")
            return None
        time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    return pid


def _restarted(net: Net, part: str, old: int, since: float) -> float | None:
    deadline = time.monotonic() + RESTART_S
    while time.monotonic() < deadline:
        pid = _pids(net).get(part)
        if pid is not None and pid != old:
            return round(time.monotonic() - since, 1)
        time.sleep(2)
    return None


def _shown(net: Net, part: str, peers: list[str]) -> str:
    """Whether the cut took effect, for a peer whose port is known (a broker, S3)."""
    for peer in peers:
        if peer in BROKERS:
            host, port = net.broker(peer)
        elif peer == "s3":
            host, port = mh.address("s3"), S3_PORT
        else:
            continue
        return f"{part} -> {peer} {'still connects (NOT cut)' if reaches(part, host, port) else 'refused'}"
    return "-"


def _advanced(net: Net, since: float, base: tuple[int | None, int | None]) -> float | None:
    deadline = since + RECOVER_S
    while time.monotonic() < deadline:
        u, p = net.progress()
        if u is not None and p is not None and u > (base[0] or 0) and p > (base[1] or 0):
            return round(time.monotonic() - since, 1)
        time.sleep(2)
    return None


def _run_event(net: Net, ev: SoakEvent, t0: float) -> None:
    p = ev.plan
    ev.start_s = round(time.monotonic() - t0, 1)
    began = time.monotonic()
    killed: int | None = None
    killed_at = 0.0
    try:
        if p.cut:
            mh.cut(p.cut, p.peers)
            ev.cut_shown = _shown(net, p.cut, p.peers)
            if "NOT cut" in ev.cut_shown:
                ev.problems.append(f"the cut did not take effect: {ev.cut_shown}")
        tried = False
        if p.kill and not p.cut:
            killed, killed_at, tried = _kill(net, ev, p.kill), time.monotonic(), True
        hold_end = began + (p.hold_s if p.cut else KILL_WATCH_S)
        while True:
            if p.cut and p.kill and not tried and time.monotonic() - began >= p.kill_after_s:
                killed, killed_at, tried = _kill(net, ev, p.kill), time.monotonic(), True
            s = net.status()
            if ev.detect_s is None and s is not None and (bad := not_ok(s)):
                ev.detect_s, ev.detected = round(time.monotonic() - began, 1), "; ".join(bad)[:300]
            if time.monotonic() >= hold_end and (not p.kill or tried):
                break
            time.sleep(min(2.0, max(0.2, hold_end - time.monotonic())))
    finally:
        if p.cut:
            mh.heal(p.cut)
    healed = time.monotonic()
    base = net.progress()
    if p.kill and killed is not None:
        ev.restart_s = _restarted(net, p.kill, killed, killed_at)
        if ev.restart_s is None:
            ev.problems.append(f"{p.kill} was not restarted within {RESTART_S:.0f} s")
    samplers = net.watch_samplers()  # the heal, and the killed process back
    ev.recover_s = _advanced(net, healed, base)
    if ev.recover_s is None:
        ev.problems.append(f"training and publishing did not both advance within {RECOVER_S:.0f} s")
    back = samplers.result()
    ev.samplers = back.cell()
    if not back.ok:
        ev.problems.append(f"sampler(s) {', '.join(sorted(back.late))} did not produce within {back.bound_s:.0f} s "
                           f"of the heal: {ev.samplers}")
    if ev.detect_s is None:  # a kill shows after the event's own time: look once more
        s = net.status()
        if s is not None and (bad := not_ok(s)):
            ev.detected = "after: " + "; ".join(bad)[:300]
    ev.end_s = round(time.monotonic() - t0, 1)


def _when(e: dict[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return None


def _attribute(net: Net, events: list[SoakEvent], t0_wall: float, lost: list[str], twice: list[str]) -> list[str]:
    """Each lost or twice-trained sample id to the event whose window (its start to the next one's) holds the time
    its write was acknowledged; the ones that fall outside every window (before the first event) are returned."""
    produced = {e.get("sample_id"): _when(e) for log in sorted(net.logs.glob("sampler-*.log"))
                for e in read_events(log) if e.get("event") == "fragment_produced"}
    outside = []
    for ids, attr in ((lost, "lost"), (twice, "twice")):
        for sid in ids:
            at = produced.get(sid)
            rel = None if at is None else at - t0_wall
            hit = next((ev for ev, nxt in zip(events, [*events[1:], None], strict=True)
                        if rel is not None and ev.start_s <= rel < (nxt.start_s if nxt else float("inf"))), None)
            if hit is None:
                outside.append(f"{attr} {sid}")
            else:
                setattr(hit, attr, getattr(hit, attr) + 1)
    return outside


@pytest.mark.timeout(int(MINUTES * 60 + 1800))
def test_soak(net: Net) -> None:
    seed = int(os.environ.get("FLYWHEEL_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    print(f"soak: seed {seed} (FLYWHEEL_SOAK_SEED={seed} replays it), {MINUTES:g} minutes")
    rng = random.Random(seed)
    net.sampler_urls()  # resolved before the first event
    net.settle()
    restarts_before = (net.status() or {}).get("services", {})
    t0, t0_wall = time.monotonic(), time.time()
    watch = AlertWatch().start()
    events: list[SoakEvent] = []
    try:
        while time.monotonic() - t0 < MINUTES * 60:
            ev = SoakEvent(len(events) + 1, plan(rng))
            events.append(ev)
            print(f"[soak {time.monotonic() - t0:6.1f} s] event {ev.index}: {ev.plan.describe()}")
            _run_event(net, ev, t0)
            print(f"    detect {ev.detect_s} s ({ev.detected[:120]}), restart {ev.restart_s} s, "
                  f"recover {ev.recover_s} s{'; ' + '; '.join(ev.problems) if ev.problems else ''}")
            time.sleep(ev.plan.gap_s)
    finally:
        for part in CUTTABLE:  # heal everything, whatever happened
            mh.heal(part)
    faults_s = time.monotonic() - t0
    watch.heal()
    # After the schedule: everything healed; training must advance, then the rows' checks on the whole run.
    net.settle(timeout_s=300)
    total = NetRow(f"soak, {len(events)} events in {faults_s / 60:.1f} min (seed {seed})")
    total.watch = watch
    at_end = net.progress()[0] or 0
    try:
        net.check(total, at_end, CHECKPOINT_EVERY)
    finally:
        acc = net.account()
        outside = _attribute(net, events, t0_wall, acc["acknowledged_lost_ids"], acc["trained_twice_ids"])
        for ev in events:
            lo, hi = ev.start_s, ev.end_s + 5
            ev.alerts = ", ".join(f"{s.key} {'firing' if s.firing_s is not None else 'pending'}"
                                  for s in watch.new() if s.pending_s is not None and lo <= s.pending_s < hi) or "-"
        after = (net.status() or {}).get("services", {})
        restarts = {k: (after.get(k) or {}).get("restarts", 0) - (restarts_before.get(k) or {}).get("restarts", 0)
                    for k in after}
        path = write_soak(seed, MINUTES, faults_s, events, total, acc, outside, restarts)
        print(f"wrote {path}")
    problems = [f"event {ev.index} ({ev.plan.describe()}): {p}" for ev in events for p in ev.problems]
    assert not problems, problems
    assert not outside, f"lost or trained twice outside every event: {outside}"
    assert len(events) >= 5, f"only {len(events)} events in {MINUTES} minutes"
