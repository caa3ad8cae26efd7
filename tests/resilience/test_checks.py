"""Active checks against real loopback servers (HTTP and grpc.health.v1) and the monitor's publishing."""

from __future__ import annotations

import random

from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health as GrpcHealth
from grpclib.server import Server

from proxy.control.checks import HealthChecker, HealthMonitor
from proxy.control.store import SnapshotStore
from proxy.core.decision import Outcome
from proxy.core.health import CheckResult, HealthCheckConfig, OutlierConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot

from tests.support import FakeBackend, free_port, until

FAST = HealthCheckConfig(interval_ms=20, jitter=0.2, timeout_ms=200, healthy_threshold=2, unhealthy_threshold=2)


def make(specs: list[BackendSpec], checks: HealthCheckConfig = FAST, outliers: OutlierConfig | None = None):
    store = SnapshotStore(Snapshot.initial(specs))
    monitor = HealthMonitor(store, checks, outliers or OutlierConfig())
    checker = HealthChecker(store, monitor, rng=random.Random(1))
    return store, monitor, checker


async def test_http_checks_follow_the_backend_with_hysteresis() -> None:
    fake = FakeBackend()
    url = await fake.start()
    store, monitor, checker = make([BackendSpec("a", url)])
    await checker.start()
    try:
        await until(lambda: store.current.get("a").health is Health.HEALTHY)
        fake.health = "fail"
        await until(lambda: store.current.get("a").health is Health.UNHEALTHY)
        assert monitor.metrics.checks.labels("a", "fail")._value.get() >= 2  # hysteresis: two failures needed
        fake.health = "ok"
        await until(lambda: store.current.get("a").health is Health.HEALTHY)
    finally:
        await checker.stop()
        await fake.stop()


async def test_check_classifies_refused_timeout_and_pass() -> None:
    fake = FakeBackend()
    url = await fake.start()
    _, _, checker = make([])
    await checker.start()
    try:
        result, latency = await checker.check(BackendSpec("a", url), 1.0)
        assert result is CheckResult.PASS and latency is not None and latency >= 0
        fake.health_stall_s = 0.3
        assert (await checker.check(BackendSpec("a", url), 0.05))[0] is CheckResult.TIMEOUT
        fake.health_stall_s = 0
        fake.health = "fail"
        assert (await checker.check(BackendSpec("a", url), 1.0))[0] is CheckResult.FAIL
        dead = f"http://127.0.0.1:{free_port()}"
        assert (await checker.check(BackendSpec("b", dead), 1.0))[0] is CheckResult.REFUSED
    finally:
        await checker.stop()
        await fake.stop()


async def test_refused_backend_is_unhealthy_after_one_check() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    store, monitor, checker = make([BackendSpec("dead", dead)],
                                   HealthCheckConfig(interval_ms=5000, jitter=0, unhealthy_threshold=5))
    await checker.start()
    try:
        await until(lambda: store.current.get("dead").health is Health.UNHEALTHY)
        assert monitor.metrics.checks.labels("dead", "refused")._value.get() == 1
    finally:
        await checker.stop()


async def test_grpc_health_v1_checks() -> None:
    status = ServiceStatus()
    status.set(True)
    server = Server([GrpcHealth({OVERALL: [status]})])
    port = free_port()
    await server.start("127.0.0.1", port)
    cfg = HealthCheckConfig(protocol="grpc", interval_ms=20, jitter=0, healthy_threshold=1, unhealthy_threshold=1)
    spec = BackendSpec("g", "http://127.0.0.1:1", grpc_address=f"127.0.0.1:{port}")
    store, _, checker = make([spec], cfg)
    await checker.start()
    try:
        assert (await checker.check(spec, 1.0))[0] is CheckResult.PASS
        await until(lambda: store.current.get("g").health is Health.HEALTHY)
        status.set(False)
        assert (await checker.check(spec, 1.0))[0] is CheckResult.FAIL
        await until(lambda: store.current.get("g").health is Health.UNHEALTHY)
        server.close()
        await server.wait_closed()
        # grpclib keeps serving open connections after close(): probe over a fresh channel, as after a restart
        fresh = BackendSpec("g2", spec.url, grpc_address=spec.grpc_address)
        assert (await checker.check(fresh, 1.0))[0] is CheckResult.REFUSED
    finally:
        await checker.stop()
        server.close()


async def test_monitor_ejects_on_reports_and_never_overwrites_draining() -> None:
    specs = [BackendSpec(n, f"http://127.0.0.1:{i + 1}") for i, n in enumerate("abcd")]
    store, monitor, _ = make(specs, outliers=OutlierConfig(consecutive_5xx=2))
    v = store.current.version
    monitor.report("a", Outcome.STATUS_5XX)
    assert store.current.version == v
    monitor.report("a", Outcome.STATUS_5XX)
    assert store.current.get("a").health is Health.UNHEALTHY and store.current.version == v + 1
    assert monitor.metrics.ejections.labels("a")._value.get() == 1
    store.update(lambda s: s.replace_backend("b", health=Health.DRAINING))
    monitor.report("b", Outcome.STATUS_5XX)
    monitor.report("b", Outcome.STATUS_5XX)
    assert store.current.get("b").health is Health.DRAINING


async def test_monitor_success_report_ends_every_failure_streak() -> None:
    # The data plane's usual report (SUCCESS) takes a short path: it must still reset each streak.
    specs = [BackendSpec(n, f"http://127.0.0.1:{i + 1}") for i, n in enumerate("abcd")]
    store, monitor, _ = make(specs, outliers=OutlierConfig(
        consecutive_5xx=2, consecutive_connect_failures=2, consecutive_stream_failures=2))
    v = store.current.version
    for failure in (Outcome.STATUS_5XX, Outcome.CONNECT_FAILURE, Outcome.STREAM_FAILURE):
        for _ in range(3):
            monitor.report("a", failure)
            monitor.report("a", Outcome.SUCCESS)
    monitor.report("zz", Outcome.SUCCESS)  # a backend the monitor does not know: nothing happens
    assert store.current.version == v and store.current.get("a").health is Health.UNKNOWN
    monitor.report("a", Outcome.STATUS_5XX)
    monitor.report("a", Outcome.STATUS_5XX)
    assert store.current.get("a").health is Health.UNHEALTHY


async def test_ejection_expires_without_active_checks() -> None:
    import asyncio

    store, monitor, _ = make([BackendSpec("a", "http://127.0.0.1:1"), BackendSpec("b", "http://127.0.0.1:2")],
                             HealthCheckConfig(enabled=False),
                             OutlierConfig(consecutive_connect_failures=1, base_ejection_ms=50))
    task = asyncio.create_task(monitor.run_expiries())
    try:
        monitor.report("a", Outcome.CONNECT_FAILURE)
        assert store.current.get("a").health is Health.UNHEALTHY
        await until(lambda: store.current.get("a").health is Health.UNKNOWN)
    finally:
        task.cancel()


async def test_checker_follows_membership_and_skips_draining() -> None:
    fake = FakeBackend()
    url = await fake.start()
    store, monitor, checker = make([BackendSpec("a", url)])
    await checker.start()
    try:
        await until(lambda: fake.health_calls >= 2)
        store.update(lambda s: s.replace_backend("a", health=Health.DRAINING))
        await until(lambda: not checker._tasks)
        calls = fake.health_calls
        monitor.add("b", joining=True)
        store.update(lambda s: s.evolve((*s.backends, *Snapshot.initial([BackendSpec("b", url)]).backends)))
        await until(lambda: fake.health_calls > calls + 1)
        assert set(checker._tasks) == {"b"}
    finally:
        await checker.stop()
        await fake.stop()
