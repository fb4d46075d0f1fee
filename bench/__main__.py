"""``python -m bench``: run the benchmark figures, write docs/benchmarks.{md,json} and the plots.

    python -m bench                      # every figure (estimated ~2.5 h on 2 cores, stability ~55 min of it)
    python -m bench --only solve         # one figure (or a comma-separated list); the others are kept
    python -m bench --list               # the figures
    python -m bench --quick              # a smoke run with short windows, written to .flywheel/bench/quick/
    FLYWHEEL_BENCH_STABILITY_SEEDS=2 FLYWHEEL_BENCH_STABILITY_MINUTES=3 python -m bench --only stability
        # fewer seeds / minutes (FLYWHEEL_BENCH_<FIGURE>_SEEDS works for every figure with seeds)
    FLYWHEEL_BENCH_PEERS_MINATAR_SEEDS=4,5 python -m bench --only peers_minatar --extend
        # seeds 4 and 5, pooled with the seeds of the figure's earlier entry that this run does not repeat
        # (figures with per-seed peer records: peers_minatar, peers_mujoco; the others refuse --extend)
    python -m bench --profile --only service_efficiency --out /tmp/prof
        # + py-spy profiles of the services in .flywheel/bench/profiles/ (python -m bench.profile FILE)
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

from bench import report
from bench.context import BENCH_HOME, Context, bench_infra, say
from bench.figures import FIGURES
from bench.machine import loadavg, machine, machine_busy_seconds, now_iso, reap_children, suite_cpu_seconds
from bench.stack import delete_topics
from devstack import REPO_ROOT
from devstack import down as infra_down


def _command(argv: list[str], environ: Mapping[str, str] = os.environ) -> str:
    """The command as run, with the ``FLYWHEEL_BENCH_*`` variables that change what it measures (seeds,
    budgets) in front, so that the figure's *Ran* line repeats the run."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(environ.items()) if k.startswith("FLYWHEEL_BENCH_")]
    return " ".join([*env, ".venv/bin/python -m bench", *argv]).strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description="Flywheel benchmark suite")
    p.add_argument("--only", help=f"comma-separated figures: {', '.join(FIGURES)}")
    p.add_argument("--list", action="store_true", help="list the figures and exit")
    p.add_argument("--quick", action="store_true", help="short windows; writes to .flywheel/bench/quick/, not docs/")
    p.add_argument("--profile", action="store_true", help="py-spy the services where a figure supports it")
    p.add_argument("--out", type=Path, help="write benchmarks.{md,json} and plots here instead of docs/")
    p.add_argument("--extend", action="store_true",
                   help="pool with the earlier entry's seeds that this run does not repeat (peers_minatar, "
                        "peers_mujoco; set the new seeds with FLYWHEEL_BENCH_<FIGURE>_SEEDS=4,5)")
    p.add_argument("--keep-infra", action="store_true", help="leave the bench Kafka + S3 running afterwards")
    args = p.parse_args(argv)
    if args.list:
        for name, mod in FIGURES.items():
            print(f"{name:20s} {mod.TITLE}  [target: {mod.TARGET}]")
        return 0
    names = list(FIGURES) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s) {unknown}; choose from {', '.join(FIGURES)}")
    if args.extend and (not args.only or any(not getattr(FIGURES[n], "EXTENDS", False) for n in names)):
        p.error("--extend pools per-seed records: name only figures that have them with --only "
                f"({', '.join(n for n, m in FIGURES.items() if getattr(m, 'EXTENDS', False))})")

    # One suite at a time: two share the bench ports and the first to finish stops the shared Kafka + S3.
    BENCH_HOME.mkdir(parents=True, exist_ok=True)
    lock = open(BENCH_HOME / "bench.lock", "a")  # noqa: SIM115 - held until this process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another `python -m bench` is running (lock {BENCH_HOME / 'bench.lock'}); run one at a time",
              file=sys.stderr)
        return 2
    out_dir = args.out or (BENCH_HOME / "quick" if args.quick else REPO_ROOT / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "benchmarks.json", out_dir / "benchmarks.md"
    started = time.monotonic()
    stamp = time.strftime("%m%d%H%M%S")
    runs = BENCH_HOME / "runs"
    if runs.is_dir():  # logs of earlier invocations' stacks (never of a running one: each has its own stamp)
        for old in runs.iterdir():
            if old.is_dir() and stamp not in old.name and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    say(f"bench infra: Kafka :29092, S3 :29000 in {BENCH_HOME}")
    ctx = Context(infra=bench_infra(), stamp=stamp, quick=args.quick, profile=args.profile, out_dir=out_dir,
                  extend=args.extend)
    mach = machine()
    say(f"machine: {mach['cores']} cores, {mach['cpu_model']}; figures: {', '.join(names)}")
    failed = []
    try:
        for name in names:
            mod = FIGURES[name]
            data = report.load(json_path)
            ctx.earlier = data["figures"].get(name)
            before, t0 = loadavg(), time.monotonic()
            busy0, ours0 = machine_busy_seconds(), suite_cpu_seconds()
            res, err = None, None
            say(f"=== {name}: {mod.TITLE}")
            try:
                res = mod.run(ctx)
            except Exception as exc:  # one broken figure must not lose the others
                err = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                failed.append(name)
            reap_children()
            if res is None and args.extend:  # keep the entry it was to extend: its seeds are hours of runs
                say(f"=== {name}: FAILED {err}; the earlier entry in {json_path} is left as it was")
                delete_topics(ctx, f"bench-{name.replace('_', '-')}-{stamp}")
                continue
            dur = time.monotonic() - t0
            # Cores other work took while this figure ran (machine CPU minus the suite's own): > ~0.2 means
            # the figure shared the machine and its numbers are suspect.
            other = max(0.0, (machine_busy_seconds() - busy0) - (suite_cpu_seconds() - ours0)) / max(dur, 1e-9)
            data["figures"][name] = report.entry(
                name, mod.TITLE, mod.TARGET, res,
                command=_command((["--quick"] if args.quick else []) + ["--only", name]
                                 + (["--extend"] if args.extend else []) if args.only else argv),
                machine=mach, date=now_iso(), duration_s=dur, load_before=before, load_after=loadavg(), error=err,
                other_cores=other)
            data["suite"] = {"last_command": _command(argv), "last_run": now_iso(),
                             "last_duration_s": round(time.monotonic() - started, 1)}
            report.save(json_path, data)
            md_path.write_text(report.render(data))
            say(f"=== {name}: {'FAILED ' + str(err) if err else 'done'} in {dur:.0f} s -> {md_path} "
                f"(other work on the machine meanwhile: {other:.2f} cores)")
            if res is not None:
                for r in res.headline:
                    say(f"    {r.metric}: {r.value}" + (f"  (target {r.target})" if r.target else ""))
            delete_topics(ctx, f"bench-{name.replace('_', '-')}-{stamp}")
    finally:
        if not args.keep_infra:
            infra_down(BENCH_HOME, progress=lambda m: None)
    say(f"suite took {time.monotonic() - started:.0f} s; {md_path}, {json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
