"""A slow reader must hold back its writer through HTTP/2 flow control, not fill the proxy's memory."""

from __future__ import annotations

import asyncio
import collections

import grpc

from proxy.grpc.call import take
from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs
from tests.grpc.conftest import echo_entries, proxy_address
from tests.grpc.echo import EchoBackend

WINDOW = 65535


def _queued_to_client(proxy) -> int:  # type: ignore[no-untyped-def]
    ctx = proxy.grpc.ctx
    return sum(len(item[0]) for down in ctx.downstreams for call in down.calls.values() for item in call.to_down)


async def test_slow_reader_bounds_proxy_buffering(echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    extra = f"grpc: {{stream_window_bytes: {WINDOW}, connection_window_bytes: {4 * WINDOW}}}\n"
    proxy = await make_proxy(echo_entries(echoes[:1]), extra=extra)
    # Small client windows too, so the client stops taking data soon after it stops reading.
    ch = channel_to(proxy_address(proxy), options=[("grpc.http2.bdp_probe", 0),
                                                   ("grpc.http2.lookahead_bytes", WINDOW)])
    stream = stubs.generate_stream(ch)
    prompt = "x" * 16_000  # ~16 KB per message, produced as fast as the backend is allowed to
    call = stream(gen.GenerateRequest(prompt=prompt, max_tokens=0))
    first = await call.read()
    assert first.index == 0
    # Stop reading. The backend keeps writing until every window on the way is full.
    peak = 0
    for _ in range(30):
        await asyncio.sleep(0.02)
        peak = max(peak, _queued_to_client(proxy))
    assert peak <= WINDOW + 16_100, peak
    # Reading again drains everything in order.
    for i in range(1, 120):
        m = await call.read()
        assert m.index == i and m.text == f"{prompt}-{i}"
    call.cancel()


def _queued_to_backend(proxy) -> int:  # type: ignore[no-untyped-def]
    ctx = proxy.grpc.ctx
    return sum(len(item[0]) for down in ctx.downstreams for call in down.calls.values() for item in call.to_up)


async def test_slow_backend_bounds_proxy_buffering(make_proxy, channel_to) -> None:
    # A backend that does not read ahead (no BDP window growth), so its windows close when it is slow.
    backend = EchoBackend("slow", options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", WINDOW)])
    await backend.start()
    try:
        await _slow_backend(backend, make_proxy, channel_to)
    finally:
        await backend.stop()


async def _slow_backend(backend: EchoBackend, make_proxy, channel_to) -> None:  # type: ignore[no-untyped-def]
    extra = f"grpc: {{stream_window_bytes: {WINDOW}, connection_window_bytes: {4 * WINDOW}}}\n"
    proxy = await make_proxy(echo_entries([backend]), extra=extra)
    bidi = stubs.generate_bidi(channel_to(proxy_address(proxy)))()
    prompt = "y" * 16_000
    sent = 0
    peak = 0

    async def writer() -> None:
        nonlocal sent
        for i in range(60):
            await bidi.write(gen.GenerateRequest(prompt=prompt, max_tokens=i, temperature=0.02))
            sent += 1
        await bidi.done_writing()

    task = asyncio.ensure_future(writer())
    got = []
    while True:
        m = await bidi.read()
        if m == grpc.aio.EOF:
            break
        got.append(m.index)
        peak = max(peak, _queued_to_backend(proxy))
    await task
    assert got == list(range(60))
    assert peak <= WINDOW + 16_100, peak


def test_take_coalesces_and_splits_with_exact_acknowledgements() -> None:
    q: collections.deque[list] = collections.deque([[b"aaaa", 4], [b"bb", 7], [b"cccccc", 6]])
    chunk, ack = take(q, 5)
    assert (chunk, ack) == (b"aaaab", 5)  # 4 from the first item, 1 of the second's 7 (5 are padding)
    assert q[0] == [b"b", 6]
    chunk, ack = take(q, 100)
    assert (chunk, ack) == (b"bcccccc", 12)
    assert not q
    q.extend([[b"0123456789", 10]])
    assert take(q, 4) == (b"0123", 4) and take(q, 6) == (b"456789", 6) and not q
