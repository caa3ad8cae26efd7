"""The LoRA adapter pool, through the proxy against the simulator's runtime LoRA API: a burst for an adapter
loaded on one backend loads it on another and routing spreads onto it; idle adapters are unloaded after
their TTL; no backend ever holds more adapters than its slots."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import AsyncIterator

import aiohttp
import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.support import until

SLOTS = 2


@pytest.fixture
async def bare_fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, speed=200.0)
    yield f
    await f.stop()


def _text(fleet: Fleet, slots: int = SLOTS) -> str:
    lines = []
    for s in fleet.servers:
        pinned = ", adapters: [sql-lora]" if s.name == "sim-0" else ""
        lines.append(f"  - {{name: {s.name}, url: '{s.url}'{pinned}}}")
    return ("listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nrouting: {policy: affinity}\n"
            f"lora_pool: {{enabled: true, interval_s: 0.2, idle_ttl_s: 1.5, target_rps_per_backend: 20,"
            f" slots_per_backend: {slots}, adapters: {{sql-lora: /models/sql, chat-lora: /models/chat}}}}\n"
            "backends:\n" + "\n".join(lines) + "\n")


async def _actions(proxy: AffinityProxy) -> Counter[str]:
    out: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s, s.get(proxy.admin_url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("affinity_proxy_lora_pool_actions_total{"):
                labels, value = line.rsplit(" ", 1)
                action = labels.split('action="', 1)[1].split('"', 1)[0]
                result = labels.split('result="', 1)[1].split('"', 1)[0]
                out[f"{action}:{result}"] += int(float(value))
    return out


async def test_the_pool_loads_hot_adapters_spreads_them_and_unloads_idle_ones(bare_fleet: Fleet) -> None:
    engines = {s.name: s.backend.engine for s in bare_fleet.servers}
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(bare_fleet.servers[0].url + "/v1/load_lora_adapter",
                         json={"lora_name": "sql-lora", "lora_path": "/models/sql"})
        assert r.status_code == 200
    proxy = AffinityProxy(parse_config(_text(bare_fleet)))
    await proxy.start()
    most = 0
    sampling = True

    async def sample() -> None:
        nonlocal most
        while sampling:
            most = max(most, *(len(e.known_adapters) for e in engines.values()))
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        seen: Counter[str] = Counter()
        async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as client:
            async def ask(i: int) -> None:
                raw = await client.completions.with_raw_response.create(
                    model="sql-lora", max_tokens=1, prompt=f"select {i} from t{i % 7}")
                seen[raw.headers["x-affinity-backend"]] += 1

            # A burst well over target_rps_per_backend (20/s): ~200 requests/s for 2 s.
            for wave in range(40):
                await asyncio.gather(*(ask(wave * 10 + j) for j in range(10)))
                await asyncio.sleep(0.05)
        holders = {n for n, e in engines.items() if "sql-lora" in e.known_adapters}
        assert len(holders) >= 2, holders
        assert set(seen) - {"sim-0"}, seen  # routing spread onto the backends the pool loaded it on
        assert set(seen) <= holders | {"sim-0"}
        assert (await _actions(proxy))["load:ok"] >= 1
        # Idle past its TTL: unloaded everywhere but where the configuration pins it (sim-0).
        await until(lambda: {n for n, e in engines.items() if "sql-lora" in e.known_adapters} == {"sim-0"},
                    timeout=10, message="idle adapter unloaded")
        assert (await _actions(proxy))["unload:ok"] >= 1
        assert "sql-lora" in proxy.router.adapter_names()
        assert {b.name for b in proxy.store.current.backends if "sql-lora" in b.adapters} == {"sim-0"}
    finally:
        sampling = False
        await sampler
        await proxy.stop()
    assert most <= SLOTS


async def test_a_cold_catalog_adapter_is_loaded_on_first_demand(bare_fleet: Fleet) -> None:
    proxy = AffinityProxy(parse_config(_text(bare_fleet)))
    await proxy.start()
    try:
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
            body = {"model": "chat-lora", "prompt": "hello", "max_tokens": 1}
            first = await c.post("/v1/completions", json=body)
            assert first.status_code == 404  # loaded nowhere yet: the engine's own answer

            async def served() -> bool:
                return (await c.post("/v1/completions", json=body)).status_code == 200
            await until(served, timeout=10, message="chat-lora loaded by the pool")
    finally:
        await proxy.stop()


async def test_slot_limits_hold_when_two_hot_adapters_compete(bare_fleet: Fleet) -> None:
    engines = [s.backend.engine for s in bare_fleet.servers]
    async with httpx.AsyncClient(timeout=10) as c:
        await c.post(bare_fleet.servers[0].url + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/m"})
    proxy = AffinityProxy(parse_config(_text(bare_fleet, slots=1)))
    await proxy.start()
    most = 0
    try:
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
            for wave in range(30):
                await asyncio.gather(*(c.post("/v1/completions", json={
                    "model": ("sql-lora", "chat-lora")[j % 2], "prompt": f"q {wave} {j}", "max_tokens": 1})
                    for j in range(10)))
                most = max(most, *(len(e.known_adapters) for e in engines))
                await asyncio.sleep(0.05)
        assert most == 1  # one slot each: never two adapters on one engine
        assert any("chat-lora" in e.known_adapters for e in engines)  # the second adapter found a free backend
        assert "chat-lora" not in engines[0].known_adapters  # sim-0's slot is sql-lora's (pinned)
    finally:
        await proxy.stop()
