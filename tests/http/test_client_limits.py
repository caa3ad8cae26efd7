"""Client timeouts and limits of the HTTP/1.1 listener (issue 18): idle, partial-head, short-body and
slowloris sockets are closed by their timeouts; the header limit is bytes, not a count; malformed HTTP
gets OpenAI-shaped errors; an optional cap on connections per client address."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from proxy.app import AffinityProxy
from tests.http.conftest import ProxyFactory
from tests.support import FakeBackend

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
SHORT = "timeouts: {client_header_s: 0.4, client_body_idle_s: 0.4, client_body_s: 5, client_keepalive_s: 0.4}\n"


async def _connect(proxy: AffinityProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(proxy.http_url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def _until_closed(reader: asyncio.StreamReader, within: float) -> tuple[bytes, float]:
    """Everything the proxy sends until it closes the connection, and how long that took."""
    t0 = time.monotonic()
    data = bytearray()
    while True:
        try:
            piece = await asyncio.wait_for(reader.read(65536), within)
        except ConnectionError:  # reset, or a broken pipe from a write that came too late
            break
        if not piece:
            break
        data += piece
    return bytes(data), time.monotonic() - t0


def _status_and_error(answer: bytes) -> tuple[int, dict[str, str]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


async def test_idle_socket_is_closed(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra=SHORT)
    reader, writer = await _connect(proxy)
    data, took = await _until_closed(reader, 5)
    assert took < 3  # 0.4 s plus the sweep's tick; nothing was asked, so nothing or a 408 is answered
    writer.close()


async def test_partial_head_gets_408_and_is_closed(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra=SHORT)
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    data, took = await _until_closed(reader, 5)
    assert took < 3
    status, err = _status_and_error(data)
    assert status == 408 and err["code"] == "request_headers_timeout"
    writer.close()


async def test_short_body_gets_408_and_is_closed(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra=SHORT)
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabcd")
    data, took = await _until_closed(reader, 5)
    assert took < 3
    status, err = _status_and_error(data)
    assert status == 408 and err["code"] == "request_body_timeout"
    assert backends[0].seen == []
    writer.close()


async def test_slowloris_sockets_are_closed(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    """Bytes that keep trickling in do not keep a head alive: the head has a deadline of its own."""
    proxy = await make_proxy(backends[:1], extra=SHORT)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200

    async def slowloris() -> float:
        reader, writer = await _connect(proxy)
        t0 = time.monotonic()
        try:
            for byte in head:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)  # 10 bytes/s: each one well within any idle gap
                if reader.at_eof():
                    break
                if time.monotonic() - t0 > 10:
                    raise AssertionError("a slowloris socket was never closed")
        except ConnectionError:
            pass
        await _until_closed(reader, 5)
        writer.close()
        return time.monotonic() - t0

    took = await asyncio.gather(*(slowloris() for _ in range(10)))
    assert max(took) < 5


async def test_idle_keepalive_connection_is_closed(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra=SHORT)
    reader, writer = await _connect(proxy)
    body = json.dumps(CHAT).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    await reader.readexactly(length)
    data, took = await _until_closed(reader, 5)  # then nothing more: closed after the keep-alive idle time
    assert data == b"" and took < 3
    writer.close()


async def test_many_small_headers_under_the_byte_limit_are_accepted(make_proxy: ProxyFactory) -> None:
    """200 small fields (aiohttp's server refused more than 128 whatever their size): the total is the rule."""
    seen: list[bytes] = []

    async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # a raw backend: aiohttp's own server has the count limit
        length = next(int(v) for n, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                      if n.lower() == b"content-length")
        await reader.readexactly(length)
        seen.append(head)
        body = b'{"ok": true}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(backend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        fake = FakeBackend("raw")
        fake.url = f"http://127.0.0.1:{port}"  # only its name and URL are used by make_proxy
        proxy = await make_proxy([fake])
        headers = {f"X-H{i}": "v" for i in range(200)}
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
                assert resp.status == 200
        assert seen[-1].count(b"\r\nX-H") == 200
        async with aiohttp.ClientSession() as s:  # and the byte limit still holds
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT,
                              headers={f"X-H{i}": "v" * 100 for i in range(200)}) as resp:
                assert resp.status == 431
                assert (await resp.json())["error"]["code"] == "headers_too_large"
    finally:
        server.close()


async def test_malformed_http_is_an_openai_shaped_400(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1])
    for wire in (b"GARBAGE\r\n\r\n", b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                 b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        reader, writer = await _connect(proxy)
        writer.write(wire)
        data, _ = await _until_closed(reader, 5)
        status, err = _status_and_error(data)
        assert status == 400 and err["type"] == "invalid_request_error" and err["code"] == "bad_request"
        writer.close()
    assert backends[0].seen == []


async def test_connections_per_client_can_be_capped(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra="limits: {max_connections_per_client: 2}\n")
    held = [await _connect(proxy) for _ in range(2)]
    for _, w in held:  # the main port sniffs HTTP/1.1 vs HTTP/2 from the first bytes: speak HTTP/1.1
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reader, writer = await _connect(proxy)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data, _ = await _until_closed(reader, 5)
    status, err = _status_and_error(data)
    assert status == 429 and err["code"] == "too_many_connections"
    writer.close()
    for _, w in held:
        w.close()
        await w.wait_closed()
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as s:  # the slots are free again
        async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200


async def test_pipelined_requests_are_answered_in_order(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1])
    reader, writer = await _connect(proxy)
    body = json.dumps(CHAT).encode()
    one = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-request-id: r%d\r\nContent-Length: %d\r\n\r\n%s"
    writer.write(one % (1, len(body), body) + one % (2, len(body), body) + b"GET /health HTTP/1.1\r\nHost: x\r\n"
                 b"x-request-id: r3\r\nConnection: close\r\n\r\n")
    data, _ = await _until_closed(reader, 10)
    ids = [line.split(b":", 1)[1].strip() for line in data.split(b"\r\n") if line.lower().startswith(b"x-request-id")]
    assert ids == [b"r1", b"r2", b"r3"]
    assert data.count(b"HTTP/1.1 200") == 3
    writer.close()


async def test_http10_client_gets_its_answer_then_the_close(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1])
    for stream in (False, True):
        reader, writer = await _connect(proxy)
        body = json.dumps({**CHAT, "stream": stream}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data, _ = await _until_closed(reader, 10)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
        assert (b"[DONE]" in rest) if stream else json.loads(rest)["choices"]
        writer.close()


async def test_an_accepted_transport_can_be_handed_over(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    """What a one-port listener does: sniff the first bytes, then give the transport to the HTTP/1.1 protocol."""
    proxy = await make_proxy(backends[:1])
    plane = proxy.http
    assert plane is not None

    class Sniffer(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            http = plane.protocol()
            self.transport.set_protocol(http)
            http.connection_made(self.transport)
            http.data_received(data)

    server = await asyncio.get_running_loop().create_server(Sniffer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # and the connection stays the HTTP/1.1 protocol's for the next request
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200 and (await resp.json())["choices"]
    finally:
        server.close()
