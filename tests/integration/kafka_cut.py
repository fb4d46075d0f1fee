"""A proxy in front of the test broker through which one client alone talks to Kafka, so that its link can be cut.

A plain TCP proxy does not do for Kafka: the broker's Metadata answer names its advertised address, and the
client connects there directly. This one rewrites the broker addresses in the Metadata and FindCoordinator
answers (Kafka's protocol, decoded and encoded with aiokafka's own structs) to itself, so every connection the
client makes goes through it; everything else passes unchanged. :meth:`KafkaCut.cut` resets every connection and
refuses new ones (what a client cut from every broker sees, fast), :meth:`KafkaCut.heal` listens again on the
same port. One broker: every node id maps to this proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

from aiokafka.protocol import coordination, metadata

REWRITTEN = {3: (metadata, "MetadataResponse_v{}"), 10: (coordination, "FindCoordinatorResponse_v{}")}


class KafkaCut:
    def __init__(self, broker: str) -> None:
        host, _, port = broker.rpartition(":")
        self.broker = (host, int(port))
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.rewritten = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def heal(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
            self.port = self._server.sockets[0].getsockname()[1]

    start = heal

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._conns.clear()

    def _rewrite(self, api_key: int, version: int, body: bytes) -> bytes:
        module, name = REWRITTEN[api_key]
        cls: Any = getattr(module, name.format(version))  # a version aiokafka does not have: fails loudly
        resp = cls.decode(body)
        if api_key == 3:
            resp.brokers = [(b[0], "127.0.0.1", self.port, *b[3:]) for b in resp.brokers]
        else:
            resp.host, resp.port = "127.0.0.1", self.port
        self.rewritten += 1
        out: bytes = resp.encode()
        return out

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.broker)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_writer))
        asked: dict[int, tuple[int, int]] = {}  # correlation id -> (api key, version) of the answers to rewrite

        async def frames(src: asyncio.StreamReader, dst: asyncio.StreamWriter, to_broker: bool) -> None:
            try:
                while True:
                    size = struct.unpack(">i", await src.readexactly(4))[0]
                    data = await src.readexactly(size)
                    if to_broker:
                        api_key, version, corr = struct.unpack(">hhi", data[:8])
                        if api_key in REWRITTEN:
                            asked[corr] = (api_key, version)
                    else:
                        corr = struct.unpack(">i", data[:4])[0]
                        if corr in asked:
                            data = data[:4] + self._rewrite(*asked.pop(corr), data[4:])
                    dst.write(struct.pack(">i", len(data)) + data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(frames(reader, up_writer, True), frames(up_reader, writer, False))
        self._conns.discard(writer)
        self._conns.discard(up_writer)
