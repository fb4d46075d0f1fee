"""LocalStack: the whole Flywheel system as local processes (the Docker-free ``make up``).

The single place that knows how to run trainer, paramsync, admin and N samplers on one machine
(their environment, ports, logs and launch records under ``<home>``, start-up health, stop order),
next to Kafka + S3 (``devstack.infra``) and Prometheus, with a supervisor that restarts what dies."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from devstack import forward, kafka, s3, supervisor
from devstack import hosts as multihost
from devstack import prometheus as prom
from devstack.config import DEFAULT_CONFIG, MAX_BROKERS, REPO_ROOT, InfraConfig, InfraEndpoints, StackError
from devstack.infra import down as infra_down
from devstack.infra import ensure_up, say
from devstack.infra import status as infra_status
from devstack.logs import LOG_BACKUPS, LOG_MAX_BYTES
from devstack.procs import (
    Proc,
    ProcStatus,
    describe_listener,
    file_lock,
    is_running,
    port_is_free,
    require_free,
    table_lock,
    tail,
    wait_gone,
)
from devstack.readiness import http_ok, wait_until
from devstack.services import (
    HOST,
    SERVICES,
    START_ORDER,
    parse_key,
    proc_key,
    resolve_admin_token,
    resolve_signing_keys,
    service_command,
    service_env,
    validate_config,
)
from devstack.state import StackState, SupervisorState
from shared.keyfile import public_keys_path

INFRA = (kafka.NAME, s3.NAME)
_KAFKA_NODE = re.compile(rf"{kafka.NAME}-[2-{MAX_BROKERS}]")
"""The other nodes of a Kafka cluster (``InfraConfig.kafka_nodes``): infra too, when this stack owns it."""


def is_infra(name: str) -> bool:
    """Kafka (any node of it) or the S3 server."""
    return name in INFRA or _KAFKA_NODE.fullmatch(name) is not None


class LocalStack:
    """Trainer, paramsync, admin and samplers as detached processes whose state lives in ``home``.

    ``infra`` None means Kafka + S3 are this home's own (started on demand on the default ports,
    supervised, stopped by ``down()``); given endpoints are used, never supervised nor stopped.
    ``supervise``: ``up`` starts this home's supervisor, which restarts any wanted process that
    dies (see ``devstack.supervisor``). Every method is idempotent and works across Python
    processes: it reads the files in ``home``.

    ``hosts``: the multi-host stack (``devstack.hosts``): every Kafka node, the S3 server, every trainer rank,
    paramsync, admin and each sampler in a network namespace of its own, at its own address on one bridge
    (needs root and the stack's own infra). None: as the home's stack is (multi-host while its hosts.json exists).
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
        trainer_rank_base_port: int = 8170,
        rendezvous_port: int = 29500,
        trainers: int | None = None,
        *,
        prometheus_port: int = 9090,
        supervise: bool = True,
        log_max_bytes: int = LOG_MAX_BYTES,
        brokers: int | None = None,
        hosts: bool | None = None,
        progress: Callable[[str], None] = say,
    ) -> None:
        if store_backend not in ("local", "s3"):
            raise StackError(f"store_backend must be 'local' or 's3', got {store_backend=}")
        self.home = Path(home).expanduser().resolve()
        self.config = Path(config).expanduser().resolve()
        self.run = run
        self.env = dict(env or {})
        self.store_backend = store_backend
        self.prometheus_port = prometheus_port
        self.supervise = supervise
        self.log_max_bytes = log_max_bytes
        self.brokers = brokers
        """Kafka nodes of the infra this stack owns (``devstack.infra.ensure_up``; None: ``$FLYWHEEL_INFRA_BROKERS``,
        else 1)."""
        self._infra = infra
        self._owns_infra = infra is None
        self._ports = {"trainer": trainer_port, "paramsync": paramsync_port, "admin": admin_port}
        self._sampler_base_port = sampler_base_port
        self._trainer_rank_base_port = trainer_rank_base_port
        self.rendezvous_port = rendezvous_port
        self._trainers = trainers
        self._progress = progress
        self._token: tuple[str, str] | None = None
        self._signing: Path | None = None
        self.state = StackState(self.home)
        self.hosts = multihost.active(self.home) if hosts is None else hosts
        if self.hosts and not self._owns_infra:
            raise StackError("the multi-host stack (hosts) runs its own Kafka and S3 in namespaces: "
                             "it cannot use given infra endpoints")

    # ---- names, files, ports -------------------------------------------------------------
    def _proc(self, service: str, replica: int = 0) -> Proc:
        return Proc(self.home, self._name(service, replica))

    def _name(self, name: str, replica: int = 0) -> str:
        """The process name for a service (+ replica), ``sampler-<i>``, ``prometheus``, or Kafka (``kafka``,
        ``kafka-<i>`` for the other nodes of a cluster) / S3 (only when this stack owns them)."""
        if is_infra(name):
            if not self._owns_infra:
                raise StackError(f"{name} is not this stack's: its Kafka + S3 endpoints were given")
            return name
        if name == prom.NAME:
            return name
        if name in SERVICES:
            return proc_key(name, replica)
        parse_key(name)  # sampler-<i>, or an error naming what is expected
        return name

    def log_path(self, service: str, replica: int = 0) -> Path:
        return self._proc(service, replica).log

    def pidfile(self, service: str, replica: int = 0) -> Path:
        return self._proc(service, replica).pidfile

    def port(self, service: str, replica: int = 0) -> int:
        proc_key(service, replica)
        if service == "sampler":
            return self._sampler_base_port + replica
        if service == "trainer" and replica:
            return self._trainer_rank_base_port + replica
        return self._ports[service]

    def host(self, service: str, replica: int = 0) -> str:
        """The address a service process listens on: 127.0.0.1, or its own host's in the multi-host stack."""
        key = proc_key(service, replica)
        return multihost.address(key) if self.hosts else HOST

    def netns(self, service: str, replica: int = 0) -> str | None:
        """The network namespace a service process runs in (None: this one's)."""
        key = proc_key(service, replica)
        return multihost.netns_name(key) if self.hosts else None

    @property
    def trainers(self) -> int:
        """Trainer ranks (``trainer.world_size``): as given, else as at the last ``up``, else 1."""
        if self._trainers is None:
            self._trainers = int(self.state.load().get("trainers") or 1)
        return self._trainers

    @property
    def admin_url(self) -> str:
        return f"http://{self.host('admin')}:{self._ports['admin']}"

    @property
    def admin_token(self) -> str:
        self._token = self._token or resolve_admin_token(self.home, self.env)
        return self._token[0]

    @property
    def admin_token_source(self) -> str:
        """Where the token comes from: the path of ``<home>/admin-token`` or the variable's name."""
        self._token = self._token or resolve_admin_token(self.home, self.env)
        return self._token[1]

    @property
    def run_name(self) -> str:
        """The run the services run: ``run``, else ``FLYWHEEL_RUN`` (the stack's env, then the environment), else
        the config file's ``run``, else ``default``."""
        named = self.run or self.env.get("FLYWHEEL_RUN") or os.environ.get("FLYWHEEL_RUN")
        if named:
            return named
        try:
            data = yaml.safe_load(self.config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            data = {}
        return str(data.get("run") or "default") if isinstance(data, dict) else "default"

    @property
    def signing(self) -> Path:
        """The directory of the run's signing keys, generated once (``resolve_signing_keys``)."""
        self._signing = self._signing or resolve_signing_keys(self.home, self.run_name)
        return self._signing

    def endpoints(self, timeout_s: float = 120.0) -> InfraEndpoints:
        """Kafka + S3 endpoints; for a stack that owns its infra, starts (or reuses) it."""
        if self._infra is None:
            try:
                self._infra = ensure_up(self.home, brokers=self.brokers, hosts=self.hosts, timeout_s=timeout_s,
                                        progress=self._progress)
            except StackError as exc:
                raise StackError(f"Kafka / S3 did not come up: {exc}") from exc
        return self._infra

    def service_env(self, service: str, replica: int = 0) -> dict[str, str]:
        """The full environment one service process is started with (see ``services.service_env``); trainer
        ranks get their rank, the world size and rank 0's rendezvous address (rank 0's host's, in the multi-host
        stack, where each process also listens on its own host's address and gloo uses the host's interface)."""
        env = service_env(os.environ, service=service, replica=replica, port=self.port(service, replica),
                          home=self.home, config=self.config, run=self.run, store_backend=self.store_backend,
                          endpoints=self.endpoints(), admin_token=self.admin_token, overrides=self.env,
                          log_max_bytes=self.log_max_bytes, log_backups=LOG_BACKUPS, signing=self.signing)
        if self.hosts:
            env["FLYWHEEL_HTTP_HOST"] = self.host(service, replica)
            if service == "trainer":
                env["GLOO_SOCKET_IFNAME"] = multihost.NS_IFACE
        if service == "trainer" and self.trainers > 1:
            env.update({"FLYWHEEL_TRAINER_WORLD_SIZE": str(self.trainers), "FLYWHEEL_TRAINER_RANK": str(replica),
                        "FLYWHEEL_TRAINER_RENDEZVOUS": f"{self.host('trainer')}:{self.rendezvous_port}"})
        return env

    # ---- one process ---------------------------------------------------------------------
    def pid(self, service: str, replica: int = 0) -> int | None:
        """The pid of this stack's running ``service`` replica, or None."""
        return self._proc(service, replica).pid()

    def pids(self) -> dict[str, int]:
        """Running processes by name (``trainer``, ``sampler-1``, ``prometheus``, ...)."""
        return {st.name: st.pid for st in self.status(infra=False) if st.alive and st.pid is not None}

    def start(self, service: str, replica: int = 0) -> int:
        """Start one service process (detached) unless it already runs; return its pid. Does not wait."""
        proc = self._proc(service, replica)
        if (pid := proc.pid()) is not None:
            self._progress(f"{proc.name} already running (pid {pid})")
            return pid
        port = self.port(service, replica)
        if not self.hosts:  # a host of the multi-host stack is a namespace of its own: its ports are free
            require_free(proc.name, port, self.home)
        env = self.service_env(service, replica)
        netns = self.netns(service, replica)
        pid, started = proc.ensure(service_command(service), cwd=REPO_ROOT, env=env, netns=netns)
        if service == "sampler":
            self.state.add_sampler(replica)
        what = f"started {proc.name}" if started else f"{proc.name} was just restarted by the supervisor"
        where = f" in netns {netns}" if netns else ""
        self._progress(f"{what} (pid {pid}){where} on {self.host(service, replica)}:{port}, log {proc.log}")
        return pid

    def wait_healthy(self, service: str, replica: int = 0, timeout_s: float = 60.0) -> None:
        """Wait until the process answers 200 on /healthz; raise with its log tail if it exits.

        A supervised process that is down (killed, restart pending) is waited for first.
        """
        proc, deadline = self._proc(service, replica), time.monotonic() + timeout_s
        pid = proc.pid()
        while pid is None and time.monotonic() < deadline and proc.record() and self.supervisor_pid():
            time.sleep(0.1)
            pid = proc.pid()
        if pid is None:
            raise StackError(f"{proc.name} is not running.\nlast 30 lines of {proc.crash_log()}:\n"
                             f"{tail(proc.crash_log())}")
        url = f"http://{self.host(service, replica)}:{self.port(service, replica)}/healthz"
        took = wait_until(f"{proc.name} (pid {pid})", lambda left: http_ok(url, min(left, 2.0)), deadline=deadline,
                          alive=lambda: is_running(pid), log_path=proc.crash_log())
        self._progress(f"{proc.name} healthy (pid {pid}) after {took:.1f} s")

    def kill(self, name: str, replica: int = 0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a process: a service (``replica`` for samplers), ``sampler-<i>``,
        ``prometheus``, or ``kafka`` / ``kafka-<i>`` / ``s3`` when this stack owns them. A supervised process that
        dies of it is restarted (see :meth:`hold`). With SIGKILL, wait until it is gone and (for a
        service) its port is released or a restarted one runs, so an immediate :meth:`start` works."""
        proc = self._proc(name, replica)
        pid = proc.pid()
        if pid is None:
            raise StackError(f"cannot signal {proc.name}: it is not running")
        os.kill(pid, sig)
        if (sig == signal.SIGKILL and wait_gone(pid, timeout_s=10.0) and not is_infra(name) and name != prom.NAME
                and not self.hosts):  # a dead process's port in its own namespace is free at once
            service, index = parse_key(proc.name)
            port, deadline = self.port(service, index), time.monotonic() + 10.0
            while not port_is_free(port) and proc.pid() in (None, pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        self._progress(f"sent {signal.Signals(sig).name} to {proc.name} (pid {pid})")

    def stop(self, service: str, replica: int = 0, timeout_s: float = 20.0) -> None:
        """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL. No-op when not running.

        The process stops being wanted first, so the supervisor does not take it for dead.
        """
        proc = self._proc(service, replica)
        if (pid := proc.stop(timeout_s)) is not None:
            self._progress(f"stopped {proc.name} (pid {pid})")

    def hold(self, name: str, replica: int = 0) -> None:
        """Tell the supervisor to leave this process alone (not restart it) until :meth:`release`."""
        self._set_held(self._name(name, replica), True)

    def release(self, name: str, replica: int = 0) -> None:
        """Undo :meth:`hold`: a process that is down is restarted after the usual backoff."""
        self._set_held(self._name(name, replica), False)

    def _set_held(self, key: str, held: bool) -> None:
        with table_lock(self.home):
            SupervisorState(self.home).update(key, held=held)
        self._progress(f"{key} {'held: the supervisor leaves it alone' if held else 'released'}")

    def restarts(self) -> dict[str, int]:
        """How often the supervisor restarted each process (since the last ``down``)."""
        return SupervisorState(self.home).restarts()

    def supervisor_pid(self) -> int | None:
        """The pid of this home's running supervisor, or None."""
        return supervisor.proc(self.home).pid()

    # ---- the whole stack -----------------------------------------------------------------
    def up(self, samplers: int = 2, timeout_s: float = 120.0, prometheus: bool = True,
           trainers: int | None = None, install_extras: bool = False) -> None:
        """Infra (if needed), admin token, the trainer (``trainers`` ranks), paramsync, admin, ``samplers``
        samplers, the supervisor; wait for all, then Prometheus. Before any service starts the config is loaded
        and the env checked (``install_extras``: the package its id needs is installed when missing).

        Running processes are reused; samplers beyond ``samplers`` are stopped (scaling down). A different
        number of trainer ranks re-forms the group: the running ranks stop together (rank 0 writes the last
        checkpoint), then ``trainers`` ranks start from it.
        """
        if samplers < 0:
            raise StackError(f"samplers must be >= 0, got {samplers=}")
        if trainers is not None and trainers < 1:
            raise StackError(f"trainers must be >= 1, got {trainers=}")
        deadline = time.monotonic() + timeout_s
        with file_lock(self.home / ".localstack.lock"):
            self._check_mode()
            if trainers is not None and trainers != self.trainers:
                self._stop_ranks()
                self._trainers = trainers
            wanted = self._layout(range(samplers), self.trainers)
            for service, replica in wanted:  # before anything starts: a taken port fails fast
                if self.pid(service, replica) is None and not self.hosts:
                    require_free(proc_key(service, replica), self.port(service, replica), self.home)
            plan: list[multihost.Host] = []
            if self.hosts:  # each part's host (namespace, veth, address) before the part
                brokers = InfraConfig.resolve(self.home, brokers=self.brokers, hosts=True).brokers
                plan = multihost.plan(brokers, self.trainers, range(samplers))
                multihost.ensure_network(self.home, plan, self._progress)
            self.endpoints(timeout_s)
            self._progress(f"admin token: {self.admin_token_source}")
            checking = time.monotonic()
            validate_config(self.config, self.service_env("trainer"), install_extras=install_extras,
                            progress=self._progress)
            deadline += time.monotonic() - checking  # installing an extra takes minutes: not the services' time
            for replica in self.state.samplers():
                if replica >= samplers:
                    self.stop("sampler", replica)
                    SupervisorState(self.home).forget([proc_key("sampler", replica)])
            if self.hosts:  # the hosts of samplers and ranks scaled down go too
                multihost.prune(self.home, plan, self._progress)
            self.state.save(samplers=list(range(samplers)), trainers=self.trainers, prometheus=prometheus,
                            config=str(self.config), signing_keys_file=str(public_keys_path(self.signing)),
                            run=self.run, store_backend=self.store_backend, log_max_bytes=self.log_max_bytes,
                            ports={**self._ports, "sampler_base": self._sampler_base_port,
                                   "trainer_rank_base": self._trainer_rank_base_port,
                                   "rendezvous": self.rendezvous_port, "prometheus": self.prometheus_port},
                            brokers=len(self.endpoints().kafka_bootstrap.split(",")) if self._owns_infra else None)
            for service, replica in wanted:
                self.start(service, replica)
            if self.supervise:
                pid, started = supervisor.start(self.home)
                self._progress(f"supervisor {'started' if started else 'already running'} (pid {pid}), "
                               f"log {supervisor.proc(self.home).log}")
            elif (stopped := supervisor.proc(self.home).stop()) is not None:
                self._progress(f"stopped the supervisor (pid {stopped}): supervise=False")
            for service, replica in wanted:
                self.wait_healthy(service, replica, timeout_s=max(1.0, deadline - time.monotonic()))
            if self.hosts:
                self._ensure_admin_forward()
            if prometheus:
                targets: dict[str, list[int | str]] = {s: [self._target(s)] for s in ("trainer", "paramsync", "admin")}
                targets["trainer-ranks"] = [self._target("trainer", r) for r in range(1, self.trainers)]
                targets["sampler"] = [self._target("sampler", r) for r in range(samplers)]
                prom.ensure_running(self.home, self.prometheus_port, targets, deadline=deadline,
                                    progress=self._progress)

    def _target(self, service: str, replica: int = 0) -> int | str:
        """What Prometheus scrapes: a port on 127.0.0.1, or ``address:port`` in the multi-host stack."""
        port = self.port(service, replica)
        return f"{self.host(service, replica)}:{port}" if self.hosts else port

    def _check_mode(self) -> None:
        """Refuse to mix a plain stack and a multi-host one in one home while either runs."""
        was_hosts = multihost.active(self.home)
        if self.hosts == was_hosts:
            return
        alive = [st.name for st in self.status() if st.alive]
        if alive:
            now, then = ("a multi-host", "on 127.0.0.1") if self.hosts else ("a plain", "as a multi-host stack")
            raise StackError(f"the stack in {self.home} runs {then} ({', '.join(alive)} alive); it cannot become "
                             f"{now} one while it runs: `python -m devstack down` first")
        if was_hosts:  # nothing runs: what is left of the network goes before a plain stack starts
            multihost.teardown(self.home, self._progress)

    def _admin_forward(self) -> tuple[Proc, list[str], int]:
        port = self._ports["admin"]
        cmd = [sys.executable, "-m", "devstack.forward", f"{HOST}:{port}", f"{self.host('admin')}:{port}"]
        return Proc(self.home, forward.NAME), cmd, port

    def _ensure_admin_forward(self) -> None:
        """The multi-host stack's admin listens on its own host's address; forward 127.0.0.1:<admin port> in the
        root namespace to it (supervised), so the ``flywheel`` CLI's default URL works, when that port is free."""
        proc, cmd, port = self._admin_forward()
        if proc.pid() is None and not port_is_free(port):
            self._progress(f"127.0.0.1:{port} is taken by {describe_listener(port)}: no forwarder to the admin API; "
                           f"use `flywheel --url {self.admin_url} ...`")
            return
        pid, started = proc.ensure(cmd, cwd=REPO_ROOT)
        self._progress(f"{'started' if started else 'already running:'} {proc.name} (pid {pid}): "
                       f"http://{HOST}:{port} -> {self.admin_url}")

    def down(self, infra: bool = True) -> None:
        """Stop the supervisor, then samplers (together), admin, paramsync, the trainer (it commits),
        Prometheus, and Kafka + S3 when this stack owns them and ``infra``; then, for a multi-host stack, every
        namespace, link and rule of its network (``devstack.hosts.teardown``; kept with ``infra`` False, where
        Kafka and S3 still run in theirs)."""
        if not self.home.is_dir():
            return
        with file_lock(self.home / ".localstack.lock"):
            if (pid := supervisor.proc(self.home).stop()) is not None:
                self._progress(f"stopped the supervisor (pid {pid})")
            layout = self._layout(self.state.samplers(), self.trainers)
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda r: self.stop("sampler", r), [r for s, r in layout if s == "sampler"]))
                for service in ("admin", "paramsync"):
                    self.stop(service)
            self._stop_ranks()
            if (pid := prom.proc(self.home).stop()) is not None:
                self._progress(f"stopped prometheus (pid {pid})")
            stopped = [proc_key(s, r) for s, r in layout] + [prom.NAME]
            if (pid := Proc(self.home, forward.NAME).stop()) is not None:
                self._progress(f"stopped {forward.NAME} (pid {pid})")
            if self.hosts:
                stopped.append(forward.NAME)
            if infra and self._owns_infra:
                infra_down(self.home, progress=self._progress)
                stopped += [*INFRA, *(f"{kafka.NAME}-{i}" for i in range(2, MAX_BROKERS + 1))]
                if self.hosts:
                    multihost.teardown(self.home, self._progress)
                elif multihost.leftovers_possible() and os.geteuid() == 0:  # a multi-host stack's, after a crash
                    multihost.teardown(self.home, self._progress, orphans_only=True)
            elif self.hosts:
                self._progress("the multi-host network stays (Kafka and S3 still run in their namespaces): "
                               "`python -m devstack down` removes it")
            SupervisorState(self.home).forget(stopped)

    def _stop_ranks(self) -> None:
        """Stop every trainer rank together: the first to stop votes the group out, and rank 0 writes the
        last checkpoint. Ranks no longer wanted are forgotten by the supervisor."""
        ranks = list(range(self.trainers))
        with ThreadPoolExecutor(max_workers=max(1, len(ranks))) as pool:
            list(pool.map(lambda r: self.stop("trainer", r), ranks))
        SupervisorState(self.home).forget([proc_key("trainer", r) for r in ranks if r])

    def status(self, infra: bool = True) -> list[ProcStatus]:
        """Every process this stack runs or should run, alive or dead, with pid, endpoint and restarts."""
        out = [self._proc(s, r).status(f"http://{self.host(s, r)}:{self.port(s, r)}")
               for s, r in self._layout(self.state.samplers(), self.trainers)]
        if self.state.load().get("prometheus") and prom.binary():
            out.append(prom.proc(self.home).status(f"http://{HOST}:{self.prometheus_port}"))
        if self.hosts:
            fwd, _cmd, port = self._admin_forward()
            if fwd.record() is not None or fwd.pid() is not None:
                out.append(fwd.status(f"http://{HOST}:{port}"))
        if infra and self._owns_infra:
            out += infra_status(self.home)
        sup = SupervisorState(self.home).load()
        return [dataclasses.replace(st, restarts=int(sup.get(st.name, {}).get("restarts", 0)),
                                    held=bool(sup.get(st.name, {}).get("held"))) for st in out]

    @staticmethod
    def _layout(samplers: Iterable[int], trainers: int = 1) -> list[tuple[str, int]]:
        """(service, replica) in start order: trainer ranks, paramsync, admin, samplers."""
        return ([("trainer", r) for r in range(trainers)]
                + [(s, 0) for s in START_ORDER if s not in ("sampler", "trainer")] + [("sampler", i) for i in samplers])
