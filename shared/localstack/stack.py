"""LocalStack: the four Flywheel services as local processes (the Docker-free ``make up``).

The single place that knows how to run trainer, paramsync, admin and N samplers on one machine (their
environment, ports, logs and pid files under ``<home>``, start-up health, stop order). Kafka and the S3
server come from ``shared.infra``; process bookkeeping from ``shared.infra.procs``."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import shared.infra
from shared.infra.config import REPO_ROOT, InfraEndpoints, InfraError
from shared.infra.procs import file_lock, is_running, port_is_free, spawn, tail
from shared.infra.procs import stop as stop_pid
from shared.localstack import prometheus as prom
from shared.localstack.launch import HOST, service_command, service_env, validate_config
from shared.localstack.process import (
    START_ORDER,
    LocalStackError,
    cmdline_matcher,
    find_service,
    proc_key,
    require_free,
    wait_gone,
    wait_http_ok,
)
from shared.localstack.state import ProcStatus, StackState
from shared.localstack.token import resolve_admin_token

DEFAULT_CONFIG = REPO_ROOT / "configs" / "cartpole.yaml"


def _say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


class LocalStack:
    """Trainer, paramsync, admin and samplers as detached processes whose state lives in ``home``.

    ``infra`` None means Kafka + S3 are this home's own ``shared.infra`` stack (started on demand
    on the default ports, stopped by ``down()``); given endpoints are used and never stopped.
    Every method is idempotent and works across Python processes: it reads the pid files.
    """

    def __init__(
        self,
        home: str | os.PathLike[str],
        config: str | os.PathLike[str] = DEFAULT_CONFIG,
        run: str | None = None,
        env: dict[str, str] | None = None,
        infra: InfraEndpoints | None = None,
        admin_port: int = 8080,
        trainer_port: int = 8101,
        paramsync_port: int = 8102,
        sampler_base_port: int = 8110,
        store_backend: str = "local",
        *,
        prometheus_port: int = 9090,
        progress: Callable[[str], None] = _say,
    ) -> None:
        if store_backend not in ("local", "s3"):
            raise LocalStackError(f"store_backend must be 'local' or 's3', got {store_backend=}")
        self.home = Path(home).expanduser().resolve()
        self.config = Path(config).expanduser().resolve()
        self.run = run
        self.env = dict(env or {})
        self.store_backend = store_backend
        self.prometheus_port = prometheus_port
        self._infra = infra
        self._owns_infra = infra is None
        self._ports = {"trainer": trainer_port, "paramsync": paramsync_port, "admin": admin_port}
        self._sampler_base_port = sampler_base_port
        self._progress = progress
        self._token: tuple[str, str] | None = None
        self.state = StackState(self.home)

    # ---- names, files, ports -------------------------------------------------------------
    def log_path(self, service: str, replica: int = 0) -> Path:
        return self.home / "logs" / f"{proc_key(service, replica)}.log"

    def pidfile(self, service: str, replica: int = 0) -> Path:
        return self.home / "pids" / f"{proc_key(service, replica)}.pid"

    def port(self, service: str, replica: int = 0) -> int:
        proc_key(service, replica)
        return self._sampler_base_port + replica if service == "sampler" else self._ports[service]

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self._ports['admin']}"

    @property
    def admin_token(self) -> str:
        self._token = self._token or resolve_admin_token(self.home, self.env)
        return self._token[0]

    @property
    def admin_token_source(self) -> str:
        """Where the token comes from: the path of ``<home>/admin-token`` or the variable's name."""
        self._token = self._token or resolve_admin_token(self.home, self.env)
        return self._token[1]

    def endpoints(self, timeout_s: float = 120.0) -> InfraEndpoints:
        """Kafka + S3 endpoints; for a stack that owns its infra, starts (or reuses) it."""
        if self._infra is None:
            try:
                self._infra = shared.infra.ensure_up(self.home, timeout_s=timeout_s, progress=self._progress)
            except InfraError as exc:
                raise LocalStackError(f"Kafka / S3 did not come up: {exc}") from exc
        return self._infra

    def service_env(self, service: str, replica: int = 0) -> dict[str, str]:
        """The full environment one service process is started with (see ``launch.service_env``)."""
        return service_env(os.environ, service=service, replica=replica, port=self.port(service, replica),
                           home=self.home, config=self.config, run=self.run, store_backend=self.store_backend,
                           endpoints=self.endpoints(), admin_token=self.admin_token, overrides=self.env)

    # ---- one process ---------------------------------------------------------------------
    def pid(self, service: str, replica: int = 0) -> int | None:
        """The pid of this stack's running ``service`` replica, or None."""
        return find_service(self.pidfile(service, replica), service, self.home)

    def pids(self) -> dict[str, int]:
        """Running processes by name (``trainer``, ``sampler-1``, ``prometheus``, ...)."""
        return {st.name: st.pid for st in self.status(infra=False) if st.alive and st.pid is not None}

    def start(self, service: str, replica: int = 0) -> int:
        """Start one process (detached) unless it already runs; return its pid. Does not wait."""
        key = proc_key(service, replica)
        if (pid := self.pid(service, replica)) is not None:
            self._progress(f"{key} already running (pid {pid})")
            return pid
        port, log = self.port(service, replica), self.log_path(service, replica)
        require_free(key, port, self.home)
        pid = spawn(service_command(service), log_path=log, pidfile=self.pidfile(service, replica),
                    cwd=REPO_ROOT, env=self.service_env(service, replica))
        if service == "sampler":
            self.state.add_sampler(replica)
        self.state.record_pid(key, pid)
        self._progress(f"started {key} (pid {pid}) on {HOST}:{port}, log {log}")
        return pid

    def wait_healthy(self, service: str, replica: int = 0, timeout_s: float = 60.0) -> None:
        """Wait until the process answers 200 on /healthz; raise with its log tail if it exits."""
        key = proc_key(service, replica)
        log = self.log_path(service, replica)
        pid = self.pid(service, replica)
        if pid is None:
            raise LocalStackError(f"{key} is not running.\nlast 30 lines of {log}:\n{tail(log, 30)}")
        url = f"http://{HOST}:{self.port(service, replica)}/healthz"
        took = wait_http_ok(f"{key} (pid {pid})", url, deadline=time.monotonic() + timeout_s,
                            alive=lambda: is_running(pid), log_path=log)
        self._progress(f"{key} healthy (pid {pid}) after {took:.1f} s")

    def kill(self, service: str, replica: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process (e.g. kill -9 the trainer); with SIGKILL, wait until it is gone and
        its port is released (the main thread exits first; threads and sockets go a moment later), so
        an immediate :meth:`start` finds the port free."""
        key = proc_key(service, replica)
        pid = self.pid(service, replica)
        if pid is None:
            raise LocalStackError(f"cannot signal {key}: it is not running")
        os.kill(pid, sig)
        if sig == signal.SIGKILL and wait_gone(pid, timeout_s=10.0):
            port, deadline = self.port(service, replica), time.monotonic() + 10.0
            while not port_is_free(port) and time.monotonic() < deadline:
                time.sleep(0.02)
            is_running(pid)  # reaps it now that it has fully exited, if it is our child
            self.pidfile(service, replica).unlink(missing_ok=True)
        self._progress(f"sent {signal.Signals(sig).name} to {key} (pid {pid})")

    def stop(self, service: str, replica: int = 0, timeout_s: float = 20.0) -> None:
        """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL. No-op when not running."""
        if self.pid(service, replica) is not None:  # checks FLYWHEEL_HOME too; stop_pid rechecks the pid
            pid = stop_pid(self.pidfile(service, replica), cmdline_matcher(service), timeout_s=timeout_s)
            self._progress(f"stopped {proc_key(service, replica)} (pid {pid})")

    # ---- the whole stack -----------------------------------------------------------------
    def up(self, samplers: int = 2, timeout_s: float = 120.0, prometheus: bool = True) -> None:
        """Infra (if needed), admin token, trainer, paramsync, admin, ``samplers`` samplers; wait for all.

        Running processes are reused; samplers beyond ``samplers`` are stopped (scaling down).
        """
        if samplers < 0:
            raise LocalStackError(f"samplers must be >= 0, got {samplers=}")
        deadline = time.monotonic() + timeout_s
        with file_lock(self.home / ".localstack.lock"):
            wanted = self._layout(range(samplers))
            for service, replica in wanted:  # before anything starts: a taken port fails fast
                if self.pid(service, replica) is None:
                    require_free(proc_key(service, replica), self.port(service, replica), self.home)
            self.endpoints(timeout_s)
            self._progress(f"admin token: {self.admin_token_source}")
            validate_config(self.config, self.service_env("trainer"))
            for replica in self.state.samplers():
                if replica >= samplers:
                    self.stop("sampler", replica)
            self.state.save(samplers=list(range(samplers)), prometheus=prometheus, config=str(self.config),
                            run=self.run, store_backend=self.store_backend)
            for service, replica in wanted:
                self.start(service, replica)
            for service, replica in wanted:
                self.wait_healthy(service, replica, timeout_s=max(1.0, deadline - time.monotonic()))
            if prometheus:
                targets = {s: [self.port(s)] for s in ("trainer", "paramsync", "admin")}
                targets["sampler"] = [self.port("sampler", r) for r in range(samplers)]
                prom.ensure_running(self.home, self.prometheus_port, targets, deadline=deadline,
                                    progress=self._progress)

    def down(self, infra: bool = True) -> None:
        """Stop samplers (together), admin, paramsync, then the trainer (it commits), Prometheus, infra."""
        if not self.home.is_dir():
            return
        with file_lock(self.home / ".localstack.lock"):
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda r: self.stop("sampler", r), self.state.samplers()))
            for service in ("admin", "paramsync", "trainer"):
                self.stop(service)
            pid = prom.stop_running(self.home)
            if pid is not None:
                self._progress(f"stopped prometheus (pid {pid})")
            if infra and self._owns_infra:
                shared.infra.down(self.home, progress=self._progress)

    def status(self, infra: bool = True) -> list[ProcStatus]:
        """Every process this stack runs or should run, alive or dead, with pid and endpoint."""
        out: list[ProcStatus] = []
        for service, replica in self._layout(self.state.samplers()):
            last = self.state.last_pid(self.pidfile(service, replica))
            pid = self.pid(service, replica)
            url = f"http://{HOST}:{self.port(service, replica)}"
            out.append(ProcStatus(proc_key(service, replica), pid or last, pid is not None, url,
                                  self.log_path(service, replica)))
        if self.state.load().get("prometheus") and prom.binary():
            last = self.state.last_pid(prom.pidfile(self.home))
            pid = prom.find(self.home)
            out.append(ProcStatus("prometheus", pid or last, pid is not None,
                                  f"http://{HOST}:{self.prometheus_port}", prom.log_path(self.home)))
        if infra and self._owns_infra:
            for st in shared.infra.status(self.home):
                out.append(ProcStatus(st.name, st.pid, st.running, st.endpoint or "-",
                                      self.home / "logs" / f"{st.name}.log"))
        return out

    @staticmethod
    def _layout(samplers: Iterable[int]) -> list[tuple[str, int]]:
        """(service, replica) in start order."""
        return [(s, 0) for s in START_ORDER if s != "sampler"] + [("sampler", i) for i in samplers]
