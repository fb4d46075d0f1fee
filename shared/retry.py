"""Transient faults: one retry policy (tenacity), one classification, one health record.

Faults are normal (docs/architecture.md, "Faults are normal"): a broker restart, an S3 endpoint that refuses
connections, a coordinator that moved. A service retries such an operation with capped
exponential backoff and jitter, reports itself *degraded* with the reason while it does, and
carries on when the dependency is back. Anything else (a bug, a bad config, a fatal Kafka error)
is not retried: it propagates and stops the process loudly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, NodeNotReadyError
from prometheus_client import Gauge
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

from shared.marker import BadPayload
from shared.store import PreconditionFailed, StoreError

T = TypeVar("T")

DEGRADED = Gauge("flywheel_service_degraded", "1 while the service retries a dependency (see /healthz for why)",
                 ["service"])

CLIENT_STOP_TIMEOUT_S = 10.0
"""Longest a service waits for one client to close at stop (a broker that is down must not hang SIGTERM)."""
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 10.0
"""Capped so a dependency that comes back is noticed within ~10 s (the goal is resuming within 30 s)."""


def is_transient(exc: BaseException) -> bool:
    """True for faults that go away on their own: connection, timeout, retriable Kafka errors, and
    object-store errors other than a lost conditional write (that one is a decision, not a fault)."""
    if isinstance(exc, (PreconditionFailed, BadPayload)):
        return False
    if isinstance(exc, (StoreError, TimeoutError, ConnectionError, KafkaConnectionError, KafkaTimeoutError,
                        NodeNotReadyError)):
        return True
    if isinstance(exc, KafkaError):
        return bool(getattr(exc, "retriable", False))
    return False


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


@dataclass
class Health:
    """What ``/healthz`` and heartbeats say: ``ok``, or ``degraded`` with a reason per component.

    A component is e.g. ``kafka``, ``store``, ``publish``; :func:`retry_transient` marks it degraded
    while it retries and clears it on success.
    """

    service: str = "service"
    reasons: dict[str, str] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        DEGRADED.labels(service=self.service).set(0)

    def degraded(self, component: str, reason: str) -> None:
        self.reasons[component] = reason
        self.since.setdefault(component, time.time())
        DEGRADED.labels(service=self.service).set(1)

    def recovered(self, component: str) -> float | None:
        """Clear ``component``; returns for how long it was degraded (None if it was not)."""
        self.reasons.pop(component, None)
        started = self.since.pop(component, None)
        DEGRADED.labels(service=self.service).set(1 if self.reasons else 0)
        return None if started is None else time.time() - started

    @property
    def state(self) -> str:
        return "degraded" if self.reasons else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "reasons": dict(self.reasons),
                "degraded_since": min(self.since.values()) if self.since else None}


async def retry_transient(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    component: str,
    health: Health,
    log: Any,
    stop_event: asyncio.Event | None = None,
    timeout_s: float | None = None,
    max_wait_s: float = BACKOFF_MAX_S,
) -> T:
    """``await op()`` until it succeeds, retrying transient faults with capped, jittered backoff.

    Each attempt is bounded by ``timeout_s`` (aiokafka retries some errors internally without end).
    Retries stop when ``stop_event`` is set (the last error is raised: the service is stopping).
    A non-transient error is raised at once.
    """

    async def attempt() -> T:
        if timeout_s is None:
            return await op()
        return await asyncio.wait_for(op(), timeout_s)

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        reason = f"{what} failed: {describe(exc) if exc else '?'}"
        health.degraded(component, reason)
        n = state.attempt_number
        if n == 1 or n % 10 == 0:
            delay = state.next_action.sleep if state.next_action is not None else None
            log.warning("transient_fault", component=component, operation=what, attempt=n,
                        retry_in_s=None if delay is None else round(delay, 2), error=describe(exc) if exc else None)

    def stopping(_state: RetryCallState) -> bool:
        return stop_event is not None and stop_event.is_set()

    retrying = AsyncRetrying(
        retry=retry_if_exception(is_transient),
        wait=wait_exponential_jitter(multiplier=BACKOFF_INITIAL_S, max=max_wait_s, jitter=BACKOFF_INITIAL_S),
        stop=stopping,
        before_sleep=before_sleep,
        reraise=True,
    )
    result: T = await retrying(attempt)
    if component in health.reasons:
        took = health.recovered(component)
        log.info("transient_fault_recovered", component=component, operation=what,
                 degraded_s=None if took is None else round(took, 2))
    return result


async def stop_clients(clients: Iterable[Any], log: Any, timeout_s: float = CLIENT_STOP_TIMEOUT_S) -> None:
    """Close each client (``await client.stop()``) within ``timeout_s``; a failure is logged, and the
    remaining clients are still closed."""
    for client in clients:
        try:
            await asyncio.wait_for(client.stop(), timeout_s)
        except Exception as exc:
            log.warning("client_stop_failed", client=type(client).__name__, error=describe(exc))


async def poll_or_pause(poll: Callable[[], Awaitable[T]], *, what: str, health: Health | None = None,
                        log: Any = None, pause_s: float = 1.0) -> T | None:
    """One consumer poll; on a transient Kafka error, note it (``health`` degraded on ``kafka``, a log
    line), wait ``pause_s`` and return None so the caller's loop polls again. Fatal errors propagate."""
    try:
        return await poll()
    except KafkaError as exc:
        if not is_transient(exc):
            raise
        if health is not None:
            health.degraded("kafka", f"{what} failed: {describe(exc)}")
        if log is not None:
            log.warning(f"{what.replace(' ', '_')}_failed", error=describe(exc))
        await asyncio.sleep(pause_s)
        return None



class Retrier:
    """A service's one retry binding: :func:`retry_transient` with its health, log and stop event bound.

    ``stop_event`` may be replaced (``retrier.stop_event = ...``) when ``run`` receives the real one."""

    def __init__(self, health: Health, log: Any, stop_event: asyncio.Event | None = None) -> None:
        self.health = health
        self.log = log
        self.stop_event = stop_event or asyncio.Event()

    async def __call__(self, op: Callable[[], Awaitable[T]], what: str, component: str,
                       timeout_s: float | None = None) -> T:
        return await retry_transient(op, what=what, component=component, health=self.health, log=self.log,
                                     stop_event=self.stop_event, timeout_s=timeout_s)


async def every(interval_s: Callable[[], float], job: Callable[[], Awaitable[None]], *, name: str, log: Any,
                stop_event: asyncio.Event, wake: asyncio.Event | None = None) -> None:
    """Run ``job`` every ``interval_s()`` seconds (re-read each time: runtime settings may change it), or
    as soon as ``wake`` is set, until ``stop_event`` is set: one named periodic task instead of a
    ``_maybe_*`` guard in a loop. A transient error is logged and the job runs again next time; a fatal
    one ends the task (the owner sees it done and stops, loudly)."""
    while not stop_event.is_set():
        try:
            await job()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("periodic_job_failed", job=name, error=describe(exc))
        try:
            if wake is None:
                await asyncio.wait_for(stop_event.wait(), interval_s())
            else:
                waiter = asyncio.ensure_future(wake.wait())
                stopper = asyncio.ensure_future(stop_event.wait())
                try:
                    await asyncio.wait({waiter, stopper}, timeout=interval_s(), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                    stopper.cancel()
                wake.clear()
        except TimeoutError:
            pass


async def read_forever(tail: Any, handle: Callable[[Any], Awaitable[None] | None], *, name: str, log: Any,
                       timeout_ms: int = 1000, pause_s: float = 1.0) -> None:
    """The one "read a topic forever" loop: poll ``tail`` and hand each record to ``handle``; a read
    error is logged and retried after ``pause_s`` (the owner cancels the task to stop it)."""
    while True:
        try:
            records = await tail.poll(timeout_ms=timeout_ms)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("topic_read_failed", reader=name, error=describe(exc))
            await asyncio.sleep(pause_s)
            continue
        for rec in records:
            result = handle(rec)
            if result is not None:
                await result
