"""TLS-aware health checks: a backend whose TLS handshake takes 1.5 s but whose answers are quick stays
healthy with the adaptive timeout (the handshake is bounded and timed apart from the response), and is
ejected by a fixed 1 s timeout that has to cover both (the design's 18.7% of healthy backends ejected)."""

from __future__ import annotations

import asyncio
import ssl
from typing import AsyncIterator

import pytest

from proxy.control.checks import HealthChecker, HealthMonitor
from proxy.control.store import SnapshotStore
from proxy.core.health import CheckResult, HealthCheckConfig, OutlierConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot
from proxy.tls import BackendTlsConfig, ClientTls
from tests.tls.conftest import Pki

HANDSHAKE_DELAY_S = 1.5


class _Answer(asyncio.Protocol):
    """The backend once TLS is up: answers the first request at once."""

    def __init__(self, listener: "SlowHandshakeListener") -> None:
        self.listener = listener
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # start_tls gives a Transport
        self.data_received(b"")  # the request may have come in before start_tls returned

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" in self.buf and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            self.listener.answered += 1
            self.transport.close()


class _Delay(asyncio.Protocol):
    """Accepts TCP at once and leaves the client's hello unread for `delay_s`, then starts TLS."""

    def __init__(self, listener: "SlowHandshakeListener") -> None:
        self.listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]  # a TCP transport: the hello waits in the kernel
        loop = asyncio.get_running_loop()
        loop.call_later(self.listener.delay_s, lambda: self.listener.upgrade(transport))  # type: ignore[arg-type]  # a Transport

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class SlowHandshakeListener:
    """A TLS backend whose handshake starts `delay_s` after the connection, then answers in no time."""

    def __init__(self, ctx: ssl.SSLContext, delay_s: float) -> None:
        self.ctx = ctx
        self.delay_s = delay_s
        self.server: asyncio.Server | None = None
        self.answered = 0
        self.tasks: set[asyncio.Task[object]] = set()

    async def start(self) -> str:
        self.server = await asyncio.get_running_loop().create_server(lambda: _Delay(self), "127.0.0.1", 0)
        return f"https://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def upgrade(self, transport: asyncio.Transport) -> None:
        if transport.is_closing():
            return
        task = asyncio.ensure_future(self._upgrade(transport))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        answer = _Answer(self)
        transport.set_protocol(answer)
        try:
            tls = await asyncio.get_running_loop().start_tls(transport, answer, self.ctx, server_side=True)
        except (OSError, ssl.SSLError, ConnectionError):
            transport.close()  # the checker gave up on the handshake and closed
            return
        if tls is not None:
            answer.connection_made(tls)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for t in list(self.tasks):
            t.cancel()


@pytest.fixture
async def slow(pki: Pki) -> AsyncIterator[tuple[SlowHandshakeListener, str]]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pki.cert_file), str(pki.key_file))
    listener = SlowHandshakeListener(ctx, HANDSHAKE_DELAY_S)
    url = await listener.start()
    yield listener, url
    await listener.stop()


async def _checks(pki: Pki, url: str, *, adaptive: bool, rounds: int) -> tuple[list[CheckResult], HealthMonitor,
                                                                               HealthChecker]:
    spec = BackendSpec(name="slow", url=url)
    store = SnapshotStore(Snapshot.initial((spec,)))
    cfg = HealthCheckConfig(enabled=False, timeout_ms=1000, adaptive_timeout=adaptive, healthy_threshold=1,
                            unhealthy_threshold=2)
    monitor = HealthMonitor(store, cfg, OutlierConfig(enabled=False))
    tls = ClientTls(lambda key: BackendTlsConfig(ca_file=str(pki.ca_file)))
    checker = HealthChecker(store, monitor, tls=tls)
    await checker.start()  # enabled=False: no probe loop of its own, the checks below are driven by hand
    results = []
    try:
        for _ in range(rounds):
            result, latency_ms = await checker.check(spec, monitor.fleet.timeout_s("slow"))
            monitor.on_check("slow", result, latency_ms)
            results.append(result)
            if result is CheckResult.PASS:
                assert latency_ms is not None and latency_ms < 1000  # the response alone, not the handshake
    finally:
        await checker.stop()
    return results, monitor, checker


async def test_slow_handshake_is_not_ejected_with_the_adaptive_timeout_but_is_with_a_fixed_one(
        pki: Pki, slow: tuple[SlowHandshakeListener, str]) -> None:
    listener, url = slow
    (adaptive, monitor_a, checker_a), (fixed, monitor_f, _) = await asyncio.gather(
        _checks(pki, url, adaptive=True, rounds=3), _checks(pki, url, adaptive=False, rounds=2))
    # Adaptive: each check passes; the handshake (~1.5 s) was timed apart and sets the next budget.
    assert adaptive == [CheckResult.PASS] * 3
    assert monitor_a.health("slow") is Health.HEALTHY
    handshakes = list(checker_a.handshakes_s["slow"])
    assert len(handshakes) == 3 and min(handshakes) >= HANDSHAKE_DELAY_S * 0.9
    assert checker_a.handshake_budget_s("slow") >= 2.5 * max(handshakes) * 0.99
    # Fixed 1 s for the whole check: the handshake alone exceeds it, so a backend that answers in no time
    # is ejected.
    assert fixed == [CheckResult.TIMEOUT] * 2
    assert monitor_f.health("slow") is Health.UNHEALTHY
    assert listener.answered >= 3


def test_handshake_budget_is_k_times_p95_within_the_floor_and_the_cap() -> None:
    store = SnapshotStore(Snapshot.initial((BackendSpec(name="b", url="https://127.0.0.1:1"),)))
    cfg = HealthCheckConfig(enabled=False, timeout_ms=1000, adaptive_max_timeout_ms=10000, handshake_k=2.5)
    checker = HealthChecker(store, HealthMonitor(store, cfg, OutlierConfig()))
    assert checker.handshake_budget_s("b") == 10.0  # nothing known yet: the whole cap
    for _ in range(19):
        checker._record_handshake("b", 0.1)
    assert checker.handshake_budget_s("b") == 1.0  # 2.5 x 0.1 is below the floor
    for _ in range(5):
        checker._record_handshake("b", 1.15)  # the design's p95 through an mTLS sidecar
    assert checker.handshake_budget_s("b") == pytest.approx(2.875)
    for _ in range(40):
        checker._record_handshake("b", 6.0)
    assert checker.handshake_budget_s("b") == 10.0  # capped
