"""Bringing the whole local stack (Kafka + S3) up, down, and reporting on it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.infra import kafka, s3
from shared.infra.config import DEFAULT_TIMEOUT_S, InfraConfig, InfraEndpoints, InfraError
from shared.infra.jars import ensure_kafka_jars, find_java
from shared.infra.procs import (
    describe_listener,
    file_lock,
    find_ours,
    is_running,
    port_is_free,
    read_cmdline,
    stop,
)
from shared.infra.readiness import run_coro, wait_until

Progress = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class ServiceState:
    """One service of the stack: its pid when running, and where it listens."""

    name: str
    pid: int | None
    endpoint: str | None

    @property
    def running(self) -> bool:
        return self.pid is not None


def _require_free(cfg: InfraConfig, port: int, what: str, flag: str, env: str) -> None:
    if not port_is_free(port):
        raise InfraError(
            f"port {port} ({what}) on 127.0.0.1 is already in use by {describe_listener(port)}, which is not "
            f"a process of the stack in {cfg.home}; stop it or choose another port with {flag} / {env}"
        )


def ensure_up(
    home: str | os.PathLike[str] | None = None,
    *,
    kafka_port: int | None = None,
    controller_port: int | None = None,
    s3_port: int | None = None,
    bucket: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Progress = _print,
) -> InfraEndpoints:
    """Start (or reuse) Kafka and the S3 server for `home`, wait until both really work.

    Idempotent: processes recorded in `<home>/pids` that are alive and are what we started are
    reused. Kafka's data survives `down`/`up`. Writes `<home>/infra.env`. Raises InfraError with
    the reason (and a log tail) when anything fails or `timeout_s` passes while waiting.
    """
    cfg = InfraConfig.resolve(home, kafka_port, controller_port, s3_port, bucket)
    cfg.home.mkdir(parents=True, exist_ok=True)
    with file_lock(cfg.home / ".lock"):
        started = time.monotonic()
        kafka_pid = find_ours(kafka.pidfile(cfg), lambda a: kafka.is_ours(cfg, a))
        s3_pid = find_ours(s3.pidfile(cfg), s3.is_ours)
        if kafka_pid is not None:
            kafka.check_ports(cfg, kafka_pid)
        else:
            _require_free(cfg, cfg.kafka_port, "kafka", "--kafka-port", "FLYWHEEL_INFRA_KAFKA_PORT")
            _require_free(
                cfg,
                cfg.controller_port,
                "kafka controller",
                "--controller-port",
                "FLYWHEEL_INFRA_CONTROLLER_PORT",
            )
        if s3_pid is not None:
            s3.check_port(cfg, s3_pid)
        else:
            s3.moto_server_path()
            _require_free(cfg, cfg.s3_port, "s3", "--s3-port", "FLYWHEEL_INFRA_S3_PORT")

        if kafka_pid is None:
            java = find_java()
            libs = ensure_kafka_jars(progress)
            kafka.prepare(cfg, java, libs, progress)
            kafka_pid = kafka.start(cfg, java, libs)
            progress(f"started Kafka (pid {kafka_pid}), log {kafka.log_path(cfg)}")
        else:
            progress(f"Kafka already running (pid {kafka_pid})")
        if s3_pid is None:
            s3_pid = s3.start(cfg)
            progress(f"started S3 server (moto, pid {s3_pid}), log {s3.log_path(cfg)}")
        else:
            progress(f"S3 server already running (pid {s3_pid})")

        ep = cfg.endpoints
        deadline = time.monotonic() + timeout_s
        pid_s3, pid_kafka = s3_pid, kafka_pid
        took = wait_until(
            f"S3 at {ep.s3_endpoint}",
            lambda left: s3.roundtrip(ep.s3_endpoint, ep.bucket, timeout_s=min(left, 10.0)),
            deadline=deadline,
            alive=lambda: is_running(pid_s3),
            log_path=s3.log_path(cfg),
            progress=progress,
        )
        progress(f"S3 ready at {ep.s3_endpoint} (bucket {ep.bucket}) after {took:.1f} s")
        took = wait_until(
            f"Kafka at {ep.kafka_bootstrap}",
            lambda left: run_coro(kafka.roundtrip(ep.kafka_bootstrap, min(left, 30.0))),
            deadline=deadline,
            alive=lambda: is_running(pid_kafka),
            log_path=kafka.log_path(cfg),
            progress=progress,
        )
        progress(f"Kafka ready at {ep.kafka_bootstrap} after {took:.1f} s")
        write_env_file(cfg.env_file, ep)
        progress(f"stack up in {time.monotonic() - started:.1f} s; endpoints in {cfg.env_file}")
        return ep


def write_env_file(path: Path, ep: InfraEndpoints) -> None:
    lines = [f"{key}={value}" for key, value in ep.as_env().items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# Written by `python -m shared.infra up`.\n" + "\n".join(lines) + "\n")
    tmp.replace(path)


def down(home: str | os.PathLike[str] | None = None, *, progress: Progress = _print) -> list[str]:
    """Stop our own Kafka and S3 processes for `home` (by pid); data is kept. Returns what stopped."""
    cfg = InfraConfig.resolve(home)
    stopped: list[str] = []
    if not cfg.home.is_dir():
        progress(f"nothing to stop: {cfg.home} does not exist")
        return stopped
    with file_lock(cfg.home / ".lock"):
        for name, pidfile, matches in (
            ("S3 server", s3.pidfile(cfg), s3.is_ours),
            ("Kafka", kafka.pidfile(cfg), lambda a: kafka.is_ours(cfg, a)),
        ):
            pid = stop(pidfile, matches)
            if pid is None:
                progress(f"{name}: not running")
            else:
                progress(f"{name}: stopped (pid {pid})")
                stopped.append(name)
    return stopped


def status(home: str | os.PathLike[str] | None = None) -> list[ServiceState]:
    """What runs for `home`: Kafka and the S3 server, with pids and endpoints."""
    cfg = InfraConfig.resolve(home)
    states: list[ServiceState] = []
    pid = find_ours(kafka.pidfile(cfg), lambda a: kafka.is_ours(cfg, a))
    ports = kafka.running_ports(read_cmdline(pid) or []) if pid else None
    states.append(
        ServiceState("kafka", pid, f"127.0.0.1:{ports[0]} (controller {ports[1]})" if ports else None)
    )
    pid = find_ours(s3.pidfile(cfg), s3.is_ours)
    port = s3.running_port(read_cmdline(pid) or []) if pid else None
    states.append(ServiceState("s3", pid, f"http://127.0.0.1:{port}" if port else None))
    return states
