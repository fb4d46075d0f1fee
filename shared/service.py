"""What every service process shares: the entrypoint, /healthz + /metrics, shutdown on SIGTERM.

A service is a class with ``start()``, ``run()`` (returns when ``stop_event`` is set) and
``stop()``; :func:`serve` wires it to signals and the small HTTP server. Entrypoints validate
settings *before* importing torch (see :func:`entrypoint`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from shared.logging import RotatingFile, configure_logging, get_logger
from shared.placement import cpu_list, pin
from shared.posture import protections_off
from shared.settings import ConfigError, Settings, load_settings
from shared.signing import startup_problem as signing_startup_problem


class Service(Protocol):
    name: str

    async def start(self) -> None: ...

    async def run(self, stop_event: asyncio.Event) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> dict[str, Any]:
        """Small JSON for /healthz; ``ok`` False turns it into a 503."""
        ...


def entrypoint(service: str, argv: list[str] | None = None) -> Settings:
    """Parse ``--config``, validate settings, configure logging, log the resolved config once.

    Exits with status 2 and a message naming the field on invalid configuration.
    """
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"Flywheel {service}")
    parser.add_argument("--config", help="YAML file in configs/ (default: $FLYWHEEL_CONFIG)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        sys.stderr.write(f"flywheel {service}: {exc}\n")
        raise SystemExit(2) from None
    problem = signing_startup_problem(service, settings)
    if problem is not None:
        sys.stderr.write(f"flywheel {service}: invalid configuration: {problem}\n")
        raise SystemExit(2)
    stream = None
    if settings.log.file is not None:
        stream = RotatingFile(settings.log.file, settings.log.max_bytes, settings.log.backups)
    configure_logging(service, settings.run, settings.log.level, stream)
    get_logger().info("config_resolved", config=settings.redacted())
    for off in protections_off(service, settings):
        get_logger().warning("protection_off", setting=off.setting, leaves=off.leaves)
    return settings


def run_main(service: str, build: Callable[[Settings], tuple[Service, Any]],
             problem: Callable[[Settings], str | None] | None = None) -> None:
    """The whole life of a service process: settings, then ``build`` (heavy imports go there),
    then :func:`serve` until SIGTERM. ``build`` runs inside the event loop (aiokafka needs one)
    and returns the service and its HTTP app (None: the default /healthz + /metrics app).
    ``problem``: a check of the settings against this installation (e.g. a package an option needs); what it
    returns stops the process before ``build``, in one line on stderr, with status 2."""
    settings = entrypoint(service)
    found = problem(settings) if problem is not None else None
    if found is not None:
        sys.stderr.write(f"flywheel {service}: {found}\n")
        raise SystemExit(2)
    # Before build: torch's and the services' threads are made after this and inherit the placement.
    where = pin(service, settings)
    if where.cpus is not None:
        get_logger().info("cpus_pinned", cpus=cpu_list(where.cpus), reason=where.reason)
    elif settings.trainer.dedicated_cores:
        get_logger().warning("cpus_not_pinned", reason=where.reason)

    async def amain() -> None:
        svc, app = build(settings)
        await serve(svc, settings, app=app)

    asyncio.run(amain())


def http_app(svc: Service) -> Any:
    """A FastAPI app with /healthz and /metrics for ``svc``."""
    from fastapi import FastAPI, Response
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

    app = FastAPI(title=f"flywheel {svc.name}", docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> Response:
        body = svc.health()
        return Response(json.dumps(body), status_code=200 if body.get("ok") else 503, media_type="application/json")

    @app.get("/metrics")
    def metrics() -> Response:
        # The classic text format (generate_latest escapes names to underscores), declared as such, as admin
        # does: prometheus_client's CONTENT_TYPE_LATEST now says version=1.0.0 (UTF-8 names), which that
        # body is not, and scrapers pick the parser from this header.
        return Response(generate_latest(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind early so a taken port fails at start-up with a clear message."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"cannot listen on http.host={host} http.port={port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


STOP_AFTER_FAILURE_S = 60.0
"""How long a service whose run failed may take to stop before the process exits without a clean stop (a
trainer rank whose collective failed was seen to hang in its stop for good while its peer kept re-joining)."""


async def serve(svc: Service, settings: Settings, app: Any | None = None) -> None:
    """Run ``svc`` with its HTTP server until SIGTERM/SIGINT; then stop it cleanly."""
    import uvicorn

    log = get_logger()
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    sock = bind_socket(settings.http.host, settings.http.port)
    config = uvicorn.Config(app or http_app(svc), log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    # The service owns SIGTERM/SIGINT (stop_event above); uvicorn must not capture them.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    http_task = asyncio.create_task(server.serve(sockets=[sock]))
    log.info("http_listening", host=settings.http.host, port=sock.getsockname()[1])
    failed: BaseException | None = None
    try:
        await check_kafka_credentials(settings)
        await svc.start()
        await svc.run(stop_event)
    except BaseException as exc:  # said in the stopping line: the traceback alone goes to stderr, not the log
        failed = exc
        raise
    finally:
        run_failed = failed is not None and not isinstance(failed, asyncio.CancelledError | KeyboardInterrupt)
        if run_failed:
            log.error("stopping", reason="failed", error=f"{type(failed).__name__}: {failed}"[:500])
        else:
            log.info("stopping", reason="signal" if stop_event.is_set() else "run returned")
        try:
            if not run_failed:
                await svc.stop()
            else:
                try:
                    await asyncio.wait_for(svc.stop(), STOP_AFTER_FAILURE_S)
                except TimeoutError:
                    log.error("stop_timed_out", after_s=STOP_AFTER_FAILURE_S,
                              detail="the run had failed and the stop did not finish: exiting without it")
                    os._exit(1)  # a thread stuck in the stop would keep the interpreter from exiting
        finally:
            server.should_exit = True
            await http_task
    log.info("stopped")


async def check_kafka_credentials(settings: Settings) -> None:
    """With SASL or TLS configured, fail at start-up on refused credentials (a wrong password would
    otherwise look like a broker outage and be retried for ever). An unreachable broker is not an
    error here: the service starts degraded and retries like for any outage."""
    if settings.kafka.security_protocol == "PLAINTEXT":
        return
    from aiokafka.errors import KafkaConnectionError

    from shared.kafka import check_credentials

    try:
        await check_credentials(settings)
    except (KafkaConnectionError, TimeoutError) as exc:
        get_logger().warning("kafka_unreachable_at_start", error=f"{type(exc).__name__}: {exc}"[:300])


class RateMeter:
    """Events per second over a sliding window."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window_s
        self.clock = clock
        self._events: list[tuple[float, float]] = []

    def add(self, amount: float) -> None:
        now = self.clock()
        self._events.append((now, amount))
        cutoff = now - self.window
        while self._events and self._events[0][0] < cutoff:
            self._events.pop(0)

    def rate(self) -> float:
        now = self.clock()
        events = [(t, a) for t, a in self._events if t >= now - self.window]
        if len(events) < 2:
            return 0.0
        span = max(now - events[0][0], 1e-6)
        return sum(a for _, a in events) / span


def percentile(values: list[float] | list[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
