"""A slow reader must hold back its writer through HTTP/2 flow control, not fill the proxy's memory."""

from __future__ import annotations

import asyncio

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
