"""Fixtures for the gRPC data plane: simulated backends (grpclib), grpcio echo backends, the proxy.

Tests drive everything with Google's `grpcio` client (`grpc.aio`), not grpclib, so the proxy is checked
against the client most users run. The proxy runs without telemetry scrapes or health checks: these tests
assert what the data plane itself does.
"""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import pytest

from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.decision import Outcome
from tests.grpc.echo import EchoBackend

QUIET = ("listen: {port: 0}\ngrpc_listen: {port: 0}\n"
         "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n")

ProxyFactory = Callable[..., Awaitable[AffinityProxy]]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    # speed 200: a simulated second lasts 5 ms, so generation is quick but still really streamed.
    f = await start_fleet(3, grpc_port=0, speed=200.0)
    yield f
    await f.stop()


@pytest.fixture
async def echoes() -> AsyncIterator[list[EchoBackend]]:
    backends = [EchoBackend(f"echo-{i}") for i in range(2)]
    for b in backends:
        await b.start()
    yield backends
    for b in backends:
        await b.stop()


def backend_lines(entries: Sequence[tuple[str, str, str | None]], weights: Sequence[float] | None = None) -> str:
    out = []
    for i, (name, url, grpc_address) in enumerate(entries):
        extra = f", grpc: '{grpc_address}'" if grpc_address else ""
        if weights is not None:
            extra += f", weight: {weights[i]}"
        out.append(f"  - {{name: {name}, url: '{url}'{extra}}}")
    return "backends:\n" + "\n".join(out) + "\n"


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    """Start a proxy with a gRPC listener in front of (name, http url, grpc address) entries."""
    started: list[AffinityProxy] = []

    async def make(entries: Sequence[tuple[str, str, str | None]], *, policy: str = "round_robin",
                   weights: Sequence[float] | None = None, extra: str = "",
                   admin_token: str | None = None,
                   on_outcome: Callable[[str, Outcome], None] | None = None) -> AffinityProxy:
        admin = f"admin: {{port: 0, token: {admin_token}}}\n" if admin_token else "admin: {port: 0}\n"
        text = f"{QUIET}{admin}routing: {{policy: {policy}}}\n{backend_lines(entries, weights)}{extra}"
        proxy = AffinityProxy(parse_config(text), on_outcome=on_outcome)
        await proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for p in started:
        await p.stop()


def fleet_entries(fleet: Fleet) -> list[tuple[str, str, str | None]]:
    return [(s.name, s.url, s.grpc_address) for s in fleet.servers]


def echo_entries(echoes: Sequence[EchoBackend]) -> list[tuple[str, str, str | None]]:
    # The HTTP url is never used by gRPC calls; it only has to be a valid URL, one per backend (the config
    # refuses two backends with one URL).
    return [(e.name, f"http://127.0.0.1:{9 + i}", e.address) for i, e in enumerate(echoes)]


def proxy_address(proxy: AffinityProxy) -> str:
    assert proxy.grpc is not None
    return f"127.0.0.1:{proxy.grpc.port}"


@pytest.fixture
async def channel_to() -> AsyncIterator[Callable[..., grpc.aio.Channel]]:
    channels: list[grpc.aio.Channel] = []

    def make(address: str, **kwargs: object) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(address, **kwargs)  # type: ignore[arg-type]
        channels.append(ch)
        return ch

    yield make
    for ch in channels:
        await ch.close()
