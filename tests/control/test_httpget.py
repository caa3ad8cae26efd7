"""The scrape client against scripted raw HTTP servers: every body framing, keep-alive, and each failure."""

from __future__ import annotations

import asyncio
import gzip
from typing import AsyncIterator, Callable

import pytest

from proxy.control.httpget import HttpStatusError, MetricsHttpClient, ProtocolError

Responder = Callable[[int], list[bytes]]  # request number on this server -> byte pieces to send


class ScriptedServer:
    """Answers the n-th request with responder(n); pieces are sent with a pause in between (split reads)."""

    def __init__(self, responder: Responder, close_after: bool = False) -> None:
        self.responder = responder
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                for piece in self.responder(len(self.requests)):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> "ScriptedServer":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/metrics"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., object]]:
    servers: list[ScriptedServer] = []

    async def make(responder: Responder, close_after: bool = False) -> ScriptedServer:
        s = await ScriptedServer(responder, close_after).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


def ok(body: bytes, extra: bytes = b"") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n", body]


async def test_content_length_keep_alive_reuses_one_connection(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: ok(f"page {n}\n".encode() * 1000))
    client = MetricsHttpClient(2.0, headers={"Accept": "text/plain"})
    try:
        for n in (1, 2, 3):
            assert await client.get(srv.url) == f"page {n}\n".encode() * 1000
    finally:
        client.close()
    assert srv.connections == 1
    assert srv.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Accept: text/plain\r\n" in srv.requests[0]


async def test_chunked_body_with_trailers(serve) -> None:  # type: ignore[no-untyped-def]
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n",
              b"7;ext=1\r\n, world\r\n", b"0\r\n", b"X-Trailer: 1\r\n\r\n"]
    srv = await serve(lambda n: pieces)
    client = MetricsHttpClient(2.0)
    try:
        assert await client.get(srv.url) == b"hello, world"
        assert await client.get(srv.url) == b"hello, world"
    finally:
        client.close()
    assert srv.connections == 1


async def test_body_until_close_and_connection_close(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: [b"HTTP/1.0 200 OK\r\n\r\n", b"no length", b" at all"], close_after=True)
    client = MetricsHttpClient(2.0)
    try:
        assert await client.get(srv.url) == b"no length at all"
        assert await client.get(srv.url) == b"no length at all"
    finally:
        client.close()
    assert srv.connections == 2


async def test_gzip_body_is_decompressed(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: ok(gzip.compress(b"x 1\n"), b"Content-Encoding: gzip\r\n"))
    client = MetricsHttpClient(2.0)
    try:
        assert await client.get(srv.url) == b"x 1\n"
    finally:
        client.close()


async def test_non_200_is_a_status_error_and_keeps_the_connection(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: [b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno\n"] if n == 1 else ok(b"y"))
    client = MetricsHttpClient(2.0)
    try:
        with pytest.raises(HttpStatusError) as err:
            await client.get(srv.url)
        assert err.value.status == 404
        assert await client.get(srv.url) == b"y"
    finally:
        client.close()
    assert srv.connections == 1


async def test_server_closing_an_idle_connection_is_retried_once(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: ok(b"fresh"), close_after=True)  # closes after each answer, without saying so
    client = MetricsHttpClient(2.0)
    try:
        assert await client.get(srv.url) == b"fresh"
        await asyncio.sleep(0.05)  # let the close arrive while the connection is idle in the pool
        assert await client.get(srv.url) == b"fresh"
    finally:
        client.close()
    assert srv.connections == 2


async def test_timeout_closes_the_connection(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"] if n == 1 else ok(b"z"))
    client = MetricsHttpClient(0.1)
    try:
        with pytest.raises(TimeoutError):
            await client.get(srv.url)
        assert await client.get(srv.url) == b"z"  # a new connection: the half-read one was dropped
    finally:
        client.close()
    assert srv.connections == 2


async def test_refused_connection_is_an_oserror() -> None:
    client = MetricsHttpClient(2.0)
    with pytest.raises(OSError):
        await client.get("http://127.0.0.1:9/metrics")


async def test_garbage_is_a_protocol_error(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: [b"SSH-2.0-OpenSSH\r\n\r\n"])
    client = MetricsHttpClient(2.0)
    with pytest.raises(ProtocolError):
        await client.get(srv.url)


async def test_empty_chunk_size_line_is_a_protocol_error(serve) -> None:  # type: ignore[no-untyped-def]
    """This client used to read an empty chunk-size line as the last chunk and return a truncated body;
    RFC 9112 7.1 says chunk-size = 1*HEXDIG, so it is malformed framing (decided in tests/wire/test_http1.py)."""
    srv = await serve(lambda n: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n\r\n"
                                 b"5\r\nworld\r\n0\r\n\r\n"] if n == 1 else ok(b"after"))
    client = MetricsHttpClient(2.0)
    try:
        with pytest.raises(ProtocolError, match="chunk size"):
            await client.get(srv.url)
        assert await client.get(srv.url) == b"after"  # on a new connection: the broken one was dropped
    finally:
        client.close()
    assert srv.connections == 2


async def test_interim_100_continue_is_skipped(serve) -> None:  # type: ignore[no-untyped-def]
    srv = await serve(lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", *ok(b"final")])
    client = MetricsHttpClient(2.0)
    try:
        assert await client.get(srv.url) == b"final"
        assert await client.get(srv.url) == b"final"
    finally:
        client.close()
    assert srv.connections == 1


def test_only_http_and_https() -> None:
    client = MetricsHttpClient(1.0)
    with pytest.raises(ValueError):
        client._target("ftp://example.invalid/metrics")
    client._target("https://example.invalid/metrics")  # https:// scrapes are TLS connections (tests/tls)
