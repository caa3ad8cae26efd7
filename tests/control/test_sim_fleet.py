"""Telemetry end to end against the simulator, every flavor: load shows in the score and in routing within
two rounds; a backend whose /metrics stops is marked stale (score unknown), never idle."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import aiohttp
import pytest

from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.snapshot import Snapshot

FLAVORS = ("vllm", "sglang", "tgi", "triton")
INTERVAL_MS = 100


async def wait_for(proxy: AffinityProxy, ok: Callable[[Snapshot], bool], *, safety_s: float = 20.0) -> Snapshot:
    """Until a published snapshot satisfies `ok`. The timeout is a hang guard, not what the test checks."""
    hit = asyncio.Event()
    proxy.store.subscribe(lambda snap: hit.set() if ok(snap) else None)
    if not ok(proxy.store.current):
        await asyncio.wait_for(hit.wait(), timeout=safety_s)
    return proxy.store.current


@pytest.fixture(params=FLAVORS)
async def fleet_and_proxy(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Fleet, AffinityProxy]]:
    fleet = await start_fleet(2, flavor=request.param, speed=20.0, seed=7)
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    config = parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\nhealth_checks: {enabled: false}\n"
        f"routing: {{policy: least_load}}\ntelemetry: {{interval_ms: {INTERVAL_MS}, timeout_ms: 80}}\n"
        f"backends:\n{lines}\n"
    )
    proxy = AffinityProxy(config)
    await proxy.start()
    try:
        yield fleet, proxy
    finally:
        await proxy.stop()
        await fleet.stop()


def fresh(snap: Snapshot) -> bool:
    return all(b.signals is not None and not b.stale and b.load_score is not None for b in snap.backends)


async def test_load_change_reaches_score_and_routing_within_two_rounds(
    fleet_and_proxy: tuple[Fleet, AffinityProxy],
) -> None:
    fleet, proxy = fleet_and_proxy
    assert proxy.telemetry is not None
    snap = await wait_for(proxy, fresh)
    flavor_engine = snap.backends[0].signals.engine  # type: ignore[union-attr]
    assert flavor_engine in FLAVORS
    idle = snap.get("sim-1").load_score
    assert idle is not None

    poller = proxy.telemetry
    await fleet.servers[1].set_faults({"background_requests": 64})
    rounds_at_change = poller.rounds  # rounds published so far; one may be in flight, its scrape done already
    seen_in_round: list[int] = []

    def loaded(s: Snapshot) -> bool:
        if (s.get("sim-1").load_score or 0) > idle + 0.1:
            seen_in_round.append(poller.rounds)  # the number of the round being published
            return True
        return False

    snap = await wait_for(proxy, loaded)
    assert seen_in_round[0] - rounds_at_change <= 2  # "within two intervals", counted in rounds, not seconds
    b1 = snap.get("sim-1")
    assert b1.signals is not None and (b1.signals.kernel_queue or 0) >= 64
    assert (b1.load_score or 0) > (snap.get("sim-0").load_score or 0)

    # routing follows the score: least_load sends new work to the idle GPU
    served: list[str] = []
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            body = {"model": fleet.servers[0].backend.engine.model_name, "prompt": f"hello {i}", "max_tokens": 4}
            async with session.post(proxy.http_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                served.append(resp.headers["x-affinity-backend"])
    assert served == ["sim-0"] * 6


async def test_stopped_metrics_mark_the_backend_stale_not_idle(fleet_and_proxy: tuple[Fleet, AffinityProxy]) -> None:
    fleet, proxy = fleet_and_proxy
    await fleet.servers[1].set_faults({"background_requests": 32})
    snap = await wait_for(proxy, lambda s: fresh(s) and (s.get("sim-1").signals.kernel_queue or 0) >= 32)  # type: ignore[union-attr]
    await fleet.servers[1].set_faults({"metrics_absent": True})
    snap = await wait_for(proxy, lambda s: s.get("sim-1").stale)
    b1 = snap.get("sim-1")
    assert b1.load_score is None
    assert b1.signals is not None and (b1.signals.kernel_queue or 0) >= 32  # last known values, not zeros
    assert not snap.get("sim-0").stale
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.admin_url + "/admin/backends") as resp:
            view = {b["name"]: b for b in (await resp.json())["backends"]}
        async with session.get(proxy.admin_url + "/metrics") as resp:
            text = await resp.text()
    assert view["sim-1"]["stale"] is True and view["sim-1"]["load_score"] is None
    assert view["sim-1"]["metrics_age_s"] > 0
    assert 'affinity_proxy_backend_metrics_stale{backend="sim-1"} 1.0' in text
    assert 'affinity_proxy_telemetry_scrape_errors_total{backend="sim-1",kind="http_4xx"}' in text
    # and back: the endpoint returns, the backend is fresh again
    await fleet.servers[1].set_faults({"metrics_absent": False})
    await wait_for(proxy, lambda s: not s.get("sim-1").stale)


async def test_orca_reports_reach_the_snapshot(fleet_and_proxy: tuple[Fleet, AffinityProxy]) -> None:
    fleet, proxy = fleet_and_proxy
    assert proxy.telemetry is not None
    await wait_for(proxy, fresh)
    before = proxy.telemetry_metrics.orca_reports._value.get()
    async with aiohttp.ClientSession() as session:
        body = {"model": fleet.servers[0].backend.engine.model_name, "prompt": "hi", "max_tokens": 2}
        async with session.post(proxy.http_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            # The proxy asked for the report, so it is the proxy's: consumed, never leaked to the client.
            assert "endpoint-load-metrics" not in resp.headers
    assert proxy.telemetry_metrics.orca_reports._value.get() == before + 1
