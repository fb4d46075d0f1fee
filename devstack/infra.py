"""Kafka + the S3 server of one home: bring them up (or reuse them), stop them, report on them."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from devstack import kafka, s3
from devstack.config import DEFAULT_TIMEOUT_S, MAX_BROKERS, InfraConfig, InfraEndpoints, StackError
from devstack.jars import ensure_kafka_jars, find_java
from devstack.procs import Proc, ProcStatus, file_lock, is_running, require_free
from devstack.readiness import run_coro, wait_until

Progress = Callable[[str], None]


def say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def ensure_up(
    home: str | os.PathLike[str] | None = None,
    *,
    kafka_port: int | None = None,
    controller_port: int | None = None,
    s3_port: int | None = None,
    bucket: str | None = None,
    kafka_sasl_port: int | None = None,
    kafka_authorizer: bool = False,
    brokers: int | None = None,
    hosts: bool | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Progress = say,
) -> InfraEndpoints:
    """Start (or reuse) Kafka and the S3 server for ``home``, wait until both really work.

    Idempotent: what runs is reused (``Proc.pid`` checks it is what we started). Kafka's data
    survives ``down``/``up``. Writes ``<home>/infra.env``. Raises StackError with the reason (and a
    log tail) when anything fails or ``timeout_s`` passes while waiting. ``kafka_sasl_port`` adds a
    SASL_PLAINTEXT listener (SCRAM-SHA-512, user created when the storage is formatted, so use a fresh
    home); the endpoints then carry its address and credentials (``InfraEndpoints.kafka_sasl_env``).
    ``kafka_authorizer`` (with ``kafka_sasl_port``) turns the StandardAuthorizer on and adds a SCRAM user per
    role (``InfraEndpoints.kafka_sasl_env(role)``), who may do nothing until ``shared.acl.provision_run``
    creates their ACLs; the stack's own SASL user is a super user.
    ``brokers`` (default ``$FLYWHEEL_INFRA_BROKERS``, else 1): a KRaft cluster of that many nodes; ready once
    every node runs, all are registered and an acks=all round trip on a topic replicated min(3, n) times works.
    ``hosts`` (default: as the home is, see ``InfraConfig.resolve``): each node and the S3 server in its own
    network namespace, which ``devstack.hosts.ensure_network`` made first.
    """
    cfg = InfraConfig.resolve(home, kafka_port, controller_port, s3_port, bucket, kafka_sasl_port=kafka_sasl_port,
                              kafka_authorizer=kafka_authorizer, brokers=brokers, hosts=hosts)
    cfg.home.mkdir(parents=True, exist_ok=True)
    with file_lock(cfg.home / ".infra.lock"):
        started = time.monotonic()
        kprocs, sproc = kafka.procs(cfg), s3.proc(cfg)
        kafka_pids, s3_pid = [p.pid() for p in kprocs], sproc.pid()
        for node, kproc, pid in zip(cfg.kafka_nodes, kprocs, kafka_pids, strict=True):
            if pid is not None:
                kafka.check_ports(cfg, pid, node)
                _check_netns(cfg, kproc, pid)
            elif not cfg.hosts:  # in the multi-host stack each node listens in a namespace of its own
                require_free(f"{node.name}; see --kafka-port, FLYWHEEL_INFRA_KAFKA_PORT", node.port, cfg.home)
                require_free(f"{node.name} controller; see --controller-port, FLYWHEEL_INFRA_CONTROLLER_PORT",
                             node.controller_port, cfg.home)
        if kafka_pids[0] is None and cfg.kafka_sasl_port is not None and not cfg.hosts:
            require_free("kafka SASL listener (kafka_sasl_port)", cfg.kafka_sasl_port, cfg.home)
        if s3_pid is not None:
            s3.check_port(cfg, s3_pid)
            _check_netns(cfg, sproc, s3_pid)
        else:
            s3.moto_server_path()
            if not cfg.hosts:
                require_free("s3; see --s3-port, FLYWHEEL_INFRA_S3_PORT", cfg.s3_port, cfg.home)

        running = list(kafka_pids)
        if None in kafka_pids:
            java = find_java()
            libs = ensure_kafka_jars(progress)
            kafka.prepare(cfg, java, libs, progress)
            for i, (node, kproc) in enumerate(zip(cfg.kafka_nodes, kprocs, strict=True)):
                if kafka_pids[i] is None:
                    kafka_pids[i], _ = kproc.ensure(kafka.command(cfg, java, libs, node), cwd=node.dir,
                                                    netns=cfg.netns(node.name))
        for node, kproc, was, pid in zip(cfg.kafka_nodes, kprocs, running, kafka_pids, strict=True):
            what = "Kafka" if node.node_id == 1 else f"Kafka {node.name}"
            progress(f"{what} already running (pid {pid})" if was is not None
                     else f"started {what} (pid {pid}), log {kproc.log}")
        if s3_pid is None:
            s3_pid, _ = sproc.ensure(s3.command(cfg), cwd=cfg.home, netns=cfg.netns(s3.NAME))
            progress(f"started S3 server (moto, pid {s3_pid}), log {sproc.log}")
        else:
            progress(f"S3 server already running (pid {s3_pid})")

        ep = cfg.endpoints
        deadline = time.monotonic() + timeout_s
        pid_s3, pids_kafka, klog = s3_pid, [pid for pid in kafka_pids if pid is not None], kprocs[0].log
        kafka_alive = lambda: all(is_running(pid) for pid in pids_kafka)  # noqa: E731
        took = wait_until(f"S3 at {ep.s3_endpoint}",
                          lambda left: s3.roundtrip(ep.s3_endpoint, ep.bucket, timeout_s=min(left, 10.0)),
                          deadline=deadline, alive=lambda: is_running(pid_s3), log_path=sproc.log, progress=progress)
        progress(f"S3 ready at {ep.s3_endpoint} (bucket {ep.bucket}) after {took:.1f} s")
        took = wait_until(f"Kafka at {ep.kafka_bootstrap}",
                          lambda left: run_coro(kafka.roundtrip(ep.kafka_bootstrap, min(left, 30.0),
                                                                brokers=cfg.brokers,
                                                                replication=cfg.kafka_replication)),
                          deadline=deadline, alive=kafka_alive, log_path=klog, progress=progress)
        progress(f"Kafka ready at {ep.kafka_bootstrap} after {took:.1f} s")
        if ep.kafka_sasl_bootstrap is not None:
            sasl_bootstrap, security = ep.kafka_sasl_bootstrap, kafka.sasl_security(cfg)
            took = wait_until(f"Kafka SASL listener at {sasl_bootstrap}",
                              lambda left: run_coro(kafka.roundtrip(sasl_bootstrap, min(left, 30.0), security)),
                              deadline=deadline, alive=kafka_alive, log_path=klog, progress=progress)
            progress(f"Kafka SASL_PLAINTEXT ({cfg.kafka_sasl_username}, SCRAM-SHA-512) ready at {sasl_bootstrap} "
                     f"after {took:.1f} s")
        write_env_file(cfg.env_file, ep)
        progress(f"Kafka + S3 up in {time.monotonic() - started:.1f} s; endpoints in {cfg.env_file}")
        return ep


def _check_netns(cfg: InfraConfig, proc: Proc, pid: int) -> None:
    """A reused process must run where this call expects it: on 127.0.0.1, or in its own host's namespace."""
    record = proc.record()
    running_in = record.netns if record is not None else None
    expected = cfg.netns(proc.name)
    if running_in != expected:
        raise StackError(f"our {proc.name} in {cfg.home} (pid {pid}) runs in {_where(running_in)}, not in "
                         f"{_where(expected)}: run `python -m devstack down --home {cfg.home}` first")


def _where(netns: str | None) -> str:
    return f"network namespace {netns}" if netns else "the root namespace (127.0.0.1)"


def write_env_file(path: Path, ep: InfraEndpoints) -> None:
    lines = [f"{key}={value}" for key, value in ep.as_env().items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# Written by `python -m devstack infra-up` / `up`.\n" + "\n".join(lines) + "\n")
    tmp.replace(path)


def down(home: str | os.PathLike[str] | None = None, *, progress: Progress = say) -> list[str]:
    """Stop this home's own S3 server and Kafka nodes (by pid; every node it started, whatever
    ``$FLYWHEEL_INFRA_BROKERS`` says now); data is kept. Returns the names stopped."""
    cfg = InfraConfig.resolve(home)
    stopped: list[str] = []
    if not cfg.home.is_dir():
        progress(f"nothing to stop: {cfg.home} does not exist")
        return stopped
    with file_lock(cfg.home / ".infra.lock"):
        nodes = [(f"Kafka {p.name}" if p.name != kafka.NAME else "Kafka", p) for p in _kafka_procs(cfg)]
        for what, proc in [("S3 server", s3.proc(cfg)), *reversed(nodes)]:
            pid = proc.stop()
            progress(f"{what}: not running" if pid is None else f"{what}: stopped (pid {pid})")
            if pid is not None:
                stopped.append(proc.name)
    return stopped


def _kafka_procs(cfg: InfraConfig) -> list[Proc]:
    """Node 1's process and every other node's this home ever started (a launch record or a pid file)."""
    others = [Proc(cfg.home, f"{kafka.NAME}-{i}") for i in range(2, MAX_BROKERS + 1)]
    return [kafka.proc(cfg), *(p for p in others if p.record() is not None or p.last_pid() is not None)]


def status(home: str | os.PathLike[str] | None = None) -> list[ProcStatus]:
    """Kafka's nodes and the S3 server of ``home``: alive or not, pid, endpoint, log."""
    cfg = InfraConfig.resolve(home)
    out = []
    for kproc in _kafka_procs(cfg):
        krec = kproc.record()  # where it listens, as started
        ports = kafka.running_ports(krec.cmd) if krec else None
        host = cfg.host(kproc.name) if krec is not None and krec.netns else "127.0.0.1"
        out.append(kproc.status(f"{host}:{ports[0]} (controller {ports[1]})" if ports else "-"))
    sproc = s3.proc(cfg)
    srec = sproc.record()
    port = s3.running_port(srec.cmd) if srec else None
    host = cfg.host(s3.NAME) if srec is not None and srec.netns else "127.0.0.1"
    return [*out, sproc.status(f"http://{host}:{port}" if port else "-")]
