"""Kafka + the S3 server of one home: bring them up (or reuse them), stop them, report on them."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from devstack import kafka, s3
from devstack.config import DEFAULT_TIMEOUT_S, InfraConfig, InfraEndpoints
from devstack.jars import ensure_kafka_jars, find_java
from devstack.procs import ProcStatus, file_lock, is_running, require_free
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
    """
    cfg = InfraConfig.resolve(home, kafka_port, controller_port, s3_port, bucket, kafka_sasl_port=kafka_sasl_port,
                              kafka_authorizer=kafka_authorizer)
    cfg.home.mkdir(parents=True, exist_ok=True)
    with file_lock(cfg.home / ".infra.lock"):
        started = time.monotonic()
        kproc, sproc = kafka.proc(cfg), s3.proc(cfg)
        kafka_pid, s3_pid = kproc.pid(), sproc.pid()
        if kafka_pid is not None:
            kafka.check_ports(cfg, kafka_pid)
        else:
            require_free("kafka; see --kafka-port, FLYWHEEL_INFRA_KAFKA_PORT", cfg.kafka_port, cfg.home)
            require_free("kafka controller; see --controller-port, FLYWHEEL_INFRA_CONTROLLER_PORT",
                         cfg.controller_port, cfg.home)
            if cfg.kafka_sasl_port is not None:
                require_free("kafka SASL listener (kafka_sasl_port)", cfg.kafka_sasl_port, cfg.home)
        if s3_pid is not None:
            s3.check_port(cfg, s3_pid)
        else:
            s3.moto_server_path()
            require_free("s3; see --s3-port, FLYWHEEL_INFRA_S3_PORT", cfg.s3_port, cfg.home)

        if kafka_pid is None:
            java = find_java()
            libs = ensure_kafka_jars(progress)
            kafka.prepare(cfg, java, libs, progress)
            kafka_pid, _ = kproc.ensure(kafka.command(cfg, java, libs), cwd=cfg.kafka_dir)
            progress(f"started Kafka (pid {kafka_pid}), log {kproc.log}")
        else:
            progress(f"Kafka already running (pid {kafka_pid})")
        if s3_pid is None:
            s3_pid, _ = sproc.ensure(s3.command(cfg), cwd=cfg.home)
            progress(f"started S3 server (moto, pid {s3_pid}), log {sproc.log}")
        else:
            progress(f"S3 server already running (pid {s3_pid})")

        ep = cfg.endpoints
        deadline = time.monotonic() + timeout_s
        pid_s3, pid_kafka = s3_pid, kafka_pid
        took = wait_until(f"S3 at {ep.s3_endpoint}",
                          lambda left: s3.roundtrip(ep.s3_endpoint, ep.bucket, timeout_s=min(left, 10.0)),
                          deadline=deadline, alive=lambda: is_running(pid_s3), log_path=sproc.log, progress=progress)
        progress(f"S3 ready at {ep.s3_endpoint} (bucket {ep.bucket}) after {took:.1f} s")
        took = wait_until(f"Kafka at {ep.kafka_bootstrap}",
                          lambda left: run_coro(kafka.roundtrip(ep.kafka_bootstrap, min(left, 30.0))),
                          deadline=deadline, alive=lambda: is_running(pid_kafka), log_path=kproc.log,
                          progress=progress)
        progress(f"Kafka ready at {ep.kafka_bootstrap} after {took:.1f} s")
        if ep.kafka_sasl_bootstrap is not None:
            sasl_bootstrap, security = ep.kafka_sasl_bootstrap, kafka.sasl_security(cfg)
            took = wait_until(f"Kafka SASL listener at {sasl_bootstrap}",
                              lambda left: run_coro(kafka.roundtrip(sasl_bootstrap, min(left, 30.0), security)),
                              deadline=deadline, alive=lambda: is_running(pid_kafka), log_path=kproc.log,
                              progress=progress)
            progress(f"Kafka SASL_PLAINTEXT ({cfg.kafka_sasl_username}, SCRAM-SHA-512) ready at {sasl_bootstrap} "
                     f"after {took:.1f} s")
        write_env_file(cfg.env_file, ep)
        progress(f"Kafka + S3 up in {time.monotonic() - started:.1f} s; endpoints in {cfg.env_file}")
        return ep


def write_env_file(path: Path, ep: InfraEndpoints) -> None:
    lines = [f"{key}={value}" for key, value in ep.as_env().items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# Written by `python -m devstack infra-up` / `up`.\n" + "\n".join(lines) + "\n")
    tmp.replace(path)


def down(home: str | os.PathLike[str] | None = None, *, progress: Progress = say) -> list[str]:
    """Stop this home's own S3 server and Kafka (by pid); data is kept. Returns the names stopped."""
    cfg = InfraConfig.resolve(home)
    stopped: list[str] = []
    if not cfg.home.is_dir():
        progress(f"nothing to stop: {cfg.home} does not exist")
        return stopped
    with file_lock(cfg.home / ".infra.lock"):
        for what, proc in (("S3 server", s3.proc(cfg)), ("Kafka", kafka.proc(cfg))):
            pid = proc.stop()
            progress(f"{what}: not running" if pid is None else f"{what}: stopped (pid {pid})")
            if pid is not None:
                stopped.append(proc.name)
    return stopped


def status(home: str | os.PathLike[str] | None = None) -> list[ProcStatus]:
    """Kafka and the S3 server of ``home``: alive or not, pid, endpoint, log."""
    cfg = InfraConfig.resolve(home)
    kproc, sproc = kafka.proc(cfg), s3.proc(cfg)
    krec, srec = kproc.record(), sproc.record()  # where they listen, as started
    ports = kafka.running_ports(krec.cmd) if krec else None
    port = s3.running_port(srec.cmd) if srec else None
    return [kproc.status(f"127.0.0.1:{ports[0]} (controller {ports[1]})" if ports else "-"),
            sproc.status(f"http://127.0.0.1:{port}" if port else "-")]
