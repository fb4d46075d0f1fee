"""A Flywheel stack run by the bench (``BenchStack``, ``stack``): started fresh per run with its own run
name, its metrics scraped, its logs read, windows of its rates and CPU measured, and its topics dropped after.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.context import (
    ADMIN_PORT,
    BENCH_HOME,
    DEFAULT_CONFIG,
    PARAMSYNC_PORT,
    SAMPLER_BASE_PORT,
    TRAINER_PORT,
    Context,
    say,
)
from bench.machine import cpu_seconds, machine_busy_seconds, parse_ts
from devstack import LocalStack

_HTTP = httpx.Client(timeout=10.0)  # one client: a fresh httpx.get() per scrape costs ~0.05 s of CPU


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {sample name: value summed over labels}."""
    text = _HTTP.get(url).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def read_events(path: Path, event: str | None = None, since: float | None = None) -> list[dict[str, Any]]:
    """JSON log lines of ``path`` (optionally one event, optionally at/after epoch ``since``),
    each with ``_t`` (epoch seconds of its timestamp)."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    with path.open("r", errors="replace") as fh:
        for line in fh:
            if not line.startswith("{"):
                continue
            if event is not None and f'"{event}"' not in line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if event is not None and d.get("event") != event:
                continue
            ts = d.get("timestamp")
            if not isinstance(ts, str):
                continue
            d["_t"] = parse_ts(ts)
            if since is not None and d["_t"] < since:
                continue
            out.append(d)
    return out


_POOL = ThreadPoolExecutor(max_workers=12)


def _try_scrape(url: str) -> dict[str, float] | None:
    for attempt in range(2):
        try:
            return scrape(url)
        except httpx.HTTPError:
            if attempt == 0:
                time.sleep(0.05)
    return None


class BenchStack:
    """One LocalStack run on the bench infra with settings overrides; metrics, logs, admin status."""

    def __init__(self, ctx: Context, run: str, overrides: dict[str, Any] | None = None,
                 config: Path = DEFAULT_CONFIG, hosts_home: Path | None = None, brokers: int = 1) -> None:
        """``hosts_home``: run on the multi-host stack of that home (``devstack.hosts``: every part in a network
        namespace of its own, its own ``brokers`` Kafka nodes and S3 server there, kept between runs by
        ``down``) instead of on 127.0.0.1 with the bench's infra."""
        self.ctx = ctx
        self.run = run
        env = {k: str(v) for k, v in (overrides or {}).items()}
        self.home = hosts_home or BENCH_HOME / "runs" / run
        self.infra_home = hosts_home or BENCH_HOME
        """Where the pid files of the Kafka nodes and the S3 server this stack uses are."""
        where: dict[str, Any] = ({"hosts": True, "brokers": brokers, "store_backend": "s3"} if hosts_home
                                 else {"infra": ctx.infra, "store_backend": "local"})
        self.stack = LocalStack(self.home, config=config, run=run, env=env,
                                admin_port=ADMIN_PORT, trainer_port=TRAINER_PORT, paramsync_port=PARAMSYNC_PORT,
                                sampler_base_port=SAMPLER_BASE_PORT, trainer_rank_base_port=ADMIN_PORT + 90,
                                rendezvous_port=ADMIN_PORT + 99, **where,
                                supervise=False, progress=lambda m: None)  # figures restart processes by hand
        self.samplers = 0
        self.scrape_misses = 0
        self._last_sampler: dict[int, dict[str, float]] = {}

    # lifecycle
    def up(self, samplers: int, timeout_s: float = 180.0, trainers: int | None = None) -> float:
        """Start (or scale to) ``samplers`` samplers plus trainer (``trainers`` ranks), paramsync, admin; return
        seconds taken."""
        t0 = time.monotonic()
        self.stack.up(samplers=samplers, timeout_s=timeout_s, prometheus=False, trainers=trainers)
        self.samplers = samplers
        return time.monotonic() - t0

    def up_to_first_fragment(self, samplers: int, timeout_s: float = 120.0) -> float:
        """Start the stack (``up``) and wait until a sampler has produced its first fragment: the start-up
        the peer figures report (from starting it to its first env step, within the 0.2 s poll)."""
        up_s = self.up(samplers)
        return up_s + self.wait_for("the first fragment", lambda: self.status_samplers_producing() >= 1, timeout_s,
                                    poll_s=0.2)

    def down(self) -> None:
        self.stack.down(infra=False)

    # observation
    def metrics_url(self, service: str, replica: int = 0) -> str:
        return f"http://{self.stack.host(service, replica)}:{self.stack.port(service, replica)}/metrics"

    def scrape(self, service: str, replica: int = 0) -> dict[str, float]:
        return scrape(self.metrics_url(service, replica))

    def counters(self) -> dict[str, float]:
        """Trainer counters + the samplers' summed env steps, scraped concurrently (one instant)."""
        urls = [self.metrics_url("trainer")] + [self.metrics_url("sampler", r) for r in range(self.samplers)]
        t_mid = time.monotonic()
        pages = list(_POOL.map(_try_scrape, urls))
        t_mid = (t_mid + time.monotonic()) / 2
        t = pages[0]
        if t is None:
            raise httpx.HTTPError("trainer /metrics did not answer")
        # A sampler that did not answer this time keeps its last counters (they only grow), so one slow
        # scrape under load cannot make the sum go down; how often that happened is counted.
        for r, page in enumerate(pages[1:]):
            if page is None:
                self.scrape_misses += 1
            else:
                self._last_sampler[r] = page
        known = [self._last_sampler[r] for r in range(self.samplers) if r in self._last_sampler]
        steps = sum(p.get("flywheel_sampler_env_steps_total", 0.0) for p in known)
        # Time held by flow control: waiting for credits, or paused on the measured backlog (max_backlog).
        backpressure = sum(p.get("flywheel_sampler_backpressure_seconds_total", 0.0)
                           + p.get("flywheel_sampler_credit_wait_seconds_total", 0.0) for p in known)
        return {
            "t": t_mid,
            **{f"cpu:{k}": v for k, v in self.cpu().items()},
            "backpressure": backpressure,
            "trained": t.get("flywheel_trainer_env_steps_trained_total", 0.0),
            "busy": t.get("flywheel_trainer_busy_seconds_total", 0.0),
            "updates": t.get("flywheel_trainer_updates_total", 0.0),
            "dropped": t.get("flywheel_trainer_fragments_dropped_stale_total", 0.0),
            "consumed": t.get("flywheel_trainer_fragments_consumed_total", 0.0),
            "sampled": steps,
        }

    def status(self) -> dict[str, Any]:
        r = _HTTP.get(f"{self.stack.admin_url}/status")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each process of the stack (samplers summed), Kafka, the S3 server and
        this bench process - to see where the cores go."""
        groups: dict[str, float] = {}
        pids = dict(self.stack.pids())
        for name in ("kafka", "s3"):
            try:
                pids[name] = int((self.infra_home / "pids" / f"{name}.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        pids["bench"] = os.getpid()
        for name, pid in pids.items():
            secs = cpu_seconds(pid)
            if secs is not None:
                key = "samplers" if name.startswith("sampler") else name
                groups[key] = groups.get(key, 0.0) + secs
        groups["machine"] = machine_busy_seconds()
        return groups

    def status_samplers_producing(self) -> int:
        """How many of this stack's samplers have produced a fragment (from their /metrics)."""
        urls = [self.metrics_url("sampler", r) for r in range(self.samplers)]
        pages = list(_POOL.map(_try_scrape, urls))
        return sum(1 for p in pages if p and p.get("flywheel_sampler_fragments_produced_total", 0.0) > 0)

    def log(self, service: str, replica: int = 0) -> Path:
        return self.stack.log_path(service, replica)

    def events(self, service: str, event: str | None = None, replica: int = 0,
               since: float | None = None) -> list[dict[str, Any]]:
        return read_events(self.log(service, replica), event, since)

    def wait_for(self, what: str, cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.25) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if cond():
                    return time.monotonic() - t0
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"{self.run}: {what} did not happen within {timeout_s:.0f} s")

    def wait_trained(self, env_steps: float, timeout_s: float = 120.0) -> float:
        return self.wait_for(f"{env_steps:.0f} env steps trained",
                             lambda: self.counters()["trained"] >= env_steps, timeout_s, 0.5)

    def sample_until(self, env_steps: float, timeout_s: float = 300.0, poll_s: float = 1.0) -> list[dict[str, float]]:
        """Poll the counters every ``poll_s`` until the samplers have made ``env_steps`` env steps (or the
        timeout); returns every snapshot taken."""
        series: list[dict[str, float]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            series.append(self.counters())
            if series[-1]["sampled"] >= env_steps:
                break
            time.sleep(poll_s)
        return series


@contextmanager
def stack(ctx: Context, run: str, overrides: dict[str, Any] | None = None,
          config: Path = DEFAULT_CONFIG, hosts_home: Path | None = None, brokers: int = 1) -> Iterator[BenchStack]:
    """A :class:`BenchStack`, its services stopped at the end (infra, and a multi-host network, kept)."""
    st = BenchStack(ctx, run, overrides, config, hosts_home=hosts_home, brokers=brokers)
    try:
        yield st
    finally:
        try:
            st.down()
        except Exception as exc:  # never leave the suite half-way because a stop failed
            say(f"warning: stopping {run} failed: {exc}")


@dataclass(frozen=True)
class Window:
    """Rates over one measurement window between two counter snapshots."""

    seconds: float
    trained_per_s: float
    sampled_per_s: float
    busy_fraction: float
    updates_per_s: float
    dropped: float
    backpressure_fraction: float  # mean over samplers of the fraction of time paused by flow control
    cpu: dict[str, float] = field(default_factory=dict)  # cores used by each process group over the window

    @classmethod
    def between(cls, a: dict[str, float], b: dict[str, float], samplers: int = 1) -> Window:
        dt = max(b["t"] - a["t"], 1e-9)
        return cls(dt, (b["trained"] - a["trained"]) / dt, (b["sampled"] - a["sampled"]) / dt,
                   (b["busy"] - a["busy"]) / dt, (b["updates"] - a["updates"]) / dt, b["dropped"] - a["dropped"],
                   (b["backpressure"] - a["backpressure"]) / dt / max(samplers, 1),
                   {k[4:]: (b[k] - a.get(k, 0.0)) / dt for k in b if k.startswith("cpu:")})


def cpu_table(windows: list[Window], total_cores: int | None = None) -> str:
    """A Markdown line: median cores used by each process group over the windows, and by everything else
    on the machine (other work sharing the cores makes a window's numbers suspect)."""
    def med(k: str) -> float:
        return statistics.median([w.cpu.get(k, 0.0) for w in windows])

    names = sorted({k for w in windows for k in w.cpu} - {"machine"}, key=lambda k: -med(k))
    parts = [f"{k} {med(k):.2f}" for k in names]
    total = sum(med(k) for k in names)
    other = statistics.median([w.cpu.get("machine", 0.0) - sum(v for k, v in w.cpu.items() if k != "machine")
                               for w in windows]) if any("machine" in w.cpu for w in windows) else float("nan")
    cores = total_cores or os.cpu_count() or 1
    return (f"CPU (cores busy, median of windows): {', '.join(parts)}; total {total:.2f} of {cores}; "
            f"other processes on the machine {max(other, 0.0):.2f}.")


def measure_windows(st: BenchStack, window_s: float, repeats: int) -> list[Window]:
    """``repeats`` back-to-back windows of ``window_s`` seconds each."""
    out: list[Window] = []
    prev = st.counters()
    for _ in range(repeats):
        time.sleep(window_s)
        cur = st.counters()
        out.append(Window.between(prev, cur, st.samplers))
        prev = cur
    return out


def delete_topics(ctx: Context, prefix: str) -> int:
    """Drop the topics of finished runs (names starting with ``prefix``) so the bench broker does
    not accumulate them. Returns how many were deleted."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def go() -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=ctx.infra.kafka_bootstrap)
        await admin.start()
        try:
            names = [n for n in await admin.list_topics() if n.startswith(prefix)]
            if names:
                await admin.delete_topics(names)
            return len(names)
        finally:
            await admin.close()

    try:
        return asyncio.run(go())
    except Exception as exc:  # hygiene only
        say(f"warning: could not delete topics {prefix}*: {exc}")
        return 0
