"""Library log lines during an outage (shared/logging.py): Kafka client noise at WARNING, one line per
message template per interval plus a count; Flywheel's own events never limited."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from shared.logging import LogLimiter, configure_logging, get_logger

UNABLE_NODE = "Unable connect to node with id %s: %s"
UNABLE_METADATA = "Unable to update metadata from %s"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def out() -> tuple[io.StringIO, Clock]:
    buf, clock = io.StringIO(), Clock()
    configure_logging("trainer", "run-x", stream=buf, library_interval_s=30.0, clock=clock)
    return buf, clock


def lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in buf.getvalue().splitlines()]


def test_ten_thousand_reconnect_errors_make_one_warning_and_one_count(out: tuple[io.StringIO, Clock]) -> None:
    buf, clock = out
    client = logging.getLogger("aiokafka.client")
    start = clock.now
    for i in range(10_000):  # 10k records within one 30 s interval (~333/s, as in the outage)
        clock.now = start + i * 0.0029
        client.error(UNABLE_NODE, i % 3, f"[Errno 111] Connect call failed ('127.0.0.1', {19092 + i % 3})")
    got = lines(buf)
    assert len(got) == 1
    assert got[0]["level"] == "warning" and got[0]["event"].startswith("Unable connect to node with id 0")
    clock.now = start + 30.5  # the interval ends: its count is written (here by the periodic flush)
    logging.getLogger().handlers[0].flush_expired()  # type: ignore[attr-defined]
    got = lines(buf)
    assert len(got) == 2
    summary = got[1]
    assert summary["event"] == "library_log_suppressed" and summary["suppressed"] == 9_999
    assert summary["template"] == UNABLE_NODE and summary["logger"] == "aiokafka.client"
    assert summary["level"] == "warning" and summary["service"] == "trainer" and summary["run"] == "run-x"
    assert summary["interval_s"] == 30.0
    # The next interval starts with a line again.
    client.error(UNABLE_NODE, 1, "again")
    assert len(lines(buf)) == 3 and lines(buf)[2]["event"] == "Unable connect to node with id 1: again"


def test_the_count_comes_before_the_next_line_of_its_key(out: tuple[io.StringIO, Clock]) -> None:
    buf, clock = out
    log = logging.getLogger("aiokafka")
    for _ in range(5):
        log.error(UNABLE_METADATA, [1])
    clock.now += 31
    log.error(UNABLE_METADATA, [2])
    got = lines(buf)
    assert [g["event"] for g in got] == ["Unable to update metadata from [1]", "library_log_suppressed",
                                         "Unable to update metadata from [2]"]
    assert got[1]["suppressed"] == 4


def test_a_distinct_message_is_not_suppressed_and_other_errors_keep_their_level(
        out: tuple[io.StringIO, Clock]) -> None:
    buf, _ = out
    for _ in range(100):
        logging.getLogger("aiokafka.client").error(UNABLE_NODE, 0, "refused")
    logging.getLogger("aiokafka.client").error(UNABLE_METADATA, [0])  # another template
    logging.getLogger("aiokafka.consumer.fetcher").error(UNABLE_NODE, 0, "refused")  # another logger
    logging.getLogger("aiokafka.consumer.group_coordinator").error("Unexpected error in coordinator routine")
    logging.getLogger("botocore").error("Unable to update metadata from %s", "s3")  # not a Kafka client
    got = lines(buf)
    assert [(g["event"], g["level"]) for g in got] == [
        ("Unable connect to node with id 0: refused", "warning"),
        ("Unable to update metadata from [0]", "warning"),
        ("Unable connect to node with id 0: refused", "warning"),
        ("Unexpected error in coordinator routine", "error"),
        ("Unable to update metadata from s3", "error"),
    ]


def test_flywheel_events_are_never_rate_limited(out: tuple[io.StringIO, Clock]) -> None:
    buf, _ = out
    log = get_logger()
    for i in range(2_000):
        log.info("fragment_trained", outcome="trained", offset=i)
        log.error("fragment_send_failed", error="KafkaConnectionError")
    got = lines(buf)
    assert len(got) == 4_000 and [g["offset"] for g in got if "offset" in g] == list(range(2_000))


def test_a_minute_long_broker_outage_writes_a_few_dozen_lines(out: tuple[io.StringIO, Clock]) -> None:
    buf, clock = out
    noise = [("aiokafka.client", UNABLE_NODE, (1, "refused")), ("aiokafka.client", UNABLE_METADATA, ([1],)),
             ("aiokafka.client", 'Unable connect to "%s:%s": %s', ("kafka", 9092, "refused")),
             ("aiokafka.consumer.fetcher", "Failed fetch messages from %s: %s", (1, "NodeNotReady")),
             ("aiokafka.consumer.group_coordinator", "Heartbeat send request failed: %s. Will retry.", ("x",)),
             ("aiokafka.producer.sender", "FindCoordinator Request failed: %s", ("x",))]
    start = clock.now
    for i in range(60 * 430):  # 430 lines/s for 60 s
        clock.now = start + i / 430
        name, msg, args = noise[i % len(noise)]
        logging.getLogger(name).error(msg, *args)
    clock.now += 31
    logging.getLogger().handlers[0].flush_expired()  # type: ignore[attr-defined]
    got = lines(buf)
    assert len(got) <= 40, len(got)  # was 25,800 at ERROR
    assert {g["level"] for g in got} == {"warning"}
    assert sum(g.get("suppressed", 0) for g in got) + sum(1 for g in got if "suppressed" not in g) == 60 * 430


def test_limiter_tracks_a_bounded_number_of_keys_and_never_drops_untracked_ones() -> None:
    lim = LogLimiter(interval_s=10, max_keys=2)
    assert lim.offer(("a", 40, "x"), 0)[0] and lim.offer(("b", 40, "x"), 0)[0]
    assert all(lim.offer(("c", 40, "x"), 0)[0] for _ in range(3))  # over the limit: written, not counted
    assert not lim.offer(("a", 40, "x"), 1)[0]
    assert lim.expired(5) == []
    (s,) = lim.expired(10)
    assert s.key == ("a", 40, "x") and s.count == 1 and lim.drain() == []
    with pytest.raises(ValueError, match="interval_s"):
        LogLimiter(interval_s=0)
