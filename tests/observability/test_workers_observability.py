"""`affinity-proxy run --workers 2`: every worker writes the access log (whole lines, never interleaved), the
workers' closed windows travel to the supervisor, whose aggregator serves /admin/hotspots and /dashboard
for the whole host, and application logs are JSON lines naming their worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from tests.deploy.procs import AFFINITY_PROXY, start_proxy
from tests.support import FakeBackend, until


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeBackend]]:
    started = [FakeBackend(f"gpu-{i}") for i in range(2)]
    for f in started:
        await f.start()
    yield started
    for f in started:
        await f.stop()


async def test_workers_log_every_request_and_the_supervisor_merges_their_windows(
        tmp_path: Path, fakes: list[FakeBackend]) -> None:
    log_path = tmp_path / "access.log"
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in fakes)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        f"logging: {{format: json, access_log: {{path: '{log_path}', flush_interval_s: 0.2}}}}\n"
        "hotspots: {window_s: 1}\nrouting: {policy: round_robin}\n"
        f"timeouts: {{drain_s: 10}}\nbackends:\n{lines}\n")
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    n = 300
    try:
        assert len(proxy.workers()) == 2
        # A fresh connection per request, so the kernel spreads them over both workers.
        async def one(i: int) -> None:
            async with aiohttp.ClientSession() as s:
                async with s.post(proxy.http + "/v1/completions",
                                  json={"model": "fake-model", "prompt": f"p{i}", "max_tokens": 2}) as r:
                    assert r.status == 200
                    await r.read()
        for start in range(0, n, 20):
            await asyncio.gather(*(one(i) for i in range(start, start + 20)))

        async with aiohttp.ClientSession() as s:
            async def host_wide() -> dict | None:
                async with s.get(proxy.admin + "/dashboard/data") as r:
                    data = await r.json()
                counts = data["heatmap"]["metrics"]["requests"]
                total = sum(c or 0 for row in counts for c in row)
                return data if total >= n else None
            data = await until(host_wide, timeout=20, interval=0.3)
            assert set(data["heatmap"]["backends"]) == {"gpu-0", "gpu-1"}
            async with s.get(proxy.admin + "/admin/hotspots") as r:
                assert r.status == 200
                hot = await r.json()
            assert hot["window_s"] == 1 and set(hot["backends"]) <= {"gpu-0", "gpu-1"}
            async with s.get(proxy.admin + "/dashboard") as r:
                assert r.status == 200 and "<html" in (await r.text()).lower()
        records = await until(lambda: (lambda got: got if len(got) >= n else None)(
            [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []),
            timeout=10)
    finally:
        assert await proxy.terminate() == 0
    assert len(records) == n and len({r["request_id"] for r in records}) == n  # every line whole, none lost
    assert {r["backend"] for r in records} == {"gpu-0", "gpu-1"} and {r["status"] for r in records} == {200}
    app_lines = [json.loads(line) for line in proxy.log if line.startswith("{")]
    assert app_lines and all({"time", "level", "logger", "message"} <= set(e) for e in app_lines)
    assert {e.get("worker") for e in app_lines if "worker" in e} == {0, 1}
