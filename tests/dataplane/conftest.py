"""One simulated backend that speaks HTTP and gRPC, and a proxy with both data listeners in front of it."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    # speed 200: a simulated second lasts 5 ms, so generation is quick but still really streamed.
    f = await start_fleet(1, grpc_port=0, speed=200.0)
    yield f
    await f.stop()


@pytest.fixture
async def proxy(fleet: Fleet) -> AsyncIterator[AffinityProxy]:
    s = fleet.servers[0]
    text = ("listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nrouting: {policy: round_robin}\n"
            f"backends:\n  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}'}}\n")
    p = AffinityProxy(parse_config(text))
    await p.start()
    yield p
    await p.stop()
