"""``python -m shared.localstack up|down|status|restart``: the whole Flywheel stack as local processes.

    up [--samplers N] [--config PATH] [--run NAME] [--no-prometheus]   start or reuse everything, wait
    down [--keep-infra]                                                 stop services, then Kafka + S3
    status                                                              alive/dead, pids, ports, logs
    restart SERVICE                                                     trainer|paramsync|admin|sampler[-i]

State lives in ``$FLYWHEEL_HOME`` (default ``<repo>/.flywheel``). See docs/local-stack.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from shared.infra.config import REPO_ROOT, InfraError
from shared.localstack.process import LocalStackError, parse_key
from shared.localstack.stack import DEFAULT_CONFIG, LocalStack
from shared.localstack.state import StackState

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"  # what the `flywheel` CLI assumes without --url


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def default_home() -> Path:
    return Path(os.environ.get("FLYWHEEL_HOME") or REPO_ROOT / ".flywheel").expanduser().resolve()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shared.localstack",
        description="Run Flywheel (Kafka, S3, trainer, paramsync, admin, samplers) as local processes, "
        "without Docker. State, logs and pid files live in $FLYWHEEL_HOME (default <repo>/.flywheel).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start (or reuse) the stack and wait until every service is healthy")
    up.add_argument("--samplers", type=int, help="sampler replicas (default: as last time, else 2)")
    up.add_argument("--config", help="YAML config (default: as last time, else configs/cartpole.yaml)")
    up.add_argument("--run", help="run name, overriding the config's (default: as last time)")
    up.add_argument("--store", choices=["local", "s3"],
                    help="object store: local = <home>/store, kept across down/up (default); "
                    "s3 = the local S3 server (moto: in memory, lost on down)")
    up.add_argument("--no-prometheus", action="store_true", help="do not run Prometheus")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait (default: %(default)s)")
    down = sub.add_parser("down", help="stop the services (samplers first, trainer last), then Kafka and S3")
    down.add_argument("--keep-infra", action="store_true", help="leave Kafka and the S3 server running")
    sub.add_parser("status", help="list the stack's processes, alive or dead, with pids and ports")
    restart = sub.add_parser("restart", help="stop and start one service, wait until it is healthy")
    restart.add_argument("service", help="trainer, paramsync, admin, sampler (every replica) or sampler-<i>")
    return parser


def _stack(
    home: Path, config: str | None = None, run: str | None = None, store: str | None = None
) -> LocalStack:
    """A LocalStack for ``home``, remembering the config, run and store of the last ``up``."""
    last = StackState(home).load()
    return LocalStack(home, config=config or last.get("config") or DEFAULT_CONFIG, run=run or last.get("run"),
                      store_backend=store or last.get("store_backend") or "local")


def _up(args: argparse.Namespace, home: Path) -> int:
    last = StackState(home).load()
    samplers = args.samplers if args.samplers is not None else len(last.get("samplers") or [0, 1])
    stack = _stack(home, args.config, args.run, args.store)
    now = {"config": str(stack.config), "run": stack.run, "store_backend": stack.store_backend}
    changed = [k for k, v in now.items() if k in last and last[k] != v]
    if changed and stack.pids():
        _out(f"note: {', '.join(changed)} changed since the last up; processes already running keep the old "
             "settings (down, then up, to apply them everywhere)")
    try:
        stack.up(samplers=samplers, timeout_s=args.timeout, prometheus=not args.no_prometheus)
    except LocalStackError as exc:
        raise LocalStackError(f"{exc}\n(what did start is still running: see `python -m shared.localstack "
                              "status`, stop it with `python -m shared.localstack down`)") from None
    _out()
    _out(f"Flywheel is up: {samplers} sampler(s), config {stack.config}, state in {home}")
    store = f"{home}/store (kept across down/up)" if stack.store_backend == "local" else "the S3 server"
    _out(f"store:      {store}")
    _out("logs:")
    for st in stack.status():
        _out(f"  {st.name:<11} {st.log}")
    _out(f"admin API:  {stack.admin_url}    OpenAPI docs: {stack.admin_url}/docs")
    source = stack.admin_token_source
    if source.startswith("/"):
        _out(f"token:      {source} (mode 0600): export FLYWHEEL_ADMIN_TOKEN=$(cat {source})")
    else:
        _out(f"token:      from {source}")
    url = "" if stack.admin_url == DEFAULT_ADMIN_URL else f" --url {stack.admin_url}"
    _out(f"status:     flywheel status{url}    (processes: python -m shared.localstack status)")
    _out("stop:       make down    (or: python -m shared.localstack down)")
    return 0


def _status(home: Path) -> int:
    stack = _stack(home)
    states = stack.status()
    _out(f"flywheel local stack in {home}")
    for st in states:
        pid = f"pid {st.pid or '-'}" + ("" if st.alive or not st.pid else " (last)")
        _out(f"  {st.name:<11} {'alive' if st.alive else 'DEAD ':<5}  {pid:<17}  {st.endpoint:<36}  {st.log}")
    if not any(st.alive for st in states):
        _out("nothing is running: python -m shared.localstack up")
    return 0 if all(st.alive for st in states) else 3


def _restart(name: str, home: Path) -> int:
    stack = _stack(home)
    service, replica = parse_key(name)
    replicas = stack.state.samplers() if name == "sampler" else [replica]
    for r in replicas:
        stack.stop(service, r)
        stack.start(service, r)
    for r in replicas:
        stack.wait_healthy(service, r)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # infra readiness reports its own errors
    home = default_home()
    try:
        if args.command == "up":
            return _up(args, home)
        if args.command == "down":
            _stack(home).down(infra=not args.keep_infra)
            return 0
        if args.command == "status":
            return _status(home)
        return _restart(args.service, home)
    except (LocalStackError, InfraError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
