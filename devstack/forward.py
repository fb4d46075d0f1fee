"""A TCP forwarder in the root namespace: ``python -m devstack.forward 127.0.0.1:8080 10.77.0.22:8080``.

The multi-host stack (``devstack.hosts``) runs the admin API in a namespace of its own, at its own address; this
forwards the address the ``flywheel`` CLI assumes (http://127.0.0.1:8080) to it, so a plain ``flywheel status``
works from the root namespace. Bytes only, both ways, one pair of tasks per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

NAME = "admin-fwd"


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], stop: asyncio.Event) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout=10.0)
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    sys.stdout.write(f"forwarding {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}\n")
    sys.stdout.flush()
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m devstack.forward LISTEN_HOST:PORT TARGET_HOST:PORT\n")
        return 2
    listen, target = parse_addr(args[0]), parse_addr(args[1])

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(listen, target, stop)

    asyncio.run(_main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
