"""A TCP proxy in front of the S3 server, so the endpoint can go down while the data stays.

moto keeps objects in memory: killing it to make "S3 down" would also erase the run. The services
talk to this proxy instead; :meth:`TcpProxy.down` closes the listening socket and every open
connection (new connections are refused, open ones reset: what a crashed or unreachable endpoint
looks like to a client), :meth:`TcpProxy.up` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpProxy:
    def __init__(self, listen_port: int, target_host: str, target_port: int) -> None:
        self.port = listen_port
        self.target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread.start()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    def up(self) -> None:
        self._call(self._up())

    def down(self) -> None:
        self._call(self._down())

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _up(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._conns.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._conns.discard(writer)
        self._conns.discard(up_writer)
