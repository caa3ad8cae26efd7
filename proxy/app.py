"""Runtime wiring: one `AffinityProxy` per process holds everything a running proxy is made of.

    config ──► SnapshotStore (backends) ──► Router(policy, InflightTable, ProxyMetrics)
                                               │
                     HTTP data plane (proxy/http) ─┤── gRPC data plane (proxy/grpc, optional service)
                                               │
    control-plane services (poller, health checks, reload, discovery) publish into the store
    admin listener: /metrics, /admin/backends, /healthz (+ write endpoints added to `admin_app`)

Hook points for the other subsystems (use these names; wire new ones in `_install_subsystems`):
  - `proxy.store`      SnapshotStore: control-plane tasks `publish`/`update` new snapshots here.
  - `proxy.router`     Router: data planes do `async with proxy.router.route(summary) as lease:`.
  - `proxy.inflight`   InflightTable (Mapping[str, Inflight]) shared by every data plane.
  - `proxy.metrics`    ProxyMetrics: `.registry` for new metrics, `register_collector` for scrape-time ones.
  - `proxy.admin_app`  aiohttp Application of the admin listener: add routes before `start()`, guarded with
                       `proxy.admin.require_token(proxy.admin_token, handler)`.
  - `proxy.add_service(svc, data_plane=False)`  anything with `async start()` / `async stop()`. Control-plane
                       services start after the listeners are bound and stop after the data planes drained;
                       data-plane services (the gRPC listener) are stopped concurrently with the HTTP drain,
                       and their `stop()` must drain within `config.timeouts.drain_s`.
  - `proxy.add_task(name, coro_fn)`  a coroutine that runs for the proxy's lifetime and is cancelled on stop.
  - `proxy.session`    an aiohttp ClientSession (after `start()`) for the proxy's own calls (health checks...).
  - `proxy.upstream`   the data plane's UpstreamPool (after `start()`): `close_idle(url)` when a backend leaves.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Literal, Protocol

import aiohttp
from aiohttp import web

from proxy.admin import build_admin_app
from proxy.config import Config
from proxy.control.kv_events import build_precise_routing
from proxy.control.poller import Poller
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_metrics import TelemetryMetrics
from proxy.core.decision import Policy
from proxy.core.policies import build_policy
from proxy.core.snapshot import Snapshot
from proxy.dataplane.router import Router
from proxy.grpc.listener import GrpcListener
from proxy.http.server import HttpDataPlane
from proxy.upstream.http1 import UpstreamPool
from proxy.upstream.factory import create_pool, create_session
from proxy.resilience import Resilience
from proxy.core.inflight import InflightTable
from proxy.metrics import ProxyMetrics

log = logging.getLogger("affinity_proxy")


Role = Literal["all", "control", "data"]


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class _Task:
    name: str
    factory: Callable[[], Awaitable[None]]
    task: asyncio.Task[None] | None = None


class AffinityProxy:
    def __init__(
        self, config: Config, *, policy: Policy | None = None, reuse_port: bool = False, role: Role = "all",
        config_path: str | None = None, store: SnapshotStore | None = None,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port  # several worker processes sharing the listeners (proxy/multiproc/serve.py)
        # "all": one process does everything. With --workers N (proxy/multiproc/serve.py) the supervisor runs
        # "control" (admin listener, control-plane services and tasks) and each worker runs "data" (the
        # listeners and data-plane services) on snapshots the supervisor publishes into its store.
        self.role = role
        self.config_path = config_path  # the file hot reload re-reads (SIGHUP, file change, POST /admin/reload)
        # A worker process passes its own store (proxy/multiproc/serve.py) so that data-plane writes reach the supervisor.
        self.store = store if store is not None else SnapshotStore(Snapshot.initial(config.backend_specs()))
        # Precise routing on the engines' KV events (telemetry.kv_events): every routing process holds the index.
        self.precise = build_precise_routing(config) if role != "control" else None
        self.policy = policy if policy is not None else build_policy(
            config.routing, precise=self.precise.matcher if self.precise is not None else None)
        self.inflight = InflightTable()
        self.metrics = ProxyMetrics()
        self.metrics.watch(self.store, self.inflight)
        self.router = Router(
            self.store, self.policy, self.inflight, self.metrics, max_inflight_total=config.limits.max_inflight_total
        )
        self.admin_token = config.admin.resolved_token()
        self.admin_app = build_admin_app(self.store, self.inflight, self.metrics)
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None
        self.http: HttpDataPlane | None = None
        self._services: list[tuple[Service, bool]] = []
        self._tasks: list[_Task] = []
        self._http_runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._started = False
        self._install_subsystems()

    # ------------------------------------------------------------------------------------------ hooks

    def add_service(self, service: Service, *, data_plane: bool = False) -> None:
        if self._started:
            raise RuntimeError("services must be added before start()")
        self._services.append((service, data_plane))

    def add_task(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        if self._started:
            raise RuntimeError("tasks must be added before start()")
        self._tasks.append(_Task(name, factory))

    def _install_subsystems(self) -> None:
        """Where optional subsystems are wired from the config (telemetry poller, health checks, reload,
        discovery, the gRPC listener): one guarded line each, e.g.
        ``if self.config.grpc_listen is not None: self.add_service(GrpcListener(self), data_plane=True)``."""
        # Telemetry: the poller is a control-plane service (the supervisor's, with --workers); data-only
        # workers get their snapshots from the supervisor, so they neither poll nor fold in ORCA reports.
        self.telemetry: Poller | None = None
        self.telemetry_metrics = TelemetryMetrics(self.metrics.registry)
        self.metrics.register_collector(self.telemetry_metrics.snapshot_collector(self.store, time.monotonic))
        if self.config.telemetry.enabled and self.role != "data":
            self.telemetry = Poller(self.store, self.config.telemetry, metrics=self.telemetry_metrics)
            self.add_service(self.telemetry)
        # gRPC/h2c listener (proxy/grpc): a data-plane service sharing this process's router and in-flight table.
        self.grpc: GrpcListener | None = None
        if self.config.grpc_listen is not None and self.role != "control":
            self.grpc = GrpcListener(self)
            self.add_service(self.grpc, data_plane=True)
        # Resilience (proxy/resilience.py): health checks, outlier ejection, drains, hot reload, discovery and
        # the admin write endpoints; retries, overload shedding and panic routing in the router.
        if self.precise is not None:  # KV-event subscriber: a data-plane service, one per routing process
            self.add_service(self.precise.subscriber(self.metrics.registry), data_plane=True)
        self.resilience = Resilience(self, self.config_path)
        self.add_service(self.resilience, data_plane=self.role == "data")

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._started = True
        cfg = self.config
        self.session = create_session(cfg)
        self.upstream = create_pool(cfg, self.metrics.upstream)
        self.upstream.start()
        if self.role != "control":
            self.http = HttpDataPlane(
                cfg, self.router, self.session, self.metrics, cfg.routing.session_header, pool=self.upstream
            )
            if self.telemetry is not None and cfg.telemetry.orca:
                self.http.load_report = self.telemetry.observe_orca
            self._http_runner = web.ServerRunner(self.http.make_server(), shutdown_timeout=cfg.timeouts.drain_s)
            await self._http_runner.setup()
            await web.TCPSite(
                self._http_runner, cfg.listen.host, cfg.listen.port, backlog=4096, reuse_port=self.reuse_port or None
            ).start()
        if self.role != "data":
            self._admin_runner = web.AppRunner(self.admin_app, access_log=None)
            await self._admin_runner.setup()
            await web.TCPSite(self._admin_runner, cfg.admin.host, cfg.admin.port).start()
        for service, data_plane in self._services:
            if self._runs(data_plane):
                await service.start()
        if self.role != "data":
            for t in self._tasks:
                t.task = asyncio.create_task(self._guard(t), name=t.name)
        log.info(
            "affinity-proxy (%s) listening on %s (admin %s)", self.role,
            self.http_url if self._http_runner else "-", self.admin_url if self._admin_runner else "-",
        )

    def _runs(self, data_plane: bool) -> bool:
        return self.role == "all" or (self.role == "data") == data_plane

    async def _guard(self, t: _Task) -> None:
        try:
            await t.factory()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s crashed", t.name)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests and streams finish (up to timeouts.drain_s), then close."""
        drains: list[Awaitable[None]] = []
        if self._http_runner is not None:
            drains.append(self._http_runner.cleanup())
        drains.extend(s.stop() for s, data_plane in self._services if data_plane and self._runs(True))
        results = await asyncio.gather(*drains, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("error while draining: %r", r)
        for t in self._tasks:
            if t.task is not None:
                t.task.cancel()
        await asyncio.gather(*(t.task for t in self._tasks if t.task is not None), return_exceptions=True)
        for service, data_plane in reversed(self._services):
            if not data_plane and self._runs(False):
                try:
                    await service.stop()
                except Exception:
                    log.exception("error stopping %r", service)
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            await self.upstream.close()
        self._http_runner = self._admin_runner = None

    async def serve_until_signal(self) -> None:
        """Run until SIGTERM or SIGINT, then drain and stop."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
            log.info("signal received: draining for up to %.0f s", self.config.timeouts.drain_s)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.stop()

    # ------------------------------------------------------------------------------------------ addresses

    @staticmethod
    def _url(runner: web.BaseRunner | None) -> str:
        if runner is None or not runner.addresses:
            raise RuntimeError("not started")
        host, port = runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    @property
    def http_url(self) -> str:
        return self._url(self._http_runner)

    @property
    def admin_url(self) -> str:
        return self._url(self._admin_runner)
