"""What the gRPC listener serves itself (health, admin) and the plain-HTTP/2 bridge."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from grpclib.health.v1 import health_pb2

from sim.fleet import Fleet
from proxy.core.snapshot import Health
from proxy.protos import admin_pb2
from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs
from tests.grpc.conftest import fleet_entries, proxy_address

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_follows_routable_backends(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    ch = channel_to(proxy_address(proxy))
    check = stubs.health_check(ch)
    assert (await check(health_pb2.HealthCheckRequest())).status == SERVING
    watch = ch.unary_stream("/grpc.health.v1.Health/Watch",
                            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                            response_deserializer=health_pb2.HealthCheckResponse.FromString)
    watching = watch(health_pb2.HealthCheckRequest())
    assert (await watching.read()).status == SERVING
    drain = stubs.admin(ch, "Drain")
    for s in fleet.servers[:-1]:
        await drain(admin_pb2.DrainRequest(name=s.name, drain=True))
    assert (await check(health_pb2.HealthCheckRequest())).status == SERVING
    await drain(admin_pb2.DrainRequest(name=fleet.servers[-1].name, drain=True))
    assert (await check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
    assert (await watching.read()).status == NOT_SERVING  # Watch streams the change through the listener
    watching.cancel()
    await drain(admin_pb2.DrainRequest(name=fleet.servers[0].name, drain=False))
    assert (await check(health_pb2.HealthCheckRequest(service="affinity.admin.v1.ProxyAdmin"))).status == SERVING


async def test_admin_reads_state_and_changes_weight_and_drain(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet), policy="weighted_round_robin")
    ch = channel_to(proxy_address(proxy))
    listing = await stubs.admin(ch, "ListBackends")(admin_pb2.ListBackendsRequest())
    assert [b.name for b in listing.backends] == ["sim-0", "sim-1", "sim-2"]
    assert listing.backends[0].grpc_address == fleet.servers[0].grpc_address
    assert all(b.routable and b.weight == 1.0 for b in listing.backends)

    status = await stubs.admin(ch, "SetWeight")(admin_pb2.SetWeightRequest(name="sim-1", weight=0))
    assert status.weight == 0 and status.configured_weight == 1 and not status.routable
    status = await stubs.admin(ch, "Drain")(admin_pb2.DrainRequest(name="sim-2", drain=True))
    assert status.health == "draining"
    assert proxy.store.current.get("sim-2").health is Health.DRAINING  # type: ignore[union-attr]

    # Both take effect on the very next calls of an already open connection.
    generate = stubs.generate(ch)
    backends = {(await generate(gen.GenerateRequest(prompt="x", max_tokens=1))).backend for _ in range(5)}
    assert backends == {"sim-0"}

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stubs.admin(ch, "GetBackend")(admin_pb2.GetBackendRequest(name="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stubs.admin(ch, "SetWeight")(admin_pb2.SetWeightRequest(name="sim-0", weight=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_plain_http2_requests_are_proxied_like_http1(fleet: Fleet, make_proxy) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    url = f"http://{proxy_address(proxy)}"
    async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=10) as client:
        body = {"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 5, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello over h2c"}]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.http_version == "HTTP/2"
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert data["usage"]["completion_tokens"] == 5

        chunks = []
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            async for line in stream.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 1

        bad = await client.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_json"


async def test_admin_writes_need_the_admin_token_when_set(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet), admin_token="s3cret")
    ch = channel_to(proxy_address(proxy))
    # Reads stay open, as on the HTTP admin API.
    assert len((await stubs.admin(ch, "ListBackends")(admin_pb2.ListBackendsRequest())).backends) == 3
    set_weight = stubs.admin(ch, "SetWeight")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await set_weight(admin_pb2.SetWeightRequest(name="sim-0", weight=5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await set_weight(admin_pb2.SetWeightRequest(name="sim-0", weight=5),
                         metadata=(("authorization", "Bearer wrong"),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert proxy.store.current.get("sim-0").effective_weight == 1.0  # type: ignore[union-attr]
    status = await set_weight(admin_pb2.SetWeightRequest(name="sim-0", weight=5),
                              metadata=(("authorization", "Bearer s3cret"),))
    assert status.weight == 5 and proxy.store.current.get("sim-0").effective_weight == 5  # type: ignore[union-attr]
