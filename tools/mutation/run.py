"""Mutation testing of the trust core (``make test-mutation``): cosmic-ray over each file of
``tools/mutation/targets.toml`` against that file's unit tests, the results kept in
``docs/reliability-mutation.json`` and rendered to ``docs/reliability-mutation.md`` (with every survivor,
explained from ``tools/mutation/explained.toml`` or marked unexplained), whose summary
``docs/reliability.md`` embeds.

Each target runs in a private copy of the tree (a temporary directory): cosmic-ray rewrites the module on disk
for every mutant, and nobody else's test run or editor must ever see a mutated file. The copy is taken when the
target starts, so a run measures the tree as it was then (its sha256 is recorded; the report flags a file that
changed since).

    python tools/mutation/run.py                  # every target, then the report
    python tools/mutation/run.py --only lease     # one target (others keep their last results)
    python tools/mutation/run.py --survivors lease  # re-test only last run's survivors (same file content)
    python tools/mutation/run.py --report         # re-render the report only (e.g. after editing explained.toml)

``--survivors`` is for the loop "add a test, see whether it kills the survivor" in seconds: it refuses when the
file changed since the full run, and the report says the survivors were re-checked and when.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tools" / "mutation"
TARGETS = HERE / "targets.toml"
EXPLAINED = HERE / "explained.toml"
RESULTS = REPO / "docs" / "reliability-mutation.json"
REPORT = REPO / "docs" / "reliability-mutation.md"
RELIABILITY = REPO / "docs" / "reliability.md"
LOCK = REPO / ".flywheel" / "mutation-results.lock"  # .flywheel/ is ignored
COPIED = ["shared", "services", "devstack", "tests", "bench", "configs", "pyproject.toml"]
TARGET_PERCENT = 90.0
MIN_TIMEOUT_S = 10.0
TIMEOUT_FACTOR = 5.0
"""Per mutant: the larger of MIN_TIMEOUT_S and TIMEOUT_FACTOR x the unmutated run through the fork server (a mutant
that loops forever, or computes ``x ** (2**64 - 1)``, is stopped by it and counted as a timeout)."""

# Only the plugins these unit tests use: autoloading every installed pytest plugin (schemathesis, hypothesis...)
# costs ~2 s per mutant.
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin", "-p", "pytest_timeout"]
FORKSERVER_ERROR = "FORKSERVER-ERROR:"  # tools/mutation/forkserver.py ERROR
PYTEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

_print_lock = threading.Lock()
_children: set[subprocess.Popen[Any]] = set()


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT: stop the cosmic-ray runs (and their test runs) and leave the temporary copies to be removed."""
    for proc in list(_children):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    raise Stopped(signum)


class Stopped(BaseException):
    """A signal stopped the run (not caught per target: the whole run ends)."""


def say(msg: str) -> None:
    with _print_lock:
        print(msg, flush=True)  # noqa: T201


@dataclass
class Target:
    name: str
    file: str
    tests: list[str]
    scope: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)


def load_targets() -> list[Target]:
    raw = tomllib.loads(TARGETS.read_text())
    return [Target(t["name"], t["file"], list(t["tests"]), list(t.get("scope", [])), list(t.get("exclude", [])))
            for t in raw["target"]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def commit_label(file: str) -> str:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", file)
    return head + (f" + uncommitted changes to {file}" if dirty else "")


def tool_version() -> str:
    return f"cosmic-ray {metadata.version('cosmic-ray')}"


# ---- scope --------------------------------------------------------------------------------------------------
def _find(body: list[ast.stmt], path: list[str]) -> ast.AST:
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == path[0]:
            return node if len(path) == 1 else _find(node.body, path[1:])
    raise SystemExit(f"scope: no definition {'.'.join(path)!r}")


def scope_ranges(source: str, scope: list[str]) -> list[tuple[int, int]]:
    """Line ranges (inclusive) of the scope entries in ``source``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for entry in scope:
        name, _, text = entry.partition(":")
        node = _find(tree.body, name.split("."))
        assert isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        end = node.end_lineno or node.lineno
        if text:
            start = next((i for i in range(start, end + 1) if text in lines[i - 1]), 0)
            if not start:
                raise SystemExit(f"scope: {text!r} not found in {name}")
        out.append((start, end))
    return out


def annotation_spans(source: str) -> list[tuple[int, int, int, int]]:
    """``(line, col, end_line, end_col)`` of every annotation in ``source``, when the module has ``from __future__
    import annotations`` (else none): there annotations are never evaluated, so a mutant inside one (``str | None``
    made ``str - None``) is equivalent by construction. Such mutants are skipped and counted apart."""
    tree = ast.parse(source)
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations"
                 for a in n.names) for n in tree.body)
    if not future:
        return []
    out = []
    for node in ast.walk(tree):
        found: list[ast.expr | None] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            found += [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x]
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        out += [(e.lineno, e.col_offset, e.end_lineno or e.lineno, e.end_col_offset or 0) for e in found if e]
    return out


def in_spans(pos: tuple[int, int], spans: list[tuple[int, int, int, int]]) -> bool:
    return any((l0, c0) <= pos < (l1, c1) for l0, c0, l1, c1 in spans)


# ---- one target ---------------------------------------------------------------------------------------------
def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def diff_lines(diff: str) -> tuple[str, str]:
    """The original and the mutated source of a one-mutant unified diff, each stripped and joined."""
    old = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(old), " / ".join(new)


def run_target(t: Target, previous: dict[str, Any] | None, survivors_only: bool) -> dict[str, Any]:
    missing = [p for p in [t.file, *t.tests] if not (REPO / p).exists()]
    if missing:
        raise SystemExit(f"{t.name}: missing {', '.join(missing)}")
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"flywheel-mutation-{t.name}-") as tmp:
        work = Path(tmp)
        copy_tree(work)
        # Byte-compile the copy once: each mutant's test run then imports everything but the mutated module
        # from .pyc (the runs themselves write none; a mutant's mtime never matches the copy's, so it is
        # always compiled from its source).
        subprocess.run([sys.executable, "-m", "compileall", "-q", *COPIED[:-1]], cwd=work, check=True,
                       capture_output=True)
        source = (work / t.file).read_text()
        digest = hashlib.sha256(source.encode()).hexdigest()
        if survivors_only:
            if previous is None or previous.get("sha256") != digest:
                raise SystemExit(f"{t.name}: --survivors needs a full run of this exact {t.file} first "
                                 "(the file changed since, or never ran)")
        env = {**os.environ, **PYTEST_ENV}
        sock = work / "forkserver.sock"
        server_log = work / "forkserver.log"
        client_cmd = [sys.executable, "-S", str(HERE / "forkserver.py"), "client", str(sock)]
        with open(server_log, "w") as log:
            # Each test run's tmp_path under the copy: out of reach of other pytest sessions' clean-up.
            args = [*PYTEST_ARGS, f"--basetemp={work / 'pytest-tmp'}", *t.tests]
            server = subprocess.Popen([sys.executable, str(HERE / "forkserver.py"), "serve", str(sock), t.file, *args],
                                      cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _children.add(server)
        try:
            result = _run_with_server(t, previous, survivors_only, work, env, source, digest, server, server_log,
                                      client_cmd, started)
            if not survivors_only:  # how busy the machine was: the time is wall-clock
                result["load"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
            return result
        finally:
            _children.discard(server)
            if server.poll() is None:  # it holds nothing worth a clean exit (torch's at-exit work takes long)
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _run_with_server(t: Target, previous: dict[str, Any] | None, survivors_only: bool, work: Path,
                     env: dict[str, str], source: str, digest: str, server: subprocess.Popen[bytes],
                     server_log: Path, client_cmd: list[str], started: float) -> dict[str, Any]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    sock = Path(client_cmd[-1])
    while not sock.exists():  # the server runs the unmutated tests first
        if server.poll() is not None:
            raise SystemExit(f"{t.name}: the tests fail on the unmutated tree:\n{server_log.read_text()[-4000:]}")
        time.sleep(0.2)

    def unmutated() -> float:
        t0 = time.monotonic()
        rc = subprocess.run(client_cmd, cwd=work, env=env, capture_output=True).returncode
        if rc != 0:
            raise SystemExit(f"{t.name}: the unmutated tests failed through the fork server (exit {rc})")
        return time.monotonic() - t0

    baseline_s = min(unmutated(), unmutated())
    timeout_s = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * baseline_s)
    config = work / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(t.file)}\n"
        f"timeout = {timeout_s:.1f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(' '.join(client_cmd))}\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n"
    )
    session = work / "session.sqlite"
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(config), str(session)], cwd=work,
                   env=env, check=True, capture_output=True)
    ranges = scope_ranges(source, t.scope) if t.scope else None
    excluded = scope_ranges(source, t.exclude)
    keep_survivors = {(s["operator"], s["occurrence"]) for s in (previous or {}).get("survivors", [])}
    spans = annotation_spans(source)
    annotations = 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        skip = []
        for item in db.pending_work_items:
            m = item.mutations[0]
            line = m.start_pos[0]
            if ranges is not None and not any(lo <= line <= hi for lo, hi in ranges):
                skip.append(item.job_id)
            elif any(lo <= line <= hi for lo, hi in excluded):
                skip.append(item.job_id)
            elif in_spans((m.start_pos[0], m.start_pos[1]), spans):
                skip.append(item.job_id)
                annotations += 1
            elif survivors_only and (m.operator_name, m.occurrence) not in keep_survivors:
                skip.append(item.job_id)
        if skip:
            db.set_multiple_results(skip, WorkResult(output="skipped", worker_outcome=WorkerOutcome.SKIPPED))
        todo = db.num_work_items - len(skip)
    say(f"[{t.name}] {todo} mutants of {t.file}"
        f"{' (the previous survivors)' if survivors_only else ''}; tests {baseline_s:.1f} s unmutated, "
        f"timeout {timeout_s:.0f} s")
    proc = subprocess.Popen([sys.executable, "-m", "cosmic_ray.cli", "exec", str(config), str(session)],
                            cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _children.add(proc)
    last = time.monotonic()
    while proc.poll() is None:
        time.sleep(2)
        if time.monotonic() - last >= 60:
            last = time.monotonic()
            with sqlite3.connect(session) as c:
                done = c.execute("select count(*) from work_results").fetchone()[0] - len(skip)
            say(f"[{t.name}] {done}/{todo} after {time.monotonic() - started:.0f} s")
    _children.discard(proc)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{t.name}: cosmic-ray exec failed ({proc.returncode}):\n{err[-3000:]}")
    if server.poll() is not None:
        raise SystemExit(f"{t.name}: the fork server died during the run:\n{server_log.read_text()[-3000:]}")
    unmutated()  # the file is back as it was, and the tests still pass through the server
    counts = {"killed": 0, "timeouts": 0, "survived": 0, "errors": 0}
    survivors, errors = [], []
    src_lines = source.splitlines()
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome in (WorkerOutcome.SKIPPED, WorkerOutcome.NO_TEST):
                continue
            m = item.mutations[0]
            old, new = diff_lines(result.diff or "")
            row = {"line": m.start_pos[0], "operator": m.operator_name, "occurrence": m.occurrence,
                   "source": old or src_lines[m.start_pos[0] - 1].strip(), "mutant": new}
            if (result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT
                    or FORKSERVER_ERROR in (result.output or "")):
                counts["errors"] += 1
                errors.append({**row, "output": (result.output or "")[-500:]})
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                survivors.append(row)
            elif result.output == "timeout":
                counts["timeouts"] += 1
            else:
                counts["killed"] += 1
    seconds = time.monotonic() - started
    survivors.sort(key=lambda r: (r["line"], r["operator"], r["occurrence"]))
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if survivors_only:
        assert previous is not None
        killed_now = len(previous["survivors"]) - len(survivors) - counts["errors"]
        out = dict(previous)
        out["counts"] = {**previous["counts"], "killed": previous["counts"]["killed"] + max(0, killed_now),
                         "timeouts": previous["counts"]["timeouts"], "survived": len(survivors),
                         "errors": previous["counts"]["errors"] + counts["errors"]}
        out["survivors"] = survivors
        out["rechecked"] = {"when": now, "seconds": round(seconds, 1), "commit": commit_label(t.file),
                            "killed": killed_now}
        out["errors"] = previous.get("errors", []) + errors
        say(f"[{t.name}] re-checked {len(previous['survivors'])} survivors in {seconds:.0f} s: "
            f"{killed_now} killed now, {len(survivors)} still survive")
        return out
    total = sum(counts.values())
    say(f"[{t.name}] {total} mutants in {seconds:.0f} s: {counts}")
    return {"file": t.file, "scope": t.scope, "exclude": t.exclude, "tests": t.tests, "sha256": digest,
            "commit": commit_label(t.file),
            "when": now, "seconds": round(seconds, 1), "baseline_s": round(baseline_s, 2),
            "timeout_s": round(timeout_s, 1), "counts": counts, "annotation_mutants": annotations,
            "survivors": survivors, "errors": errors,
            "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
                    f"{platform.python_version()})", "tool": tool_version()}


# ---- the report ---------------------------------------------------------------------------------------------
def load_results() -> dict[str, Any]:
    if RESULTS.exists():
        data: dict[str, Any] = json.loads(RESULTS.read_text())
        return data
    return {"targets": {}}


def load_explained() -> list[dict[str, Any]]:
    if not EXPLAINED.exists():
        return []
    return list(tomllib.loads(EXPLAINED.read_text()).get("survivor", []))


def explanation(file: str, s: dict[str, Any], explained: list[dict[str, Any]]) -> str | None:
    for e in explained:
        if (e["file"] == file and e["operator"] == s["operator"] and e["source"] == s["source"]
                and e["mutant"] == s["mutant"]):
            return str(e["why"])
    return None


def pct(killed: float, total: float) -> str:
    return "-" if total == 0 else f"{100.0 * killed / total:.1f}%"


def md_code(text: str) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if "`" not in text else f"``{text}``"


def render(results: dict[str, Any], targets: list[Target]) -> tuple[str, float | None, int]:
    """The report, the total % killed (None when nothing ran) and how many survivors are unexplained."""
    explained = load_explained()
    rows, survivor_rows, notes = [], [], []
    tot = {"mutants": 0, "killed": 0, "timeouts": 0, "survived": 0, "explained": 0, "errors": 0, "seconds": 0.0,
           "annotations": 0}
    unexplained = 0
    for t in targets:
        r = results["targets"].get(t.name)
        if r is None:
            rows.append(f"| {t.name} | `{t.file}` | not run yet | | | | | | | |")
            continue
        c = r["counts"]
        mutants = c["killed"] + c["timeouts"] + c["survived"]
        n_explained = 0
        for s in r["survivors"]:
            why = explanation(r["file"], s, explained)
            if why is None:
                unexplained += 1
                why = "**unexplained**"
            else:
                n_explained += 1
            survivor_rows.append(f"| `{r['file']}:{s['line']}` | {s['operator'].removeprefix('core/')} "
                                 f"| {md_code(s['source'])} → {md_code(s['mutant'])} | {why} |")
        scope = ", ".join(f"`{s}`" for s in r["scope"]) or "whole file"
        if r.get("exclude"):
            scope += " except " + ", ".join(f"`{s}`" for s in r["exclude"])
        changed = (REPO / r["file"]).exists() and sha256(REPO / r["file"]) != r["sha256"]
        when = r["when"] + (f"; survivors re-checked {r['rechecked']['when']}" if r.get("rechecked") else "")
        rows.append(f"| {t.name} | `{r['file']}` | {scope} | {mutants} | {c['killed']} | {c['timeouts']} "
                    f"| {c['survived']} ({n_explained} explained) | {pct(c['killed'] + c['timeouts'], mutants)} "
                    f"| {r['seconds'] / 60:.1f} min | {when}, `{r['commit']}`"
                    f"{' **(file changed since)**' if changed else ''} |")
        tests = ", ".join(f"`{p}`" for p in r["tests"])
        tot["annotations"] += r.get("annotation_mutants", 0)
        load = f", load average {r['load'][0]} at the start, {r['load'][1]} at the end" if r.get("load") else ""
        notes.append(f"- **{t.name}**: {tests} (unmutated {r['baseline_s']:.1f} s, timeout {r['timeout_s']:.0f} s, "
                     f"{r.get('annotation_mutants', 0)} mutants inside annotations not run{load}"
                     f"{', ' + str(c['errors']) + ' mutants errored, not counted' if c['errors'] else ''}).")
        tot["mutants"] += mutants
        tot["explained"] += n_explained
        tot["seconds"] += r["seconds"]
        for k in ("killed", "timeouts", "survived", "errors"):
            tot[k] += c[k]
    detected = tot["killed"] + tot["timeouts"]
    total_pct = None if tot["mutants"] == 0 else 100.0 * detected / tot["mutants"]
    tools = sorted({r.get("tool", "?") for r in results["targets"].values()}) or [tool_version()]
    hosts = sorted({r.get("host", "?") for r in results["targets"].values()})
    lines = [
        "# Mutation testing of the trust core",
        "",
        "Written by `make test-mutation` (`tools/mutation/run.py`, " + ", ".join(tools) + "); do not edit by hand.",
        "Survivor explanations come from `tools/mutation/explained.toml` (kept by hand: only mutants that are",
        "truly equivalent, or that no test can tell apart, with the reason). Measured on " + "; ".join(hosts) + ".",
        "",
        "Each file is mutated by cosmic-ray (every core operator: arithmetic, comparison, boolean and unary",
        "operators, numbers, `break`/`continue`, exceptions caught, decorators, loops run zero times) in a private",
        "copy of the tree, and every mutant is run against that file's unit tests (`pytest -x`, listed below)",
        f"with a timeout of {TIMEOUT_FACTOR:.0f}x the unmutated run (at least {MIN_TIMEOUT_S:.0f} s). "
        "*% killed* = (killed + timeouts) / mutants;",
        "a timeout is a mutant the tests catch by hanging. An explained survivor still counts as survived.",
        "Not run nor counted: mutants inside type annotations, which these modules never evaluate (`from",
        "__future__ import annotations`), so each is equivalent by construction (`str | None` made `str - None`);",
        "their number is given per file below.",
        "",
        "<!-- summary -->",
        "| target | file | scope | mutants | killed | timeouts | survived | % killed | time | run |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        f"| **total** | | | {tot['mutants']} | {tot['killed']} | {tot['timeouts']} | {tot['survived']} "
        f"({tot['explained']} explained) | **{pct(detected, tot['mutants'])}** | {tot['seconds'] / 60:.1f} min | |",
        "",
        f"Target: at least {TARGET_PERCENT:.0f}% killed over these files. Time is wall-clock for one file's full run",
        "(one mutant at a time), the total their sum; on a busy machine (other work, or files run side by side with",
        "`--jobs`) it is longer than on an idle one. `make test-mutation` is not part of `make test` nor of CI.",
        "<!-- /summary -->",
        "",
        "Tests run against each file's mutants:",
        "",
        *notes,
        "",
        "## Survivors",
        "",
    ]
    if survivor_rows:
        lines += ["| where | operator | mutation | why it survives |", "|---|---|---|---|", *survivor_rows]
    else:
        lines.append("None.")
    lines += [
        "",
        "## How to run",
        "",
        "    make test-mutation                 # every file (see the times above), then this report",
        "    make test-mutation ONLY=lease      # one file; the others keep their last results",
        "    .venv/bin/python tools/mutation/run.py --survivors lease  # last survivors only, after adding a test",
        "    .venv/bin/python tools/mutation/run.py --report           # re-render after editing explained.toml",
        "",
        "A survivor is either killed by a new unit test (`tests/unit/test_mutation_<module>.py`) or explained in",
        "`tools/mutation/explained.toml` (keyed by file, operator, original and mutated line).",
    ]
    return "\n".join(lines) + "\n", total_pct, unexplained


def update_reliability() -> None:
    """Refresh the mutation section of docs/reliability.md (the fault suite rewrites that file and embeds the
    same section: tests/faults/report.py)."""
    sys.path.insert(0, str(REPO))
    from tests.faults.report import MUTATION_BEGIN, mutation_section

    if not RELIABILITY.exists():
        return
    text = RELIABILITY.read_text()
    head = text.split(MUTATION_BEGIN)[0].rstrip("\n")
    RELIABILITY.write_text(head + "\n\n" + "\n".join(mutation_section()) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="target names (targets.toml); default: all")
    ap.add_argument("--survivors", nargs="*", default=None, metavar="NAME",
                    help="re-test only the last run's survivors of these targets")
    ap.add_argument("--report", action="store_true", help="only re-render the report from the stored results")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at once (each one mutant at a time)")
    args = ap.parse_args()
    targets = load_targets()
    by_name = {t.name: t for t in targets}
    results = load_results()
    names = args.survivors if args.survivors is not None else (args.only or [])
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown targets: {unknown}; known: {list(by_name)}")
    if args.report:
        chosen = []
    elif names:
        chosen = [by_name[n] for n in names]
    elif args.survivors is not None:
        raise SystemExit("--survivors needs target names")
    else:
        chosen = targets
    lock = threading.Lock()
    failed: list[str] = []

    def one(t: Target) -> None:
        try:
            r = run_target(t, results["targets"].get(t.name), survivors_only=args.survivors is not None)
        except SystemExit as exc:
            say(f"[{t.name}] FAILED: {exc}")
            failed.append(t.name)
            return
        LOCK.parent.mkdir(exist_ok=True)
        with lock, open(LOCK, "w") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)  # another run.py (another target) may be saving too
            stored = load_results()
            stored["targets"][t.name] = r
            RESULTS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.jobs <= 1:
        for t in chosen:  # in the main thread: a signal unwinds it, removing the temporary copy
            one(t)
    else:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, chosen))
    text, total_pct, unexplained = render(load_results(), targets)
    REPORT.write_text(text)
    update_reliability()
    say(f"wrote {REPORT.relative_to(REPO)}: "
        + ("nothing run yet" if total_pct is None else f"{total_pct:.1f}% killed, {unexplained} unexplained survivors"))
    if failed:
        return 2
    return 1 if total_pct is not None and total_pct < TARGET_PERCENT else 0


if __name__ == "__main__":
    sys.exit(main())
