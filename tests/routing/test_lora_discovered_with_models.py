"""A backend whose `models` list names only its base model still serves the LoRA adapters discovered on it
(the engine's /v1/models lists them with a `parent`): a request for one is routed there, not refused as an
unknown model."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.support import until


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(3, speed=200.0)
    yield f
    await f.stop()


async def test_a_discovered_adapter_is_served_by_a_backend_restricted_to_its_base_model(fleet: Fleet) -> None:
    target = fleet.servers[2]
    base = target.backend.engine.model_name
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(target.url + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/a"})
        assert r.status_code == 200
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}', models: ['{base}']}}" for s in fleet.servers)
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\n"
        "telemetry: {interval_ms: 50, timeout_ms: 40}\nhealth_checks: {enabled: false}\n"
        f"routing: {{policy: affinity}}\nbackends:\n{lines}\n"))
    await proxy.start()
    try:
        await until(lambda: "sql-lora" in proxy.router.adapter_names(), timeout=10, message="adapter discovered")
        async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
            for i in range(8):
                raw = await c.completions.with_raw_response.create(model="sql-lora", max_tokens=1, prompt=f"q {i}")
                assert raw.headers["x-affinity-backend"] == target.name
            with pytest.raises(openai.NotFoundError):  # a name nobody serves is still the proxy's 404
                await c.completions.create(model="no-such-lora", max_tokens=1, prompt="x")
    finally:
        await proxy.stop()
