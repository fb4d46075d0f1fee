"""Operator commands on ``<run>.control``: sent in request order, acknowledged in time or answered ``pending``.

Every operator command that admin announces on the control topic (pause, resume, rollback, a runtime-settings
revision) is stored in the object store first; the command is the fast path, and the services also poll the
store. So a command Kafka does not acknowledge is not a failure, and the request must not wait for Kafka
longer than the operator's client does (the CLI gives up after 10 s, and a Kafka request may take
``kafka.request_timeout_ms``, 30 s by default). :class:`CommandOutbox` decouples the two: a request submits its
command and waits up to ``ACK_WAIT_S`` for the acknowledgement (:meth:`CommandOutbox.deliver`); if none came it
answers pending, with what was observed (:meth:`CommandOutbox.settle`), while one background task keeps sending
the queued commands in order, with capped exponential backoff, for at most ``GIVE_UP_S`` each. A command that
was answered pending gets an audit entry when it is finally sent (``command_sent``) or given up
(``command_not_sent``), naming the original request. The task ends when the queue is empty and is cancelled when
the service stops (the stored state still applies at the services' next poll)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from shared.messages import ControlCommand
from shared.retry import describe, is_transient

ACK_WAIT_S = 3.0
"""How long a request waits for Kafka to acknowledge its control command before answering pending (well under the
CLI's 10 s HTTP timeout, with the store writes and the audit entry around it)."""
GIVE_UP_S = 600.0
"""How long a queued command is retried; then it is dropped (audited): the services have the stored state."""
BACKOFF_INITIAL_S = 0.25
BACKOFF_MAX_S = 5.0

Send = Callable[[ControlCommand], Awaitable[None]]
Audit = Callable[[str, dict[str, Any], str], Awaitable[None]]
"""``(action, params, outcome)``: append an entry to the audit trail (never raises)."""
Spawn = Callable[[str, Coroutine[Any, Any, None]], Any]


@dataclass(eq=False)
class Outgoing:
    """One queued command. ``params`` name the original request in the audit entries written when it is settled."""

    cmd: ControlCommand
    params: dict[str, Any]
    queued_at: float  # the outbox clock (monotonic)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    sent: bool = False
    error: str | None = None
    """The last attempt's error; with ``settled`` and not ``sent``: why it was given up."""
    attempts: int = 0
    answered_pending: bool = False
    """The request answered pending: the outcome is audited when it comes."""


def backoff_s(attempt: int, initial_s: float = BACKOFF_INITIAL_S, max_s: float = BACKOFF_MAX_S) -> float:
    """The pause after failed attempt ``attempt`` (1, 2, ...): doubling from ``initial_s``, capped at ``max_s``."""
    return float(min(max_s, initial_s * 2 ** max(0, attempt - 1)))


class CommandOutbox:
    """The control commands of one admin, in request order (see the module doc)."""

    def __init__(self, send: Send, audit: Audit, spawn: Spawn, log: Any, *, give_up_s: float = GIVE_UP_S,
                 backoff: Callable[[int], float] = backoff_s, clock: Callable[[], float] = time.monotonic,
                 kafka_health: Callable[[], str | None] = lambda: None) -> None:
        """``kafka_health``: what else the service has seen of Kafka (its degraded reason), said in a pending reason
        while the command itself has not failed yet."""
        self._send, self._audit, self._spawn, self.log = send, audit, spawn, log
        self._kafka_health = kafka_health
        self.give_up_s, self._backoff, self._clock = give_up_s, backoff, clock
        self.queue: deque[Outgoing] = deque()
        self._worker: asyncio.Task[None] | None = None

    def submit(self, cmd: ControlCommand, params: dict[str, Any]) -> Outgoing:
        """Queue ``cmd`` behind the unsent ones and make sure the sender runs; returns at once."""
        item = Outgoing(cmd, params, self._clock())
        self.queue.append(item)
        if self._worker is None or self._worker.done():
            self._worker = self._spawn("control-commands", self._drain())
        return item

    async def wait(self, item: Outgoing, timeout_s: float) -> None:
        """Until ``item`` is sent or given up, or ``timeout_s`` has passed (the sending goes on regardless)."""
        try:
            await asyncio.wait_for(item.settled.wait(), timeout_s)
        except TimeoutError:
            pass

    def settle(self, item: Outgoing) -> str | None:
        """What the request answers: None when Kafka acknowledged the command, else why it is pending (and from now
        on its sending or giving up is audited)."""
        if item.sent:
            return None
        item.answered_pending = True
        if item.settled.is_set():
            return f"stored; the control command was not sent ({item.error}); the services apply the stored state " \
                   "at their next poll of the store"
        waited = self._clock() - item.queued_at
        ahead = next((i for i, queued in enumerate(self.queue) if queued is item), 0)
        if item.error is not None:
            seen = f"{item.attempts} attempt{'s' if item.attempts != 1 else ''}, last: {item.error}"
        elif ahead:
            head = self.queue[0].error
            seen = f"queued behind {ahead} unsent command{'s' if ahead != 1 else ''}" + \
                   (f", last error: {head}" if head else ", no answer from Kafka yet")
        else:
            seen = "no answer from Kafka yet"
        if item.error is None and (health := self._kafka_health()):
            seen += f" (admin's Kafka clients: {health})"
        return f"stored; control command not acknowledged by Kafka within {waited:.1f} s: {seen}"

    async def deliver(self, cmd: ControlCommand, params: dict[str, Any], timeout_s: float = ACK_WAIT_S) -> str | None:
        """Submit, wait up to ``timeout_s``, settle: None (sent) or the pending reason."""
        item = self.submit(cmd, params)
        await self.wait(item, timeout_s)
        return self.settle(item)

    async def _drain(self) -> None:
        """Send the queued commands in order until none is left; never raises but on cancellation. The task was
        started inside one operator's request and copied its log context: its lines name each command's requester
        (``requested_by``) instead of that request's ``operator``."""
        structlog.contextvars.unbind_contextvars("operator")
        try:
            while self.queue:
                item = self.queue[0]
                if item.attempts and self._clock() - item.queued_at > self.give_up_s:
                    await self._finish(item, f"gave up after {item.attempts} attempts: {item.error}")
                    continue
                try:
                    await self._send(item.cmd)
                except Exception as exc:  # Kafka unreachable (transient: retried) or refusing (given up)
                    item.attempts += 1
                    item.error = describe(exc)
                    if not is_transient(exc):
                        await self._finish(item, f"refused by Kafka: {item.error}")
                        continue
                    if item.attempts == 1 or item.attempts % 10 == 0:
                        self.log.warning("operator_command_not_sent", command=item.cmd.command,
                                         request_id=item.cmd.request_id, requested_by=item.params.get("requested_by"),
                                         attempt=item.attempts, error=item.error, queued=len(self.queue))
                    await asyncio.sleep(self._backoff(item.attempts))
                    continue
                item.sent = True
                await self._finish(item, None)
        except asyncio.CancelledError:
            if self.queue:  # stopping: the stored state still applies at the services' next poll
                self.log.warning("operator_commands_unsent", request_ids=[i.cmd.request_id for i in self.queue])
            raise

    async def _finish(self, item: Outgoing, failure: str | None) -> None:
        self.queue.popleft()
        if failure is not None:
            item.error = failure
        item.settled.set()
        waited = round(self._clock() - item.queued_at, 1)
        if failure is None and (item.attempts or item.answered_pending):
            self.log.info("operator_command_sent_late", command=item.cmd.command, request_id=item.cmd.request_id,
                          requested_by=item.params.get("requested_by"), after_s=waited, attempts=item.attempts + 1)
        if not item.answered_pending:
            return  # the request itself says what happened
        params = {**item.params, "pending_s": waited}
        if failure is None:
            await self._audit("command_sent", params, f"{item.cmd.command} sent on the control topic {waited} s "
                                                      "after the request, which had answered without it")
        else:
            await self._audit("command_not_sent", params, f"{failure}; the services apply the stored state at "
                                                          "their next poll of the store")
