"""Writes docs/reliability.md from what the fault suite measured (``make test-faults``)."""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from services.trainer.intake import DEDUP_WINDOW  # the text states the code's window, not a copy of it
from tests.faults.liveness import PAGE_TEXT as SAMPLERS_BACK

if TYPE_CHECKING:
    from tests.faults.conftest import Row

REPO = Path(__file__).resolve().parents[2]

GUARANTEES = f"""\
## What Flywheel guarantees, and where it ends

- **No service exits on a transient fault.** Kafka and object-store operations are retried with
  capped exponential backoff and jitter (`shared/retry.py`, tenacity; at most 10 s between tries),
  the service reports itself `degraded` with the reason (`/healthz`, `/status` → `services`,
  `flywheel_service_degraded`) and resumes by itself when the dependency is back. A fatal error (a
  bug, a refused authorisation, a configuration error) stops the process with a non-zero status
  and the reason in its last log line.
- **The local stack restarts what dies** (`python -m devstack supervise`, started by `make up`):
  capped exponential backoff with jitter, restarts counted (`python -m devstack status`). Compose
  does the same with `restart: unless-stopped`. Admin's `/status` counts restarts it sees in the
  heartbeats (`services.<name>.restarts`).
- **Every record gets an outcome**: trained, dropped as stale (at batch time, against the older of
  the trainer's version and the newest published one), or dead-lettered to `<run>.samples.dlq` with
  a `dlq-reason` header (undecodable, bad dtype or shape, non-finite, out of range, bad header, env
  mismatch, future version, duplicate sample id, ambiguous header, oversize; a payload over the size limit is
  dead-lettered as headers only, `dlq-truncated`). Offsets are committed only after the outcome,
  and only for partitions the trainer owns. A record re-delivered within a run (its commit lost in
  a rebalance) gets a second outcome: it is refused as a duplicate, never trained twice.
- **No record is trained twice within a trainer run** (sample ids are de-duplicated over the last
  {DEDUP_WINDOW:,} admitted; a revoke marks its partitions at once, waits for the update in progress and commits it
  before the partitions go; records of those partitions still in the poll or in a batch formed
  meanwhile are released, not trained).
- **Exactly-once model state across crashes**: a checkpoint stores the offsets its model reflects,
  and a restarted trainer seeks to them, so what was trained after the last checkpoint (and lost
  with the crash) is trained again, once. Checkpoint blobs are content-addressed; restore falls
  back to the previous good checkpoint; an unreachable store is retried, never taken for "no
  checkpoint"; with checkpoints present but none usable the trainer refuses to start unless
  `trainer.fresh_start=true`.
- **`flywheel verify` proves the run from the artifact and the topics**: every partition of the samples
  topic is in the newest checkpoint's ledger from the run's origin (offset 0), every offset of it has
  exactly one outcome (trained, dropped as stale, dead-lettered, gap), none was lost before training, and
  the outcomes agree with the samples and dead-letter topics. Records that leave the log before the trainer
  reads them (retention, `deleteRecords`) are found when the trainer reads past them and recorded as `lost`
  (audit entry, `flywheel_trainer_records_lost_total`, alert `FlywheelRecordsLost`): `verify` then fails,
  naming the partition and range (`tests/e2e/test_lost_records.py`).
- **A non-finite loss or gradient is refused** (the step is skipped and counted, the weights and
  optimizer state are kept).
- **Training cannot stall silently**: a candidate not published within
  `trainer.candidate_resend_s` is re-sent; paramsync re-announces the published version every
  `paramsync.reannounce_interval_s`; records arriving with no update for `trainer.stall_after_s`
  set `trainer.stalled` in `/status` with the reason, trigger a re-send, and fire
  `FlywheelTrainingStalled` if that did not help within 2 minutes.

Where it ends:

- **One trainer group.** Exactly-once model state assumes one trainer (with `trainer.world_size`
  ranks, its rank 0) owns the run's checkpoints; every rank's offsets and ledger are in rank 0's
  checkpoint, and losing a rank restarts the group from it. The trainer holds a lease in the store
  (`<run>/trainer/lease.json`, renewed every 2 s, fencing token checked before every checkpoint): a
  second trainer for the same run is refused
  at start naming the running one, and a trainer whose lease was taken over stops before writing.
  A foreign member in the consumer group (not a trainer) is handled: rebalances are safe, nothing
  is trained by both.
- **Records re-read after a crash may be dropped as stale.** They are re-processed from the
  checkpoint's offsets, but against the current published version; those older than
  `max_staleness` are dropped (counted), not trained. Checkpoint more often
  (`trainer.checkpoint_every`) to shorten that window.
- **Fragments a sampler could not send are gone** (`flywheel_sampler_send_errors_total`, logged with
  their sample id): they never reached Kafka, so no consumer can account for them.
- **Kafka's own durability** is the brokers': by default the local stack and compose run one
  broker with replication factor 1, so a lost disk loses the topics. `make up BROKERS=3` (compose:
  the `cluster` profile) runs three KRaft nodes with replication factor 3, `min.insync.replicas` 2
  and `acks=all`; its fault rows (a partition leader killed, two of three brokers away) are in
  `docs/reliability-cluster.md` (`make test-faults BROKERS=3`).
- **What `verify` does not prove.** Records beyond the checkpoint's resume offset are not in the model
  yet and are not claimed. A stale drop leaves nothing on a topic: the digests prove the offset was
  dropped, not what it held. Outcomes at offsets the log no longer holds (retention after training) are
  proven by the digests only (`below_log_start` in its output). A log truncated below the trainer's
  position (unclean leader election, which the run's topics do not allow) cannot be told from the digests.
  After a deliberate `trainer.fresh_start` the proof starts where the new model began, and says so.
- **Log lines**: services rotate their log files by size between lines (`log.file`,
  `log.max_bytes`, `log.backups`); lines older than the kept backups are gone, and with them the
  trace of those samples.
"""

NETWORK = """\
## Across a network, and the soak (outside CI)

The partition suite (`make test-partitions`, in CI, ~12-14 min) cuts, isolates and slows links on the multi-host
stack, with the alerts each cut raised: [reliability-network.md](reliability-network.md). The soak
(`make test-soak`, `tests/hosts/test_soak.py`) runs **outside CI** (`.ci/run` does not call it): on the same stack,
`SOAK_MINUTES` (default 10) of random cuts (10-40 s) and `kill -9` of random processes, sometimes both at once, from
a printed seed (`FLYWHEEL_SOAK_SEED` replays it), then the same checks on the whole run (records lost 0, trained
twice 0, `flywheel verify` ok). It takes ~13 min with the stack's start and the checks (12.8 min measured); its results:
[reliability-soak.md](reliability-soak.md).
"""
"""What the partition suite and the soak cover (their own reports are written by ``tests/hosts``)."""


MUTATION_REPORT = REPO / "docs" / "reliability-mutation.md"
MUTATION_BEGIN = "<!-- mutation: from docs/reliability-mutation.md (make test-mutation) -->"


def mutation_section(path: Path | None = None) -> list[str]:
    """The summary of the trust core's mutation testing, copied from ``docs/reliability-mutation.md`` (written by
    ``make test-mutation``, ``tools/mutation/run.py``, which refreshes this section in place too): this file is
    rewritten by every fault-suite run, the mutation results live in their own file."""
    path = path or MUTATION_REPORT
    lines = [MUTATION_BEGIN, "## Mutation testing of the trust core", ""]
    text = path.read_text() if path.exists() else ""
    if "<!-- summary -->" not in text:
        return lines + ["Not run yet: `make test-mutation` writes `docs/reliability-mutation.md`."]
    summary = text.split("<!-- summary -->", 1)[1].split("<!-- /summary -->", 1)[0].strip("\n")
    return lines + [
        "The digest, ledger, verify, lease, guard and autorollback, marker, credits and the intake's de-duplication,",
        "mutated by `make test-mutation` against their unit tests; every survivor, and why it survives, is in",
        "[reliability-mutation.md](reliability-mutation.md).",
        "",
        summary,
    ]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def commit_label() -> str:
    """``git rev-parse --short HEAD``, plus `` + uncommitted changes`` when the tree differs from it (the reports
    the suites write aside: a previous run's rewrite is not a change to the code under test)."""
    head = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--", ".", *(f":(exclude){page}" for page in GENERATED_PAGES))
    return head + (" + uncommitted changes" if dirty else "")


GENERATED_PAGES = ("docs/reliability.md", "docs/reliability-network.md", "docs/reliability-soak.md", "docs/security.md")
"""The pages the suites rewrite: their changes are not changes to the code under test (``commit_label``)."""


def last_run(seed: int | None, minutes: float | None, replay: str) -> str:
    """The *Last run* line of a suite's page: when, on which commit, the seed and how to replay it (a suite without
    a seed: the command alone), where."""
    took = f", the suite took {minutes:.1f} min" if minutes is not None else ""
    how = f"`{replay}`" if seed is None else f"seed {seed} (replay: `FAULT_SEED={seed} {replay}`)"
    return (f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"commit `{commit_label()}`, {how}, {platform.node()} "
            f"({platform.machine()}, Python {platform.python_version()}){took}.")


def _header(title: str, seed: int, minutes: float | None, replay: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"Written by the fault-injection suite (`{replay}`, `tests/faults/`); do not edit by hand.",
        last_run(seed, minutes, replay),
        "",
    ]


def unrecorded_outcome(request: pytest.FixtureRequest) -> tuple[str, str, str] | None:
    """For a test that failed (or xfailed) before it added its row: its name as a row names it, the outcome
    (``FAILED``, ``xfail (known gap)``) and the reason's first line (``|`` made ``/``, at most 300 characters), so
    the page never drops a row because its test failed; None when it passed. Needs the call's report on the item
    (``pytest_runtest_makereport`` below, imported by each suite's conftest)."""
    call = getattr(request.node, "rep_call", None)
    if call is None or call.passed:
        return None
    xfailed = hasattr(call, "wasxfail")
    crash = getattr(getattr(call.longrepr, "reprcrash", None), "message", None) or str(call.longrepr)
    reason = str(getattr(call, "wasxfail", "")) if xfailed else crash.strip().splitlines()[0]
    name = request.node.name.removeprefix("test_").replace("_", " ")
    return name, "xfail (known gap)" if xfailed else "FAILED", reason.replace("|", "/")[:300]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| fault | outcome | verify | time to recover (s) | samplers back (s) | records lost | trained twice in a run "
        "| restarts so far | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        restarts = ", ".join(f"{k} {v}" for k, v in sorted(r.restarts.items())) or "none"
        rec = "-" if r.recover_s is None else f"{r.recover_s:.1f}"
        lost, twice = ("-" if n is None else str(n) for n in (r.lost, r.trained_twice))
        lines.append(f"| {r.fault} | {r.outcome} | {r.verify} | {rec} | {r.samplers.replace('|', '/')} | {lost} "
                     f"| {twice} | {restarts} | {r.note} |")
    return lines + [
        "",
        "*Time to recover*: for a kill, from the kill until the policy version advances again (worst of",
        "the kills); for an outage, from the dependency's return until the policy version advances.",
        SAMPLERS_BACK + " A row with several faults gives each sampler's worst.",
        "*Records lost*: records below the trainer group's committed offsets with no outcome, plus, in the row",
        "that deletes records before training on purpose, those (the row passes when the trainer and `verify`",
        "name exactly them; from then on `verify` keeps naming them, and a later row's *verify* passes only when",
        "they are all it names).",
        "*verify*: `flywheel verify` on the newest checkpoint after the fault (exit 0: every record below",
        "the checkpoint's offsets trained once or dead-lettered or dropped with its reason, none twice).",
    ]


def write_reliability(rows: list[Row], seed: int, path: Path | None = None, minutes: float | None = None) -> Path:
    path = path or REPO / "docs" / "reliability.md"
    lines = _header("Reliability: faults injected into the real stack", seed, minutes, "make test-faults") + [
        "The stack: its own Kafka broker (KRaft, killed and restarted by the suite), moto S3 behind a TCP proxy",
        "(the endpoint goes down, the objects stay), trainer, paramsync, admin and 2 samplers under the",
        "local stack's supervisor. Faults come from outside the processes. After each, every record on",
        "`<run>.samples` is read back from the broker and matched with the trainer's outcome log lines",
        "(`tests/faults/accounting.py`), and `flywheel verify` proves from the newest checkpoint's ledger",
        "and the topics that every record below its offsets is in the model exactly once (column *verify*).",
        "Each test first asserts that its fault really happened (the process died, records moved to the",
        "other member, the marker was unreadable, the request was refused) and only then that nothing was lost.",
        "",
    ] + _table(rows) + ["", GUARANTEES, NETWORK] + mutation_section()
    path.write_text("\n".join(lines) + "\n")
    return path


def write_cluster_reliability(rows: list[Row], seed: int, path: Path | None = None,
                              minutes: float | None = None) -> Path:
    """The cluster rows (``tests/faults/test_cluster_faults.py``, ``make test-faults BROKERS=3``) in a file of
    their own: they run only with three brokers, and ``docs/reliability.md`` is rewritten by every run."""
    path = path or REPO / "docs" / "reliability-cluster.md"
    lines = _header("Reliability on a 3-broker Kafka cluster", seed, minutes, "make test-faults BROKERS=3") + [
        "The stack: three KRaft nodes of its own (each broker and controller; run topics with replication",
        "factor 3 and `min.insync.replicas` 2, producers with `acks=all` and idempotence), moto S3 behind a",
        "TCP proxy, trainer, paramsync, admin and 2 samplers under the local stack's supervisor. Nodes are",
        "killed with SIGKILL from outside. Records are accounted and `flywheel verify` run after each fault",
        "as in `docs/reliability.md`, whose guarantees hold here too. *Degraded* is each service's own",
        "`/healthz` (admin's `/status` reads heartbeats through Kafka, which is what is away).",
        "",
    ] + _table(rows)
    path.write_text("\n".join(lines) + "\n")
    return path
