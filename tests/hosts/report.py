"""``docs/reliability-network.md``, written by the partition suite (``make test-partitions``) from its rows."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devstack.config import REPO_ROOT
from tests.faults.liveness import BOUND_S
from tests.faults.liveness import PAGE_TEXT as SAMPLERS_BACK
from tests.faults.report import commit_label
from tests.hosts.net import NetRow

if TYPE_CHECKING:
    from tests.hosts.test_soak import SoakEvent

PATH = REPO_ROOT / "docs" / "reliability-network.md"
SOAK_PATH = REPO_ROOT / "docs" / "reliability-soak.md"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


NOT_YET = [
    "- **Alerts that fire**: the production rules' `for:` (FlywheelServiceDown 1 min, FlywheelServiceDegraded and",
    "  FlywheelKafkaUnderReplicated 5 min, FlywheelNoLiveSamplers 2 min) are longer than most cuts here, so most",
    "  rows show alerts *pending*, not firing. No test-only rule file with shorter `for:` is used: the column",
    "  reports what the real rules did. A row that holds a cut past a rule's `for:` would show it firing.",
]


def write_network_reliability(rows: list[NetRow], minutes: float | None = None, path: Path | None = None) -> Path:
    path = path or PATH
    took = f", the suite took {minutes:.1f} min" if minutes is not None else ""
    lines = [
        "# Reliability across a network: partitions on the multi-host stack",
        "",
        "Written by the partition suite (`make test-partitions`, `tests/hosts/`); do not edit by hand.",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit `{commit_label()}`, "
        f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}){took}.",
        "",
        "The stack (`python -m devstack up --hosts --brokers 3 --trainers 2 --samplers 2 --store s3`): three KRaft",
        "nodes, the S3 server, two data-parallel trainer ranks, paramsync, admin and two samplers, each in a network",
        "namespace of its own with its own address on one bridge (`docs/local-stack.md`, multi-host). Run topics",
        "have replication factor 3 and `min.insync.replicas` 2; producers use `acks=all` and idempotence.",
        "`trainer.checkpoint_every` is 20 (cartpole.yaml's 50) so each row's proof has a checkpoint soon after",
        "its heal. A cut is `iptables` DROP rules inside one part's namespace (`python -m devstack hosts cut`);",
        "every row first shows the cut took effect (a TCP connection across it fails, one beside it still",
        "succeeds), then heals, then checks the data:",
        "",
        "- *records lost*: acknowledged writes (every `fragment_produced` a sampler logged, with its partition",
        "  and offset) not on `<run>.samples` at that offset with that sample id, plus records that left the log",
        "  untrained (`records_lost_before_training`). Must be 0.",
        "- *trained twice*: fragments (by sample id) on the topic at two offsets that were both trained. Must be 0.",
        "- *verify*: `flywheel verify` on the first checkpoint after the heal: the ledger, cumulative from the run's",
        "  origin, against the topics: every offset of every partition trained, dead-lettered or dropped exactly",
        "  once. The checks are cumulative: each row's also covers every row before it.",
        "- *detect*: from the cut to the first service `/status` shows degraded or down (or the trainer stalled),",
        "  polled every ~2 s; *heal*: from the heal until the trainer's updates and the published version both",
        "  advanced past their values at the heal. `/status` includes `services.kafka`: the run topics' partitions",
        "  as admin describes them (degraded while one is under-replicated or offline, naming it).",
        f"- {SAMPLERS_BACK} Each sampler's `/healthz` is read from the root namespace at its part's address.",
        "- *alerts*: Prometheus runs with the stack (root namespace, scraping every part at its own address every",
        "  5 s, rules evaluated every 5 s) with the production rules of `deploy/prometheus/alerts.yml`, unchanged;",
        "  its `/api/v1/alerts` is polled every ~2 s from the cut until the row's checks are done (some seconds",
        "  after the heal). Times are from the cut: *from* is when the rule's condition began to hold (Prometheus's",
        "  `activeAt`), *at* the first poll that saw it firing. An alert pending only did not last its rule's",
        "  `for:` (named); alerts already active before the cut are listed apart.",
        "",
        "| fault (and how the cut was shown) | outcome | cut (s) | detect (s) | what the operator saw (`/status`) "
        "| alerts (Prometheus, production rules) | heal (s) | samplers back (s) | during the cut | records lost "
        "| trained twice | verify | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        det, heal = _secs(r.detect_s), _secs(r.heal_s)
        lost, twice = ("-" if n is None else str(n) for n in (r.lost, r.twice))
        lines.append(f"| **{_cell(r.name)}**: {_cell(r.fault)} | {r.outcome} | {r.cut_s:.0f} | {det} | "
                     f"{_cell(r.detected[:400])} | {_cell(r.alerts)} | {heal} | {_cell(r.samplers)} "
                     f"| {_cell(r.during)} | {lost} | {twice} | "
                     f"{_cell(r.verify)} | "
                     f"{_cell('; '.join(r.notes)) or '-'} |")
    lines += ["", "The soak (partitions and `kill -9` at random for 10 minutes, `make test-soak`, outside CI) writes",
              "its own page: [`docs/reliability-soak.md`](reliability-soak.md).",
              "", "## Not covered yet", "", *NOT_YET, ""]
    path.write_text("\n".join(lines))
    return path


def write_soak(seed: int, minutes: float, faults_s: float, events: list[SoakEvent], total: NetRow,
               acc: dict[str, Any], outside: list[str], restarts: dict[str, int], path: Path | None = None) -> Path:
    """``docs/reliability-soak.md``: the soak's events, one row each, and its totals (``make test-soak``)."""
    path = path or SOAK_PATH
    kinds = {k: sum(1 for e in events if e.plan.kind == k) for k in ("cut", "kill", "cut+kill")}
    kills = sum(1 for e in events if e.plan.kill)
    cuts = sum(1 for e in events if e.plan.cut)
    ok = total.outcome == "ok" and not outside and not any(e.problems for e in events)
    lines = [
        "# Reliability soak: partitions and `kill -9` at random on the multi-host stack",
        "",
        "Written by the soak (`make test-soak`, `tests/hosts/test_soak.py`); do not edit by hand. It runs outside CI",
        "(docs/reliability.md): the faults alone take `SOAK_MINUTES` (default 10), the stack's start and the final",
        "checks some 3-5 more (12.8 min in all for 10 minutes of faults on a 2-core machine).",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit `{commit_label()}`, "
        f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}); seed **{seed}** "
        f"(`FLYWHEEL_SOAK_SEED={seed} make test-soak` replays the same sequence of events), "
        f"{minutes:g} minutes asked, faults for {faults_s / 60:.1f} min.",
        "",
        "The stack is the partition suite's ([reliability-network.md](reliability-network.md): 3 KRaft brokers, S3,",
        "two trainer ranks, paramsync, admin, two samplers, each in its own network namespace; RF 3, min ISR 2;",
        "Prometheus with the production alert rules). Events follow one another with a few seconds between them:",
        "",
        "- *cut*: one part cut from some peers (every broker, S3, the other rank, the other brokers, a random few",
        "  parts) for 10-40 s, then healed (`iptables` DROP inside its namespace);",
        "- *kill*: `kill -9` of one process (trainer rank, sampler, paramsync, admin, or a broker; services twice as",
        "  likely); the supervisor restarts it;",
        "- *cut+kill*: a kill of another part in the middle of a cut (never two brokers away at once).",
        "",
        "Per event: *detect*, from the event's start to the first service `/status` showed not ok (kills are watched",
        "15 s); *restart*, from the kill to the supervisor's new process; *recover*, from the heal (or the restart)",
        "until the trainer's updates and the published version both advanced; *samplers back*, each sampler's",
        "seconds from the heal (or the killed process's restart) to its first fragment acknowledged after it, read",
        f"from its own `/healthz` (`tests/faults/liveness.py`; every sampler must produce again within {BOUND_S:.0f}",
        "s, or the event has a problem naming it); *lost* / *twice*, records lost or",
        "trained twice whose write was acknowledged in the event's window (its start to the next event's); *alerts*,",
        "those whose condition began in it. After the last event everything is healed, training must advance, and",
        "the partition rows' checks run on the whole run (cumulative from its origin): records lost, trained twice,",
        "`flywheel verify` on a checkpoint after the last event. The next event starts once training advanced,",
        "not once every service is ok: an event's *detect* can be an earlier event's after-effect still showing (a",
        "broker killed just before still catching up: `kafka: degraded` within a second of the next event's start).",
        "",
        f"**Result: {'ok' if ok else 'FAILED'}.** {len(events)} events ({kinds['cut']} cuts, {kinds['kill']} kills, "
        f"{kinds['cut+kill']} cut+kill: {cuts} cuts and {kills} kills in all); records lost "
        f"{'-' if total.lost is None else total.lost}, trained twice {'-' if total.twice is None else total.twice}, "
        f"`flywheel verify` {total.verify}; {acc.get('acknowledged', '?')} acknowledged writes checked on the topic "
        f"({acc.get('on_topic', '?')} records), {acc.get('records_trained', '?')} trained; "
        f"{acc.get('sampler_send_failures', 0)} sends failed at the samplers (never acknowledged, not lost), "
        f"{acc.get('resent_duplicates', 0)} fragment(s) on the topic twice with the second not trained.",
        "",
        "Restarts seen by admin during the soak: "
        + (", ".join(f"{k} {v}" for k, v in sorted(restarts.items()) if v) or "none") + ".",
        "",
        f"Alerts over the whole soak (Prometheus, production rules): {_cell(total.alerts)}",
        "",
        "| # | at (s) | event | cut shown | detect (s) | what `/status` showed first | restart (s) | recover (s) "
        "| samplers back (s) | lost | twice | alerts begun | problems |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in events:
        det, rs, rc = _secs(e.detect_s), _secs(e.restart_s), _secs(e.recover_s)
        lines.append(f"| {e.index} | {e.start_s:.0f} | {e.plan.kind}: {_cell(e.plan.describe())} "
                     f"| {_cell(e.cut_shown)} | {det} | {_cell(e.detected[:300])} | {rs} | {rc} | {_cell(e.samplers)} "
                     f"| {e.lost} | {e.twice} "
                     f"| {_cell(e.alerts)} "
                     f"| {_cell('; '.join(e.problems)) or '-'} |")
    if outside:
        lines += ["", f"Lost or trained twice outside every event's window: {', '.join(outside)}"]
    lines.append("")
    path.write_text("\n".join(lines))
    return path
