"""The LoRA adapter pool under `affinity-proxy run --workers 2` (a real process tree): the supervisor runs the
one pool, fed by the adapter demand every worker reports over its channel; its loads reach the workers as
snapshots, so a burst for an adapter loaded on one backend spreads onto the backends it is loaded on."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import httpx
import pytest

from sim.fleet import Fleet, start_fleet
from tests.deploy.procs import AFFINITY_PROXY, start_proxy
from tests.support import until

SLOTS = 2


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, speed=200.0)
    yield f
    await f.stop()


def _config(fleet: Fleet) -> str:
    lines = []
    for s in fleet.servers:
        pinned = ", adapters: [sql-lora]" if s.name == "sim-0" else ""
        lines.append(f"  - {{name: {s.name}, url: '{s.url}'{pinned}}}")
    return ("listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nrouting: {policy: affinity}\n"
            "timeouts: {drain_s: 5}\n"
            f"lora_pool: {{enabled: true, interval_s: 0.2, idle_ttl_s: 2, target_rps_per_backend: 20,"
            f" slots_per_backend: {SLOTS}, adapters: {{sql-lora: /models/sql}}}}\n"
            "backends:\n" + "\n".join(lines) + "\n")


async def test_the_supervisor_runs_one_pool_on_every_workers_demand(tmp_path: Path, fleet: Fleet) -> None:
    engines = {s.name: s.backend.engine for s in fleet.servers}
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(fleet.servers[0].url + "/v1/load_lora_adapter",
                         json={"lora_name": "sql-lora", "lora_path": "/models/sql"})
        assert r.status_code == 200
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fleet))
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        assert len(proxy.workers()) == 2
        seen: Counter[str] = Counter()
        # A new connection per request: the kernel spreads them over both workers' listening sockets.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async def ask(i: int) -> None:
                async with s.post(proxy.http + "/v1/completions", json={
                        "model": "sql-lora", "prompt": f"select {i} from t{i % 7}", "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()
                    seen[resp.headers["x-affinity-backend"]] += 1

            for wave in range(40):  # ~150 requests/s for 2-3 s, well over target_rps_per_backend
                await asyncio.gather(*(ask(wave * 10 + j) for j in range(10)))
                await asyncio.sleep(0.02)
        holders = {n for n, e in engines.items() if "sql-lora" in e.known_adapters}
        assert len(holders) >= 2, holders  # the pool loaded it on more backends
        assert set(seen) - {"sim-0"} and set(seen) <= holders | {"sim-0"}, seen  # both workers route onto them
        assert max(len(e.known_adapters) for e in engines.values()) <= SLOTS
        # Idle past its TTL: unloaded everywhere but where the configuration pins it.
        await until(lambda: {n for n, e in engines.items() if "sql-lora" in e.known_adapters} == {"sim-0"},
                    timeout=15, message="idle adapter unloaded by the supervisor's pool")
        async with aiohttp.ClientSession() as s, s.get(proxy.admin + "/metrics") as resp:
            text = await resp.text()
        loads = [line for line in text.splitlines()
                 if line.startswith("affinity_proxy_lora_pool_actions_total{") and 'action="load"' in line
                 and 'result="ok"' in line]
        assert loads, "the pool's loads are counted on the supervisor's /metrics"
    finally:
        await proxy.terminate()
