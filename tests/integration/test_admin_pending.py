"""Operator commands while admin is cut from every Kafka broker (real broker, real S3): ``flywheel pause`` and
``flywheel config set`` answer within the CLI's timeout that the command is stored and pending (exit 3), and after
the heal admin sends the commands in request order and the audit trail says when (``command_sent``, naming the
request). Admin reaches the broker only through :class:`~tests.integration.kafka_cut.KafkaCut`; this test reads the
control topic from the broker directly."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shared.runtime import read_paused
from tests.integration.conftest import TOKEN
from tests.integration.kafka_cut import KafkaCut
from tests.integration.test_admin_ops import _control
from tests.integration.test_cli import _flywheel, served

pytestmark = [pytest.mark.kafka, pytest.mark.s3]
CLI_TIMEOUT_S = 10.0
"""``flywheel``'s HTTP timeout for these commands (services/admin/cli.py, ``run``)."""


@pytest.fixture
def kafka_cut(kafka_bootstrap: str) -> Iterator[KafkaCut]:
    proxy = KafkaCut(kafka_bootstrap)
    proxy.up()
    yield proxy
    proxy.close()


@pytest.fixture
def admin_bootstrap(kafka_cut: KafkaCut) -> str:
    return kafka_cut.address


async def _audit(client: Any, action: str, request_id: str, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in (await client.get("/audit", params={"limit": 1000})).json()["entries"]:
            if e["action"] == action and e["params"].get("request_id") == request_id:
                return dict(e)
        await asyncio.sleep(0.2)
    return None


async def test_pause_while_admin_is_cut_from_kafka_is_pending_then_sent_and_audited(
        api: Any, kafka_cut: KafkaCut, kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    client, state = api
    assert kafka_cut.rewritten > 0, "admin's Kafka clients do not go through the proxy"
    async with served(state) as url:
        code, out, _ = await _flywheel(capsys, url, "--token", TOKEN, "resume")  # Kafka up: sent, exit 0
        assert code == 0 and out.strip().startswith("resume requested for every sampler") and "pending" not in out

        kafka_cut.cut()
        try:
            t0 = time.monotonic()
            code, out, err = await _flywheel(capsys, url, "--token", TOKEN, "pause")
            took = time.monotonic() - t0
            assert code == 3, (code, out, err)
            assert took < CLI_TIMEOUT_S, took
            text = out.strip()
            assert text.startswith("pause requested for every sampler (request "), text
            assert ": pending: stored; control command not acknowledged by Kafka within 3." in text, text
            assert text.endswith("; samplers apply it from the store at their next poll; admin keeps sending the "
                                 "command until Kafka takes it (flywheel audit shows when: command_sent)"), text
            pause_id = re.search(r"\(request ([0-9a-f]+)\)", text).group(1)  # type: ignore[union-attr]
            assert read_paused(state.store, state.settings.run)["all"] is not None  # stored before answering

            t0 = time.monotonic()
            code, out, _ = await _flywheel(capsys, url, "--token", TOKEN, "config", "set", "sampler.max_backlog=7")
            assert code == 3 and time.monotonic() - t0 < CLI_TIMEOUT_S, out
            assert out.startswith("revision 1\n") and "\npending: stored; control command not acknowledged" in out
            assert "queued behind 1 unsent command" in out, out  # the pause is still ahead of it

            entries = (await client.get("/audit", params={"limit": 1000})).json()["entries"]
            pause = next(e for e in entries if e["action"] == "pause" and e["params"]["request_id"] == pause_id)
            assert pause["outcome"].startswith("pending: stored; control command not acknowledged by Kafka")
            config = next(e for e in entries if e["action"] == "config_change")
            config_id = config["params"]["request_id"]
            assert "pending: stored" in config["outcome"]
            assert not [e for e in entries if e["action"] == "command_sent"]
        finally:
            kafka_cut.heal()

        healed = time.monotonic()
        sent = await _audit(client, "command_sent", pause_id, 60)
        assert sent is not None, "the pending pause was not sent after the heal"
        assert sent["actor"] == "admin" and sent["params"]["command"] == "pause"
        assert sent["params"]["requested_by"] == "admin" and sent["params"]["pending_s"] >= 3
        assert sent["outcome"].startswith("pause sent on the control topic ")
        assert await _audit(client, "command_sent", config_id, 30) is not None
        commands = await _control(kafka_bootstrap, state.topics.control, 3)  # resume, pause, config
        order = [c.request_id for c in commands if c.request_id in (pause_id, config_id)]
        assert order[:2] == [pause_id, config_id], order  # request order (a resend may follow)
        assert [c.command for c in commands if c.request_id == pause_id][0] == "pause"
        with capsys.disabled():
            print(f"\n{text}\nsent {sent['params']['pending_s']} s after the request, "
                  f"{time.monotonic() - healed:.1f} s after the heal")

        code, out, _ = await _flywheel(capsys, url, "audit", "--limit", "20")
        assert code == 0 and "command_sent" in out and pause_id in out
