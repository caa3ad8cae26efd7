"""Active health checks (HTTP and grpc.health.v1) and the monitor that turns health events into snapshots.

`HealthMonitor` owns the pure `FleetHealth` (proxy/core/health.py) and is the only writer of a backend's
`health` field besides draining: active check results and the data plane's outcome reports go in, and a
new snapshot comes out only when a backend's combined health actually changes. It never overwrites
DRAINING, which belongs to reload, discovery and the admin API.

`HealthChecker` runs one task per backend: a check, then a jittered sleep (jitter keeps a fleet of proxies
from probing a backend in lockstep), with at most one check per backend in flight, so a stalled backend
is never hit by a pile of probes. Each check gets that backend's adaptive timeout. A check connection is
never reused (`force_close`): a pooled keep-alive connection the backend closed while idle would fail with
a reset that says nothing about the backend, and a reset counts at once.

TLS (https:// backends, verified with the backend's `tls:` section, proxy/tls.py): since every check opens
a new connection, it pays a handshake, which can be slow for reasons that are not the backend's answers (an
mTLS sidecar under load: the design this grew from saw a p95 of 1.15 s make a 1 s timeout eject 18.7% of
healthy backends). So with the adaptive timeout the connection (TCP + TLS handshake) is timed and bounded
apart: its budget is `handshake_k` x the p95 of the backend's recent handshakes (the whole
`adaptive_max_timeout_ms` until one is known), and the response gets the adaptive timeout of its own,
counted from the end of the handshake; the latency fed to the monitor is the response's alone. With the
adaptive timeout off, one fixed timeout covers both, as before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import ssl
import time
from collections import deque
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit

import aiohttp

from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.control.store import SnapshotStore
from proxy.core.decision import Outcome
from proxy.core.health import CheckResult, FleetHealth, HealthChange, HealthCheckConfig, OutlierConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot
from proxy.tls import ClientTls, grpc_host_port

if TYPE_CHECKING:  # grpclib is imported only when a gRPC check runs
    from grpclib.client import Channel

log = logging.getLogger("affinity_proxy.health")

Clock = Callable[[], float]
_RESET_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}


class HealthMonitor:
    """FleetHealth plus publishing: events in, snapshot updates out (only on a change of health)."""

    def __init__(
        self,
        store: SnapshotStore,
        checks: HealthCheckConfig,
        outliers: OutlierConfig,
        *,
        metrics: ResilienceMetrics | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.store = store
        self.fleet = FleetHealth(checks, outliers)
        self.metrics = metrics if metrics is not None else ResilienceMetrics()
        self.clock = clock
        self._expiry_changed = asyncio.Event()
        self._logged: dict[str, Health] = {}  # the last health logged per backend
        self._listeners: list[Callable[[HealthChange], None]] = []
        for b in store.current.backends:
            self.fleet.add(b.name)

    @property
    def checks(self) -> HealthCheckConfig:
        return self.fleet.checks

    def subscribe(self, listener: Callable[[HealthChange], None]) -> None:
        self._listeners.append(listener)

    # --- membership (reload, discovery)
    def add(self, name: str, joining: bool) -> Health:
        return self.fleet.add(name, joining=joining)

    def remove(self, name: str) -> None:
        self.fleet.remove(name)

    def health(self, name: str) -> Health:
        return self.fleet.health(name) if name in self.fleet else Health.UNKNOWN

    def reconfigure(self, checks: HealthCheckConfig, outliers: OutlierConfig) -> None:
        self.fleet.reconfigure(checks, outliers)

    # --- events
    def on_check(self, name: str, result: CheckResult, latency_ms: float | None) -> None:
        self.metrics.checks.labels(name, result.value).inc()
        self._apply(self.fleet.on_check(name, result, latency_ms, self.clock()))

    def report(self, name: str, outcome: Outcome) -> None:
        """Called by the data planes after every attempt on a backend (passive outlier detection)."""
        if outcome is Outcome.SUCCESS:  # the usual report: no change of health can come of it
            self.fleet.on_success(name)
            return
        change = self.fleet.on_outcome(name, outcome, self.clock())
        if change is not None:
            self.metrics.ejections.labels(name).inc()
            self._expiry_changed.set()
        self._apply(change)

    def _apply(self, change: HealthChange | None) -> None:
        if change is None:
            return
        # Good news at INFO, bad news at WARNING; one line per transition, even if a transition is reported
        # again (same backend, same health) by another path.
        if self._logged.get(change.name) is not change.health:
            self._logged[change.name] = change.health
            level = logging.INFO if change.health is Health.HEALTHY else logging.WARNING
            log.log(level, "backend %s is now %s (%s)", change.name, change.health.value, change.cause)
        self.metrics.transitions.labels(change.name, change.health.value, change.cause).inc()
        current = self.store.current.get(change.name)
        if current is not None and current.health is not Health.DRAINING and current.health is not change.health:
            self.store.update(lambda s: s.replace_backend(change.name, health=change.health))
        for listener in self._listeners:
            listener(change)

    def sync_health(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` with every tracked, non-draining backend at its current combined health."""
        out = snapshot
        for b in snapshot.backends:
            if b.name in self.fleet and b.health is not Health.DRAINING:
                h = self.fleet.health(b.name)
                if h is not b.health:
                    out = out.replace_backend(b.name, health=h)
        return out

    async def run_expiries(self) -> None:
        """Ends ejections whose time is up (without active checks; with them the next pass ends them)."""
        while True:
            deadline = self.fleet.next_expiry()
            self._expiry_changed.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(self._expiry_changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            for change in self.fleet.tick(self.clock()):
                self._apply(change)


class HealthChecker:
    """One probing task per tracked backend; results go to the monitor."""

    def __init__(
        self,
        store: SnapshotStore,
        monitor: HealthMonitor,
        *,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
        tls: ClientTls | None = None,
    ) -> None:
        """`tls`: the contexts of https:// and grpcs:// backends (proxy/upstream/factory.py `backend_tls`);
        without it they are verified against the system CAs."""
        self.store = store
        self.monitor = monitor
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        self.tls = tls if tls is not None else ClientTls(lambda key: None)
        self.handshakes_s: dict[str, deque[float]] = {}  # recent TLS connection times per backend
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._channels: dict[str, Channel] = {}
        self._running = False

    @property
    def cfg(self) -> HealthCheckConfig:
        return self.monitor.checks

    async def start(self) -> None:
        self._running = True
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(self._connect_started)
        trace.on_connection_create_end.append(self._connect_ended)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
            trace_configs=[trace],
        )
        self.store.subscribe(self._on_snapshot)
        self._on_snapshot(self.store.current)

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        if self._session is not None:
            await self._session.close()

    def refresh(self) -> None:
        """Re-evaluate which backends to probe (after a reload switched checks on or off)."""
        self._on_snapshot(self.store.current)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        """Keep one task per backend that is tracked and not draining (draining ones get no traffic)."""
        if not self._running:
            return
        wanted = {b.name for b in snapshot.backends if b.health is not Health.DRAINING and b.name in self.monitor.fleet}
        if not self.cfg.enabled:
            wanted = set()
        for name in list(self._tasks):
            if name not in wanted:
                self._tasks.pop(name).cancel()
                self.handshakes_s.pop(name, None)
                ch = self._channels.pop(name, None)
                if ch is not None:
                    ch.close()
        for name in wanted:
            if name not in self._tasks:
                self._tasks[name] = asyncio.get_running_loop().create_task(self._probe_loop(name), name=f"check-{name}")

    def next_interval_s(self) -> float:
        cfg = self.cfg
        return cfg.interval_ms / 1000.0 * (1.0 + cfg.jitter * (2.0 * self.rng.random() - 1.0))

    async def _probe_loop(self, name: str) -> None:
        # Spread the first probes over the jitter window so a fleet does not get checked in one burst.
        await asyncio.sleep(self.cfg.interval_ms / 1000.0 * self.cfg.jitter * self.rng.random())
        while True:
            b = self.store.current.get(name)
            if b is None or name not in self.monitor.fleet:
                return
            result, latency_ms = await self.check(b.spec, self.monitor.fleet.timeout_s(name))
            self.monitor.on_check(name, result, latency_ms)
            await asyncio.sleep(self.next_interval_s())

    def handshake_budget_s(self, name: str) -> float:
        """How long a TLS check may spend connecting: handshake_k x p95 of the recent handshakes, at least the
        timeout floor, at most adaptive_max_timeout_ms (which is also the budget before any is known)."""
        cfg = self.cfg
        cap = cfg.adaptive_max_timeout_ms / 1000.0
        recent = self.handshakes_s.get(name)
        if not recent:
            return cap
        ordered = sorted(recent)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(cap, max(cfg.timeout_ms / 1000.0, cfg.handshake_k * p95))

    def _record_handshake(self, name: str, seconds: float) -> None:
        window = self.handshakes_s.get(name)
        if window is None or window.maxlen != self.cfg.latency_window:
            window = self.handshakes_s[name] = deque(window or (), maxlen=self.cfg.latency_window)
        window.append(seconds)

    async def _connect_started(self, session: object, ctx: object, params: object) -> None:
        phases = getattr(ctx, "trace_request_ctx", None)
        if isinstance(phases, _Phases):
            phases.connect_started = self.clock()

    async def _connect_ended(self, session: object, ctx: object, params: object) -> None:
        phases = getattr(ctx, "trace_request_ctx", None)
        if isinstance(phases, _Phases) and phases.connect_started is not None:
            phases.connected = self.clock()
            phases.handshake_s = phases.connected - phases.connect_started
            if phases.scope is not None:  # the response's own budget starts now
                phases.scope.reschedule(asyncio.get_running_loop().time() + phases.response_timeout_s)

    async def check(self, spec: BackendSpec, timeout_s: float) -> tuple[CheckResult, float | None]:
        """Probe one backend once; returns the result and, when it answered, the latency in ms."""
        start = self.clock()
        grpc = self.cfg.protocol == "grpc" and bool(spec.grpc_address)
        phased = not grpc and self.cfg.adaptive_timeout and spec.url.startswith("https://")
        phases = _Phases(timeout_s)
        try:
            async with asyncio.timeout(self.handshake_budget_s(spec.name) if phased else timeout_s) as scope:
                if phased:
                    phases.scope = scope
                if grpc:
                    ok = await self._grpc_check(spec)
                else:
                    ok = await self._http_check(spec, phases)
        except TimeoutError:
            self._drop_channel(spec.name)
            return CheckResult.TIMEOUT, None
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, aiohttp.ServerDisconnectedError):
            self._drop_channel(spec.name)
            return CheckResult.REFUSED, None
        except (ssl.SSLError, aiohttp.ClientSSLError) as exc:  # OSErrors: a certificate from another CA...
            self._drop_channel(spec.name)
            log.warning("health check of %s: TLS handshake failed: %s", spec.name, exc)
            return CheckResult.FAIL, None
        except OSError as exc:  # aiohttp.ClientOSError and ClientConnectorError are OSErrors
            self._drop_channel(spec.name)
            return (CheckResult.REFUSED if exc.errno in _RESET_ERRNOS else CheckResult.FAIL), None
        except aiohttp.ClientError:
            return CheckResult.FAIL, None
        except Exception as exc:  # a grpclib protocol error and the like: the backend answered badly
            if _is_refused(exc):
                self._drop_channel(spec.name)
                return CheckResult.REFUSED, None
            log.info("health check of %s failed: %r", spec.name, exc)
            return CheckResult.FAIL, None
        end = self.clock()
        if phases.handshake_s is not None and spec.url.startswith("https://"):
            self._record_handshake(spec.name, phases.handshake_s)
        if phased and phases.connected is not None:
            start = phases.connected  # the response's latency alone: the handshake is measured apart
        return (CheckResult.PASS if ok else CheckResult.FAIL), (end - start) * 1000.0

    async def _http_check(self, spec: BackendSpec, phases: "_Phases | None" = None) -> bool:
        assert self._session is not None, "start() first"
        tls = self.tls.for_url(spec.url)
        extra: dict[str, object] = {}
        if tls is not None:
            extra["ssl"] = tls[0]
            if tls[1] is not None:
                extra["server_hostname"] = tls[1]
        async with self._session.get(spec.url + self.cfg.path, allow_redirects=False, trace_request_ctx=phases,
                                     **extra) as resp:  # type: ignore[arg-type]  # ssl / server_hostname, typed by aiohttp per keyword
            await resp.read()
            return 200 <= resp.status < 300

    async def _grpc_check(self, spec: BackendSpec) -> bool:
        from grpclib.client import Channel
        from grpclib.health.v1.health_grpc import HealthStub
        from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

        channel = self._channels.get(spec.name)
        if channel is None:
            address = spec.grpc_address or ""
            tls = self.tls.for_grpc(address)
            host, port = grpc_host_port(address) if tls is not None else _host_port(address)
            channel = self._channels[spec.name] = Channel(host, port, ssl=tls[0] if tls is not None else None)
        reply = await HealthStub(channel).Check(HealthCheckRequest(service=self.cfg.grpc_service))
        return reply is not None and reply.status == HealthCheckResponse.SERVING

    def _drop_channel(self, name: str) -> None:
        ch = self._channels.pop(name, None)
        if ch is not None:
            ch.close()


class _Phases:
    """One check's connection timing, filled in by the session's trace hooks."""

    __slots__ = ("response_timeout_s", "scope", "connect_started", "connected", "handshake_s")

    def __init__(self, response_timeout_s: float) -> None:
        self.response_timeout_s = response_timeout_s
        self.scope: asyncio.Timeout | None = None  # set when the handshake has a budget of its own
        self.connect_started: float | None = None
        self.connected: float | None = None
        self.handshake_s: float | None = None


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit("//" + address)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"gRPC address must be host:port, got {address!r}")
    return parts.hostname, parts.port


def _is_refused(exc: BaseException) -> bool:
    """grpclib wraps connection failures; look through the cause chain for a refusal or reset."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        if isinstance(cur, (ConnectionRefusedError, ConnectionResetError, BrokenPipeError)):
            return True
        if isinstance(cur, OSError) and cur.errno in _RESET_ERRNOS:
            return True
        status = getattr(getattr(cur, "status", None), "name", None)
        if status == "UNAVAILABLE":
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


__all__ = ["HealthChecker", "HealthMonitor"]
