"""shared.kafka_init, the one-shot that provisions a run's topics and ACLs (compose's kafka-init, the Kubernetes
local overlay's acls sidecar): transient broker errors retried until a deadline, refusals and bad settings not."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from shared import kafka_init as ki
from shared.acl import AclError

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cartpole.yaml"


def test_kafka_init_retries_transient_errors_and_stops_on_refusals() -> None:
    now = {"t": 0.0}
    waits: list[float] = []

    async def sleep(s: float) -> None:  # a fake clock: sleeping advances it
        waits.append(s)
        now["t"] += s

    def clock() -> float:
        return now["t"]

    def retry(step: Any, deadline_s: float, backoff: ki.Backoff) -> None:
        asyncio.run(ki.run_with_retries(step, deadline_s, backoff, random.Random(1), lambda _: None, sleep, clock))

    calls = {"n": 0}

    async def flaky() -> None:
        calls["n"] += 1
        if calls["n"] < 4:
            raise ConnectionRefusedError("not yet")

    retry(flaky, 60.0, ki.Backoff(0.5, 2.0))
    assert calls["n"] == 4 and len(waits) == 3 and all(0 <= w <= 2.0 for w in waits)

    async def refused() -> None:
        calls["n"] += 1
        raise AclError("no authorizer")

    calls["n"], waits[:] = 0, []
    with pytest.raises(AclError):
        retry(refused, 60.0, ki.Backoff())
    assert calls["n"] == 1 and not waits  # a refusal is not retried

    async def down() -> None:
        now["t"] += 0.5  # each attempt takes time too: the deadline is on the clock, not on the pauses
        raise ConnectionRefusedError("down")

    now["t"], waits[:] = 0.0, []
    with pytest.raises(ConnectionRefusedError):
        retry(down, 5.0, ki.Backoff(1.0, 1.0))
    assert 5.0 <= now["t"] < 5.0 + 1.0 + 0.5  # gave up at the first attempt past the deadline
    with pytest.raises(ValueError, match="base_s"):
        ki.Backoff(0.0, 1.0)


def test_kafka_init_bad_settings_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(CONFIG))
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")  # no username or password
    assert ki.main(deadline_s=0.0) == 2
    assert "kafka-init: invalid settings" in capsys.readouterr().err


def test_kafka_init_unreachable_broker_exits_1_after_the_deadline(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens at the bootstrap address: retried until --deadline-s, then exit 1 naming the address."""
    import socket

    with socket.socket() as sock:  # a free port, closed again: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(CONFIG))
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", f"127.0.0.1:{port}")
    assert ki.cli(["--deadline-s", "0"]) == 1
    err = capsys.readouterr().err
    assert f"Kafka at 127.0.0.1:{port} not usable after 0 s" in err


def test_kafka_init_cli_refuses_a_negative_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ki.cli(["--deadline-s", "-1"])
    assert exc.value.code == 2 and "--deadline-s -1.0: want seconds >= 0" in capsys.readouterr().err
