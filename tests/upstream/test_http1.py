"""The relay pool against scripted raw-socket backends: framing, reuse, limits, TTL, failures."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from proxy.upstream.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamReset, UpstreamTimeout
from proxy.upstream.http1 import UpstreamPool
from proxy.metrics import UpstreamCounters
from tests.support import until

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


class RawBackend:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.script(r, w)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                w.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def make_pool(**kw: float) -> tuple[UpstreamPool, UpstreamCounters]:
    counters = UpstreamCounters()
    opts = {"connections_per_backend": 4, "keepalive_s": 4.0, "connect_timeout_s": 2.0, "request_timeout_s": 10.0}
    opts.update(kw)
    return UpstreamPool(counters, **opts), counters  # type: ignore[arg-type]


def json_answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_content_length_body_and_keepalive_reuse() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(json_answer(b'{"ok": true}'))

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool()
        for _ in range(5):
            ex = await pool.request(url, HEAD, b"{}")
            assert ex.status == 200 and ex.content_length == 12 and not ex.chunked
            assert ex.headers["content-type"] == "application/json"
            assert await ex.read() == b'{"ok": true}'
            ex.release()
        assert backend.connections == 1 and counters.new_connections == 1
        await pool.close()


async def test_response_split_at_every_byte_and_interim_1xx() -> None:
    body = b"x" * 50
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + json_answer(body)

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        for i in range(len(answer)):
            w.write(answer[i : i + 1])
            await w.drain()
            await asyncio.sleep(0)

    async with RawBackend(script) as url:
        pool, _ = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        assert ex.status == 200
        assert await ex.read() == body
        ex.release()
        await pool.close()


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"8\r\ndata: a\n\r\n" b"8;ext=1\r\ndata: b\n\r\n" b"0\r\nX-Trailer: t\r\n\r\n"
)


@pytest.mark.parametrize("step", [1, 3, 7, len(CHUNKED)])
async def test_chunked_decoding_and_raw_relay(step: int) -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            for i in range(0, len(CHUNKED), step):
                w.write(CHUNKED[i : i + step])
                await w.drain()
                await asyncio.sleep(0)

    class Sink:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 0

    async with RawBackend(script) as url:
        pool, counters = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        assert ex.chunked
        assert [p async for p in ex.stream()] in ([b"data: a\n", b"data: b\n"],)
        ex.release()
        ex = await pool.request(url, HEAD, b"{}")
        sink = Sink()
        ex.relay_chunks(sink)  # type: ignore[arg-type]
        while not ex.complete:
            await ex.wait_relay()
        ex.release()
        # complete raw chunks only (re-framed if they arrived with the head), never the terminator
        assert sink.data in (b"8\r\ndata: a\n\r\n8;ext=1\r\ndata: b\n\r\n", b"8\r\ndata: a\n\r\n8\r\ndata: b\n\r\n")
        assert counters.new_connections == 1  # the connection was reused after a complete chunked answer
        await pool.close()


async def test_body_until_close() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await w.drain()

    async with RawBackend(script) as url:
        pool, _ = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        assert not ex.keep_alive
        assert b"".join([p async for p in ex.stream()]) == b"all of it"
        ex.release()
        await pool.close()


async def test_reset_mid_body_is_an_error() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await w.drain()

    async with RawBackend(script) as url:
        pool, _ = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        with pytest.raises(UpstreamReset):
            await ex.read()
        ex.release()
        await pool.close()


async def test_connect_refused_and_timeout() -> None:
    async with RawBackend(lambda r, w: asyncio.sleep(0)) as url:
        pass  # closed: nothing listens there any more
    pool, _ = make_pool()
    with pytest.raises(UpstreamConnectError):
        await pool.request(url, HEAD, b"{}")

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(30)

    async with RawBackend(silent) as url2:
        pool2, _ = make_pool(request_timeout_s=0.2)
        with pytest.raises(UpstreamTimeout):
            await pool2.request(url2, HEAD, b"{}")
        await pool2.close()
    await pool.close()


async def test_per_backend_limit_queues_then_serves_everyone() -> None:
    gate = asyncio.Event()
    active = 0
    peak = 0

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal active, peak
        while True:
            await read_request(r)
            active += 1
            peak = max(peak, active)
            await gate.wait()
            active -= 1
            w.write(json_answer(b"{}"))

    backend = RawBackend(script)
    async with backend as url:
        pool, _ = make_pool(connections_per_backend=2)

        async def one() -> bytes:
            ex = await pool.request(url, HEAD, b"{}")
            try:
                return await ex.read()
            finally:
                ex.release()

        tasks = [asyncio.create_task(one()) for _ in range(6)]
        await until(lambda: active >= 2, message="two requests reach the backend")
        gate.set()
        assert await asyncio.gather(*tasks) == [b"{}"] * 6
        assert peak == 2 and backend.connections == 2
        await pool.close()


async def test_idle_connections_expire_and_are_swept() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(json_answer(b"{}"))

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool(keepalive_s=0.2)
        pool.start()
        ex = await pool.request(url, HEAD, b"{}")
        await ex.read()
        ex.release()
        assert pool.idle_connections(url) == 1
        await until(lambda: pool.idle_connections(url) == 0, interval=0.02, message="swept: no ghost connection")
        ex = await pool.request(url, HEAD, b"{}")
        await ex.read()
        ex.release()
        assert counters.new_connections == 2
        assert pool.close_idle(url) == 1 and pool.idle_connections(url) == 0
        await pool.close()


async def test_backend_closing_an_idle_connection_is_not_reused() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(json_answer(b"{}"))
        await w.drain()  # then close: a keep-alive the server ends

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool()
        for _ in range(3):
            ex = await pool.request(url, HEAD, b"{}")
            assert await ex.read() == b"{}"
            ex.release()
            await asyncio.sleep(0.05)  # the close reaches the pool
        assert counters.new_connections == 3
        await pool.close()


async def test_headers_are_end_to_end_only() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 201 Created\r\nConnection: keep-alive, X-Secret\r\nKeep-Alive: timeout=5\r\n"
                b"X-Secret: 1\r\nX-Ok: 1\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 2\r\n\r\n{}")

    async with RawBackend(script) as url:
        pool, _ = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        assert ex.status == 201 and ex.reason == "Created" and ex.keep_alive
        assert sorted(k for k, _ in ex.headers.items()) == ["Set-Cookie", "Set-Cookie", "X-Ok"]
        assert ex.headers.getall("Set-Cookie") == ["a=1", "b=2"]
        assert len(ex.raw_headers) == 7
        assert await ex.read() == b"{}"
        ex.release()
        await pool.close()


async def test_empty_chunk_size_line_is_a_protocol_error() -> None:
    """Malformed framing (RFC 9112 7.1: chunk-size = 1*HEXDIG; decided in tests/wire/test_http1.py): the
    chunks before it are delivered, then the stream fails and the connection is not reused."""
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(b"5\r\nhello\r\n\r\n5\r\nworld\r\n0\r\n\r\n")

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool()
        ex = await pool.request(url, HEAD, b"{}")
        got: list[bytes] = []
        with pytest.raises(UpstreamProtocolError, match="chunk size"):
            async for piece in ex.stream():
                got.append(piece)
        assert got == [b"hello"]
        ex.release()
        ex = await pool.request(url, HEAD, b"{}")
        ex.release()
        assert counters.new_connections == 2
        await pool.close()


async def test_bytes_after_the_end_of_a_response_are_not_trusted() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(json_answer(b"{}") + b"HTTP/1.1 200 OK\r\n")  # out of turn: nobody asked for a second one

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool()
        for _ in range(2):
            ex = await pool.request(url, HEAD, b"{}")
            assert await ex.read() == b"{}" and not ex.keep_alive
            ex.release()
        assert counters.new_connections == 2 and pool.idle_connections(url) == 0
        await pool.close()


async def test_head_request_has_no_body_whatever_the_length_says() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")

    backend = RawBackend(script)
    async with backend as url:
        pool, counters = make_pool()
        for _ in range(2):
            ex = await pool.request(url, HEAD, b"{}", head_only=True)
            assert ex.complete and ex.content_length is None and await ex.read() == b""
            assert ("Content-Length" not in ex.headers) and ex.raw_headers == [(b"Content-Length", b"1234")]
            ex.release()
        assert counters.new_connections == 1
        await pool.close()


async def test_send_on_an_idle_connection_and_a_head_with_two_chunks_in_one_read() -> None:
    """`send`: None while no connection is idle (then `request` connects); afterwards the exchange at once,
    its `head` awaited, its `body()` taken without a coroutine. A head that arrives with two chunks and
    without the end (the one-read fast path of `Exchange.feed`) keeps both pieces in order."""
    first = asyncio.Event()

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(json_answer(b'{"n": 1}'))
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n3\r\ntwo\r\n")
        await w.drain()
        await first.wait()
        w.write(b"0\r\n\r\n")
        await read_request(r)
        w.write(json_answer(b'{"n": 3}'))

    async with RawBackend(script) as url:
        pool, counters = make_pool()
        assert pool.send(url, HEAD, b"{}") is None  # nothing idle yet
        ex = await pool.request(url, HEAD, b"{}")
        assert await ex.read() == b'{"n": 1}'
        ex.release()
        ex2 = pool.send(url, HEAD, b"{}")
        assert ex2 is not None
        await ex2.head
        assert ex2.chunked and not ex2.complete
        pieces = ex2.stream()
        assert [await pieces.__anext__(), await pieces.__anext__()] == [b"one", b"two"]
        first.set()
        assert [p async for p in pieces] == []
        ex2.release()
        ex3 = pool.send(url, HEAD, b"{}")
        assert ex3 is not None
        await ex3.head
        await until(lambda: ex3.complete)
        assert ex3.body() == b'{"n": 3}' and ex3.status == 200
        ex3.release()
        assert counters.new_connections == 1
        await pool.close()


@pytest.mark.parametrize("head_only", [False, True])
async def test_one_read_and_byte_by_byte_feed_agree(head_only: bool) -> None:
    """Differential: an answer fed to an Exchange in one read (its fast paths) ends in the same state as the
    same bytes fed one at a time (the general event loop)."""
    from proxy.upstream.http1 import Backend, Exchange, _Connection

    pool, _ = make_pool()

    def Conn() -> _Connection:  # noqa: N802  # a real connection with no transport (compiled code checks types)
        return _Connection(pool, Backend("http://127.0.0.1:1"))

    answers = [
        json_answer(b'{"ok": true}'),
        json_answer(b""),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n3\r\none\r\n3\r\ntwo\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n3\r\ntwo\r\n0\r\nT: x\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" + json_answer(b'{"a": 1}'),
        b"HTTP/1.1 503 Busy\r\nConnection: close, X-Hop\r\nX-Hop: 1\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\nno",
        json_answer(b'{"a": 1}') + b"HTTP/1.1 200 OK\r\n",  # bytes after the end: not reusable
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close",
        b"HTTP/1.1 204 No Content\r\nX-B: 2\r\n\r\n",
    ]
    loop = asyncio.get_running_loop()

    def state(ex: Exchange) -> tuple[object, ...]:
        return (ex.status, ex.reason, list(ex.headers.items()), ex.raw_headers, ex.chunked, ex.content_length,
                ex.keep_alive, ex.complete, ex.error is not None, b"".join(ex._parts), ex.head.done())

    for raw in answers:
        whole = Exchange(Conn(), head_only, loop)
        whole.feed(raw)
        split = Exchange(Conn(), head_only, loop)
        for i in range(len(raw)):
            split.feed(raw[i:i + 1])
        assert state(whole) == state(split), raw
