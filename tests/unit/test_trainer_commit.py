"""The trainer's commit error handling (a consumer twin whose commit fails: what is tested is our
reaction to the error, not Kafka's commit semantics, which the integration and e2e tests cover)."""

from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaConnectionError, RequestTimedOutError, TopicAuthorizationFailedError

from services.trainer.group import ConsumerGroup
from shared.bus import MemoryBus
from shared.logging import get_logger
from shared.retry import Health, Retrier
from shared.runtime import AuditLog, Auditor
from shared.store import LocalDirStore

TP = TopicPartition("r.samples", 0)


class CommitTwin:
    def __init__(self, errors: list[Exception], owned: set[TopicPartition] | None = None) -> None:
        self.errors = errors
        self.committed: list[dict[TopicPartition, int]] = []
        self.owned = {TP} if owned is None else owned

    def assignment(self) -> set[TopicPartition]:
        return set(self.owned)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.committed.append(dict(offsets))


def _trainer(tmp_path: Path, twin: Any) -> ConsumerGroup:
    health = Health("trainer")
    g = ConsumerGroup(twin, MemoryBus().bus().publisher, samples_topic="r.samples", dlq_topic="r.samples.dlq",
                      max_message_bytes=1 << 20, kafka_timeout_s=5.0, health=health,
                      retry=Retrier(health, get_logger()),
                      audit=Auditor(AuditLog(LocalDirStore(tmp_path), "r"), get_logger(), "trainer"), log=get_logger())
    for offset in range(3):
        assert g.ledger.consumed(TP, offset)
        g.finished(TP, offset, "trained")
    return g


@pytest.mark.parametrize("error", [RequestTimedOutError(), KafkaConnectionError(), CommitFailedError("rebalanced")])
async def test_a_retriable_commit_failure_is_retried_by_the_next_commit(tmp_path: Path, error: Exception) -> None:
    twin = CommitTwin([error])
    t = _trainer(tmp_path, twin)
    await t.commit()  # fails, logged, nothing marked committed
    assert twin.committed == [] and t.ledger.committable() == {TP: 3}
    await t.commit()  # the next commit carries the same offsets
    assert twin.committed == [{TP: 3}] and t.ledger.committable() == {}


async def test_a_fatal_commit_error_stops_the_trainer(tmp_path: Path) -> None:
    t = _trainer(tmp_path, CommitTwin([TopicAuthorizationFailedError()]))
    with pytest.raises(TopicAuthorizationFailedError):
        await t.commit()
    assert t.ledger.committable() == {TP: 3}


async def test_commits_name_only_owned_partitions(tmp_path: Path) -> None:
    # A partition revoked while its records were handled is not committed by this member (committing it
    # would raise IllegalStateError, or move the new owner's position).
    other = TopicPartition("r.samples", 1)
    twin = CommitTwin([], owned={TP})
    t = _trainer(tmp_path, twin)
    t.ledger.consumed(other, 7)
    t.finished(other, 7, "dead")
    await t.commit()
    assert twin.committed == [{TP: 3}]
