"""A simulated fleet (HTTP + gRPC) and an `affinity` proxy with HTTP/1.1, HTTP/2 (gRPC listener) doors."""

from __future__ import annotations

from collections import Counter
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet

ProxyFactory = Callable[..., Awaitable[AffinityProxy]]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, grpc_port=0, speed=200.0, adapters=("sql-lora", "chat-lora"))
    yield f
    await f.stop()


def proxy_text(fleet: Fleet, *, policy: str = "affinity", backend_extra: dict[str, str] | None = None,
               extra: str = "") -> str:
    lines = []
    for s in fleet.servers:
        more = (backend_extra or {}).get(s.name, "")
        lines.append(f"  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}'{more}}}")
    return ("listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            f"routing: {{policy: {policy}}}\n{extra}backends:\n" + "\n".join(lines) + "\n")


@pytest.fixture
async def make_proxy(fleet: Fleet) -> AsyncIterator[ProxyFactory]:
    started: list[AffinityProxy] = []

    async def make(*, policy: str = "affinity", backend_extra: dict[str, str] | None = None,
                   extra: str = "") -> AffinityProxy:
        p = AffinityProxy(parse_config(proxy_text(fleet, policy=policy, backend_extra=backend_extra, extra=extra)))
        await p.start()
        started.append(p)
        return p

    yield make
    for p in started:
        await p.stop()


@pytest.fixture
async def proxy(make_proxy: ProxyFactory) -> AffinityProxy:
    return await make_proxy()


def model_of(fleet: Fleet) -> str:
    return fleet.servers[0].backend.engine.model_name


def grpc_address(proxy: AffinityProxy) -> str:
    assert proxy.grpc is not None
    return f"127.0.0.1:{proxy.grpc.port}"


async def decisions(proxy: AffinityProxy) -> Counter[str]:
    """Routing decisions by reason, read off the admin /metrics page."""
    out: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s, s.get(proxy.admin_url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("affinity_proxy_routing_decisions_total{"):
                labels, value = line.rsplit(" ", 1)
                reason = labels.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] += int(float(value))
    return out
