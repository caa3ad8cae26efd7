"""Hot spots found by the real proxy in front of the simulator, with 1 s windows so the test stays short.

Steady load goes round-robin over three simulated servers. Then sim-1 and sim-2 are slowed down by stall
faults (POST /sim/faults {"stall_ms": ...}, repeated) and sim-2 also answers 20% of its requests with a 5xx:
both become latency hot spots no earlier than their third slow window, only sim-2 is marked as spreading an
anomaly, and both clear once they recover. A healthy fleet under the same load marks nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.observability.simload import Load, slowed
from tests.support import until

WINDOW_S = 1.0
HOTSPOTS = ("hotspots: {window_s: 1, windows: 3, clear_windows: 2, baseline_windows: 10, min_baseline_windows: 3,"
            " min_requests: 3, min_p99_s: 0.15}\n")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(3, speed=50.0)
    yield f
    await f.stop()


@pytest.fixture
async def proxy(fleet: Fleet) -> AsyncIterator[AffinityProxy]:
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    p = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        "outlier_detection: {enabled: false}\nretries: {enabled: false}\nlogging: {access_log: {enabled: false}}\n"
        f"{HOTSPOTS}routing: {{policy: round_robin}}\nbackends:\n{backends}\n", "<test>"))
    await p.start()
    yield p
    await p.stop()


def state(proxy: AffinityProxy, name: str) -> dict[str, Any]:
    return proxy.observer.hotspots()["backends"].get(name, {})


def window_now() -> int:
    return int(time.time() // WINDOW_S)


async def test_a_stalled_backend_is_a_hot_spot_and_one_with_5xx_is_spreading(fleet: Fleet, proxy: AffinityProxy) -> None:
    model = fleet.servers[0].backend.engine.model_name
    async with Load(proxy, model) as load:
        # A baseline for every backend first (min_baseline_windows: 3 normal windows).
        await until(lambda: all(state(proxy, s.name).get("baseline_windows", 0) >= 3 for s in fleet.servers),
                    timeout=30, interval=0.2)
        sim2 = fleet.by_name("sim-2")
        assert sim2 is not None
        first_slow = window_now()  # the slowdown starts in this window (partly slow already)
        # A 0.9 s stall renewed every 0.95 s: a hot spot is p99 over 3x the baseline, and on a loaded 2-core
        # machine (CI, 2026-12-07) the baseline p99 reached ~0.17 s, so a 0.4 s stall's first windows went
        # into the baseline instead (then 0.51 s against 0.51 s). This one stands out of a 0.3 s baseline.
        async with slowed(fleet, ("sim-1", "sim-2"), stall_ms=900.0, every_s=0.95):
            # The 5xx start once sim-2 is a hot spot. Started with the stall, they went into sim-2's
            # baseline whenever a window was not yet over the latency threshold: on a loaded 2-core machine
            # (CI, 2026-12-07) ten such windows made the baseline 9.8% errors, so 10.5% was no anomaly.
            await until(lambda: state(proxy, "sim-2").get("latency_hot_spot"), timeout=30, interval=0.2,
                        message=lambda: f"sim-2 a hot spot; sim-2: {state(proxy, 'sim-2')}")
            assert state(proxy, "sim-2")["baseline_error_rate"] == 0.0
            await sim2.set_faults({"fail_rate": 0.2, "fail_status": 500})
            # A timeout was seen once in CI (2026-12-07), not reproduced (idle, or under three busy loops:
            # baseline p99 6-30 ms, stalled p99 ~0.5 s, both marked within 3 s): it says what the detector saw.
            await until(lambda: state(proxy, "sim-1").get("latency_hot_spot")
                        and state(proxy, "sim-2").get("spreading_anomaly"), timeout=30, interval=0.2,
                        message=lambda: (f"sim-1 a hot spot and sim-2 spreading; sim-1: {state(proxy, 'sim-1')}; "
                                         f"sim-2: {state(proxy, 'sim-2')}; statuses so far: {load.statuses}"))
            async with aiohttp.ClientSession() as s:
                async with s.get(proxy.admin_url + "/admin/hotspots") as r:
                    hot = await r.json()
                async with s.get(proxy.admin_url + "/dashboard/data") as r:
                    page = await r.json()
                async with s.get(proxy.admin_url + "/metrics") as r:
                    metrics = await r.text()
        await sim2.set_faults({"fail_rate": 0.0})
        assert hot["backends"]["sim-1"]["latency_hot_spot"] and not hot["backends"]["sim-1"]["spreading_anomaly"]
        assert hot["backends"]["sim-2"]["latency_hot_spot"] and hot["backends"]["sim-2"]["spreading_anomaly"]
        assert not hot["backends"]["sim-0"]["latency_hot_spot"]
        entered = {(e["backend"], e["state"]): e["window"] for e in hot["events"] if e["entered"]}
        # "for 3 consecutive windows": the earliest it can enter is the third slowed window.
        assert entered[("sim-1", "latency_hot_spot")] >= first_slow + 2
        assert entered[("sim-2", "latency_hot_spot")] >= first_slow + 2
        assert not any(b == "sim-0" for b, _ in entered) and ("sim-1", "spreading_anomaly") not in entered
        assert 'affinity_proxy_backend_hotspot{backend="sim-1",state="latency_hot_spot"} 1.0' in metrics
        assert 'affinity_proxy_backend_hotspot{backend="sim-0",state="latency_hot_spot"} 0.0' in metrics
        marks = dict(zip(page["heatmap"]["backends"], page["heatmap"]["marks"]))
        # sim-0 is healthy: never a hot spot or spreading (a passing "over threshold" streak mark from one
        # slow window on a loaded 2-core machine is not a state, and CI showed one once).
        assert "spreading" in marks["sim-2"] and "hot" in marks["sim-1"]
        assert not {"hot", "spreading"} & set(marks["sim-0"]), marks["sim-0"]
        # Recovered: both clear (clear_windows: 2 normal windows in a row).
        await until(lambda: not state(proxy, "sim-1")["latency_hot_spot"]
                    and not state(proxy, "sim-2")["latency_hot_spot"], timeout=30, interval=0.2)
        assert not state(proxy, "sim-2")["spreading_anomaly"]
        left = {(e.backend, e.state) for e in proxy.observer.events if not e.entered}
        assert {("sim-1", "latency_hot_spot"), ("sim-2", "latency_hot_spot"),
                ("sim-2", "spreading_anomaly")} <= left
    assert load.statuses.get(200, 0) > 100 and load.statuses.get(500, 0) > 0


async def test_a_healthy_fleet_marks_nothing_under_steady_load(fleet: Fleet, proxy: AffinityProxy) -> None:
    model = fleet.servers[0].backend.engine.model_name
    async with Load(proxy, model, clients=12) as load:
        start = window_now()
        await until(lambda: window_now() >= start + 10, timeout=30, interval=0.2)
    judged = proxy.observer.hotspots()
    assert set(judged["backends"]) == {s.name for s in fleet.servers}
    assert all(b["baseline_windows"] >= 3 for b in judged["backends"].values())
    assert list(proxy.observer.events) == []
    assert not any(b["latency_hot_spot"] or b["spreading_anomaly"] for b in judged["backends"].values())
    assert set(load.statuses) == {200}
