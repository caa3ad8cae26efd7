"""hotspots.lower_weight_to: a latency hot spot's routing weight is lowered until it clears (off by default)."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from proxy.app import AffinityProxy
from proxy.config import ConfigError, parse_config
from proxy.control.store import SnapshotStore
from proxy.core.hotspots import LATENCY_HOT_SPOT, SPREADING_ANOMALY, HotspotEvent
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.observability.demote import HotspotWeights
from sim.fleet import Fleet, start_fleet
from tests.observability.simload import Load, slowed
from tests.support import until


def event(name: str, entered: bool, state: str = LATENCY_HOT_SPOT) -> HotspotEvent:
    return HotspotEvent(name, state, entered, 7, 0.9, 0.1, 0.0, 0.0)


def store() -> SnapshotStore:
    return SnapshotStore(Snapshot.initial([BackendSpec(name="a", url="http://127.0.0.1:9", weight=2.0),
                                           BackendSpec(name="b", url="http://127.0.0.1:10")]))


def test_a_hot_spot_routes_less_until_it_clears_and_gets_its_weight_back() -> None:
    s = store()
    w = HotspotWeights(s, 0.25)
    w.on_event(event("a", True))
    assert s.current.get("a").effective_weight == 0.5 and s.current.get("b").weight is None
    w.on_event(event("a", True, SPREADING_ANOMALY))  # spreading changes nothing more
    w.on_event(event("a", True))  # already lowered: not lowered twice
    assert s.current.get("a").effective_weight == 0.5
    w.on_event(event("a", False))
    assert s.current.get("a").weight is None and s.current.get("a").effective_weight == 2.0


def test_an_operators_weight_change_during_the_hot_spot_wins() -> None:
    s = store()
    w = HotspotWeights(s, 0.5)
    w.on_event(event("b", True))
    s.update(lambda snap: snap.replace_backend("b", weight=3.0))  # POST /admin/backends/b/weight
    w.on_event(event("b", False))
    assert s.current.get("b").weight == 3.0
    w.on_event(event("gone", True))  # a backend no longer in the fleet: ignored
    assert "gone" not in s.current


def test_config_bounds() -> None:
    base = "backends: [{name: b0, url: 'http://127.0.0.1:9'}]\n"
    assert parse_config(base).hotspots.lower_weight_to is None
    assert parse_config(base + "hotspots: {lower_weight_to: 0.2}\n").hotspots.lower_weight_to == 0.2
    with pytest.raises(ConfigError, match="hotspots.lower_weight_to"):
        parse_config(base + "hotspots: {lower_weight_to: 1.5}\n")
    with pytest.raises(ConfigError, match="hotspots.lower_weight_to"):
        parse_config(base + "hotspots: {lower_weight_to: 0}\n")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, speed=50.0)
    yield f
    await f.stop()


async def test_through_the_proxy_a_stalled_backend_is_weighted_down_then_restored(fleet: Fleet) -> None:
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        "outlier_detection: {enabled: false}\nretries: {enabled: false}\nlogging: {access_log: {enabled: false}}\n"
        "hotspots: {window_s: 1, windows: 3, clear_windows: 2, baseline_windows: 10, min_baseline_windows: 3,"
        " min_requests: 3, min_p99_s: 0.15, lower_weight_to: 0.25}\n"
        f"routing: {{policy: round_robin}}\nbackends:\n{backends}\n", "<test>"))
    await proxy.start()
    try:
        async with Load(proxy, fleet.servers[0].backend.engine.model_name, clients=12):
            await until(lambda: all(b.get("baseline_windows", 0) >= 3
                                    for b in proxy.observer.hotspots()["backends"].values())
                        and len(proxy.observer.hotspots()["backends"]) == 2, timeout=30, interval=0.2)
            async with slowed(fleet, ("sim-1",)):
                await until(lambda: proxy.store.current.get("sim-1").weight == 0.25, timeout=30, interval=0.1)
                assert proxy.observer.hotspots()["backends"]["sim-1"]["latency_hot_spot"]
                assert proxy.store.current.get("sim-0").weight is None
            await until(lambda: proxy.store.current.get("sim-1").weight is None, timeout=30, interval=0.1)
            assert not proxy.observer.hotspots()["backends"]["sim-1"]["latency_hot_spot"]
    finally:
        await proxy.stop()
