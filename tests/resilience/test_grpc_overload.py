"""Overload over gRPC: a saturated fleet answers RESOURCE_EXHAUSTED (reject_status 429) or UNAVAILABLE (503)."""

from __future__ import annotations

import grpc
import pytest

from sim.fleet import start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs


@pytest.mark.parametrize("reject_status, code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                                 (503, grpc.StatusCode.UNAVAILABLE)])
async def test_saturated_fleet_over_grpc(reject_status: int, code: grpc.StatusCode) -> None:
    fleet = await start_fleet(1, grpc_port=0, speed=200.0)
    s = fleet.servers[0]
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ngrpc_listen: {port: 0}\ntelemetry: {enabled: false}\n"
        "health_checks: {enabled: false}\n"
        f"overload: {{max_inflight_per_backend: 1, reject_status: {reject_status}}}\n"
        f"backends:\n  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}'}}\n"))
    await proxy.start()
    try:
        assert proxy.grpc is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
            call = stubs.generate(ch)
            assert (await call(gen.GenerateRequest(prompt="x", max_tokens=1))).text is not None  # serves
            proxy.inflight.acquire(s.name, 0)  # the one slot is taken (as by a long stream)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(gen.GenerateRequest(prompt="x", max_tokens=1))
            assert info.value.code() == code and "saturated" in (info.value.details() or "")
    finally:
        await proxy.stop()
        await fleet.stop()
