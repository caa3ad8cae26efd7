"""Joins, drains, restores and DNS discovery, driven on a real store and monitor (no proxy needed)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.control.checks import HealthMonitor
from proxy.control.discovery import Discovery, expand, is_dns_name, split_services
from proxy.control.membership import Membership, close_idle_connections
from proxy.control.store import SnapshotStore
from proxy.config import DiscoveryConfig
from proxy.core.health import CheckResult, HealthCheckConfig, OutlierConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot
from proxy.core.inflight import InflightTable

from tests.support import FakeBackend, until


def spec(name: str, port: int = 1, **kw) -> BackendSpec:
    return BackendSpec(name, f"http://127.0.0.1:{port}", **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(specs: list[BackendSpec], checks: HealthCheckConfig = HealthCheckConfig()):
    store = SnapshotStore(Snapshot.initial(specs))
    monitor = HealthMonitor(store, checks, OutlierConfig())
    inflight = InflightTable()
    clock = Clock()
    closed: list[str] = []

    async def close_idle(s: BackendSpec) -> None:
        closed.append(s.name)

    m = Membership(store, monitor, inflight, drain_timeout_s=5, close_idle=close_idle, clock=clock)
    m.seed("config", specs)
    return store, monitor, inflight, clock, m, closed


async def test_added_backend_joins_after_first_passing_check() -> None:
    store, monitor, _, _, m, _ = setup([spec("a")])
    snap = m.set_source("config", [spec("a"), spec("b", 2)])
    assert snap.get("b").health is Health.UNHEALTHY and not snap.get("b").routable
    assert snap.get("a").health is Health.UNKNOWN
    monitor.on_check("b", CheckResult.PASS, 1.0)
    assert store.current.get("b").health is Health.HEALTHY


async def test_removed_backend_drains_until_idle_then_leaves_and_connections_close() -> None:
    store, monitor, inflight, _, m, closed = setup([spec("a"), spec("b", 2)])
    inflight.acquire("b", 10)
    snap = m.set_source("config", [spec("a")])
    assert snap.get("b").health is Health.DRAINING
    assert await m.finish_drains_once() == []  # still busy
    assert "b" in store.current
    inflight.release("b", 10)
    assert await m.finish_drains_once() == ["b"]
    assert "b" not in store.current and "b" not in monitor.fleet
    assert closed == ["b"] and m.drained == [("b", "idle")]
    assert m.metrics.drained.labels("idle")._value.get() == 1


async def test_drain_deadline_removes_a_busy_backend() -> None:
    store, _, inflight, clock, m, _ = setup([spec("a"), spec("b", 2)])
    inflight.acquire("b", 1)
    m.set_source("config", [spec("a")])
    clock.t = 4.9
    assert await m.finish_drains_once() == []
    clock.t = 5.0
    assert await m.finish_drains_once() == ["b"]
    assert m.drained == [("b", "deadline")]


async def test_reappearing_backend_is_restored_with_its_health() -> None:
    store, monitor, inflight, _, m, _ = setup([spec("a"), spec("b", 2)])
    monitor.on_check("b", CheckResult.PASS, 1.0)
    inflight.acquire("b", 1)
    m.set_source("config", [spec("a")])
    snap = m.set_source("config", [spec("a"), spec("b", 2)])
    assert snap.get("b").health is Health.HEALTHY and m.removing == frozenset()


async def test_spec_change_keeps_health_and_weight_override_unless_weight_changed() -> None:
    store, monitor, _, _, m, _ = setup([spec("a"), spec("b", 2)])
    monitor.on_check("a", CheckResult.PASS, 1.0)
    m.set_weight("a", 5)
    snap = m.set_source("config", [spec("a", 9), spec("b", 2)])
    a = snap.get("a")
    assert a.spec.url.endswith(":9") and a.health is Health.HEALTHY and a.effective_weight == 5
    snap = m.set_source("config", [spec("a", 9, weight=2.0), spec("b", 2)])
    assert snap.get("a").effective_weight == 2.0
    v = snap.version
    assert m.set_source("config", [spec("a", 9, weight=2.0), spec("b", 2)]).version == v  # no-op publishes nothing


async def test_admin_drain_restore_and_weight() -> None:
    store, monitor, _, _, m, _ = setup([spec("a"), spec("b", 2)])
    v = store.current.version
    assert m.drain("a").get("a").health is Health.DRAINING
    monitor.on_check("a", CheckResult.PASS, 1.0)  # checks do not undo a manual drain
    assert store.current.get("a").health is Health.DRAINING
    assert await m.finish_drains_once() == []  # manual drains never leave the fleet
    snap = m.restore("a")
    assert snap.get("a").health is Health.HEALTHY and snap.version == v + 2
    assert m.set_weight("b", 0).get("b").effective_weight == 0
    assert m.set_weight("b", None).get("b").effective_weight == 1.0
    with pytest.raises(KeyError):
        m.drain("nope")
    with pytest.raises(ValueError):
        m.set_weight("b", -1)
    for bad in (float("inf"), float("nan")):  # the YAML weight's bound, at the admin door too
        with pytest.raises(ValueError, match="weight: must be a finite number"):
            m.set_weight("b", bad)
    assert store.current.get("b").effective_weight == 1.0


async def test_restore_refuses_a_backend_removed_by_config() -> None:
    _, _, inflight, _, m, _ = setup([spec("a"), spec("b", 2)])
    inflight.acquire("b", 1)
    m.set_source("config", [spec("a")])
    with pytest.raises(ValueError):
        m.restore("b")


async def test_run_task_finishes_drains() -> None:
    store, _, inflight, _, m, closed = setup([spec("a"), spec("b", 2)])
    task = asyncio.create_task(m.run())
    try:
        inflight.acquire("b", 1)
        m.set_source("config", [spec("a")])
        await asyncio.sleep(0.1)
        assert "b" in store.current
        inflight.release("b", 1)
        await until(lambda: "b" not in store.current)
    finally:
        task.cancel()


async def test_close_idle_connections_empties_the_pool_for_that_backend() -> None:
    fake = FakeBackend()
    url = await fake.start()
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.get(url + "/health") as r:
                await r.read()
        assert sum(len(v) for v in session.connector._conns.values()) == 1
        assert await close_idle_connections(session, BackendSpec("x", url)) == 1
        assert sum(len(v) for v in session.connector._conns.values()) == 0
        assert await close_idle_connections(session, BackendSpec("y", "http://127.0.0.1:1")) == 0
    await fake.stop()


# --------------------------------------------------------------------------------------------- discovery


def test_dns_names_and_expansion() -> None:
    assert is_dns_name("vllm.ns.svc") and is_dns_name("localhost")
    assert not is_dns_name("10.0.0.1") and not is_dns_name("[::1]") and not is_dns_name(None)
    svc = BackendSpec("gpu", "http://vllm.svc:8000/base", weight=2, grpc_address="vllm.svc:9000",
                      metrics_url="http://vllm.svc:8001/metrics", models=("m",))
    static, services = split_services([spec("a"), svc])
    assert [s.name for s in static] == ["a"] and services == [svc]
    out = expand(svc, ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1"])
    assert [s.name for s in out] == ["gpu@10.0.0.1:8000", "gpu@10.0.0.2:8000", "gpu@[fd00::1]:8000"]
    assert out[0].url == "http://10.0.0.1:8000/base" and out[2].url == "http://[fd00::1]:8000/base"
    assert out[0].grpc_address == "10.0.0.1:9000" and out[0].metrics_url == "http://10.0.0.1:8001/metrics"
    assert out[0].weight == 2 and out[0].models == ("m",)


class FakeDNS:
    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        a = self.answers[host]
        if isinstance(a, Exception):
            raise a
        return list(a)


async def test_discovery_joins_and_drains_addresses_and_survives_dns_failure() -> None:
    svc = BackendSpec("gpu", "http://vllm.svc:8000")
    store, monitor, inflight, _, m, _ = setup([spec("static")])
    dns = FakeDNS()
    dns.answers["vllm.svc"] = ["10.0.0.1", "10.0.0.2"]
    d = Discovery(m, DiscoveryConfig(enabled=True, interval_ms=10), [svc], resolver=dns)
    await d.refresh()
    snap = store.current
    assert snap.names == ("static", "gpu@10.0.0.1:8000", "gpu@10.0.0.2:8000")
    assert snap.get("gpu@10.0.0.1:8000").routable  # the first view serves at once
    dns.answers["vllm.svc"] = ["10.0.0.2", "10.0.0.3"]
    await d.refresh()
    snap = store.current
    assert snap.get("gpu@10.0.0.3:8000").health is Health.UNHEALTHY  # joins after its first passing check
    assert snap.get("gpu@10.0.0.1:8000").health is Health.DRAINING
    monitor.on_check("gpu@10.0.0.3:8000", CheckResult.PASS, 1.0)
    assert store.current.get("gpu@10.0.0.3:8000").health is Health.HEALTHY
    await m.finish_drains_once()
    assert "gpu@10.0.0.1:8000" not in store.current
    v = store.current.version
    dns.answers["vllm.svc"] = OSError("SERVFAIL")
    await d.refresh()
    dns.answers["vllm.svc"] = []
    await d.refresh()
    assert store.current.version == v and d.failures == 2  # DNS trouble keeps the last good addresses


async def test_discovery_drops_a_second_service_resolving_to_the_same_address() -> None:
    # Two names for one pod (e.g. two Services selecting it) must not become two backends for one server:
    # the config's duplicate-URL rule, applied to what DNS answers.
    store, _, _, _, m, _ = setup([spec("static")])
    dns = FakeDNS()
    dns.answers["a.svc"] = ["10.0.0.1", "10.0.0.2"]
    dns.answers["b.svc"] = ["10.0.0.2"]
    d = Discovery(m, DiscoveryConfig(enabled=True), [BackendSpec("a", "http://a.svc:8000"),
                                                    BackendSpec("b", "http://b.svc:8000")], resolver=dns)
    await d.refresh()
    assert store.current.names == ("static", "a@10.0.0.1:8000", "a@10.0.0.2:8000")


async def test_discovery_run_loop_re_resolves_periodically() -> None:
    svc = BackendSpec("gpu", "http://vllm.svc:8000")
    store, _, _, _, m, _ = setup([])
    dns = FakeDNS()
    dns.answers["vllm.svc"] = ["10.0.0.1"]
    d = Discovery(m, DiscoveryConfig(enabled=True, interval_ms=10), [svc], resolver=dns)
    task = asyncio.create_task(d.run())
    try:
        await until(lambda: "gpu@10.0.0.1:8000" in store.current)
        dns.answers["vllm.svc"] = ["10.0.0.1", "10.0.0.9"]
        await until(lambda: "gpu@10.0.0.9:8000" in store.current)
        assert dns.calls >= 2
    finally:
        task.cancel()


async def test_discovery_switched_on_later_joins_after_checks() -> None:
    store, _, _, _, m, _ = setup([spec("static")])
    dns = FakeDNS()
    dns.answers["vllm.svc"] = ["10.0.0.1"]
    d = Discovery(m, DiscoveryConfig(enabled=True), [BackendSpec("gpu", "http://vllm.svc:8000")], resolver=dns,
                  at_startup=False)
    await d.refresh()
    assert store.current.get("gpu@10.0.0.1:8000").health is Health.UNHEALTHY  # not seen answering yet
