"""One admin rule for both doors: off loopback a token is required, or writes are refused (issue 18)."""

from __future__ import annotations

from typing import Any

import aiohttp
import grpc
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.admin_access import write_refusal
from proxy.protos import admin_pb2
from sim.fleet import Fleet, start_fleet
from tests.grpc import stubs
from tests.grpc.conftest import backend_lines


def test_the_rule() -> None:
    assert write_refusal(None, "127.0.0.1", None) is None
    assert write_refusal(None, "::1", None) is None
    assert write_refusal(None, "localhost", "whatever") is None
    refusal = write_refusal(None, "0.0.0.0", None)
    assert refusal is not None and refusal.kind == "forbidden"
    assert write_refusal(None, "10.1.2.3", "Bearer x") is not None  # no token configured: nothing unlocks it
    for host in ("127.0.0.1", "0.0.0.0"):
        assert write_refusal("s3cret", host, "Bearer s3cret") is None
        for given in (None, "", "Bearer wrong", "s3cret", "Bearer s3cret "):
            r = write_refusal("s3cret", host, given)
            assert r is not None and r.kind == "unauthorized"


@pytest.fixture
async def fleet() -> Any:
    f = await start_fleet(2, grpc_port=0, speed=200.0)
    yield f
    await f.stop()


async def _proxy(fleet: Fleet, host: str, token: str | None) -> AffinityProxy:
    admin = f"admin: {{host: '{host}', port: 0{', token: ' + token if token else ''}}}\n"
    text = (f"listen: {{port: 0}}\ngrpc_listen: {{host: '{host}', port: 0}}\n{admin}"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            + backend_lines([(s.name, s.url, s.grpc_address) for s in fleet.servers]))
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    return proxy


async def _http_write(proxy: AffinityProxy, headers: dict[str, str]) -> int:
    port = proxy.admin_url.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/admin/backends/sim-0/weight", json={"weight": 2},
                          headers=headers) as resp:
            return resp.status


async def _grpc_writes(proxy: AffinityProxy, metadata: tuple[tuple[str, str], ...]) -> list[grpc.StatusCode]:
    assert proxy.grpc is not None
    codes = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
        # Reads stay open whatever the rule says.
        assert len((await stubs.admin(ch, "ListBackends")(admin_pb2.ListBackendsRequest())).backends) == 2
        for method, req in (("SetWeight", admin_pb2.SetWeightRequest(name="sim-0", weight=2)),
                            ("Drain", admin_pb2.DrainRequest(name="sim-1", drain=False))):
            try:
                await stubs.admin(ch, method)(req, metadata=metadata)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.append(err.code())
    return codes


async def test_off_loopback_without_a_token_both_doors_refuse_writes(fleet: Fleet) -> None:
    proxy = await _proxy(fleet, "0.0.0.0", None)
    try:
        assert await _http_write(proxy, {}) == 403
        assert await _grpc_writes(proxy, ()) == [grpc.StatusCode.PERMISSION_DENIED] * 2
        assert proxy.store.current.get("sim-0").spec.weight != 2  # type: ignore[union-attr]
    finally:
        await proxy.stop()


async def test_off_loopback_with_a_token_both_doors_need_it(fleet: Fleet) -> None:
    proxy = await _proxy(fleet, "0.0.0.0", "s3cret")
    try:
        assert await _http_write(proxy, {}) == 401
        assert await _http_write(proxy, {"Authorization": "Bearer nope"}) == 401
        assert await _grpc_writes(proxy, (("authorization", "Bearer nope"),)) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert await _http_write(proxy, {"Authorization": "Bearer s3cret"}) == 200
        assert await _grpc_writes(proxy, (("authorization", "Bearer s3cret"),)) == [grpc.StatusCode.OK] * 2
    finally:
        await proxy.stop()


async def test_on_loopback_without_a_token_both_doors_accept_writes(fleet: Fleet) -> None:
    proxy = await _proxy(fleet, "127.0.0.1", None)
    try:
        assert await _http_write(proxy, {}) == 200
        assert await _grpc_writes(proxy, ()) == [grpc.StatusCode.OK] * 2
    finally:
        await proxy.stop()
