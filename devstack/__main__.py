"""``python -m devstack COMMAND``: the whole Flywheel stack as local processes, without Docker.

    up [--samplers N] [--brokers N] [--config PATH] [--run NAME] [--store local|s3] [--no-prometheus] [--log-max-mb MB]
       [--hosts]                 --hosts: every part in a network namespace of its own (devstack.hosts; root)
    down [--keep-infra]          stop the supervisor, the services (trainer last), Prometheus, Kafka + S3
                                 (and remove a multi-host stack's namespaces, links and rules)
    status                       every process: alive/DEAD, pid, restarts, endpoint, log
    hosts [cut NAME [PEER...] [--direction both|out|in] | slow NAME [PEER...] [--delay-ms D] [--rate-kbps R]
          | heal NAME | cleanup]
                                 the multi-host stack: NAME NETNS ADDRESS PID per part; cut / heal links
    restart SERVICE              trainer|paramsync|admin|sampler|sampler-<i>
    hold NAME / release NAME     the supervisor leaves NAME alone / looks after it again
    infra-up / infra-down        just Kafka + S3
    supervise                    the supervisor itself (``up`` starts it)

Every command takes ``--home`` (default ``$FLYWHEEL_HOME``, else ``<repo>/.flywheel``). See
docs/local-stack.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from devstack import forward, infra, supervisor
from devstack import hosts as multihost
from devstack.config import DEFAULT_CONFIG, DEFAULT_TIMEOUT_S, StackError, default_home
from devstack.logs import LOG_MAX_BYTES
from devstack.services import parse_key
from devstack.stack import LocalStack
from devstack.state import StackState

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"  # what the `flywheel` CLI assumes without --url
PROG = "python -m devstack"


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", type=Path, help="state directory (default: $FLYWHEEL_HOME, else <repo>/.flywheel)")
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run Flywheel (Kafka, S3, trainer, paramsync, admin, samplers, Prometheus) as local "
        "processes, without Docker, with a supervisor that restarts what dies.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="start (or reuse) the stack and wait until it is healthy")
    up.add_argument("--samplers", type=int, help="sampler replicas (default: as last time, else 2)")
    up.add_argument("--trainers", type=int,
                    help="data-parallel trainer ranks, trainer.world_size (default: as last time, else 1)")
    up.add_argument("--brokers", type=int,
                    help="Kafka nodes: 1, or 3 for a replicated KRaft cluster (default: as last time, else "
                    "$FLYWHEEL_INFRA_BROKERS, else 1; a home's Kafka keeps the size it was formatted with)")
    up.add_argument("--config", help="YAML config (default: as last time, else configs/cartpole.yaml)")
    up.add_argument("--run", help="run name, overriding the config's (default: as last time)")
    up.add_argument("--store", choices=["local", "s3"],
                    help="object store: local = <home>/store, kept across down/up (default); "
                    "s3 = the local S3 server (moto: in memory, lost on down)")
    up.add_argument("--install-extras", action="store_true",
                    help="install the project's extra that the config's env needs (minatar, atari, mujoco) when it "
                    "is missing, before any service starts (make up passes it); without it a missing one is refused")
    up.add_argument("--no-prometheus", action="store_true", help="do not run Prometheus")
    up.add_argument("--no-supervise", action="store_true", help="no supervisor: nothing is restarted")
    up.add_argument("--log-max-mb", type=float,
                    help="rotate a log past this size (default: as last time, else %(default)s)")
    up.add_argument("--hosts", action=argparse.BooleanOptionalAction, default=None,
                    help="the multi-host stack: every Kafka node, the S3 server, every trainer rank, paramsync, "
                    "admin and each sampler in a network namespace of its own, at its own address on bridge "
                    f"{multihost.BRIDGE} ({multihost.SUBNET}); needs root, ip and iptables (default: as the running "
                    "stack, else off)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait (default: %(default)s)")
    down = sub.add_parser("down", parents=[common], help="stop the supervisor, the services, then Kafka and S3")
    down.add_argument("--keep-infra", action="store_true", help="leave Kafka and the S3 server running")
    sub.add_parser("status", parents=[common], help="the stack's processes, alive or dead, pids, restarts")
    hosts = sub.add_parser("hosts", parents=[common],
                           help="the multi-host stack's parts: NAME NETNS ADDRESS PID; cut / heal a part's links",
                           description="Without an action: each part of the multi-host stack (up --hosts) with its "
                           "network namespace, address and pid (a pid that does not live in its part's namespace is "
                           "flagged). `cut NAME [PEER ...]`: inside NAME's namespace, drop every packet to and from "
                           "each PEER (default: every Kafka node); `heal NAME` removes those rules. `cleanup`: "
                           f"remove every {multihost.PREFIX}* namespace, link and rule left on this machine, "
                           "whoever made them (after a crash).")
    hosts.add_argument("action", nargs="?", choices=["list", "cut", "slow", "heal", "cleanup"], default="list")
    hosts.add_argument("name", nargs="?", help="the part: kafka, kafka-<i>, s3, trainer, trainer-<r>, paramsync, "
                       "admin, sampler-<i>")
    hosts.add_argument("peers", nargs="*", help="cut: the parts to cut NAME from (default: every Kafka node)")
    hosts.add_argument("--direction", choices=multihost.DIRECTIONS, default="both",
                       help="cut: both ways (default); out: NAME's packets to the peers are dropped, theirs still "
                            "arrive; in: the peers' packets to NAME are dropped, NAME's still arrive")
    hosts.add_argument("--delay-ms", type=float, default=100.0, help="slow: delay added each way (default 100)")
    hosts.add_argument("--rate-kbps", type=float, default=0.0,
                       help="slow: kB/s a direction per connection (default 0: no cap)")
    restart = sub.add_parser("restart", parents=[common], help="stop and start a service, wait until healthy")
    restart.add_argument("service", help="trainer, paramsync, admin, sampler (every replica) or sampler-<i>")
    for name, what in (("hold", "leave NAME alone: do not restart it"), ("release", "restart NAME again if it dies")):
        cmd = sub.add_parser(name, parents=[common], help=f"tell the supervisor to {what}")
        cmd.add_argument("name", help="kafka, s3, trainer, paramsync, admin, sampler-<i> or prometheus")
    infra_up = sub.add_parser("infra-up", parents=[common], help="just Kafka + S3 (ports: FLYWHEEL_INFRA_*_PORT)")
    infra_up.add_argument("--kafka-port", type=int, help="Kafka client (PLAINTEXT) port (default 9092)")
    infra_up.add_argument("--controller-port", type=int, help="KRaft controller port (default 9093)")
    infra_up.add_argument("--s3-port", type=int, help="S3 endpoint port (default 9000)")
    infra_up.add_argument("--bucket", help="bucket to create (default: flywheel)")
    infra_up.add_argument("--brokers", type=int,
                          help="Kafka nodes (default $FLYWHEEL_INFRA_BROKERS, else 1); node i listens on the "
                          "Kafka and controller ports + 2*(i-1)")
    infra_up.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait")
    sub.add_parser("infra-down", parents=[common], help="stop this home's Kafka + S3")
    sub.add_parser("supervise", parents=[common], help="run the supervisor in the foreground (up starts it)")
    return parser


def _stack(home: Path, config: str | None = None, run: str | None = None, store: str | None = None, *,
           supervise: bool = True, log_max_bytes: int = LOG_MAX_BYTES, brokers: int | None = None,
           hosts: bool | None = None) -> LocalStack:
    """A LocalStack for ``home``, with the config, run, store, ports and Kafka size of the last ``up``."""
    last = StackState(home).load()
    ports = {k: int(v) for k, v in (last.get("ports") or {}).items()}
    return LocalStack(home, config=config or last.get("config") or DEFAULT_CONFIG, run=run or last.get("run"),
                      store_backend=store or last.get("store_backend") or "local",
                      admin_port=ports.get("admin", 8080), trainer_port=ports.get("trainer", 8101),
                      paramsync_port=ports.get("paramsync", 8102), sampler_base_port=ports.get("sampler_base", 8110),
                      prometheus_port=ports.get("prometheus", 9090), supervise=supervise, log_max_bytes=log_max_bytes,
                      brokers=brokers or last.get("brokers"),
                      trainer_rank_base_port=ports.get("trainer_rank_base", 8170),
                      rendezvous_port=ports.get("rendezvous", 29500), hosts=hosts)


def _up(args: argparse.Namespace, home: Path) -> int:
    last = StackState(home).load()
    samplers = args.samplers if args.samplers is not None else len(last.get("samplers") or [0, 1])
    log_max = int(args.log_max_mb * 1024 * 1024) if args.log_max_mb else int(last.get("log_max_bytes") or LOG_MAX_BYTES)
    stack = _stack(home, args.config, args.run, args.store, supervise=not args.no_supervise, log_max_bytes=log_max,
                   brokers=args.brokers, hosts=args.hosts)
    now = {"config": str(stack.config), "run": stack.run, "store_backend": stack.store_backend}
    changed = [k for k, v in now.items() if k in last and last[k] != v]
    if changed and stack.pids():
        _out(f"note: {', '.join(changed)} changed since the last up; processes already running keep the old "
             "settings (down, then up, to apply them everywhere)")
    try:
        stack.up(samplers=samplers, timeout_s=args.timeout, prometheus=not args.no_prometheus, trainers=args.trainers,
                 install_extras=args.install_extras)
    except StackError as exc:
        raise StackError(f"{exc}\n(what did start is still running: see `{PROG} status`, "
                         f"stop it with `{PROG} down`)") from None
    _out()
    ranks = f", {stack.trainers} trainer ranks" if stack.trainers > 1 else ""
    _out(f"Flywheel is up: {samplers} sampler(s){ranks}, config {stack.config}, state in {home}")
    _out(f"kafka:      {stack.endpoints().kafka_bootstrap}")
    store = f"{home}/store (kept across down/up)" if stack.store_backend == "local" else "the S3 server"
    _out(f"store:      {store}")
    _out(f"logs:       (rotated past {log_max / 2**20:.0f} MiB, 3 kept)")
    for st in stack.status():
        _out(f"  {st.name:<11} {st.log}")
    _out(f"admin API:  {stack.admin_url}    OpenAPI docs: {stack.admin_url}/docs")
    if stack.hosts:
        _out(f"hosts:      each part in its own network namespace on {multihost.BRIDGE} ({multihost.SUBNET}): "
             f"{PROG} hosts")
    _out(f"curves:     .venv/bin/tensorboard --logdir {home}/tb    (tracking.tensorboard_dir moves them)")
    source = stack.admin_token_source
    if source.startswith("/"):
        _out(f"token:      {source} (mode 0600): export FLYWHEEL_ADMIN_TOKEN=$(cat {source})")
    else:
        _out(f"token:      from {source}")
    forwarded = stack.hosts and any(st.name == forward.NAME and st.alive for st in stack.status(infra=False))
    url = "" if stack.admin_url == DEFAULT_ADMIN_URL or forwarded else f" --url {stack.admin_url}"
    _out(f"status:     flywheel status{url}    (processes: {PROG} status)")
    _out(f"stop:       make down    (or: {PROG} down)")
    return 0


def _status(home: Path) -> int:
    stack = _stack(home)
    states = stack.status()
    _out(f"flywheel local stack in {home}")
    for st in states:
        pid = f"pid {st.pid or '-'}" + ("" if st.alive or not st.pid else " (last)")
        alive = "alive" if st.alive else "DEAD "
        restarts = f"restarts {st.restarts}" + (" held" if st.held else "")
        _out(f"  {st.name:<11} {alive}  {pid:<17}  {restarts:<16}  {st.endpoint:<36}  {st.log}")
    sup = stack.supervisor_pid()
    _out(f"  supervisor  {f'alive  pid {sup}' if sup else 'not running: nothing is restarted'}")
    if stack.hosts:
        _out(f"  network     bridge {multihost.BRIDGE} {multihost.GATEWAY}/{multihost.PREFIX_LEN}, a namespace per "
             f"part: {PROG} hosts")
    if not any(st.alive for st in states):
        _out(f"nothing is running: {PROG} up")
    return 0 if all(st.alive for st in states) else 3


def _hosts(args: argparse.Namespace, home: Path) -> int:
    if args.action == "cleanup":
        removed = multihost.teardown(home, _out, force=True)
        _out("removed" if removed else f"nothing to remove: no {multihost.PREFIX}* namespace, link or rule")
        return 0
    if args.action in ("cut", "slow", "heal"):
        if not args.name:
            raise StackError(f"{args.action} needs the part's name, e.g. `{PROG} hosts {args.action} trainer`")
        try:
            multihost.host(args.name)
            if args.action == "heal":
                _out(f"{args.name}: removed {multihost.heal(args.name)} cut rule(s)")
                return 0
            recorded = [h["name"] for h in multihost.load_state(home).get("hosts") or []]
            peers = args.peers or [n for n in recorded if multihost.parse_part(n)[0] == "kafka"]
            if not peers:
                raise StackError(f"no multi-host stack in {home} to cut {args.name} from: name the peers")
            if args.action == "slow":
                addrs = multihost.slow(args.name, peers, args.delay_ms, args.rate_kbps,
                                       home / "logs" / f"slowlink-{args.name}.log")
                cap = f", {args.rate_kbps:g} kB/s a direction" if args.rate_kbps else ""
                _out(f"{args.name}: links to {', '.join(peers)} ({', '.join(addrs)}) slowed by {args.delay_ms:g} ms "
                     f"each way{cap} (new connections; open ones were reset); `{PROG} hosts heal {args.name}` "
                     "restores them")
                return 0
            addrs = multihost.cut(args.name, peers, args.direction)
        except ValueError as exc:
            raise StackError(str(exc)) from None
        how = {"both": "cut from", "out": "cannot send to (one way)", "in": "hears nothing from (one way)"}
        _out(f"{args.name} ({multihost.netns_name(args.name)}) {how[args.direction]} {', '.join(peers)} "
             f"({', '.join(addrs)}); `{PROG} hosts heal {args.name}` restores it")
        return 0
    if not multihost.active(home):
        _out(f"no multi-host stack in {home} (start one with `{PROG} up --hosts`, or `make up HOSTS=1`)")
        return 3
    stack = _stack(home)
    pids = {st.name: st.pid if st.alive else None for st in stack.status()}
    table = multihost.rows(home, pids)
    for line in multihost.format_rows(table):
        _out(line)
    return 0 if all(r.pid is not None and not r.where for r in table) else 3


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
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # readiness reports its own errors
    home = args.home.expanduser().resolve() if args.home else default_home()
    try:
        if args.command == "up":
            return _up(args, home)
        if args.command == "down":
            _stack(home).down(infra=not args.keep_infra)
        elif args.command == "status":
            return _status(home)
        elif args.command == "hosts":
            return _hosts(args, home)
        elif args.command == "restart":
            return _restart(args.service, home)
        elif args.command == "hold":
            _stack(home).hold(args.name)
        elif args.command == "release":
            _stack(home).release(args.name)
        elif args.command == "infra-up":
            ep = infra.ensure_up(home, kafka_port=args.kafka_port, controller_port=args.controller_port,
                                 s3_port=args.s3_port, bucket=args.bucket, brokers=args.brokers,
                                 timeout_s=args.timeout)
            _out(f"kafka bootstrap: {ep.kafka_bootstrap}")
            _out(f"s3 endpoint:     {ep.s3_endpoint} (bucket {ep.bucket}, key/secret testing/testing)")
        elif args.command == "infra-down":
            infra.down(home)
        else:
            return supervisor.main(home)
        return 0
    except StackError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
