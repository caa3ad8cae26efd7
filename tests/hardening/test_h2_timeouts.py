"""HTTP/2 client timeouts on the gRPC listener: no preface, an idle connection, a stream that sends nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import h2.events
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.grpc.grpc_config import GrpcOptions
from proxy.wire.grpc import CANCELLED
from tests.grpc.conftest import backend_lines
from tests.grpc.rawh2 import RawClient, SilentBackend, grpc_frame

GEN = "/affinity.v1.Generation/Generate"
TIMEOUTS = "grpc: {client_preface_timeout_s: 0.3, client_idle_timeout_s: 0.5, client_stream_idle_timeout_s: 0.5, " \
           "first_message_timeout_s: 0.1}\n"


def test_defaults_are_on_and_sane() -> None:
    opts = GrpcOptions()
    assert 1 <= opts.client_preface_timeout_s <= 30
    assert 60 <= opts.client_idle_timeout_s <= 3600
    assert 60 <= opts.client_stream_idle_timeout_s <= 3600


@pytest.fixture
async def silent() -> AsyncIterator[SilentBackend]:
    b = SilentBackend(headers_first=False)
    await b.start()
    yield b
    await b.stop()


@pytest.fixture
async def proxy(silent: SilentBackend) -> AsyncIterator[AffinityProxy]:
    text = ("listen: {port: 0}\nadmin: {port: 0}\ngrpc_listen: {port: 0}\ntelemetry: {enabled: false}\n"
            "health_checks: {enabled: false}\n" + TIMEOUTS
            + backend_lines([("silent", "http://127.0.0.1:9", silent.address)]))
    p = AffinityProxy(parse_config(text))
    await p.start()
    yield p
    await p.stop()


def _port(proxy: AffinityProxy) -> int:
    assert proxy.grpc is not None
    return proxy.grpc.port


async def _closed_after(reader: asyncio.StreamReader, limit: float) -> float:
    """Seconds until the proxy closed the connection (reading and dropping what it sends)."""
    start = time.monotonic()

    async def drain() -> None:
        while await reader.read(65536):
            pass

    await asyncio.wait_for(drain(), limit)
    return time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"PRI * HTTP/2.0\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"])
async def test_a_connection_without_a_whole_preface_is_closed(proxy: AffinityProxy, sent: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(proxy))
    writer.write(sent)  # nothing, half the magic, or the magic without its SETTINGS frame
    try:
        took = await _closed_after(reader, 5.0)
    finally:
        writer.close()
    assert 0.2 <= took < 2.0


async def test_an_idle_connection_gets_goaway_and_is_closed(proxy: AffinityProxy) -> None:
    client = await RawClient.connect(f"127.0.0.1:{_port(proxy)}")
    try:
        await client.wait_for(lambda ev: isinstance(ev, h2.events.ConnectionTerminated), timeout=5.0)
        await asyncio.wait_for(client.lost.wait(), 5.0)
    finally:
        client.close()


async def test_a_stream_that_sends_nothing_is_cancelled_and_others_go_on(proxy: AffinityProxy,
                                                                           silent: SilentBackend) -> None:
    client = await RawClient.connect(f"127.0.0.1:{_port(proxy)}")
    try:
        quiet = client.call(GEN, None, end=False)  # HEADERS, then nothing at all
        # A stream whose client keeps sending is not idle, even past the limit.
        chatty = client.call(GEN, b"\x0a\x01a", end=False)
        for _ in range(8):
            await asyncio.sleep(0.15)
            client.conn.send_data(chatty, grpc_frame(b"\x0a\x01b"))
            client.flush()
        code, message = await client.status(quiet, timeout=5.0)
        assert code == CANCELLED and "sent nothing" in message
        assert not any(isinstance(ev, (h2.events.StreamReset, h2.events.TrailersReceived)) and
                       ev.stream_id == chatty for ev in client.events)
        assert not client.lost.is_set()
    finally:
        client.close()


async def test_a_plain_http2_request_without_its_body_is_reset(proxy: AffinityProxy) -> None:
    client = await RawClient.connect(f"127.0.0.1:{_port(proxy)}")
    try:
        sid = client.conn.get_next_available_stream_id()
        client.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"),
                                       (b":authority", b"p"), (b"content-type", b"application/json")])
        client.flush()
        ev: Any = await client.wait_for(lambda e: isinstance(e, h2.events.StreamReset) and e.stream_id == sid, 5.0)
        assert ev.error_code == 8  # CANCEL
    finally:
        client.close()
