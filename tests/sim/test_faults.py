"""Every fault switch does what it says, set at start or at run time through POST /sim/faults."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import openai
import pytest

from sim.fleet import Fleet, start_fleet
from tests.support import until

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, speed=200.0)
    try:
        yield f
    finally:
        await f.stop()


async def set_faults(url: str, body: dict[str, object], server: str | None = None) -> httpx.Response:
    async with httpx.AsyncClient() as h:
        params = {"server": server} if server else None
        return await h.post(url + "/sim/faults", json=body, params=params)


async def test_fail_rate_answers_5xx_with_openai_error(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    assert (await set_faults(url, {"fail_rate": 1.0, "fail_status": 503})).status_code == 200
    async with httpx.AsyncClient(base_url=url) as h:
        r = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "injected_fault"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        await client.completions.create(model=MODEL, prompt="a", max_tokens=2)
    await client.close()
    await set_faults(url, {"fail_rate": 0.5, "fail_status": 500})
    statuses = []
    async with httpx.AsyncClient(base_url=url) as h:
        for _ in range(40):
            statuses.append((await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code)
    assert 5 <= statuses.count(500) <= 35 and statuses.count(200) + statuses.count(500) == 40
    assert fleet.servers[0].backend.requests_failed == 2 + statuses.count(500)


async def test_drop_after_chunks_cuts_the_stream(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    await set_faults(url, {"drop_after_chunks": 3})
    events: list[str] = []
    async with httpx.AsyncClient(base_url=url) as h:
        with pytest.raises(httpx.HTTPError):
            async with h.stream("POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 50, "stream": True, "ignore_eos": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
    assert len(events) == 3 and "[DONE]" not in events[-1]
    async with httpx.AsyncClient(base_url=url) as h:
        with pytest.raises(httpx.HTTPError):
            await h.post("/v1/completions", json={"prompt": "a b", "max_tokens": 50, "ignore_eos": True})
    assert fleet.servers[0].backend.requests_dropped == 2
    assert fleet.servers[0].backend.engine.num_running == 0  # the dropped requests were aborted


async def test_stall_freezes_generation_and_every_endpoint_until_it_ends(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    await set_faults(url, {"stall_ms": 60_000})
    async with httpx.AsyncClient(base_url=url) as h:
        gen = asyncio.ensure_future(h.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
        health = asyncio.ensure_future(h.get("/health"))
        done, _ = await asyncio.wait([gen, health], timeout=0.3)
        assert not done  # nothing answers while stalled
        other = await h.get(fleet.servers[1].url + "/health")  # the other server is not stalled
        assert other.status_code == 200
        await set_faults(url, {"stall_ms": 0})  # the control endpoint is exempt; 0 ends the stall
        assert (await gen).status_code == 200 and (await health).status_code == 200


async def test_metrics_slow_or_absent(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    await set_faults(url, {"metrics_delay_ms": 60_000})
    async with httpx.AsyncClient(base_url=url) as h:
        with pytest.raises(httpx.TimeoutException):
            await h.get("/metrics", timeout=0.3)
        await set_faults(url, {"metrics_delay_ms": 0, "metrics_absent": True})
        assert (await h.get("/metrics")).status_code == 404
        await set_faults(url, {"metrics_absent": False})
        assert (await h.get("/metrics")).status_code == 200


async def test_health_fail(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    async with httpx.AsyncClient(base_url=url) as h:
        assert (await h.get("/health")).status_code == 200
        await set_faults(url, {"health_fail": True})
        assert (await h.get("/health")).status_code == 503
        assert (await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200
        await set_faults(url, {"health_fail": False})
        assert (await h.get("/health")).status_code == 200


async def test_refuse_connections_and_recover(fleet: Fleet) -> None:
    s0, s1 = fleet.servers
    r = await set_faults(s0.url, {"refuse_connections": True})
    assert r.status_code == 200 and r.json()["refuse_connections"] is True
    async def refused() -> bool:  # the listener closes right after the reply
        try:
            async with httpx.AsyncClient() as h:
                await h.get(s0.url + "/health")
        except httpx.ConnectError:
            return True
        return False

    await until(refused, timeout=5, message="the listener stops accepting")
    # A sibling can address it while it refuses; turning the fault off reopens the same port.
    r = await set_faults(s1.url, {"refuse_connections": False}, server=s0.name)
    assert r.json()["refuse_connections"] is False
    async with httpx.AsyncClient() as h:
        assert (await h.get(s0.url + "/health")).status_code == 200


async def test_refuse_for_a_while_reopens_by_itself(fleet: Fleet) -> None:
    s0 = fleet.servers[0]
    await s0.set_faults({"refuse_connections": True, "refuse_ms": 150})
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as h:
            await h.get(s0.url + "/health")
    await until(lambda: not s0.backend.faults.refuse_connections, timeout=5, message="the refusal ends by itself")
    async with httpx.AsyncClient() as h:
        assert (await h.get(s0.url + "/health")).status_code == 200


async def test_keepalive_connection_is_reset_while_refusing(fleet: Fleet) -> None:
    s0 = fleet.servers[0]
    async with httpx.AsyncClient(base_url=s0.url) as h:
        assert (await h.get("/health")).status_code == 200  # opens a keep-alive connection
        await s0.set_faults({"refuse_connections": True})
        with pytest.raises(httpx.HTTPError):
            await h.get("/health")
    await s0.set_faults({"refuse_connections": False})


async def test_background_load_occupies_the_engine(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    await set_faults(url, {"background_requests": 5, "background_max_tokens": 64})
    backend = fleet.servers[0].backend
    async with httpx.AsyncClient(base_url=url) as h:
        load = (await h.get("/get_load")).json()[0]
        assert load["num_reqs"] == 5
        # The engine admits them on its next step; on a loaded CI box that can take longer than any fixed
        # sleep, so wait (bounded) for the first step that holds KV, then check the totals.
        for _ in range(200):
            stats = (await h.get("/sim/stats")).json()
            if stats["kv_usage"] > 0:
                break
            await asyncio.sleep(0.02)
        assert stats["running"] + stats["waiting"] == 5 and stats["kv_usage"] > 0
    assert backend.engine.stats.generation_tokens > 0
    await set_faults(url, {"background_requests": 0})
    assert backend.engine.num_running + backend.engine.num_waiting == 0


async def test_fault_updates_are_validated(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    for body in ({"fail_rat": 1}, {"fail_rate": 2}, {"fail_status": 404}, {"health_fail": "yes"}, {"drop_after_chunks": -1}):
        r = await set_faults(url, body)
        assert r.status_code == 400, body
    assert (await set_faults(url, {"x": 1}, server="nope")).status_code == 400
    async with httpx.AsyncClient() as h:
        faults = (await h.get(url + "/sim/faults")).json()
    assert faults["fail_rate"] == 0.0 and faults["drop_after_chunks"] is None


async def test_faults_given_at_start_apply_to_every_server() -> None:
    fleet = await start_fleet(2, speed=200.0, faults={"health_fail": True})
    try:
        async with httpx.AsyncClient() as h:
            for s in fleet.servers:
                assert (await h.get(s.url + "/health")).status_code == 503
    finally:
        await fleet.stop()


async def test_grpc_port_follows_health_and_refuse_faults() -> None:
    from grpclib.client import Channel
    from grpclib.exceptions import StreamTerminatedError
    from grpclib.health.v1.health_grpc import HealthStub
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

    fleet = await start_fleet(1, speed=200.0, grpc_port=0)
    try:
        s = fleet.servers[0]
        assert s.grpc_port is not None

        async def status() -> int:
            channel = Channel("127.0.0.1", s.grpc_port)
            try:
                return (await HealthStub(channel).Check(HealthCheckRequest(), timeout=5)).status
            finally:
                channel.close()

        assert await status() == HealthCheckResponse.SERVING
        await set_faults(s.url, {"health_fail": True})
        async def not_serving() -> bool:
            return await status() == HealthCheckResponse.NOT_SERVING

        await until(not_serving, timeout=5, message="gRPC health says NOT_SERVING")
        await s.set_faults({"health_fail": False, "refuse_connections": True})
        with pytest.raises((ConnectionError, OSError, StreamTerminatedError)):
            await status()
        await s.set_faults({"refuse_connections": False})
        assert await status() == HealthCheckResponse.SERVING
    finally:
        await fleet.stop()


async def test_an_engine_failure_fails_requests_instead_of_hanging_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = await start_fleet(1, speed=200.0)
    try:
        engine = fleet.servers[0].backend.engine

        def broken_step(now: float) -> None:
            raise RuntimeError("model bug")

        monkeypatch.setattr(engine, "step", broken_step)
        async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
            r = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=10)
        assert r.status_code == 500 and "model bug" in r.json()["error"]["message"]
        assert engine.num_running + engine.num_waiting == 0
    finally:
        await fleet.stop()
