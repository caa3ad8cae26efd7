"""The proxy's /metrics as Prometheus itself sees it: `promtool check metrics`, and a real scrape.

Both need Debian's `prometheus` package (`apt-get install -y prometheus`) and skip cleanly without it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.support import free_port, until


@pytest.fixture
async def running() -> AsyncIterator[tuple[Fleet, AffinityProxy]]:
    fleet = await start_fleet(3, flavor=["vllm", "sglang", "triton"], speed=20.0)
    await fleet.servers[2].set_faults({"metrics_absent": True})  # one stale backend in the exposition
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\nhealth_checks: {enabled: false}\n"
        "telemetry: {interval_ms: 100, timeout_ms: 80}\n"
        f"routing: {{policy: least_load}}\nbackends:\n{lines}\n"
    ))
    await proxy.start()
    try:
        yield fleet, proxy
    finally:
        await proxy.stop()
        await fleet.stop()


async def _exposition(fleet: Fleet, proxy: AffinityProxy) -> str:
    hit = asyncio.Event()
    proxy.store.subscribe(lambda s: hit.set() if s.get("sim-2").stale and not s.get("sim-0").stale else None)
    await asyncio.wait_for(hit.wait(), timeout=20)
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            body = {"model": fleet.servers[0].backend.engine.model_name, "prompt": f"hi {i}", "max_tokens": 3}
            async with s.post(proxy.http_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        async with s.get(proxy.admin_url + "/metrics") as resp:
            return await resp.text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
async def test_promtool_check_metrics_passes(running: tuple[Fleet, AffinityProxy]) -> None:
    text = await _exposition(*running)
    for series in ("affinity_proxy_backend_load_score", "affinity_proxy_backend_metrics_age_seconds",
                   "affinity_proxy_backend_metrics_stale", "affinity_proxy_telemetry_scrape_duration_seconds",
                   "affinity_proxy_telemetry_scrape_errors_total", "affinity_proxy_backend_weight",
                   "affinity_proxy_backend_health"):
        assert series in text, series
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr  # no lint findings




@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (apt-get install prometheus)")
async def test_a_real_prometheus_scrapes_the_proxy(running: tuple[Fleet, AffinityProxy], tmp_path: Path) -> None:
    fleet, proxy = running
    await _exposition(fleet, proxy)
    admin = proxy.admin_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: affinity-proxy\n    static_configs: [{{targets: ['{admin}']}}]\n"
    )
    port = free_port()
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    query = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        async with aiohttp.ClientSession() as s:
            async def scraped() -> dict[str, list[dict[str, object]]] | None:
                """Every query's result once Prometheus has scraped the proxy, else None."""
                results = {}
                try:
                    for q in ("up", "affinity_proxy_backend_metrics_stale", "affinity_proxy_backend_load_score"):
                        async with s.get(query, params={"query": q}) as resp:
                            results[q] = json.loads(await resp.text())["data"]["result"]
                except (aiohttp.ClientError, KeyError, ValueError):
                    return None
                return results if results["up"] and all(results.values()) else None

            results = await until(scraped, timeout=30, interval=0.1, message="Prometheus has scraped the proxy")
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    assert results["up"][0]["value"][1] == "1"  # type: ignore[index]
    stale = {r["metric"]["backend"]: r["value"][1] for r in results["affinity_proxy_backend_metrics_stale"]}  # type: ignore[index]
    assert stale == {"sim-0": "0", "sim-1": "0", "sim-2": "1"}
    scored = {r["metric"]["backend"] for r in results["affinity_proxy_backend_load_score"]}  # type: ignore[index]
    assert scored == {"sim-0", "sim-1"}  # the stale one has no score, not a zero
