"""Backend HTTP/2 connections: idle ones are closed after `upstream_idle_timeout_s`; silent ones carrying
calls are PINGed, and one that does not answer is dropped with its calls ended UNAVAILABLE.

The sweeper is driven by hand with made-up clock readings (`Pools.sweep(now)`; the configured limits are
far longer than the test, so the real sweeper never acts), which keeps these tests exact and fast.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import pytest

from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs
from tests.grpc.conftest import echo_entries, proxy_address
from tests.grpc.echo import EchoBackend
from tests.grpc.rawh2 import SilentBackend
from tests.support import until




def _pools(proxy):  # type: ignore[no-untyped-def]
    assert proxy.grpc is not None and proxy.grpc.ctx is not None
    return proxy.grpc.ctx.pools


async def test_idle_backend_connection_is_closed_and_reopened_on_demand(echoes: list[EchoBackend], make_proxy,
                                                                        channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes[:1]), extra="grpc: {upstream_idle_timeout_s: 100}\n")
    ch = channel_to(proxy_address(proxy))
    assert (await stubs.generate(ch)(gen.GenerateRequest(prompt="one"))).text == "one"
    pools = _pools(proxy)
    (pool,) = pools.all()
    (up,) = pool.conns
    t0 = asyncio.get_running_loop().time()
    # A long call keeps its connection however long it lasts.
    stream = stubs.generate_stream(ch)(gen.GenerateRequest(prompt="s", max_tokens=0, temperature=0.05))
    await stream.read()
    pools.sweep(t0)
    pools.sweep(t0 + 1000)
    assert pool.conns == [up] and not up.goaway
    stream.cancel()
    await until(lambda: not up.calls)
    # Idle from the next sweep on: kept up to the limit, closed after it.
    pools.sweep(t0 + 1001)
    pools.sweep(t0 + 1050)
    assert pool.conns == [up]
    pools.sweep(t0 + 1101)
    assert pool.conns == [] and up.goaway
    await until(lambda: up.closed)
    # The next call opens a new connection.
    assert (await stubs.generate(ch)(gen.GenerateRequest(prompt="two"))).text == "two"
    assert len(pool.conns) == 1 and pool.conns[0] is not up


@pytest.fixture
async def silent_mid_call() -> AsyncIterator[SilentBackend]:
    b = SilentBackend(headers_first=True)
    await b.start()
    yield b
    await b.stop()


_KEEPALIVE = "grpc: {upstream_ping_interval_s: 100, upstream_ping_timeout_s: 10, upstream_idle_timeout_s: 0}\n"


async def test_silent_connection_is_pinged_and_kept_while_it_answers(silent_mid_call: SilentBackend,
                                                                     make_proxy, channel_to) -> None:
    backend = silent_mid_call
    proxy = await make_proxy([("hung", "http://127.0.0.1:9", backend.address)], extra=_KEEPALIVE)
    # A streaming call: grpcio surfaces its initial metadata on its own (a unary call's only with the answer).
    call = stubs.generate_stream(channel_to(proxy_address(proxy)))(gen.GenerateRequest(prompt="x"))
    await call.initial_metadata()  # the backend answered HEADERS, then goes quiet
    pools = _pools(proxy)
    (up,) = pools.all()[0].conns
    t0 = asyncio.get_running_loop().time()
    pools.sweep(t0)
    pools.sweep(t0 + 50)
    assert backend.pings == 0  # quiet for less than the interval
    pools.sweep(t0 + 101)
    await backend.wait(lambda: backend.pings == 1)
    await until(lambda: up.heard)  # its PING answer arrived
    pools.sweep(t0 + 115)  # past the PING timeout, but it answered: kept
    assert pools.all()[0].conns == [up] and not up.closed
    call.cancel()


async def test_connection_that_stops_answering_pings_is_dropped_and_its_calls_unavailable(
        silent_mid_call: SilentBackend, make_proxy, channel_to) -> None:
    backend = silent_mid_call
    proxy = await make_proxy([("hung", "http://127.0.0.1:9", backend.address)], extra=_KEEPALIVE)
    call = stubs.generate_stream(channel_to(proxy_address(proxy)))(gen.GenerateRequest(prompt="x"))
    await call.initial_metadata()
    pools = _pools(proxy)
    (up,) = pools.all()[0].conns
    backend.hang()  # frozen: reads nothing, answers nothing
    t0 = asyncio.get_running_loop().time()
    pools.sweep(t0)
    pools.sweep(t0 + 101)  # PING sent
    assert up.ping_sent
    pools.sweep(t0 + 105)
    assert pools.all()[0].conns == [up]  # still within the PING timeout
    pools.sweep(t0 + 112)
    assert pools.all()[0].conns == []
    await until(lambda: up.closed)  # aborted
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "PING" in (info.value.details() or "")
    assert proxy.inflight.total_requests == 0
