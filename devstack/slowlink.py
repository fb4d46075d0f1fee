"""A slow link for the multi-host stack: every TCP connection a part opens to chosen peers goes through a userspace
proxy that adds a delay and caps the bandwidth (this kernel has no ``tc netem``).

The proxy runs inside the part's own namespace. An ``iptables -t nat OUTPUT ... -j REDIRECT`` rule there (tagged
``--comment flywheel-slow``) sends the part's new connections to the peers' addresses to the proxy's port; the proxy
reads where each was going (``SO_ORIGINAL_DST``), connects there itself with its socket marked (``SO_MARK``), which
the rule skips, and relays both directions: each chunk is delivered ``delay_ms`` after it was read, in order, and no
faster than ``rate_kbps`` per direction (a token bucket). ``REDIRECT`` applies to new connections only, so the
part's sockets already connected to the peers are then aborted (``ss -K``) and its clients reconnect, through the
proxy.

    python -m devstack.slowlink --delay-ms 100 --rate-kbps 1000 --port 15999

is what ``devstack.hosts.slow`` starts with ``ip netns exec`` (and ``unslow`` stops, removing the rules).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import time
from collections.abc import Sequence

SO_ORIGINAL_DST = 80
MARK = 0x77
"""The proxy's own connections carry this mark; the REDIRECT rule skips them."""
SLOW_COMMENT = "flywheel-slow"
CHUNK = 16384


def redirect_commands(netns: str, peers: Sequence[str], port: int, action: str = "-A") -> list[list[str]]:
    """Inside ``netns``: new TCP connections to each of ``peers`` (addresses) go to the proxy on ``port``, except
    the proxy's own (marked) ones."""
    return [["ip", "netns", "exec", netns, "iptables", "-w", "-t", "nat", action, "OUTPUT", "-p", "tcp", "-d", peer,
             "-m", "mark", "!", "--mark", str(MARK), "-m", "comment", "--comment", SLOW_COMMENT,
             "-j", "REDIRECT", "--to-ports", str(port)] for peer in peers]


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, = struct.unpack("!H", raw[2:4])
    return socket.inet_ntoa(raw[4:8]), port


class Bucket:
    """At most ``rate`` bytes a second on average, bursts up to a quarter of a second's worth."""

    def __init__(self, rate_bps: float) -> None:
        self.rate = rate_bps
        self.capacity = max(rate_bps / 4, CHUNK)
        self.tokens = self.capacity
        self.at = time.monotonic()

    def wait_s(self, n: int) -> float:
        """Take ``n`` bytes; how long to wait before sending them."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class SlowProxy:
    def __init__(self, delay_s: float, rate_bps: float) -> None:
        self.delay_s = delay_s
        self.rate_bps = rate_bps
        self.connections = 0

    async def pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Relay ``src`` to ``dst``: each chunk delivered ``delay_s`` after it was read, in order, within the rate."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        bucket = Bucket(self.rate_bps)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if (wait := bucket.wait_s(len(data))) > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        writer = asyncio.create_task(deliver())
        try:
            while data := await src.read(CHUNK):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
            queue.put_nowait(None)
            await writer
        except (OSError, asyncio.IncompleteReadError):
            writer.cancel()
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            host, port = original_dst(sock)
            out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            out.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
            out.setblocking(False)
            await asyncio.get_running_loop().sock_connect(out, (host, port))
            up_reader, up_writer = await asyncio.open_connection(sock=out)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        sys.stdout.write(f"slowlink: connection {self.connections} to {host}:{port}\n")
        sys.stdout.flush()
        await asyncio.gather(self.pipe(reader, up_writer), self.pipe(up_reader, writer))


async def serve(port: int, delay_s: float, rate_bps: float) -> None:
    proxy = SlowProxy(delay_s, rate_bps)
    server = await asyncio.start_server(proxy.handle, "0.0.0.0", port, reuse_address=True)  # noqa: S104 (own netns)
    sys.stdout.write(f"slowlink: port {port}, delay {delay_s * 1000:.0f} ms, rate {rate_bps / 1000:.0f} kB/s a "
                     "direction\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m devstack.slowlink", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0, help="added to each direction")
    p.add_argument("--rate-kbps", type=float, default=0.0, help="kB/s a direction per connection (0: no cap)")
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.delay_ms / 1000, args.rate_kbps * 1000))


if __name__ == "__main__":
    main()
