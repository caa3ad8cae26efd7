"""What the HTTP/2 connections and the streams on them know of each other: three small interfaces.

A connection (client-facing `Downstream`, backend-facing `Upstream`) turns h2 events into calls on the
stream they belong to; a stream (a relayed gRPC `Call`, an `HttpBridgeCall`) writes through its
connection. Naming the methods here keeps proxy/grpc/connection.py and proxy/grpc/upstream.py from
importing the calls they carry (and the calls from importing every connection kind).
"""

from __future__ import annotations

from typing import Any, Protocol

import h2.connection


class ClientStream(Protocol):
    """A request stream on a client connection: what `Downstream` hands the client's events to."""

    def client_data(self, data: bytes, flow_len: int, ended: bool = False) -> None: ...

    def client_end(self) -> None: ...

    def client_reset(self) -> None: ...

    def flush_down(self) -> None: ...


class BackendStream(Protocol):
    """A call's stream on a backend connection: what `Upstream` and `BackendPool` hand events to."""

    def attach(self, up: Any) -> None: ...

    def connect_failed(self, reason: str) -> None: ...

    def up_headers(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None: ...

    def up_data(self, data: bytes, flow_len: int) -> None: ...

    def up_trailers(self, trailers: list[tuple[bytes, bytes]]) -> None: ...

    def up_ended(self) -> None: ...

    def up_reset(self, code: int) -> None: ...

    def up_lost(self, reason: str, refused: bool) -> None: ...

    def internal_error(self, exc: BaseException) -> None:
        """A fault while handling this stream: end it alone (gRPC INTERNAL)."""

    def flush_up(self) -> None: ...

    def flush_down(self) -> None: ...


class ClientConnection(Protocol):
    """The client connection as its streams write to it."""

    conn: h2.connection.H2Connection
    now: float  # when the current read came in (time.monotonic)
    paused: bool
    blocked: dict[Any, None]
    calls: dict[int, Any]
    others: dict[int, Any]

    def mark(self) -> None: ...

    def send_whole(self, sid: int, headers: list[Any], body: bytes) -> bool: ...

    def ack(self, n: int, sid: int) -> None: ...

    def peer(self) -> str | None: ...


__all__ = ["BackendStream", "ClientConnection", "ClientStream"]
