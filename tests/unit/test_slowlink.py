"""The slow-link proxy's pure parts: the bandwidth bucket, the delayed in-order relay, and its iptables rules."""

from __future__ import annotations

import asyncio
import time

from devstack import hosts as mh
from devstack.slowlink import MARK, Bucket, SlowProxy, redirect_commands


def test_the_bucket_lets_a_burst_through_then_holds_to_the_rate() -> None:
    b = Bucket(100_000.0)  # 100 kB/s: a 25 kB burst
    assert b.wait_s(20_000) == 0.0
    wait = b.wait_s(20_000)  # 15 kB over the burst: 0.15 s at 100 kB/s
    assert 0.13 < wait < 0.16
    assert Bucket(0).wait_s(10**9) == 0.0  # no cap


def test_the_relay_delivers_every_chunk_in_order_and_late_by_the_delay() -> None:
    async def scenario() -> tuple[bytes, float]:
        received = bytearray()
        got = asyncio.Event()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                received.extend(data)
            got.set()
            writer.close()

        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, dst = await asyncio.open_connection("127.0.0.1", port)
        src = asyncio.StreamReader()
        payload = b"".join(i.to_bytes(4, "big") for i in range(20_000))  # 80 kB, order visible
        t0 = time.monotonic()
        relay = asyncio.create_task(SlowProxy(delay_s=0.2, rate_bps=200_000).pipe(src, dst))
        for i in range(0, len(payload), 8000):
            src.feed_data(payload[i:i + 8000])
        src.feed_eof()
        await relay
        await asyncio.wait_for(got.wait(), 10)
        server.close()
        return bytes(received), time.monotonic() - t0

    received, took = asyncio.run(scenario())
    assert received == b"".join(i.to_bytes(4, "big") for i in range(20_000))
    # 0.2 s of delay, then 80 kB at 200 kB/s past a 50 kB burst: ~0.15 s more.
    assert took >= 0.3, took


def test_the_rules_redirect_new_connections_except_the_proxys_own_and_abort_the_open_ones() -> None:
    redirect = redirect_commands("fw-sampler-0", ["10.77.0.11"], 15999)
    assert redirect == [["ip", "netns", "exec", "fw-sampler-0", "iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-p",
                         "tcp", "-d", "10.77.0.11", "-m", "mark", "!", "--mark", str(MARK), "-m", "comment",
                         "--comment", "flywheel-slow", "-j", "REDIRECT", "--to-ports", "15999"]]
    rules = mh.slow_commands("fw-sampler-0", ["10.77.0.11", "10.77.0.12"])
    assert rules[:2] == redirect_commands("fw-sampler-0", ["10.77.0.11", "10.77.0.12"], mh.SLOW_PORT)
    # then the sockets already open to the peers are destroyed, so their clients reconnect through the proxy
    assert rules[2:] == [["ip", "netns", "exec", "fw-sampler-0", "ss", "-K", "dst", "10.77.0.11"],
                         ["ip", "netns", "exec", "fw-sampler-0", "ss", "-K", "dst", "10.77.0.12"]]
