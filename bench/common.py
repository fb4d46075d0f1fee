"""What every figure shares: the bench's own infra and ports, a stack runner, metric scraping,
log reading, windows, statistics and the machine description.

The suite never touches a ``make up`` stack or the test-suite's: its Kafka + S3 live in
``.flywheel/bench`` on 29092/29093/29000 and its services on 28xxx; every stack gets a fresh run
name (so fresh topics, consumer groups and store prefix) and a fresh home under
``.flywheel/bench/runs/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

import shared.service
from devstack import REPO_ROOT, InfraEndpoints, LocalStack, ensure_up

BENCH_HOME = REPO_ROOT / ".flywheel" / "bench"
KAFKA_PORT, CONTROLLER_PORT, S3_PORT = 29092, 29093, 29000
ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT = 28080, 28101, 28102, 28110
DEFAULT_CONFIG = REPO_ROOT / "configs" / "cartpole.yaml"


def say(msg: str) -> None:
    sys.stdout.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stdout.flush()


# ---- statistics ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    lo: float
    hi: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        vs = [float(v) for v in values]
        if not vs:
            return cls(float("nan"), float("nan"), float("nan"), 0, ())
        return cls(statistics.median(vs), min(vs), max(vs), len(vs), tuple(vs))

    def fmt(self, digits: int = 0, unit: str = "") -> str:
        if self.n == 0:
            return "n/a"
        def f(x: float) -> str:
            return "not reached" if x == float("inf") else f"{x:,.{digits}f}"

        body = f(self.median) + (unit if self.median != float("inf") else "")
        if self.n > 1 and self.lo != self.hi:
            body += f" ({f(self.lo)}-{f(self.hi)})"
        return body

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n, "values": list(self.values)}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; NaN when empty (a figure with no data)."""
    value = shared.service.percentile(values, q)
    return float("nan") if value is None else value


# ---- the machine -----------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import torch

    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The code measured: ``git describe`` of the working tree (``-dirty`` with uncommitted changes)."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: str) -> float:
    """An ISO timestamp from a log line -> epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK


def machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (from /proc/stat): with the stack's own
    processes subtracted, what other work took from the cores during a window."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _CLK


def reap_children(wait_s: float = 2.0) -> int:
    """Reap this process's exited children (stack processes that were killed or stopped and not yet
    waited for), so their CPU time is counted as the suite's. Returns how many were reaped."""
    reaped, deadline = 0, time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:  # children remain, none has exited yet
            if time.monotonic() >= deadline or not _has_zombie_child():
                return reaped
            time.sleep(0.05)
            continue
        reaped += 1


def _has_zombie_child() -> bool:
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if f[1] == me and f[0] in ("Z", "X"):
            return True
    return False


def suite_cpu_seconds() -> float:
    """CPU seconds of this bench process, its reaped children (every stack process a figure started and
    stopped) and the bench's Kafka + S3: what the suite itself used."""
    total = 0.0
    try:
        f = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in f[11:15]) / _CLK
    except (OSError, IndexError, ValueError):
        pass
    for name in ("kafka", "s3"):
        try:
            total += cpu_seconds(int((BENCH_HOME / "pids" / f"{name}.pid").read_text().split()[0])) or 0.0
        except (OSError, ValueError, IndexError):
            pass
    return total


# ---- context handed to every figure ----------------------------------------------------------
@dataclass
class Context:
    """The suite's infra endpoints, a stamp for run names, and the options of this invocation."""

    infra: InfraEndpoints
    stamp: str
    quick: bool = False
    profile: bool = False
    out_dir: Path = field(default_factory=lambda: REPO_ROOT / "docs")
    extend: bool = False  # --extend: keep the earlier entry's seeds that this run does not repeat
    earlier: Mapping[str, Any] | None = None  # the figure's entry before this run (set per figure by the driver)

    def run_name(self, figure: str, suffix: str = "") -> str:
        return f"bench-{figure}-{self.stamp}{('-' + suffix) if suffix else ''}".replace("_", "-")

    def scale(self, seconds: float) -> float:
        """Window lengths shrink under --quick (a smoke run of the suite, not for the doc)."""
        return max(2.0, seconds / 5.0) if self.quick else seconds


def bench_infra() -> InfraEndpoints:
    return ensure_up(BENCH_HOME, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT,
                     s3_port=S3_PORT, progress=lambda m: None)


# ---- metrics and logs ------------------------------------------------------------------------
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


# ---- a stack ---------------------------------------------------------------------------------
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


# ---- the samples topic, read back after a run ------------------------------------------------
@dataclass(frozen=True)
class FragmentInfo:
    created_at: float  # the sampler's wall clock when the fragment was made
    steps: int
    returns: tuple[float, ...]  # returns of the episodes that ended in it
    sampler_id: str
    policy_version: int
    fingerprint: str = ""  # hash of the observations: equal only for identical trajectories


def read_samples(ctx: Context, run: str, timeout_s: float = 60.0, env_id: str = "CartPole-v1") -> list[FragmentInfo]:
    """Every fragment on ``<run>.samples`` (a run of ``env_id``), decoded, sorted by creation time. Read
    after the run, so the reading never competes with the measured processes for CPU."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from shared.fragment import decode_fragment
    from shared.kafka import Topics
    from shared.rl.envs import fragment_spec

    topic = Topics.for_run(run).samples
    spec = fragment_spec(env_id, max_bytes=64 * 1024 * 1024)

    async def go() -> list[FragmentInfo]:
        c = AIOKafkaConsumer(bootstrap_servers=ctx.infra.kafka_bootstrap, enable_auto_commit=False,
                             group_id=None, fetch_max_bytes=64 * 1024 * 1024,
                             max_partition_fetch_bytes=16 * 1024 * 1024)
        await c.start()
        out: list[FragmentInfo] = []
        try:
            parts = c.partitions_for_topic(topic)
            if not parts:
                await c._client.force_metadata_update()  # noqa: SLF001
                parts = c.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            ends = await c.end_offsets(tps)
            done = {tp for tp in tps if ends[tp] == 0}
            deadline = time.monotonic() + timeout_s
            while len(done) < len(tps) and time.monotonic() < deadline:
                polled = await c.getmany(timeout_ms=500, max_records=2000)
                for tp, recs in polled.items():
                    for rec in recs:
                        f = decode_fragment(rec.headers, rec.value, spec)
                        out.append(FragmentInfo(f.created_at, f.steps, tuple(float(r) for r in f.episode_returns),
                                                f.sampler_id, f.policy_version,
                                                hashlib.blake2b(f.obs.tobytes(), digest_size=8).hexdigest()))
                        if rec.offset + 1 >= ends[tp]:
                            done.add(tp)
        finally:
            await c.stop()
        out.sort(key=lambda f: f.created_at)
        return out

    return asyncio.run(go())


def episode_curve(frags: list[FragmentInfo]) -> list[tuple[float, int, float]]:
    """(seconds since the first fragment, env steps so far, return) for every finished episode,
    in the order the fragments were made."""
    if not frags:
        return []
    t0 = frags[0].created_at
    steps = 0
    out: list[tuple[float, int, float]] = []
    for f in frags:
        steps += f.steps
        for r in f.returns:
            out.append((f.created_at - t0, steps, r))
    return out


def rolling_mean(curve: list[tuple[float, int, float]], n: int) -> list[tuple[float, int, float]]:
    """(t, steps, mean of the last ``n`` returns) from the n-th episode on."""
    out: list[tuple[float, int, float]] = []
    window: list[float] = []
    total = 0.0
    for t, steps, r in curve:
        window.append(r)
        total += r
        if len(window) > n:
            total -= window.pop(0)
        if len(window) == n:
            out.append((t, steps, total / n))
    return out


def return_at_steps(curve: list[tuple[float, int, float]], steps: int, n: int = 100) -> float:
    """Mean of the last ``n`` episodes finished within the first ``steps`` env steps."""
    rs = [r for _, s, r in curve if s <= steps][-n:]
    return sum(rs) / len(rs) if rs else float("nan")


def seconds_to_steps(frags: list[FragmentInfo], steps: int) -> float:
    """Seconds from the first fragment's creation to the one that brought the env steps to ``steps``
    (NaN when they never got there)."""
    total = 0
    for f in frags:
        total += f.steps
        if total >= steps:
            return f.created_at - frags[0].created_at
    return float("nan")


def first_reaching(means: list[tuple[float, int, float]], threshold: float) -> tuple[float, int] | None:
    """(seconds, env steps) of the first point of a running-mean curve at or above ``threshold``."""
    for t, steps, m in means:
        if m >= threshold:
            return t, steps
    return None


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset); anything but a number > 0 is
    a ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want seconds, a number > 0") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: want seconds, a number > 0")
    return value


def parse_seeds(raw: str, name: str = "seeds") -> tuple[int, ...]:
    """``"N"``: seeds 1..N; ``"4,5"`` or ``"4-5"`` (or a mix, ``"1,4-5"``): exactly those, each once and in order.
    Anything else is a ValueError naming ``name``."""
    seeds: list[int] = []
    try:
        if raw.strip().isdigit():
            seeds = list(range(1, int(raw) + 1))
        else:
            for part in raw.split(","):
                lo, _, hi = part.strip().partition("-")
                seeds.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 1 or len(set(seeds)) != len(seeds):
        raise ValueError(f"{name}={raw!r}: want a count N (seeds 1..N) or distinct seeds >= 1 like '4,5' or '4-5'")
    return tuple(seeds)


def bench_seeds(figure: str, full: int, quick: int, ctx: Context) -> tuple[int, ...]:
    """``FLYWHEEL_BENCH_<FIGURE>_SEEDS`` if set (``parse_seeds``: a count or a list), else seeds 1..``quick``
    under --quick, else 1..``full``."""
    name = f"FLYWHEEL_BENCH_{figure.upper()}_SEEDS"
    if ctx.extend and name not in os.environ:  # the default 1..n would rerun and replace the earlier seeds
        raise ValueError(f"--extend: name the seeds to add with {name} (e.g. {name}=4,5)")
    return parse_seeds(os.environ.get(name, str(quick if ctx.quick else full)), name)


def ran_by(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Where a figure's entry was measured: command, commit, date and CPU (what a per-seed record carries once it
    is kept by a later run that extends the figure)."""
    m = entry.get("machine", {})
    return {"command": entry.get("command"), "commit": m.get("commit"), "date": entry.get("date"),
            "cpu_model": m.get("cpu_model"), "cores": m.get("cores")}


def earlier_runs(ctx: Context, figure: str, seeds: Sequence[int],
                 same: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Under ``--extend``: the per-seed records of the figure's earlier entry (``numbers.peers.<peer>.runs``) whose
    seeds this run does not repeat, each tagged with where it ran (``ran``, kept from an earlier merge). The
    earlier entry must have been measured with the ``same`` numbers (a wall budget, an env-step budget), or
    the seeds would not be comparable: a ValueError says which differs, as it does when the peers' kept seeds
    differ. Both are checked before any new seed runs. Without ``--extend``: nothing."""
    if not ctx.extend:
        return {}
    earlier = ctx.earlier or {}
    numbers = earlier.get("numbers") or {}
    if not numbers.get("peers"):
        raise ValueError(f"--extend: {figure} has no earlier result in {ctx.out_dir / 'benchmarks.json'} to extend")
    for key, want in same.items():
        if numbers.get(key) != want:
            raise ValueError(f"--extend: {figure}'s earlier result has {key}={numbers.get(key)!r}, this run "
                             f"{want!r}; seeds measured differently cannot be pooled")
    origin = ran_by(earlier)
    kept: dict[str, list[dict[str, Any]]] = {}
    for peer, body in numbers["peers"].items():
        # a record kept by an earlier merge keeps its origin (top level, or in ``extra`` where a figure puts it)
        kept[peer] = [{**r, "ran": r.get("ran") or (r.get("extra") or {}).get("ran") or origin}
                      for r in body.get("runs", []) if r.get("seed") not in seeds]
    seed_sets = {peer: sorted(r["seed"] for r in v) for peer, v in kept.items()}
    if len({tuple(v) for v in seed_sets.values()}) > 1:
        raise ValueError(f"--extend: {figure}'s earlier result has different seeds per peer ({seed_sets}); "
                         "they cannot be paired")
    return kept


def provenance_md(records: Iterable[Mapping[str, Any]], this_run: str = "this run") -> str:
    """One line naming which seeds came from which run, for a figure pooled from several (empty when every
    record is from this run)."""
    groups: dict[tuple[Any, ...], set[int]] = {}
    for r in records:
        ran = r.get("ran")
        key = (ran["command"], ran["commit"], ran["date"], ran["cpu_model"]) if ran else ()
        groups.setdefault(key, set()).add(int(r["seed"]))
    if set(groups) <= {()}:
        return ""
    parts = []
    for key, seeds in sorted(groups.items(), key=lambda kv: min(kv[1])):
        which = ", ".join(str(s) for s in sorted(seeds))
        if key:
            command, commit, date, cpu = key
            parts.append(f"seeds {which} from `{command}` at commit `{commit}` on {date} ({cpu})")
        else:
            parts.append(f"seeds {which} from {this_run} (its *Ran* line below)")
    return ("Pooled from more than one run (each seed's sides ran one after the other in the same run): "
            + "; ".join(parts) + ".")


# Two-sided 95% quantiles of Student's t by degrees of freedom (no scipy in the bench's dependencies).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


@dataclass(frozen=True)
class Interval:
    """Mean of independent runs with a 95% t-interval (half-width ``half``; NaN with fewer than 2 runs)."""

    mean: float
    half: float
    n: int
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float]) -> Interval:
        vs = [float(v) for v in values if v == v]
        if not vs:
            return cls(float("nan"), float("nan"), 0, ())
        if len(vs) < 2:
            return cls(vs[0], float("nan"), 1, tuple(vs))
        df = len(vs) - 1
        t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96  # the next lower df: conservative
        return cls(statistics.fmean(vs), t * statistics.stdev(vs) / len(vs) ** 0.5, len(vs), tuple(vs))

    def fmt(self, digits: int = 0) -> str:
        if self.n == 0:
            return "n/a"
        return f"{self.mean:,.{digits}f}" + ("" if self.half != self.half else f" ± {self.half:,.{digits}f}")

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "ci95_half_width": self.half, "n": self.n, "values": list(self.values)}


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
