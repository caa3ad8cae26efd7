"""Bare HTTP/2 peers (h2 over asyncio) for what real gRPC stacks hide.

grpcio's client enforces its own deadline and grpcio/grpclib servers honour ``grpc-timeout``, so neither can
show whether the proxy itself ends an expired call. `RawClient` sends gRPC requests and never gives up on
its own; `SilentBackend` accepts streams and never answers them (an engine that ignores deadlines), records
the resets it receives, and can stop reading altogether (a hung peer that no longer answers PINGs).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import h2.config
import h2.connection
import h2.events

from proxy.grpc.connection import _FAST_HEADERS, _ProbeSide


def server_side() -> _ProbeSide:
    """The proxy's own server-side HTTP/2 state (proxy/grpc/connection.py), fed bytes by hand: the fast-path
    probe's side, which never writes (a compiled H2Side takes no interpreted subclass), with a server's
    default fast paths."""
    side = _ProbeSide(client_side=False)
    side.fast_headers = _FAST_HEADERS
    return side


def grpc_frame(payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(payload)) + payload


class _Peer(asyncio.Protocol):
    def __init__(self, client_side: bool) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=client_side,
                                                                          header_encoding=None))
        self.transport: asyncio.Transport | None = None
        self.events: list[Any] = []
        self.changed = asyncio.Event()
        self.lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self.flush()

    def data_received(self, data: bytes) -> None:
        events = self.conn.receive_data(data)
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        self.events.extend(events)
        self.handle(events)
        self.flush()
        self.changed.set()

    def handle(self, events: list[Any]) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self.changed.set()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> Any:
        """The first event matching `predicate` (bounded so a broken proxy fails the test, not hangs it)."""
        async def scan() -> Any:
            while True:
                for ev in self.events:
                    if predicate(ev):
                        return ev
                self.changed.clear()
                await self.changed.wait()
        return await asyncio.wait_for(scan(), timeout)


class RawClient(_Peer):
    def __init__(self) -> None:
        super().__init__(client_side=True)

    @classmethod
    async def connect(cls, address: str) -> "RawClient":
        host, _, port = address.rpartition(":")
        _, proto = await asyncio.get_running_loop().create_connection(cls, host, int(port))
        return proto

    def call(self, path: str, message: bytes | None, *, timeout: str | None = None, end: bool = True,
             metadata: tuple[tuple[bytes, bytes], ...] = ()) -> int:
        """Start a call; `message` None sends only the HEADERS (the first message is held back)."""
        sid = self.conn.get_next_available_stream_id()
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                   (b":authority", b"proxy"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
        if timeout is not None:
            headers.append((b"grpc-timeout", timeout.encode()))
        headers.extend(metadata)
        self.conn.send_headers(sid, headers, end_stream=message is None and end)
        if message is not None:
            self.conn.send_data(sid, grpc_frame(message), end_stream=end)
        self.flush()
        return sid

    async def status(self, sid: int, timeout: float = 10.0) -> tuple[int, str]:
        """(grpc-status, grpc-message) of the stream's trailers (or trailers-only response)."""
        def ends(ev: Any) -> bool:
            return (isinstance(ev, (h2.events.TrailersReceived, h2.events.ResponseReceived))
                    and ev.stream_id == sid and any(n == b"grpc-status" for n, _ in ev.headers))
        ev = await self.wait_for(ends, timeout)
        fields = dict(ev.headers)
        return int(fields[b"grpc-status"]), fields.get(b"grpc-message", b"").decode()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class SilentBackend:
    """An h2c server that takes every stream and never finishes it (with `headers_first`, it sends the
    response HEADERS and then nothing more: a backend that hangs mid-call)."""

    def __init__(self, headers_first: bool = False) -> None:
        self.headers_first = headers_first
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.conns: list[_Peer] = []
        self.streams = 0
        self.resets: list[tuple[int, int]] = []  # (stream id, error code) of RST_STREAMs received
        self.pings = 0
        self.changed = asyncio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _protocol(self) -> _Peer:
        backend = self

        class Conn(_Peer):
            def handle(self, events: list[Any]) -> None:
                for ev in events:
                    if isinstance(ev, h2.events.RequestReceived):
                        backend.streams += 1
                        if backend.headers_first:
                            self.conn.send_headers(ev.stream_id, [(b":status", b"200"),
                                                                  (b"content-type", b"application/grpc")])
                    elif isinstance(ev, h2.events.StreamReset):
                        backend.resets.append((ev.stream_id, int(ev.error_code)))
                    elif isinstance(ev, h2.events.PingReceived):
                        backend.pings += 1
                backend.changed.set()

            def connection_lost(self, exc: Exception | None) -> None:
                super().connection_lost(exc)
                backend.changed.set()

        conn = Conn(client_side=False)
        self.conns.append(conn)
        return conn

    async def start(self) -> None:
        self.server = await asyncio.get_running_loop().create_server(self._protocol, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def hang(self) -> None:
        """Stop reading every connection: PINGs go unanswered, as with a frozen process."""
        for c in self.conns:
            if c.transport is not None:
                c.transport.pause_reading()

    async def wait(self, predicate: Any, timeout: float = 10.0) -> None:
        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), timeout)

    async def stop(self) -> None:
        for c in self.conns:
            if c.transport is not None:
                c.transport.abort()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
