"""A minimal keep-alive HTTP/1.1 GET client for metrics scrapes over http:// and https://.

Why not aiohttp for this: a scrape is the control plane's hottest operation (64 backends at 5 Hz is 320
GETs a second, forever) and aiohttp's client machinery costs ~90 us of CPU per GET here against ~20 us for
this protocol, which is most of the poller's budget (measured side by side in loadtest/bench_control.py).
A scrape needs very little of HTTP: one GET on a kept-alive connection per backend, one request at a
time, a body delimited by Content-Length, chunked encoding or the connection's end. Anything else
(redirects) goes through the aiohttp session the poller keeps for it. https:// scrapes use the backend's
context (proxy/tls.py, `tls` below), built once, on connections that are kept like plain ones.

A connection whose request timed out or failed is closed, never reused: its state is unknown. A GET sent
on a kept-alive connection that the server had already closed is retried once on a fresh one (safe: GET
is idempotent), which is the race every keep-alive client has with a server's idle timeout.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from typing import Callable
from urllib.parse import urlsplit

# ProtocolError is the codec's own: "the server's answer is not HTTP/1.x we can read" (re-exported for callers).
from proxy.wire.http1 import Data, EndOfMessage, Event, IncompleteResponse, ProtocolError, Response, ResponseParser

__all__ = ["HttpStatusError", "MetricsHttpClient", "ProtocolError"]


class HttpStatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _StaleConnection(Exception):
    """The connection ended before any byte of the response: the server closed it while idle."""


_MAX_BODY = 32 * 1024 * 1024


class _Conn(asyncio.Protocol):
    """One connection; the response bytes are parsed by the sans-I/O ResponseParser (proxy/wire/http1.py)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[bytes] | None = None
        self.closed = False
        self.reusable = True
        self.parser = ResponseParser()
        self._reset()

    def _reset(self) -> None:
        self.received = False  # any byte of this response yet
        self.status = 0
        self.gzip = False
        self.chunks: list[bytes] = []
        self.size = 0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # create_connection gives a Transport; the protocol API types it BaseTransport

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.reusable = False  # bytes nobody asked for: the connection is out of step
            return
        self.received = True
        try:
            self._on_events(self.parser.feed(data))
        except ProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        self._finish_at_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish_at_eof()

    def _finish_at_eof(self) -> None:
        self.reusable = False
        if self.waiter is None or self.waiter.done():
            return
        if not self.received:
            self._fail(_StaleConnection())
            return
        try:
            self._on_events(self.parser.feed_eof())
        except IncompleteResponse:
            self._fail(ProtocolError("connection closed in the middle of the response"))
        except ProtocolError as exc:
            self._fail(exc)

    def _on_events(self, events: list[Event]) -> None:
        for ev in events:
            kind = type(ev)
            if kind is Data:
                data = ev.data  # type: ignore[union-attr]  # kind says which event it is
                self.size += len(data)
                if self.size > _MAX_BODY:
                    raise ProtocolError("response body too large")
                self.chunks.append(data)
            elif kind is Response:
                self._on_head(ev)  # type: ignore[arg-type]  # `kind is Response` narrows what isinstance would, without its cost
            elif kind is EndOfMessage:
                if not self.parser.reusable:
                    self.reusable = False
                chunks = self.chunks
                self._done(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            # Informational (1xx): skipped, the final answer follows.

    def _on_head(self, response: Response) -> None:
        self.status = response.status
        if not response.keep_alive:
            self.reusable = False
        if response.content_length is not None and response.content_length > _MAX_BODY:
            raise ProtocolError("response body too large")
        for name, value in response.headers:
            if len(name) == 16 and name.lower() == b"content-encoding":
                self.gzip = value.lower() in (b"gzip", b"deflate")

    def _done(self, body: bytes) -> None:
        waiter, self.waiter = self.waiter, None
        status, gz = self.status, self.gzip
        self._reset()
        if waiter is None or waiter.done():
            return
        if status != 200:
            waiter.set_exception(HttpStatusError(status))
            return
        if gz:
            try:
                body = zlib.decompress(body, 47)  # gzip or zlib header, detected
            except zlib.error as exc:
                waiter.set_exception(ProtocolError(f"bad compressed body: {exc}"))
                return
        waiter.set_result(body)

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def request(self, raw: bytes) -> asyncio.Future[bytes]:
        assert self.transport is not None and self.waiter is None
        self.parser = ResponseParser()  # one per response
        self._reset()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class MetricsHttpClient:
    """GET one URL's body with keep-alive connections per host:port; all errors are exceptions.

    Raises HttpStatusError (non-200), ProtocolError, OSError (connect/reset) or TimeoutError.
    """

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None,
                 tls: Callable[[str], tuple[ssl.SSLContext, str | None] | None] | None = None) -> None:
        """`tls(url)`: the SSLContext and SNI name for an https:// URL (system CAs when not given)."""
        self.timeout_s = timeout_s
        self._tls = tls
        self._ssl: dict[tuple[str, int], tuple[ssl.SSLContext, str]] = {}
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._extra = extra
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._requests: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        cached = self._requests.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http:// or https:// URL: {url}")
            host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
            if parts.scheme == "https":
                tls = self._tls(url) if self._tls is not None else None
                ctx = tls[0] if tls is not None else ssl.create_default_context()
                self._ssl[(host, port)] = (ctx, (tls[1] if tls is not None else None) or host)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host_header = parts.netloc.rsplit("@", 1)[-1]
            raw = f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\n{self._extra}\r\n".encode("latin-1")
            cached = self._requests[url] = ((host, port), raw)
        return cached

    async def get(self, url: str) -> bytes:
        key, raw = self._target(url)
        async with asyncio.timeout(self.timeout_s):
            for attempt in range(2):
                conn = self._take(key)
                fresh = conn is None
                if conn is None:
                    conn = await self._connect(key)
                try:
                    body = await conn.request(raw)
                except _StaleConnection:
                    conn.close()
                    if fresh or attempt:
                        raise ConnectionResetError("the server closed the connection without answering") from None
                    continue
                except HttpStatusError:
                    self._release(key, conn)  # a complete answer: the connection is still in step
                    raise
                except BaseException:
                    conn.close()  # timeout, cancel, error: its state is unknown
                    raise
                self._release(key, conn)
                return body
        raise AssertionError("unreachable")

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        if conn.reusable and not conn.closed:
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.reusable:
                return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        tls = self._ssl.get(key)
        if tls is None:
            _, conn = await loop.create_connection(_Conn, key[0], key[1])
        else:
            _, conn = await loop.create_connection(_Conn, key[0], key[1], ssl=tls[0], server_hostname=tls[1])
        return conn

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
