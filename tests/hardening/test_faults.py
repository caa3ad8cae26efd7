"""One faulty request or call fails alone: the connection, the other streams and the process go on.

The fault is injected as a routing policy that raises for one specific prompt (a bug in a policy, or a
value that makes arithmetic fail, as the infinite weight of issue 18 did in core/affinity.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

import aiohttp
import grpc
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.decision import Decision, Inflight
from proxy.core.policies import RoundRobin
from proxy.core.request import RequestSummary
from proxy.core.snapshot import Snapshot
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from tests.grpc import stubs
from tests.grpc.conftest import backend_lines
from tests.support import FakeBackend

BOOM = "BOOM-this-request-breaks-the-policy"
QUIET = "listen: {port: 0}\nadmin: {port: 0}\ngrpc_listen: {port: 0}\ntelemetry: {enabled: false}\n" \
        "health_checks: {enabled: false}\n"


class RaisingPolicy:
    """Round robin, except that a request whose prompt mentions BOOM makes it raise. (It wraps a RoundRobin
    rather than subclassing it: a compiled class (proxy/native) takes no interpreted subclasses.)"""

    name = RoundRobin.name

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def pick(self, req: RequestSummary, snapshot: Snapshot, inflight: Mapping[str, Inflight],
             exclude: frozenset[str] = frozenset()) -> Decision:
        if BOOM in req.prompt:
            raise ValueError("cannot convert float NaN to integer")
        return self._rr.pick(req, snapshot, inflight, exclude)


async def _proxy(entries: list[tuple[str, str, str | None]]) -> AffinityProxy:
    proxy = AffinityProxy(parse_config(QUIET + backend_lines(entries)), policy=RaisingPolicy())
    await proxy.start()
    return proxy


@pytest.fixture
async def fleet() -> Any:
    f = await start_fleet(2, grpc_port=0, speed=200.0)
    yield f
    await f.stop()


async def test_grpc_bad_call_fails_alone_on_its_connection(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await _proxy([(s.name, s.url, s.grpc_address) for s in fleet.servers])
    assert proxy.grpc is not None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
            # Long streams in flight on the same connection while the bad call arrives.
            streams = [stubs.generate_stream(ch)(gen.GenerateRequest(prompt=f"good {i}", max_tokens=40,
                                                                      ignore_eos=True)) for i in range(3)]
            first = [await s.read() for s in streams]
            assert all(m is not grpc.aio.EOF for m in first)
            with caplog.at_level(logging.ERROR):
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stubs.generate(ch)(gen.GenerateRequest(prompt=BOOM, max_tokens=2))
            assert bad.value.code() == grpc.StatusCode.INTERNAL
            assert "internal proxy error" in (bad.value.details() or "")
            for s in streams:
                while await s.read() is not grpc.aio.EOF:
                    pass
                assert await s.code() == grpc.StatusCode.OK
            # The same connection (channel) still routes new calls.
            resp = await stubs.generate(ch)(gen.GenerateRequest(prompt="after", max_tokens=2, ignore_eos=True))
            assert resp.finished
        faults = [r for r in caplog.records if "internal error" in r.getMessage()]
        assert len(faults) == 1 and faults[0].exc_info is None  # one line, no traceback
        assert "ValueError" in faults[0].getMessage()
    finally:
        await proxy.stop()


async def test_http1_bad_request_is_a_500_and_the_keepalive_connection_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    backend = FakeBackend("b0")
    await backend.start()
    proxy = AffinityProxy(parse_config(QUIET.replace("grpc_listen: {port: 0}\n", "")
                                       + backend_lines([("b0", backend.url, None)])), policy=RaisingPolicy())
    await proxy.start()
    try:
        # One connection only: the good request after the bad one must reuse it.
        conn = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=conn) as s:
            url = proxy.http_url + "/v1/chat/completions"
            body = {"model": "fake-model", "messages": [{"role": "user", "content": BOOM}]}
            with caplog.at_level(logging.ERROR):
                async with s.post(url, json=body) as resp:
                    assert resp.status == 500
                    err = (await resp.json())["error"]
                    assert err["type"] == "server_error" and err["code"] == "internal_error"
                    assert resp.headers.get("Connection", "").lower() != "close"
            good = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(url, json=good) as resp:
                assert resp.status == 200
                assert "hello from b0" in json.dumps(await resp.json())
            assert len(conn._conns) == 1 and sum(len(v) for v in conn._conns.values()) == 1  # noqa: SLF001 - reused
        faults = [r for r in caplog.records if "internal error" in r.getMessage()]
        assert len(faults) == 1 and faults[0].exc_info is None
    finally:
        await proxy.stop()
        await backend.stop()


async def test_http2_bridge_bad_request_is_a_500(fleet: Fleet) -> None:
    import httpx

    proxy = await _proxy([(s.name, s.url, s.grpc_address) for s in fleet.servers])
    assert proxy.grpc is not None
    try:
        async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://127.0.0.1:{proxy.grpc.port}") as c:
            bad = c.post("/v1/chat/completions", json={"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": BOOM}]})
            good = c.post("/v1/chat/completions", json={"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            r_bad, r_good = await asyncio.gather(bad, good)
            assert r_bad.status_code == 500 and r_bad.json()["error"]["code"] == "internal_error"
            assert r_good.status_code == 200
    finally:
        await proxy.stop()
