"""The admin's control-command outbox (services/admin/outbox.py): a request waits for Kafka's acknowledgement only
so long, then answers pending with what it saw; the commands are sent on in request order, with backoff, bounded,
and each one that answered pending is audited when it is finally sent or given up. Kafka itself is the integration
test's business (tests/integration/test_admin_pending.py): here the sender is a function that fails, hangs or
succeeds as told."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from services.admin.outbox import BACKOFF_MAX_S, CommandOutbox, backoff_s
from shared.messages import ControlCommand


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning


class Kafka:
    """A sender: ``down`` raises ``error``; ``hang`` blocks until released; otherwise records the command."""

    def __init__(self) -> None:
        self.down = False
        self.error: Exception = KafkaConnectionError("Unable to connect to node 1")
        self.hang = asyncio.Event()
        self.hang.set()
        self.sent: list[str] = []

    async def send(self, cmd: ControlCommand) -> None:
        await self.hang.wait()
        if self.down:
            raise self.error
        self.sent.append(cmd.request_id)


def outbox(kafka: Kafka, **kw: Any) -> tuple[CommandOutbox, list[tuple[str, dict[str, Any], str]], list[Any]]:
    audit: list[tuple[str, dict[str, Any], str]] = []
    tasks: list[Any] = []

    async def write(action: str, params: dict[str, Any], outcome: str) -> None:
        audit.append((action, params, outcome))

    def spawn(name: str, job: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(job, name=name)
        tasks.append(task)
        return task

    return CommandOutbox(kafka.send, write, spawn, Log(), backoff=lambda n: 0.01, **kw), audit, tasks


def cmd(rid: str, command: Any = "pause") -> ControlCommand:
    return ControlCommand(command=command, request_id=rid)


async def settled(box: CommandOutbox) -> None:
    for _ in range(500):
        if not box.queue:
            await asyncio.sleep(0.01)  # the audit write after the last send
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still queued: {[i.cmd.request_id for i in box.queue]}")


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_s(n, 0.25, 5.0) for n in (1, 2, 3, 4, 5, 6, 9)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff_s(100) == BACKOFF_MAX_S


async def test_an_acknowledged_command_is_sent_and_not_audited_again() -> None:
    kafka = Kafka()
    box, audit, tasks = outbox(kafka)
    assert await box.deliver(cmd("a"), {"request_id": "a"}, 1.0) is None
    await settled(box)
    assert kafka.sent == ["a"] and audit == [] and tasks[0].done()  # the sender ends with the queue


async def test_unreachable_kafka_answers_pending_with_the_error_then_sends_in_order_and_audits() -> None:
    kafka = Kafka()
    kafka.down = True
    box, audit, _ = outbox(kafka)
    reason = await box.deliver(cmd("p1"), {"command": "pause", "request_id": "p1"}, 0.1)
    assert reason is not None and reason.startswith("stored; control command not acknowledged by Kafka within 0.1 s: ")
    assert "attempts, last: KafkaConnectionError" in reason and "Unable to connect to node 1" in reason
    second = await box.deliver(cmd("r1", "resume"), {"command": "resume", "request_id": "r1"}, 0.05)
    assert second is not None and "queued behind 1 unsent command, last error: KafkaConnectionError" in second
    assert kafka.sent == [] and [i.cmd.request_id for i in box.queue] == ["p1", "r1"]
    kafka.down = False  # the heal
    await settled(box)
    assert kafka.sent == ["p1", "r1"]  # request order: a resume never overtakes the pause before it
    assert [(a, p["request_id"]) for a, p, _ in audit] == [("command_sent", "p1"), ("command_sent", "r1")]
    action, params, outcome = audit[0]
    assert params["command"] == "pause" and params["pending_s"] >= 0.1
    assert outcome.startswith("pause sent on the control topic ") and "after the request" in outcome


async def test_a_send_without_an_answer_is_pending_and_audited_when_it_goes() -> None:
    kafka = Kafka()
    kafka.hang.clear()  # a black hole: no error, no acknowledgement
    box, audit, _ = outbox(kafka)
    reason = await box.deliver(cmd("h"), {"request_id": "h"}, 0.05)
    assert reason is not None and reason.startswith("stored; control command not acknowledged by Kafka within 0.")
    assert reason.endswith(" s: no answer from Kafka yet")
    box._kafka_health = lambda: "lag refresh failed: KafkaConnectionError: Unable to bootstrap"
    reason = await box.deliver(cmd("h2"), {"request_id": "h2"}, 0.02)
    assert reason is not None and reason.endswith(" s: queued behind 1 unsent command, no answer from Kafka yet "
                                                  "(admin's Kafka clients: lag refresh failed: KafkaConnectionError: "
                                                  "Unable to bootstrap)")
    kafka.hang.set()
    await settled(box)
    assert kafka.sent == ["h", "h2"] and [a for a, _, _ in audit] == ["command_sent", "command_sent"]


async def test_the_request_waits_only_so_long_and_the_sending_goes_on() -> None:
    kafka = Kafka()
    kafka.hang.clear()
    box, _, _ = outbox(kafka)
    item = box.submit(cmd("w"), {})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await box.wait(item, 0.1)
    assert 0.09 <= loop.time() - t0 < 0.5 and not item.settled.is_set()
    kafka.hang.set()
    await box.wait(item, 1.0)
    assert item.sent and box.settle(item) is None  # acknowledged after all: answered sent, nothing to audit


async def test_a_refusal_is_not_retried_and_is_audited_when_the_request_had_answered() -> None:
    kafka = Kafka()
    kafka.down, kafka.error = True, TopicAuthorizationFailedError()
    box, audit, _ = outbox(kafka)
    reason = await box.deliver(cmd("x"), {"request_id": "x"}, 0.2)
    assert reason is not None and reason.startswith("stored; the control command was not sent (refused by Kafka: "
                                                    "TopicAuthorizationFailedError")
    kafka.down = False
    await asyncio.sleep(0.05)
    assert kafka.sent == [] and not box.queue  # given up at once: authorization does not heal by retrying
    # settled before the request answered: the request's own audit entry says it, no second entry
    assert audit == []


async def test_a_command_is_given_up_after_the_bound_and_audited() -> None:
    kafka = Kafka()
    kafka.down = True
    box, audit, tasks = outbox(kafka, give_up_s=0.15)
    assert await box.deliver(cmd("g"), {"request_id": "g"}, 0.05) is not None
    await settled(box)
    assert kafka.sent == [] and tasks[-1].done()
    [(action, params, outcome)] = audit
    assert action == "command_not_sent" and params["request_id"] == "g"
    assert outcome.startswith("gave up after ") and "KafkaConnectionError" in outcome
    assert outcome.endswith("the services apply the stored state at their next poll of the store")


async def test_stopping_cancels_the_sender_and_logs_what_was_not_sent() -> None:
    kafka = Kafka()
    kafka.down = True
    box, audit, tasks = outbox(kafka)
    await box.deliver(cmd("s"), {"request_id": "s"}, 0.02)
    tasks[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert ("operator_commands_unsent", {"request_ids": ["s"]}) in box.log.events and audit == []
    kafka.down = False
    box.submit(cmd("t"), {})  # a later command starts a new sender
    await settled(box)
    assert kafka.sent == ["s", "t"] and len(tasks) == 2
