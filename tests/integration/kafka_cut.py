"""A proxy in front of the test broker through which one client alone talks to Kafka, so that its link can be cut.

A plain TCP proxy does not do for Kafka: the broker's Metadata answer names its advertised address, and the
client connects there directly. This one rewrites the broker addresses in the Metadata and FindCoordinator
answers (Kafka's protocol, decoded and encoded with aiokafka's own structs) to itself, so every connection the
client makes goes through it; everything else passes unchanged. The rest is the fault suite's
:class:`~tests.faults.proxy.TcpProxy` (its own loop in a thread): :meth:`KafkaCut.cut` resets every connection and
refuses new ones (what a client cut from every broker sees, fast), :meth:`KafkaCut.heal` listens again on the
same port. One broker: every node id maps to this proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from aiokafka.protocol import coordination, metadata

from tests.faults.proxy import TcpProxy

REWRITTEN = {3: (metadata, "MetadataResponse_v{}"), 10: (coordination, "FindCoordinatorResponse_v{}")}


class KafkaCut(TcpProxy):
    def __init__(self, broker: str) -> None:
        host, _, port = broker.rpartition(":")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            listen_port = sock.getsockname()[1]
        super().__init__(listen_port, host, int(port))
        self.rewritten = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self.down()

    def heal(self) -> None:
        self.up()

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
            up_reader, up_writer = await asyncio.open_connection(*self.target)
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
