"""LoRA end to end: adapters declared in YAML or discovered from the engine's /v1/models, in every summary
(HTTP/1.1, HTTP/2 bridge, gRPC), and a request for one reaches a backend that has it loaded."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.control.poller import adapters_from_models
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from tests.grpc import stubs
from tests.routing.conftest import ProxyFactory, grpc_address, proxy_text
from tests.support import until


def _prompt(i: int) -> str:
    return f"select the rows of table {i} where column {i * 13} is larger than {i}"


async def test_openai_client_asking_for_a_declared_adapter_reaches_the_backend_that_has_it(
        fleet: Fleet, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backend_extra={"sim-2": ", adapters: [sql-lora]"})
    seen: set[str] = set()
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        for i in range(20):
            raw = await c.chat.completions.with_raw_response.create(
                model="sql-lora", max_tokens=2, messages=[{"role": "user", "content": _prompt(i)}])
            seen.add(raw.headers["x-affinity-backend"])
            assert raw.parse().model == "sql-lora"
    async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{grpc_address(proxy)}", timeout=10) as c2:
        for i in range(5):
            resp = await c2.post("/v1/completions", json={"model": "sql-lora", "prompt": _prompt(i), "max_tokens": 1})
            assert resp.status_code == 200, resp.text
            seen.add(resp.headers["x-affinity-backend"])
    async with grpc.aio.insecure_channel(grpc_address(proxy)) as ch:
        generate = stubs.generate(ch)
        for i in range(5):
            seen.add((await generate(gen.GenerateRequest(model="sql-lora", prompt=_prompt(i), max_tokens=1))).backend)
    assert seen == {"sim-2"}
    assert "sql-lora" in fleet.servers[2].backend.engine.loaded_adapters
    # the base model still spreads over the whole fleet
    spread = set()
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        for i in range(20):
            raw = await c.completions.with_raw_response.create(
                model=fleet.servers[0].backend.engine.model_name, max_tokens=1, prompt=_prompt(i))
            spread.add(raw.headers["x-affinity-backend"])
    assert len(spread) >= 3


@pytest.fixture
async def bare_fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(3, speed=200.0)  # no adapter anywhere until one is loaded at run time
    yield f
    await f.stop()


async def test_an_adapter_loaded_at_run_time_is_discovered_and_routed_to(bare_fleet: Fleet) -> None:
    target = bare_fleet.servers[1]
    async with httpx.AsyncClient(timeout=10) as c:
        resp = await c.post(target.url + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/a"})
        assert resp.status_code == 200, resp.text
        models = (await c.get(target.url + "/v1/models")).text
    assert adapters_from_models(models) == {"sql-lora"}
    text = proxy_text(bare_fleet).replace("telemetry: {enabled: false}", "telemetry: {interval_ms: 50, timeout_ms: 40}")
    text = text.replace(", grpc: 'None'", "")
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    try:
        await until(lambda: "sql-lora" in proxy.router.adapter_names(), timeout=10, message="adapter discovered")
        async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
            for i in range(10):
                raw = await c.completions.with_raw_response.create(model="sql-lora", max_tokens=1, prompt=_prompt(i))
                assert raw.headers["x-affinity-backend"] == target.name
    finally:
        await proxy.stop()


async def test_the_simulator_refuses_adapters_beyond_its_slots(bare_fleet: Fleet) -> None:
    s = bare_fleet.servers[0]
    slots = s.backend.profile.max_loras
    async with httpx.AsyncClient(base_url=s.url, timeout=10) as c:
        for i in range(slots):
            assert (await c.post("/v1/load_lora_adapter", json={"lora_name": f"a{i}", "lora_path": "/x"})).status_code == 200
        refused = await c.post("/v1/load_lora_adapter", json={"lora_name": "one-too-many", "lora_path": "/x"})
        assert refused.status_code == 400 and "slots" in refused.json()["error"]["message"]
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})).status_code == 200
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})).status_code == 404
        assert (await c.post("/v1/load_lora_adapter", json={"lora_name": "one-too-many", "lora_path": "/x"})).status_code == 200
    assert len(s.backend.engine.known_adapters) == slots
