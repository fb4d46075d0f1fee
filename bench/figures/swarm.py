"""The swarm: 256 and 1,000 sampler identities against 3 Kafka brokers, the real trainer and
paramsync, with the old flow-control design (one credits partition: every sampler reads every grant, which
carries every sampler's count) beside the new (credits sharded, samplers / 16 partitions; samplers take turns
when they outnumber ``trainer.flow_window``), and the new design again with a consumer per identity (own: the
brokers' fan-out). The identities are ``bench.swarm_client`` processes (its docstring says what each identity
does as a sampler does, and what the identities of a process share); one real sampler process runs beside them
for its RSS and idle CPU. On the multi-host stack (``devstack.hosts``) where this machine can make test hosts,
each swarm process on a host of its own; else on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.context import BENCH_HOME, Context, say
from bench.machine import cpu_seconds, loadavg, machine_busy_seconds
from bench.proc import mapped, memory
from bench.report import FigureResult, Row
from bench.stack import _HTTP, BenchStack, stack
from bench.stats import percentile
from devstack import REPO_ROOT, LocalStack
from devstack import down as infra_down
from devstack import hosts as multihost
from devstack.config import StackError
from devstack.infra import ensure_up
from shared.credits import shard_of
from shared.kafka import Topics

NAME = "swarm"
TITLE = ("A swarm of 256 and 1,000 sampler identities against 3 brokers, the trainer and paramsync (on the "
         "multi-host stack: every part and each swarm process on a test host of its own; loopback where test hosts "
         "cannot be made): "
         "credits and policy topic bytes/s, broker CPU, sync latency, lag at training time, the old design (one "
         "credits partition) beside the new (sharded, taking turns).")
TARGET = ("new design: credits B/s per sampler at 1,000 <= 2x that at 256; lag at training time <= max_staleness; "
          "sync p99 reported")
SIZES = tuple(int(x) for x in os.environ.get("FLYWHEEL_BENCH_SWARM_SIZES", "256,1000").split(","))
"""Identities per run; ``FLYWHEEL_BENCH_SWARM_SIZES=16,32`` for a smoke run."""
DESIGNS = tuple(os.environ.get("FLYWHEEL_BENCH_SWARM_DESIGNS", "old,new,own").split(","))
"""old: one credits partition, one consumer per swarm process; new: sharded credits, one consumer per process; own:
sharded credits, every identity with consumers of its own (as a real sampler: the brokers' fan-out cost)."""
READERS = {"old": "shared", "new": "shared", "own": "own"}
PROCESSES = 4
"""Swarm client processes the identities are spread over."""
SAMPLERS_PER_SHARD = 16
"""The new design's credits partitions: samplers / 16 (docs/architecture.md, "Sharded grants")."""
SWARM_HOME = BENCH_HOME / "swarm-infra"
"""The loopback run's Kafka and S3."""
SWARM_HOSTS_HOME = BENCH_HOME / "swarm-hosts"
"""The multi-host run's stack: its network, Kafka nodes and S3 server (kept between the runs, removed at the end)."""
SWARM_HOSTS = tuple(range(10, 10 + PROCESSES))
"""The test hosts of the swarm processes (``sampler-10`` ..: 10.77.0.110 ..), beside the real sampler's."""
WHERE = os.environ.get("FLYWHEEL_BENCH_SWARM_WHERE", "hosts")
"""``hosts`` (the multi-host stack: root and network namespaces; loopback, saying why, where they cannot be made)
or ``loopback``."""
SWARM_KAFKA_PORT, SWARM_CONTROLLER_PORT, SWARM_S3_PORT = 29192, 29193, 29100
BROKERS = 3
COLLECT_S = 0.02
"""Seconds one synthetic fragment takes to 'collect' (a sleep: a cheap env, no CPU)."""


def partitions_for(design: str, samplers: int) -> int:
    """1 (old); new and own: samplers / 16 rounded up to a power of two (16 for 256, 64 for 1,000, as
    docs/scaling.md)."""
    if design == "old":
        return 1
    parts = 1
    while parts * SAMPLERS_PER_SHARD < samplers:
        parts *= 2
    return parts


# ---- pure accounting (unit-tested) -------------------------------------------------------------
def credits_read(bytes_by_partition: Mapping[int, float], sampler_ids: Iterable[str],
                 partitions: int) -> dict[str, float]:
    """What the samplers read of the credits topic: each reads only its own partition (``shard_of``), so one
    sampler reads that partition's bytes. Returns the mean per sampler, the largest, and the fleet's total (each
    partition's bytes times its readers)."""
    readers: dict[int, int] = {}
    for sid in sampler_ids:
        p = shard_of(sid, partitions)
        readers[p] = readers.get(p, 0) + 1
    n = sum(readers.values())
    fleet = sum(bytes_by_partition.get(p, 0.0) * k for p, k in readers.items())
    return {"per_sampler_mean": fleet / n if n else float("nan"),
            "per_sampler_max": max((bytes_by_partition.get(p, 0.0) for p in readers), default=float("nan")),
            "fleet": fleet}


def sync_latencies(published: Mapping[int, float], adoptions: Sequence[Mapping[str, Sequence[float]]],
                   identities: int, t0: float, t1: float) -> tuple[list[float], int]:
    """Per version published in ``[t0, t1]``: seconds from its publication until the last of ``identities``
    acted on it (or a newer one), from the clients' per-process ``adoptions`` (version -> [count, first, last]).
    Returns the latencies of the versions every identity reached and how many versions some never did."""
    out, missed = [], 0
    for v, t_pub in sorted(published.items()):
        if not t0 <= t_pub <= t1:
            continue
        count, last = 0, float("-inf")
        for proc in adoptions:
            e = proc.get(str(v))
            if e is not None:
                count += int(e[0])
                last = max(last, float(e[2]))
        if count >= identities:
            out.append(max(0.0, last - t_pub))
        else:
            missed += 1
    return out, missed


def histogram(text: str, family: str) -> dict[str, Any]:
    """A Prometheus histogram of a /metrics page: cumulative buckets {le: count}, sum and count."""
    out: dict[str, Any] = {"buckets": {}, "sum": 0.0, "count": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                out["buckets"][le] = out["buckets"].get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                out["sum"] += s.value
            elif s.name.endswith("_count"):
                out["count"] += s.value
    return out


def histogram_window(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float]:
    """Mean and an upper bound of the maximum (the smallest bucket holding every observation) of what a
    histogram observed between two readings ``a`` and ``b``."""
    n = b["count"] - a["count"]
    if n <= 0:
        return {"n": 0, "mean": float("nan"), "max_le": float("nan")}
    max_le = next((le for le in sorted(b["buckets"]) if b["buckets"][le] - a["buckets"].get(le, 0.0) >= n),
                  float("inf"))
    return {"n": n, "mean": (b["sum"] - a["sum"]) / n, "max_le": max_le}


# ---- measuring -----------------------------------------------------------------------------------
class TopicBytes:
    """Key + value + header bytes (uncompressed, without Kafka's record and batch framing) of every record that
    lands on the credits and policy topics while it runs, per partition: a consumer in this process from the
    topics' ends, counting records whose timestamp is in the window."""

    def __init__(self, bootstrap: str, topics: Sequence[str]) -> None:
        self.bootstrap, self.topics = bootstrap, list(topics)
        self.bytes: dict[tuple[str, int], float] = {}
        self.records: dict[str, int] = {t: 0 for t in topics}
        self.window = (float("inf"), float("-inf"))
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._go()), daemon=True)
        self.error: str | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        self._ready.wait(timeout_s)

    def stop(self, t0: float, t1: float) -> None:
        self.window = (t0, t1)
        time.sleep(1.0)  # what was produced by t1 arrives
        self._stop.set()
        self._thread.join(30)

    async def _go(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        c = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=16 * 1024 * 1024)
        pending: list[tuple[str, int, float, int]] = []
        try:
            await c.start()
            tps = []
            for topic in self.topics:
                parts = c.partitions_for_topic(topic)
                if not parts:
                    await c._client.force_metadata_update()  # noqa: SLF001
                    parts = c.partitions_for_topic(topic) or set()
                tps += [TopicPartition(topic, p) for p in sorted(parts)]
            c.assign(tps)
            await c.seek_to_end(*tps)
            for tp in tps:
                await c.position(tp)
            self._ready.set()
            while not self._stop.is_set():
                polled = await c.getmany(timeout_ms=200, max_records=5000)
                for tp, recs in polled.items():
                    for r in recs:
                        size = len(r.key or b"") + len(r.value or b"") + sum(len(k) + len(v or b"")
                                                                            for k, v in (r.headers or ()))
                        pending.append((tp.topic, tp.partition, r.timestamp / 1000.0, size))
        except Exception as exc:  # the figure says so instead of counting nothing silently
            self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()
        finally:
            await c.stop()
        t0, t1 = self.window
        for topic, part, ts, size in pending:
            if t0 <= ts <= t1:
                self.bytes[(topic, part)] = self.bytes.get((topic, part), 0.0) + size
                self.records[topic] += 1


def broker_pids(home: Path) -> list[int]:
    pids = []
    for f in sorted((home / "pids").glob("kafka*.pid")):
        try:
            pids.append(int(f.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def import_probe(inference: str) -> dict[str, Any]:
    """A sampler's RolloutWorker built with ``sampler.inference`` = ``inference`` in a fresh interpreter: whether
    torch / onnxruntime were imported, and the process's RSS (VmRSS: ``ru_maxrss`` keeps the bench's own peak
    across exec)."""
    code = ("import sys; from shared.settings import load_settings; "
            "from services.sampler.rollout import RolloutWorker; s = load_settings(); "
            "w = RolloutWorker.from_settings(s, 'probe', 1); "
            "print({'policy': type(w.policy).__name__, 'torch': 'torch' in sys.modules, "
            "'onnxruntime': 'onnxruntime' in sys.modules, "
            "'rss_mib': [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmRSS:')][0] / 1024})")
    env = {**os.environ, "FLYWHEEL_CONFIG": str(REPO_ROOT / "configs" / "cartpole.yaml"),
           "FLYWHEEL_SAMPLER_INFERENCE": inference}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                         cwd=REPO_ROOT)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-300:]}
    import ast

    result: dict[str, Any] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return result


def _trainer_page(st: BenchStack) -> str:
    return _HTTP.get(st.metrics_url("trainer")).text


def _counter(text: str, name: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


def where_to_run() -> tuple[str, str]:
    """("hosts" | "loopback", why loopback). Refuses while another multi-host stack runs (one per machine)."""
    if WHERE == "loopback":
        return "loopback", "FLYWHEEL_BENCH_SWARM_WHERE=loopback"
    try:
        multihost.preflight()
    except StackError as exc:
        return "loopback", f"test hosts cannot be made here: {exc}"
    seen = multihost.observe()
    if seen.owner is not None and seen.owner != str(SWARM_HOSTS_HOME.resolve()) and multihost.active(Path(seen.owner)):
        raise StackError(f"another multi-host stack (home {seen.owner}) runs on this machine: the swarm needs the "
                         "test hosts to itself (or FLYWHEEL_BENCH_SWARM_WHERE=loopback)")
    return "hosts", ""


def measure(ctx: Context, samplers: int, design: str, warmup_s: float, window_s: float,
            hosts_home: Path | None = None) -> dict[str, Any]:
    """One run. ``hosts_home``: on the multi-host stack of that home, each swarm process on a test host of its
    own (:data:`SWARM_HOSTS`); else on 127.0.0.1 with ``ctx.infra``."""
    parts = partitions_for(design, samplers)
    run = ctx.run_name(NAME, f"{design}-{samplers}")
    topics = Topics.for_run(run)
    say(f"{NAME}: {samplers} identities, {design} design ({parts} credits partition{'s' * (parts > 1)})")
    with stack(ctx, run, {"FLYWHEEL_KAFKA_CREDITS_PARTITIONS": parts}, hosts_home=hosts_home,
               brokers=BROKERS) as st:
        st.up(1, timeout_s=480.0 if hosts_home else 180.0)  # trainer, paramsync, admin and one real sampler
        if hosts_home is not None:  # the swarm processes' hosts, beside sampler-0's (up prunes them: made each run)
            multihost.ensure_network(hosts_home, multihost.plan(BROKERS, 1, [0, *SWARM_HOSTS]), lambda m: None)
        st.wait_trained(1, timeout_s=180)
        env = st.stack.service_env("sampler", 0)
        env.pop("FLYWHEEL_SAMPLER_ID", None)
        env.pop("FLYWHEEL_LOG_FILE", None)
        out_dir = st.home / "swarm"
        out_dir.mkdir(parents=True, exist_ok=True)
        procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        per = -(-samplers // PROCESSES)
        try:
            for k in range(PROCESSES):
                first, count = k * per, min(per, samplers - k * per)
                if count <= 0:
                    break
                out = out_dir / f"swarm-{k}.json"
                log = (out_dir / f"swarm-{k}.out").open("wb")
                netns = multihost.netns_name(f"sampler-{SWARM_HOSTS[k]}") if hosts_home is not None else None
                procs.append((subprocess.Popen(multihost.netns_exec(netns, [  # ip netns exec execs: same pid
                    sys.executable, "-m", "bench.swarm_client", "--first", str(first), "--count", str(count),
                    "--out", str(out), "--collect-s", str(COLLECT_S), "--readers", READERS[design]]),
                    env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT), out))
            # Every identity is known to the trainer once it consumed a fragment of each (one each, at first).
            consumed0 = _counter(_trainer_page(st), "flywheel_trainer_fragments_consumed_total")
            t_start = time.monotonic()
            try:
                st.wait_for(f"{samplers} identities' first fragments consumed",
                            lambda: _counter(_trainer_page(st), "flywheel_trainer_fragments_consumed_total")
                            >= consumed0 + samplers, timeout_s=240, poll_s=2.0)
                known_after = time.monotonic() - t_start
            except TimeoutError:
                known_after = None
                say(f"{NAME}: not every identity's first fragment was consumed within 240 s; measuring anyway")
            time.sleep(warmup_s)
            pids = {"trainer": st.stack.pid("trainer"), "paramsync": st.stack.pid("paramsync"),
                    "admin": st.stack.pid("admin"), "sampler": st.stack.pid("sampler", 0)}
            brokers = broker_pids(st.infra_home)
            swarm_pids = [p.pid for p, _ in procs]

            def cpu_now() -> dict[str, float]:
                c = {k: cpu_seconds(v) or 0.0 for k, v in pids.items() if v is not None}
                c["brokers"] = sum(cpu_seconds(p) or 0.0 for p in brokers)
                c["swarm"] = sum(cpu_seconds(p) or 0.0 for p in swarm_pids)
                c["bench"] = cpu_seconds(os.getpid()) or 0.0
                c["machine"] = machine_busy_seconds()
                return c

            reader = TopicBytes(st.stack.endpoints().kafka_bootstrap, [topics.credits, topics.policy])
            reader.start()
            page0, cpu0, load0, w0, m0 = _trainer_page(st), cpu_now(), loadavg(), time.time(), time.monotonic()
            time.sleep(window_s)
            page1, cpu1, load1, w1, m1 = _trainer_page(st), cpu_now(), loadavg(), time.time(), time.monotonic()
            sampler_pid = pids["sampler"]
            sampler = {"rss_mib": memory(sampler_pid).get("VmRSS", float("nan")) if sampler_pid else float("nan"),
                       "torch_mapped": mapped(sampler_pid, "libtorch") if sampler_pid else None,
                       "onnxruntime_mapped": mapped(sampler_pid, "onnxruntime") if sampler_pid else None}
            reader.stop(w0, w1)
            dt = m1 - m0
            cores = {k: (cpu1[k] - cpu0.get(k, 0.0)) / dt for k in cpu1}
            sampler["cpu_cores"] = cores.get("sampler", float("nan"))
            published = {int(e["policy_version"]): e["_t"] for e in st.events("paramsync", "policy_published",
                                                                               since=w0 - 60)}
            sent = {int(e["policy_version"]): e["_t"] for e in st.events("trainer", "candidate_sent", since=w0 - 60)}
            synced = [float(e["latency_s"]) for e in st.events("paramsync", "policy_synced", since=w0)
                      if e["_t"] <= w1]
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p, _ in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        results = []
        for _, out in procs:
            try:
                results.append(json.loads(out.read_text()))
            except (OSError, ValueError):
                results.append({})
    ids = [f"swarm-{i}" for i in range(samplers)] + ["sampler-0"]
    credit_parts = {p: b / dt for (t, p), b in reader.bytes.items() if t == topics.credits}
    policy_bps = sum(b for (t, _), b in reader.bytes.items() if t == topics.policy) / dt
    reads = credits_read(credit_parts, ids, parts)
    adoptions = [r.get("adoptions", {}) for r in results]
    lat, missed = sync_latencies(published, adoptions, samplers, w0, w1 - 5.0)
    lat_sent, _ = sync_latencies(sent, adoptions, samplers, w0, w1 - 5.0)
    stale = histogram_window(histogram(page0, "flywheel_trainer_fragment_staleness_versions"),
                             histogram(page1, "flywheel_trainer_fragment_staleness_versions"))
    other = max(0.0, cores["machine"] - sum(v for k, v in cores.items() if k != "machine"))
    return {
        "samplers": samplers, "design": design, "credits_partitions": parts, "window_s": dt,
        "known_after_s": known_after,
        "credits_bps_total": sum(credit_parts.values()), "credits_records_per_s": reader.records[topics.credits] / dt,
        "credits_bps_per_sampler": reads["per_sampler_mean"], "credits_bps_per_sampler_max": reads["per_sampler_max"],
        "credits_bps_fleet": reads["fleet"],
        # One grant record per partition per pass: passes/s = records/s / partitions; what a sampler reads a pass.
        "credits_bytes_per_sampler_per_pass": reads["per_sampler_mean"] / (reader.records[topics.credits] / dt / parts)
        if reader.records[topics.credits] else float("nan"),
        "policy_bps": policy_bps, "policy_records_per_s": reader.records[topics.policy] / dt,
        "policy_bps_fleet": policy_bps * len(ids), "reader_error": reader.error,
        "sync_s": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "max": max(lat, default=float("nan")),
                   "versions": len(lat), "versions_not_reached": missed},
        "from_trainer_send_s": {"p50": percentile(lat_sent, 0.5), "p99": percentile(lat_sent, 0.99),
                                "versions": len(lat_sent)},
        "paramsync_synced_s": {"p50": percentile(synced, 0.5), "p99": percentile(synced, 0.99), "n": len(synced)},
        "lag": stale,
        "updates_per_s": (_counter(page1, "flywheel_trainer_updates_total")
                          - _counter(page0, "flywheel_trainer_updates_total")) / dt,
        "consumed_per_s": (_counter(page1, "flywheel_trainer_fragments_consumed_total")
                           - _counter(page0, "flywheel_trainer_fragments_consumed_total")) / dt,
        "dropped_stale": (_counter(page1, "flywheel_trainer_fragments_dropped_stale_total")
                          - _counter(page0, "flywheel_trainer_fragments_dropped_stale_total")),
        "grants_per_s": (_counter(page1, "flywheel_trainer_credit_grants_total")
                         - _counter(page0, "flywheel_trainer_credit_grants_total")) / dt,
        "cores": cores, "other_cores": other,
        "trainer_share_of_busy": cores.get("trainer", 0.0) / cores["machine"] if cores["machine"] > 0 else float("nan"),
        "load": {"before": load0, "after": load1},
        "sampler": sampler,
        "swarm": [{k: v for k, v in r.items() if k != "adoptions"} for r in results],
    }


def _f(x: Any, digits: int = 0) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if v != v else f"{v:,.{digits}f}"


def swarm_ran(r: Mapping[str, Any]) -> bool:
    """Whether a run's identities acted as a swarm: some identity had a fragment acknowledged. Where none did, the
    trainer trained only the real sampler's, and the run's lag and sync figures say nothing of the swarm."""
    return sum(int(p.get("fragments", 0)) for p in r.get("swarm") or ()) > 0


def new_hi_over_lo(res: Mapping[str, Mapping[str, Any]], sizes: Sequence[int]) -> float:
    """The new design's credits read per sampler at the largest size over that at the smallest."""
    lo, hi = res[f"new-{sizes[0]}"], res[f"new-{sizes[-1]}"]
    lo_bps, hi_bps = float(lo["credits_bps_per_sampler"]), float(hi["credits_bps_per_sampler"])
    return hi_bps / lo_bps if lo_bps > 0 else float("inf")


def headline_rows(res: Mapping[str, Mapping[str, Any]], sizes: Sequence[int], designs: Sequence[str],
                  max_staleness: int) -> list[Row]:
    """The figure's headline from its runs (``res``: ``<design>-<size>`` -> :func:`measure`'s result). A run whose
    identities sent nothing (:func:`swarm_ran`) gets one line saying so instead of its lag and sync."""
    new_lo, new_hi = res[f"new-{sizes[0]}"], res[f"new-{sizes[-1]}"]
    ratio = new_hi_over_lo(res, sizes)
    headline = [Row(f"new design: credits B/s per sampler, {sizes[-1]} / {sizes[0]}",
                    f"{ratio:.2f}x ({_f(new_hi['credits_bps_per_sampler'])} / {_f(new_lo['credits_bps_per_sampler'])})",
                    "<= 2x", ratio <= 2.0)]
    for key in [f"old-{n}" for n in (sizes[0], sizes[-1]) if "old" in designs]:
        headline.append(Row(f"{key}: credits B/s per sampler", _f(res[key]["credits_bps_per_sampler"])))
    for key in [f"{d}-{n}" for d in ("new", "own") if d in designs for n in sizes]:
        r = res[key]
        if not swarm_ran(r):
            starved = sum(int(p.get("without_policy", 0)) for p in r.get("swarm") or ())
            headline.append(Row(f"{key}: did not run as a swarm",
                                f"no identity's fragment was sent ({starved} of {r['samplers']} identities never got "
                                "a policy); its lag and sync are not the swarm's", "ran", False))
            continue
        lag_max = r["lag"]["max_le"]
        headline.append(Row(f"{key}: lag at training time mean / max bucket", f"{_f(r['lag']['mean'], 2)} / "
                            f"<= {_f(lag_max)}", f"<= {max_staleness}", lag_max <= max_staleness))
        headline.append(Row(f"{key}: sync p50 / p99 (publication -> every identity acts on it)",
                            f"{_f(r['sync_s']['p50'], 3)} / {_f(r['sync_s']['p99'], 3)} s "
                            f"({r['sync_s']['versions']} versions, {r['sync_s']['versions_not_reached']} not reached)"))
        if key.startswith("own"):
            headline.append(Row(f"{key}: broker CPU (cores, 3 JVMs) serving a consumer per identity",
                                f"{_f(r['cores'].get('brokers'), 2)}"))
    return headline


def run(ctx: Context) -> FigureResult:
    from shared.settings import load_settings

    warmup, window = ctx.scale(15), ctx.scale(60)
    max_staleness = load_settings(REPO_ROOT / "configs" / "cartpole.yaml").trainer.max_staleness
    probes = {inf: import_probe(inf) for inf in ("auto", "onnx")}
    say(f"{NAME}: import probes {probes}")
    where, why = where_to_run()
    hosts_home = SWARM_HOSTS_HOME if where == "hosts" else None
    if hosts_home is not None:
        say(f"{NAME}: on the multi-host stack in {hosts_home} ({BROKERS} Kafka nodes, S3, the trainer, paramsync, "
            f"admin, sampler-0 and the swarm processes on sampler-{SWARM_HOSTS[0]}..{SWARM_HOSTS[-1]}'s hosts)")
        sctx = ctx
    else:
        say(f"{NAME}: loopback ({why}): {BROKERS} brokers on 127.0.0.1:{SWARM_KAFKA_PORT}.. in {SWARM_HOME}")
        ep = ensure_up(SWARM_HOME, kafka_port=SWARM_KAFKA_PORT, controller_port=SWARM_CONTROLLER_PORT,
                       s3_port=SWARM_S3_PORT, brokers=BROKERS, progress=lambda m: None)
        sctx = dataclasses.replace(ctx, infra=ep)
    res: dict[str, dict[str, Any]] = {}
    try:
        for n in SIZES:
            for design in DESIGNS:
                r = measure(sctx, n, design, warmup, window, hosts_home)
                r["max_staleness"] = max_staleness
                res[f"{design}-{n}"] = r
                say(f"{NAME}: {design}-{n}: credits {r['credits_bps_total']:,.0f} B/s, per sampler "
                    f"{r['credits_bps_per_sampler']:,.0f} B/s, policy {r['policy_bps']:,.0f} B/s, sync p99 "
                    f"{r['sync_s']['p99']:.2f} s, lag mean {r['lag']['mean']:.2f}, cores {r['cores']}")
    finally:
        if hosts_home is not None:  # its Kafka nodes, S3 server, every namespace, link and rule
            LocalStack(hosts_home, hosts=True, progress=lambda m: None).down()
        else:
            infra_down(SWARM_HOME, progress=lambda m: None)
    ratio = new_hi_over_lo(res, SIZES)
    headline = headline_rows(res, SIZES, DESIGNS, max_staleness)
    rows = []
    for n in SIZES:
        for design in DESIGNS:
            r = res[f"{design}-{n}"]
            c = r["cores"]
            rows.append(
                f"| {n} | {design} ({r['credits_partitions']}) | {_f(r['credits_bps_total'])} "
                f"({_f(r['credits_records_per_s'], 1)} rec/s) | {_f(r['credits_bps_per_sampler'])} "
                f"| {_f(r['credits_bytes_per_sampler_per_pass'])} "
                f"| {_f(r['credits_bps_fleet'] / 1e6, 2)} | {_f(r['policy_bps'])} ({_f(r['policy_records_per_s'], 1)}"
                f" rec/s) | {_f(c.get('brokers'), 2)} | {_f(r['sync_s']['p50'], 3)} / {_f(r['sync_s']['p99'], 3)} "
                f"({r['sync_s']['versions']}, {r['sync_s']['versions_not_reached']} missed) "
                f"| {_f(r['from_trainer_send_s']['p50'], 3)} / {_f(r['from_trainer_send_s']['p99'], 3)} "
                f"| {_f(r['paramsync_synced_s']['p50'], 3)} / {_f(r['paramsync_synced_s']['p99'], 3)} "
                f"| {_f(r['lag']['mean'], 2)} / <= {_f(r['lag']['max_le'])} (max_staleness {r['max_staleness']}) "
                f"| {_f(c.get('trainer'), 2)} ({_f(100 * r['trainer_share_of_busy'])}% of busy) "
                f"| {_f(r['updates_per_s'], 1)} | {_f(c.get('swarm'), 2)} | {_f(c.get('paramsync'), 2)} "
                f"| {_f(c['machine'], 2)} (other {_f(r['other_cores'], 2)}) | {_f(r['load']['before'], 1)} -> "
                f"{_f(r['load']['after'], 1)} |")
    beats = [f"{k}: {sum(p.get('heartbeats_failed', 0) for p in r['swarm']):,} of "
             f"{sum(p.get('heartbeats', 0) for p in r['swarm']):,}" for k, r in res.items()]
    srows = [f"| {k} | {_f(r['sampler']['rss_mib'])} | {_f(r['sampler']['cpu_cores'], 3)} "
             f"| {r['sampler']['torch_mapped']} | {r['sampler']['onnxruntime_mapped']} |" for k, r in res.items()]
    details = "\n".join([
        (f"On the multi-host stack (`devstack.hosts`): {BROKERS} KRaft brokers, the S3 server, the trainer, "
         "paramsync, admin and one real sampler each in a network namespace of its own at its own address on one "
         f"bridge, and the identities in {PROCESSES} `bench.swarm_client` processes, each on a test host of its own "
         f"(sampler-{SWARM_HOSTS[0]}..{SWARM_HOSTS[-1]}); every byte between them crosses the bridge. Run topics "
         "replicated 3 times, min.insync.replicas 2. The test hosts are namespaces of one machine: everything "
         f"shares its {os.cpu_count()} cores." if hosts_home is not None else
         f"Loopback, not the multi-host stack ({why}): {BROKERS} KRaft brokers on 127.0.0.1 (run topics replicated 3 "
         "times, min.insync.replicas 2), the trainer, paramsync, admin and one real sampler as processes of a "
         f"LocalStack, the identities in {PROCESSES} `bench.swarm_client` processes. Everything shares the "
         f"machine's {os.cpu_count()} cores."),
        "",
        "| identities | design (credits partitions) | credits B/s written | credits B/s read per sampler "
        "| credits B read per sampler per grant pass "
        "| credits MB/s read by all samplers | policy B/s (each sampler reads all) | broker CPU (cores, 3 JVMs) "
        "| sync p50 / p99 s (versions, missed) | from the trainer's send p50 / p99 s "
        "| paramsync's `policy_synced` p50 / p99 s "
        "| lag at training time: mean / max bucket | trainer cores (share of busy CPU) | updates/s "
        "| swarm cores | paramsync cores | machine busy cores | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Identities' heartbeats the swarm's producers could not send (buffer full for `request_timeout_ms`: the "
        "brokers behind), of those sent, over each run's whole life: " + "; ".join(beats) + ".",
        "",
        "One real sampler process (`python -m services.sampler`, `sampler.inference: auto`) beside the swarm, over "
        "the same window (it waits for its turn most of the time: its idle cost):",
        "",
        "| run | RSS MiB | CPU cores | libtorch mapped | onnxruntime mapped |",
        "|---|---|---|---|---|",
        *srows,
        "",
        "A sampler's RolloutWorker built in a fresh interpreter (what each `sampler.inference` imports): "
        + "; ".join(f"`{k}`: {v}" for k, v in probes.items()) + ".",
    ])
    method = (
        f"Per size ({', '.join(str(n) for n in SIZES)}) and design (old: `kafka.credits_partitions: 1`; new: "
        f"samplers / {SAMPLERS_PER_SHARD} partitions), in that order, a fresh stack (fresh run: fresh topics) with "
        "`configs/cartpole.yaml` (flow_window default: 4 fragments, so both sizes take turns) and one real sampler; "
        f"then the identities start at once; after the trainer consumed one fragment per identity (each may send "
        f"one to make itself known) and {warmup:.0f} s more, one window of {window:.0f} s. Credits and policy "
        "bytes: a consumer in the bench process from the topics' ends sums key + value + header bytes (uncompressed, "
        "no record framing) of records timestamped in the window, per partition; a sampler reads its own partition "
        "(new) or the one partition (old), so 'read per sampler' is the mean over identities of their partition's "
        "bytes/s, and 'read by all samplers' their sum. In the old and new rows the swarm processes share one consumer "
        "per process (see `bench/swarm_client.py`), so the broker served each partition 4 times, not once per "
        "identity: their broker CPU does not include the per-reader fan-out a real swarm costs; the own rows (new "
        "design, every identity with its own credits and policy consumers, `--readers own`) do. Broker CPU: the 3 "
        "JVMs' utime + stime from /proc over the window. Sync latency: from paramsync's `policy_published` log line "
        "(after the announcement is sent; an identity may adopt a few ms before that line, counted as 0) to the last "
        "identity adopting that version or a newer one (the clients' wall clocks, same machine), for versions "
        "published in the window but its last 5 s; the same from the trainer's `candidate_sent` line; paramsync's own "
        "`policy_synced.latency_s` (candidate received -> heartbeat of the last live sampler) beside it. Lag at "
        "training time: the trainer's `flywheel_trainer_fragment_staleness_versions` histogram over the window "
        "(mean; max as the smallest bucket bound holding every observation).")
    return FigureResult(
        headline=headline,
        numbers={"runs": res, "import_probes": probes, "ratio_new_credits_per_sampler": ratio,
                 "max_staleness": max_staleness, "where": where, "brokers": BROKERS},
        settings={"sizes": list(SIZES), "processes": PROCESSES, "samplers_per_shard": SAMPLERS_PER_SHARD,
                  "collect_s": COLLECT_S, "warmup_s": warmup, "window_s": window, "brokers": BROKERS},
        method=method, details_md=details)
