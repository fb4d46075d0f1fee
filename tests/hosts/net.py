"""The partition nemesis's tools on the multi-host stack: cut and heal links, watch what the operator sees, and check
the data afterwards from the data itself (the topic read back from the brokers, the samplers' acknowledged writes,
the trainers' outcome lines, ``flywheel verify``), never from the services' own account of how it went.

A row (:meth:`Net.partition`) runs: settle (every service ok, training advancing) -> cut -> assert the cut happened
(a TCP connection across it fails, one that should not still succeeds) -> watch ``/status`` for the cut's
duration (time to detect: the first service degraded, down, or the trainer stalled, with its reason) -> heal ->
time until training and publishing advance past where they were at the heal -> the checks
(:meth:`Net.check`). Each row ends as a :class:`NetRow` in ``docs/reliability-network.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack import hosts as mh
from devstack.config import REPO_ROOT
from tests.faults.accounting import read_events, read_topic
from tests.faults.liveness import BOUND_S, SamplersBack, assert_back
from tests.hosts.alerts import AlertWatch

ADMIN = f"http://{mh.address('admin')}:8080"
SAMPLERS = ["sampler-0", "sampler-1"]
RECOVER_S = 150.0
"""Bound on training and publishing advancing after a heal (a rank split can need one rendezvous timeout, 60 s,
after the heal)."""


@dataclass
class NetRow:
    name: str
    fault: str = ""
    """What was cut and how the suite saw that it was (which connection failed)."""
    cut_s: float = 0.0
    detect_s: float | None = None
    detected: str = "-"
    """What ``/status`` said first (service: reason), or what else showed the fault."""
    heal_s: float | None = None
    """From the heal until the trainer's updates and the published version both advanced past their values at it."""
    during: str = ""
    """What training did meanwhile."""
    lost: int | None = None
    twice: int | None = None
    verify: str = "-"
    outcome: str = "FAILED"
    notes: list[str] = field(default_factory=list)
    alerts: str = "-"
    """What Prometheus's alerts did from the cut until the row's checks were done (:class:`AlertWatch`)."""
    watch: AlertWatch | None = None
    first_seen: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Per part ``/status`` showed not ok during the cut: seconds from the cut, and what it said first."""
    samplers: str = "not measured: the row failed before its heal's check"
    """Each sampler's seconds from the heal to its first fragment after it (:mod:`tests.faults.liveness`)."""


def env_for(home: Path) -> dict[str, str]:
    """This environment without any FLYWHEEL_* of the test session's (its infra, run, store), for ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLYWHEEL_", "AWS_"))}
    env["FLYWHEEL_HOME"] = str(home)
    return env


def run_py(home: Path, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env_for(home), capture_output=True, text=True,
                         timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def reaches(name: str, host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether ``name``'s host opens a TCP connection to ``host:port`` within ``timeout_s`` (run inside its
    namespace)."""
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout={timeout_s}).close()"
    out = subprocess.run(["ip", "netns", "exec", mh.netns_name(name), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)
    return out.returncode == 0


def request_rtt(name: str, host: str, port: int, request: bytes) -> float:
    """Seconds from sending ``request`` to its reply's first bytes, from ``name``'s host over a new connection: the
    link's round trip as a client of ``host:port`` sees it."""
    code = ("import socket, time\n"
            f"s = socket.create_connection(({host!r}, {port}), timeout=20)\n"
            f"t = time.monotonic(); s.sendall({request!r})\n"
            "assert len(s.recv(4)) == 4\n"
            "print(time.monotonic() - t)\n")
    out = subprocess.run(["ip", "netns", "exec", mh.netns_name(name), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip())


def kafka_rtt(name: str, host: str, port: int) -> float:
    """A Kafka ApiVersions request's (v0) round trip from ``name``'s host (:func:`request_rtt`)."""
    req = struct.pack(">hhih", 18, 0, 7, -1)
    return request_rtt(name, host, port, struct.pack(">i", len(req)) + req)


def http_rtt(name: str, host: str, port: int, tries: int = 3) -> float:
    """The shortest of ``tries`` ``GET /healthz`` round trips from ``name``'s host to a service's HTTP port
    (:func:`request_rtt`): the link's, with as little of a busy server's own time in it as can be had."""
    request = f"GET /healthz HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    return min(request_rtt(name, host, port, request) for _ in range(tries))


def not_ok(status: dict[str, Any]) -> list[str]:
    """Every service ``/status`` shows as not ok (degraded with its reasons, down), and a stalled trainer."""
    out = []
    for name, svc in (status.get("services") or {}).items():
        if not svc.get("alive"):
            out.append(f"{name}: down (no heartbeat)")
        elif svc.get("state") != "ok":
            reasons = "; ".join(f"{k}: {v}" for k, v in (svc.get("reasons") or {}).items())
            out.append(f"{name}: {svc.get('state')} ({reasons[:160]})")
    stalled = (status.get("trainer") or {}).get("stalled")
    if stalled:
        out.append(f"trainer stalled: {str(stalled)[:160]}")
    return out


class Net:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.logs = home / "logs"
        self.rows: list[NetRow] = []
        self.kafka = mh.kafka_names(3)
        self._bootstrap: list[tuple[str, int]] | None = None
        self._sampler_urls: dict[str, str] = {}

    # ---- what the operator sees ------------------------------------------------------------------
    def status(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{ADMIN}/status", timeout=5) as r:  # noqa: S310 (a test host)
                return dict(json.loads(r.read()))
        except (OSError, ValueError):
            return None

    def progress(self) -> tuple[int | None, int | None]:
        """(trainer updates, published version) from ``/status``."""
        s = self.status()
        if not s:
            return None, None
        return (s["trainer"].get("updates") if s.get("trainer") else None), (s.get("policy") or {}).get("version")

    def bootstrap(self) -> list[tuple[str, int]]:
        """The brokers' addresses the stack gives its clients (``FLYWHEEL_KAFKA_BOOTSTRAP`` in its infra.env)."""
        if self._bootstrap is None:
            for env_file in sorted(self.home.rglob("infra.env")):
                for line in env_file.read_text().splitlines():
                    if line.startswith("FLYWHEEL_KAFKA_BOOTSTRAP="):
                        self._bootstrap = [(h, int(p)) for h, _, p in
                                           (x.rpartition(":") for x in line.split("=", 1)[1].split(","))]
            if self._bootstrap is None:
                raise AssertionError(f"no infra.env with FLYWHEEL_KAFKA_BOOTSTRAP under {self.home}")
        return self._bootstrap

    def broker(self, name: str) -> tuple[str, int]:
        return next(b for b in self.bootstrap() if b[0] == mh.address(name))

    def bootstrap_str(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.bootstrap())

    def leaders(self, topic: str, ask: Iterable[str] | None = None) -> dict[int, tuple[str, list[str]]]:
        """partition -> (leader, ISR) as the cluster says now (asked from the root namespace, of the brokers
        ``ask``: default all; an isolated broker still believes it leads), brokers by part name (``kafka``,
        ``kafka-2``, ...)."""
        names = list(ask) if ask is not None else self.kafka
        return asyncio.run(_leaders(",".join(f"{h}:{p}" for h, p in map(self.broker, names)), topic))

    def http_port(self, name: str) -> int:
        """The HTTP port of part ``name`` (``python -m devstack status``, which exits 3 while a part is down: the
        ports it prints are read all the same)."""
        for line in run_py(self.home, "-m", "devstack", "status", check=False).stdout.splitlines():
            cols = line.split()
            if cols and cols[0] == name:
                for c in cols:
                    if c.startswith(f"http://{mh.address(name)}:"):
                        return int(c.rsplit(":", 1)[1])
        raise AssertionError(f"no HTTP address for {name} in python -m devstack status")

    def sampler_urls(self) -> dict[str, str]:
        """Each sampler's ``/healthz`` at its part's address (reached from the root namespace, as Prometheus does)."""
        if not self._sampler_urls:
            self._sampler_urls = {s: f"http://{mh.address(s)}:{self.http_port(s)}/healthz" for s in SAMPLERS}
        return self._sampler_urls

    def watch_samplers(self, paused: dict[str, str] | None = None, bound_s: float = BOUND_S) -> SamplersBack:
        """At a heal: watch every sampler but ``paused`` (name -> why) for its next fragment within ``bound_s``."""
        return SamplersBack(self.sampler_urls(), paused=paused or {}, bound_s=bound_s)

    def samplers_back(self, row: NetRow, watch: SamplersBack) -> None:
        """Every watched sampler produced within the bound of the heal: fills ``row.samplers``, fails naming one
        that did not (with its ``/healthz`` reasons)."""
        back = watch.result()
        row.samplers = back.cell()
        print(f"[{row.name}] samplers back after the heal: {row.samplers}")
        assert_back(back, row.name)

    def run_name(self) -> str:
        s = self.status()
        assert s, "admin's /status does not answer"
        return str(s["run"])

    # ---- waiting ---------------------------------------------------------------------------------
    def settle(self, timeout_s: float = 240.0) -> None:
        """Until every service is ok and training advanced twice in a row (the previous row healed)."""
        deadline, last, good = time.monotonic() + timeout_s, None, 0
        while True:
            s = self.status()
            now = self.progress()[0] if s else None
            ok = s is not None and not not_ok(s)
            good = good + 1 if ok and now is not None and last is not None and now > last else 0
            if good >= 2:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the stack did not settle in {timeout_s:.0f} s: "
                                     f"{not_ok(s) if s else 'no /status'}")
            last = now
            time.sleep(3)

    def wait_checkpoint_after(self, updates: int, every: int, timeout_s: float = 300.0) -> None:
        """Until the trainer passed the first checkpoint (every ``every`` updates) after update ``updates``."""
        target = (updates // every + 1) * every + 1
        deadline = time.monotonic() + timeout_s
        while (self.progress()[0] or 0) < target:
            assert time.monotonic() < deadline, f"no checkpoint after update {updates} within {timeout_s:.0f} s"
            time.sleep(2)

    # ---- the nemesis -----------------------------------------------------------------------------
    def watch_alerts(self, row: NetRow) -> None:
        """Start polling Prometheus's alerts for ``row`` (at its cut); :meth:`check` stops it and fills
        ``row.alerts``."""
        row.watch = AlertWatch().start()

    def _seen(self, row: NetRow, s: dict[str, Any], since: float) -> list[str]:
        """What ``/status`` shows not ok now; records each part's first time in ``row.first_seen``."""
        bad = not_ok(s)
        for line in bad:
            part = line.split(": ", 1)[0]
            row.first_seen.setdefault(part, (round(time.monotonic() - since, 1), line))
        return bad

    def partition(self, row: NetRow, name: str, peers: Iterable[str], hold_s: float, *,
                  direction: str = "both", happened: Callable[[], list[str]],
                  extra_detect: Callable[[], str | None] | None = None,
                  during: Callable[[], None] | None = None,
                  paused: dict[str, str] | None = None) -> tuple[int | None, int | None]:
        """Cut ``name`` from ``peers`` for ``hold_s``, then heal; fills ``row`` (fault, detection, heal time,
        samplers back). ``happened`` returns what is wrong with the cut (empty: it took effect as meant), checked
        right after the cut; ``during`` runs once then (an operator's action during the cut); ``extra_detect``
        another sign of detection than ``/status`` (e.g. the cluster moved a partition's leader), polled with it.
        Prometheus's alerts are watched from the cut (:meth:`watch_alerts`). After the heal, training and
        publishing must advance, and every sampler but ``paused`` (name -> why) produce again
        (:meth:`samplers_back`). Returns (updates, published) at the heal."""
        peers = list(peers)
        self.sampler_urls()  # resolved now, not at the heal
        self.settle()
        before = self.progress()
        mh.cut(name, peers, direction)
        cut_at = time.monotonic()
        self.watch_alerts(row)
        try:
            wrong = happened()
            assert not wrong, f"the cut did not take effect as meant: {wrong}"
            row.fault = (f"{name} {'cut from' if direction == 'both' else f'one-way ({direction})'} "
                         f"{', '.join(peers)}: shown by {row.fault}")
            if during is not None:
                during()
            other: str | None = None
            while (left := hold_s - (time.monotonic() - cut_at)) > 0:
                s = self.status()
                bad = self._seen(row, s, cut_at) if s is not None else []
                if row.detect_s is None and bad:
                    row.detect_s, row.detected = round(time.monotonic() - cut_at, 1), "; ".join(bad)
                if extra_detect is not None and other is None and (other := extra_detect()) is not None:
                    row.notes.append(f"{other} after {time.monotonic() - cut_at:.1f} s")
                time.sleep(min(2.0, max(left, 0.0)))
            at_cut_end = self.progress()
        finally:
            mh.heal(name)
            if row.watch is not None:
                row.watch.heal()
        healed_at = time.monotonic()
        samplers = self.watch_samplers(paused)
        row.cut_s = round(healed_at - cut_at, 1)
        at_heal = self.progress()
        if before[0] is not None and at_cut_end[0] is not None:
            row.during = (f"updates {before[0]} -> {at_cut_end[0]}, published {before[1]} -> {at_cut_end[1]} "
                          "during the cut")
        base_u, base_p = (at_heal[0] or at_cut_end[0] or 0), (at_heal[1] or at_cut_end[1] or 0)
        self._advanced(row, healed_at, base_u, base_p)
        self.samplers_back(row, samplers)
        return base_u, base_p

    def _advanced(self, row: NetRow, healed_at: float, base_u: int, base_p: int) -> None:
        """Until the trainer's updates and the published version both passed their values at the heal."""
        while time.monotonic() - healed_at < RECOVER_S:
            u, p = self.progress()
            if u is not None and p is not None and u > base_u and p > base_p:
                row.heal_s = round(time.monotonic() - healed_at, 1)
                return
            time.sleep(2)
        raise AssertionError(f"{row.name}: training and publishing did not both advance within {RECOVER_S:.0f} s "
                             f"of the heal ({self.progress()})")

    def slowdown(self, row: NetRow, links: dict[str, list[str]], hold_s: float, *, back_bound_s: float = BOUND_S,
                 delay_ms: float,
                 rate_kbps: float, happened: Callable[[], list[str]]) -> tuple[dict[str, Any], dict[str, Any], int]:
        """Slow each part's links to its peers (``links``: part -> peers) for ``hold_s``, then heal; fills ``row``.
        Returns what ``/status`` showed over the 20 s before and over the slow period (:func:`_window`), and the
        trainer's updates at the heal."""
        self.sampler_urls()  # resolved now, not at the heal
        self.settle()
        before = self._window(20.0)
        started = time.monotonic()
        self.watch_alerts(row)
        try:
            for name, peers in links.items():
                mh.slow(name, peers, delay_ms, rate_kbps, self.logs / f"slowlink-{name}.log")
            wrong = happened()
            assert not wrong, f"the slow link did not take effect as meant: {wrong}"
            cap = f", {rate_kbps:g} kB/s a direction per connection" if rate_kbps else ""
            which = "; ".join(f"{n} -> {'/'.join(p)}" for n, p in links.items())
            row.fault = f"{which} through a userspace proxy, +{delay_ms:g} ms each way{cap}: shown by {row.fault}"
            during = self._window(max(hold_s - (time.monotonic() - started), 5.0), row=row, started=started)
        finally:
            for name in links:
                mh.heal(name)
            if row.watch is not None:
                row.watch.heal()
        healed_at = time.monotonic()
        samplers = self.watch_samplers(bound_s=back_bound_s)
        row.cut_s = round(healed_at - started, 1)
        base_u, base_p = self.progress()
        self._advanced(row, healed_at, int(base_u or 0), int(base_p or 0))
        self.samplers_back(row, samplers)
        return before, during, int(base_u or 0)

    def _window(self, seconds: float, row: NetRow | None = None, started: float = 0.0) -> dict[str, Any]:
        """Over ``seconds``: updates a second, the trainer's env steps a second (its own 10 s rate, averaged), the
        staleness at training (the worst max and p95 seen) and each sampler's steps a second; with ``row``, the
        first service not ok is its detection."""
        t0, u0 = time.monotonic(), self.progress()[0]
        rates, smax, sp95, per_sampler = [], 0, 0.0, defaultdict(list)
        while time.monotonic() - t0 < seconds:
            s = self.status()
            if s:
                rates.append(float(s["trainer"]["samples_per_s"]))
                st = s.get("staleness") or {}
                smax, sp95 = max(smax, int(st.get("max") or 0)), max(sp95, float(st.get("p95") or 0))
                for sm in s.get("samplers") or []:
                    per_sampler[sm.get("id") or sm.get("sampler_id")].append(float(sm.get("steps_per_s") or 0))
                bad = self._seen(row, s, started) if row is not None else []
                if row is not None and row.detect_s is None and bad:
                    row.detect_s, row.detected = round(time.monotonic() - started, 1), "; ".join(bad)
            time.sleep(2)
        u1 = self.progress()[0]
        took = time.monotonic() - t0
        return {"updates_per_s": None if u0 is None or u1 is None else round((u1 - u0) / took, 2),
                "trainer_steps_per_s": round(sum(rates) / len(rates), 1) if rates else None,
                "staleness_max": smax, "staleness_p95": sp95,
                "sampler_steps_per_s": {k: round(sum(v) / len(v), 1) for k, v in per_sampler.items() if v}}

    # ---- the checker -----------------------------------------------------------------------------
    def verify(self) -> tuple[int, str]:
        out = run_py(self.home, "-m", "services.admin.cli", "verify", timeout=300, check=False)
        return out.returncode, out.stdout + out.stderr

    def check(self, row: NetRow, at_heal_updates: int, checkpoint_every: int) -> None:
        """After a row: wait for a checkpoint after the heal, run ``flywheel verify`` on it, and account for the
        data (:meth:`account`); fills the row's lost / twice / verify / outcome and asserts them."""
        self.wait_checkpoint_after(at_heal_updates, checkpoint_every)
        code, out = self.verify()
        print(f"[{row.name}] flywheel verify exit {code}:\n{out[-2500:]}")
        acc = self.account()
        print(f"[{row.name}] accounting: {json.dumps(acc)}")
        row.lost = acc["acknowledged_lost"] + acc["lost_before_training"]
        row.twice = acc["sample_ids_trained_twice"]
        row.verify = "ok" if code == 0 else f"FAILED (exit {code})"
        if acc["sampler_send_failures"]:
            row.notes.append(f"{acc['sampler_send_failures']} sends failed at the sampler (never acknowledged, "
                             "never on the topic: logged and counted, not lost data)")
        if acc["resent_duplicates"]:
            row.notes.append(f"{acc['resent_duplicates']} fragment(s) on the topic twice, the second not trained")
        row.outcome = "ok" if code == 0 and row.lost == 0 and row.twice == 0 else "FAILED"
        if row.watch is not None:  # the alerts from the cut until now, a little after the heal
            row.watch.stop()
            row.alerts = row.watch.summary()
            print(f"[{row.name}] alerts: {row.alerts}")
        assert code == 0, out[-3000:]
        assert acc["acknowledged_lost"] == 0, f"acknowledged writes missing from the topic: {acc}"
        assert acc["lost_before_training"] == 0, f"records lost before training: {acc}"
        assert acc["sample_ids_trained_twice"] == 0, f"a fragment trained at two offsets: {acc}"

    def account(self) -> dict[str, Any]:
        """The data, read back: every write a sampler logged as acknowledged (``fragment_produced`` with its
        partition and offset) must be on ``<run>.samples`` at that offset with the same sample id (a lost or
        overwritten acknowledged write otherwise, the classic lost-write of a leader partition); no sample id
        trained at two different offsets (a fragment resent after a cut trained twice); and no
        ``records_lost_before_training`` in any rank's log."""
        topic = f"{self.run_name()}.samples"
        # The samplers' acknowledgements first, the topic after: the samplers keep producing meanwhile, and a write
        # acknowledged (and logged) before the topic is read must be on it; one logged after the read may not be yet.
        sampler_events = [e for log in sorted(self.logs.glob("sampler-*.log")) for e in read_events(log)]
        on_topic = asyncio.run(read_topic(self.bootstrap_str(), topic))
        by_id: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for key, headers in on_topic.items():
            if headers.get("sample-id"):
                by_id[headers["sample-id"]].append(key)
        acked, failed, lost_acked = 0, 0, []
        for e in sampler_events:
            if e.get("event") == "fragment_send_failed":
                failed += 1
            if e.get("event") != "fragment_produced" or e.get("partition") is None:
                continue
            acked += 1
            key = (int(e["partition"]), int(e["offset"]))
            if on_topic.get(key, {}).get("sample-id") != e.get("sample_id"):
                lost_acked.append((key, e.get("sample_id")))
        trained: dict[tuple[int, int], int] = defaultdict(int)
        lost_before = 0
        for log in (self.logs / "trainer.log", *sorted(self.logs.glob("trainer-*.log"))):
            for e in read_events(log):
                if e.get("event") == "fragment_trained" and e.get("partition") is not None:
                    trained[(int(e["partition"]), int(e["offset"]))] += 1
                elif e.get("event") == "records_lost_before_training":
                    lost_before += int(e["to_offset"]) - int(e["from_offset"])
        dup_ids = {sid: keys for sid, keys in by_id.items() if len(keys) > 1}
        twice = [(sid, keys) for sid, keys in dup_ids.items() if sum(1 for k in keys if trained.get(k)) > 1]
        return {"on_topic": len(on_topic), "acknowledged": acked, "acknowledged_lost": len(lost_acked),
                "acknowledged_lost_examples": lost_acked[:5], "sampler_send_failures": failed,
                "resent_duplicates": len(dup_ids), "sample_ids_trained_twice": len(twice),
                "trained_twice_examples": twice[:5], "lost_before_training": lost_before,
                "records_trained": len(trained), "acknowledged_lost_ids": [sid for _, sid in lost_acked],
                "trained_twice_ids": [sid for sid, _ in twice]}


async def _leaders(bootstrap: str, topic: str) -> dict[int, tuple[str, list[str]]]:
    from aiokafka.admin import AIOKafkaAdminClient

    by_address = {mh.address(n): n for n in mh.kafka_names(3)}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        nodes = {int(b["node_id"]): by_address.get(str(b["host"]), str(b["host"]))
                 for b in (await admin.describe_cluster())["brokers"]}
        described = await admin.describe_topics([topic])

        def name(node: Any) -> str:  # an offline node is not listed
            return nodes.get(int(node), f"node {node}")

        return {int(p["partition"]): (name(p["leader"]), [name(x) for x in p["isr"]])
                for t in described for p in t["partitions"]}
    finally:
        await admin.close()
