"""Runtime wiring: one `AffinityProxy` per process holds everything a running proxy is made of.

    config ──► SnapshotStore (backends) ──► Router(policy, InflightTable, ProxyMetrics)
                                               │
                     HTTP data plane (proxy/http) ─┤── gRPC data plane (proxy/grpc, optional service)
                                               │
    control-plane services (poller, health checks, reload, discovery) publish into the store
    admin listener: /metrics, /admin/backends, /healthz (+ write endpoints added to `admin_app`)

Every part gets what it uses in its constructor, built here in dependency order (store, metrics, health
monitor and overload queue, router, resilience, relay pool, OpenAI pipeline, listeners); nothing is
wired by assigning attributes afterwards, and no part is handed this object.

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
  - `proxy.upstream`   the data plane's UpstreamPool (started by `start()`): `close_idle(url)` when a backend leaves.
  - `proxy.openai`     the OpenAI pipeline (proxy/dataplane/openai.py) both HTTP listeners hand requests to.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Literal, Protocol, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from proxy.aio import cancel_and_wait
from proxy.admin import build_admin_app, snapshot_json
from proxy.config import Config
from proxy.control.checks import HealthMonitor
from proxy.control.kv_events import build_precise_routing
from proxy.control.membership import close_idle_connections
from proxy.control.peer_load import PeerLoadExchange, own_load
from proxy.core.affinity import PeerEntry
from proxy.control.lora_pool import LoraPool
from proxy.control.poller import Poller
from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_metrics import TelemetryMetrics
from proxy.core.decision import Policy
from proxy.core.admin_access import is_loopback
from proxy.core.decision import Outcome
from proxy.core.inflight import InflightTable, SharedInflightTable
from proxy.core.registry import build_policy
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec, Snapshot
from proxy.core.work_ledger import WorkLedger
from proxy.dataplane.admission import AdmissionQueue
from proxy.dataplane.openai import OpenAIPipeline
from proxy.dataplane.response_homes import ResponseHomes
from proxy.dataplane.shared_chunks import SharedChunks
from proxy.dataplane.router import Router
from proxy.experiments.admin import add_experiment_routes
from proxy.experiments.runtime import ExperimentRuntime
from proxy.grpc.listener import GrpcListener
from proxy.http.server import ClientLimits, HttpDataPlane, HttpListener
from proxy.listen import ADMIN_BACKLOG, DATA_BACKLOG, listening_socket
from proxy.tls import ServerTls, server_tls
from proxy.metrics import ProxyMetrics
from proxy.observability.admin_routes import observability_routes
from proxy.observability.demote import HotspotWeights
from proxy.observability.lifecycle import Observability
from proxy.observability.loop_lag import LoopLag
from proxy.observability.observer import Observer
from proxy.observability.tracing import Tracing, build_tracing
from proxy.resilience import Resilience, panic_view
from proxy.upstream.factory import backend_tls, create_pool, create_session
from proxy.upstream.http1 import UpstreamPool

log = logging.getLogger("affinity_proxy")
# After the drain deadline, how long the final answers (error events, 503s) get before aiohttp cuts what is left.
DRAIN_GRACE_S = 1.0


Role = Literal["all", "control", "data"]


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class _Task:
    name: str
    factory: Callable[[], Awaitable[None]]
    task: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class HostHooks:
    """What the --workers supervisor (proxy/multiproc/serve.py) adds to its control-plane AffinityProxy:
    /metrics merged from every worker, its own metrics, its readiness, and the reloads it forwards."""

    render_metrics: Callable[[CollectorRegistry], Awaitable[bytes]]
    collectors: Sequence[Callable[[], Iterable[Metric]]] = ()
    ready_checks: Sequence[Callable[[], list[str]]] = ()
    on_reload: Sequence[Callable[[Config], None]] = ()
    # The LoRA pool's demand: every worker's, as they report it (the supervisor's own router routes nothing).
    adapter_demand: Callable[[], dict[str, int]] | None = None


class AffinityProxy:
    def __init__(
        self, config: Config, *, policy: Policy | None = None, reuse_port: bool = False, role: Role = "all",
        config_path: str | None = None, store: SnapshotStore | None = None, inflight: InflightTable | None = None,
        on_outcome: Callable[[str, Outcome], None] | None = None,
        load_report: Callable[[str, str], None] | None = None,
        tracing: Tracing | None = None,
        host: HostHooks | None = None,
        response_homes: ResponseHomes | None = None,
        shared_chunks: SharedChunks | None = None,
    ) -> None:
        """`tracing`: the span exporter to use instead of one built from `config.tracing` (tests pass
        one with an in-memory exporter). `on_outcome`: where passive outlier reports go; default: this process's health monitor (role
        "all"). `load_report`: where the ORCA load reports that backends attach to answers go; default: this
        process's telemetry poller, when `telemetry.orca` is on. A --workers data process passes its channel
        to the supervisor for both (workers run no monitor and no poller). `response_homes`: the Responses API's
        response id -> backend map (a --workers data process passes one that shares what it learns).
        `shared_chunks`: a --workers data process's view of the host's tokenised prompt chunks (the precise
        index's tokenizers share them, proxy/dataplane/shared_chunks.py)."""
        self.reuse_port = reuse_port  # several worker processes sharing the listeners (proxy/multiproc/serve.py)
        # "all": one process does everything. With --workers N (proxy/multiproc/serve.py) the supervisor runs
        # "control" (admin listener, control-plane services and tasks) and each worker runs "data" (the
        # listeners and data-plane services) on snapshots the supervisor publishes into its store.
        self.role = role
        self.config_path = config_path  # the file hot reload re-reads (SIGHUP, file change, POST /admin/reload)
        # A worker process passes its own store (proxy/multiproc/serve.py) so that data-plane writes reach the supervisor.
        self.store = store if store is not None else SnapshotStore(Snapshot.initial(config.backend_specs()))
        # A worker of --workers N passes its row of the host-wide table (proxy/multiproc/shared_load.py).
        self.inflight = inflight if inflight is not None else InflightTable()
        # Precise routing on the engines' KV events (telemetry.kv_events): every routing process holds the index.
        self.precise = build_precise_routing(config, shared_chunks) if role != "control" else None
        self.metrics = ProxyMetrics(render=host.render_metrics if host is not None else None)
        self.metrics.watch(self.store, self.inflight)
        for collector in host.collectors if host is not None else ():
            self.metrics.register_collector(collector)
        self.admin_token = config.admin.resolved_token()
        self.admin_app = build_admin_app(self.store, self.inflight, self.metrics,
                                         ready_checks=host.ready_checks if host is not None else ())
        self._host = host
        self._response_homes = response_homes
        self.session: aiohttp.ClientSession | None = None
        # The data plane's relay pool: requests of every HTTP version go through it (started in start()).
        # https:// and grpcs:// backends: one SSLContext per backend section, from the config in force.
        self.backend_tls = backend_tls(lambda: self.config)
        self.upstream: UpstreamPool = create_pool(config, self.metrics.upstream, self.backend_tls)
        self.http: HttpDataPlane | None = None
        self._services: list[tuple[Service, bool]] = []
        self._tasks: list[_Task] = []
        self._http_runner: HttpListener | None = None
        self._admin_runner: web.AppRunner | None = None
        self._started = False
        self._observer_task: asyncio.Task[None] | None = None
        # Every process's own event-loop stalls (affinity_proxy_event_loop_lag_seconds).
        self.loop_lag = LoopLag()
        self.metrics.register_collector(self.loop_lag.collect)
        self._lag_task: asyncio.Task[None] | None = None
        self._install_observability(config, tracing)
        self._install_subsystems(config, policy, on_outcome, load_report)

    @property
    def config(self) -> Config:
        """The configuration in force (a hot reload replaces it)."""
        return self.resilience.config

    @property
    def policy(self) -> Policy:
        return self.router.policy

    def _own_load(self) -> dict[str, PeerEntry]:
        """This process's load per backend, as routing.peer_load publishes it (`peer_load.own_load`)."""
        work = self._work
        assert work is not None  # a routing process's, made with the exchange that calls this
        seen = self.peer_load.peers() if self.peer_load is not None else None
        return own_load(work, self.inflight, [b.name for b in self.store.current.backends], seen)

    # ------------------------------------------------------------------------------------------ hooks

    def add_service(self, service: Service, *, data_plane: bool = False) -> None:
        if self._started:
            raise RuntimeError("services must be added before start()")
        self._services.append((service, data_plane))

    def add_task(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        if self._started:
            raise RuntimeError("tasks must be added before start()")
        self._tasks.append(_Task(name, factory))

    def _install_observability(self, config: Config, tracing: Tracing | None) -> None:
        """Access log, heat-map windows and hot-spot rules, traces (proxy/observability).

        "all": one Observer judges its own windows. "data" (a --workers worker): access log and windows of
        its own requests, windows handed to the supervisor (`observer.take_closed()`, over the channel).
        "control" (the supervisor): an aggregator that merges every worker's windows, judges them and serves
        /dashboard and /admin/hotspots for the whole host; it writes no access log (it serves no requests).
        Tracing is built in each process that serves requests (after the fork, for workers)."""
        logging_config = config.logging
        if self.role == "control":
            logging_config = dataclasses.replace(
                logging_config, access_log=dataclasses.replace(logging_config.access_log, enabled=False))
        role: Literal["single", "worker", "aggregator"] = (
            "single" if self.role == "all" else "worker" if self.role == "data" else "aggregator")
        # Optional: a hot spot's routing weight is lowered until it clears, where the windows are judged
        # (one process, or the supervisor), through the store as the admin weight endpoint does.
        weights = None
        if config.hotspots.lower_weight_to is not None and self.role != "data":
            weights = HotspotWeights(self.store, config.hotspots.lower_weight_to)
        self.observer = Observer(logging_config, config.hotspots, self.metrics.registry, role=role,
                                 on_event=None if weights is None else weights.on_event)
        self.tracing: Tracing | None = None
        if self.role != "control":
            self.tracing = tracing if tracing is not None else build_tracing(config.tracing)
        self.observability = Observability(self.observer if self.role != "control" else None, self.tracing,
                                           self.metrics)
        if self.role != "data":
            store, inflight = self.store, self.inflight
            self.admin_app.add_routes(observability_routes(
                self.observer, lambda: snapshot_json(store.current, inflight)))

    def _install_subsystems(self, config: Config, policy: Policy | None,
                            on_outcome: Callable[[str, Outcome], None] | None,
                            load_report: Callable[[str, str], None] | None) -> None:
        """Where the parts are built from the config, each given what it uses, in dependency order;
        optional subsystems (telemetry poller, the gRPC listener) are one guarded block each."""
        data = self.role != "control"
        control = self.role != "data"
        # Telemetry: the poller is a control-plane service (the supervisor's, with --workers); data-only
        # workers get their snapshots from the supervisor, so they neither poll nor fold in ORCA reports.
        self.telemetry: Poller | None = None
        self.telemetry_metrics = TelemetryMetrics(self.metrics.registry)
        self.metrics.register_collector(self.telemetry_metrics.snapshot_collector(self.store, time.monotonic))
        if config.telemetry.enabled and control:
            self.telemetry = Poller(self.store, config.telemetry, metrics=self.telemetry_metrics,
                                    tls=self.backend_tls)
            self.add_service(self.telemetry)
        # Resilience's data-plane pieces go into the router: saturation thresholds, panic routing, the
        # overload queue and the passive outlier reports (proxy/resilience.py owns them on reload).
        resilience_metrics = ResilienceMetrics(self.metrics.registry)
        matcher = self.precise.matcher if self.precise is not None else None
        # The other replicas' load through Redis (routing.peer_load, optional): a data-plane service in each
        # routing process, built even while off so that a reload can turn it on (proxy/control/peer_load.py).
        self.peer_load: PeerLoadExchange | None = None
        # The process's one work ledger (proxy/core/work_ledger.py): the queued prefill of every request this
        # process routes, whichever policy routed it (the main one, an experiment arm's) and whichever
        # config was in force (it outlives a reload, like the requests it counts). Load belongs to the
        # backends, not to a policy: a ledger per policy would miss the requests the others sent while the
        # in-flight counts it is read against include them, and with routing.peer_load an arm's requests
        # would never be published. Only a routing process has one (the supervisor routes nothing).
        # With the engines' KV events it subtracts the prefill they have done since (work_ledger "Progress"),
        # as the host-wide table does with --workers.
        progress = self.precise.index.progress if self.precise is not None else None
        self._work: WorkLedger | None = WorkLedger(progress=progress) if data else None
        shared = isinstance(self.inflight, SharedInflightTable) and self.inflight.row is not None
        if data and progress is not None and shared:
            self.inflight.follow_progress(progress)  # type: ignore[attr-defined]  # shared: a worker's table
        if data:
            worker = self.inflight.row if isinstance(self.inflight, SharedInflightTable) else None
            self.peer_load = PeerLoadExchange(config.routing.peer_load, self._own_load, worker=worker,
                                              registry=self.metrics.registry)
            self.add_service(self.peer_load, data_plane=True)

        def make_policy(routing: RoutingConfig) -> Policy:  # at start and on every reload
            peers = self.peer_load.peers if self.peer_load is not None and routing.peer_load.enabled else None
            return build_policy(routing, precise=matcher, work=self._work, peers=peers)

        monitor = HealthMonitor(self.store, config.health_checks, config.outlier_detection, metrics=resilience_metrics)
        queue = AdmissionQueue(config.overload, resilience_metrics)
        if on_outcome is None and self.role == "all":
            on_outcome = monitor.report
        # Live experiments (proxy/experiments): arms of policies or canary groups, judged by guardrails; the
        # runtime runs where requests are routed (each worker of --workers N judges its own traffic).
        def make_arm_policy(routing: RoutingConfig) -> Policy:
            # An arm's policy reads what the main one reads: the KV-event lookup, the other replicas' load
            # (None while routing.peer_load is off: the exchange then holds no view) and the process's work
            # ledger, which it records into, so that its requests are counted and published like the rest.
            return build_policy(routing, precise=matcher, work=self._work,
                                peers=self.peer_load.peers if self.peer_load is not None else None)

        self.experiments = ExperimentRuntime(config.experiments, build_policy=make_arm_policy,
                                             admin_token=self.admin_token, routes=data)
        add_experiment_routes(self.admin_app, self.experiments)
        if data:  # a --workers supervisor routes nothing: its /metrics merges the workers' per-arm series
            self.metrics.register_collector(self.experiments.collect)
            self.add_service(self.experiments, data_plane=True)
        self.router = Router(
            self.store, policy if policy is not None else make_policy(config.routing), self.inflight, self.metrics,
            max_inflight_total=config.limits.max_inflight_total,
            overload=config.overload if data else None,
            panic=panic_view(config.overload, monitor) if data else None,
            queue=queue if data else None,
            on_outcome=on_outcome if data else None,
            experiments=self.experiments if data else None,
            aliases=config.model_aliases(),
            adapter_catalog=frozenset(config.lora_pool.adapters) if config.lora_pool.enabled else frozenset(),
            prepare=self.precise.prepare if self.precise is not None and data else None,
        )
        # The LoRA adapter pool (off unless configured): a control-plane service acting on the router's demand.
        if config.lora_pool.enabled and control:
            demand = self._host.adapter_demand if self._host is not None else None
            self.add_service(LoraPool(self.store, demand or self.router.take_adapter_demand, self.inflight,
                                      config.lora_pool, self.metrics.registry))
        # Resilience (proxy/resilience.py): health checks, outlier ejection, drains, hot reload, discovery and
        # the admin write endpoints; retries, overload shedding and panic routing in the router.
        # Called with every configuration a reload swapped in: the supervisor's copy of the experiment
        # definitions (its /admin/experiments) follows reloads, and the --workers supervisor forwards them.
        on_reload: list[Callable[[Config], None]] = []
        if not data:
            on_reload.append(lambda new: self.experiments.reconfigure(new.experiments))
        if self._host is not None:
            on_reload.extend(self._host.on_reload)
        # KV-event subscriber (a data-plane service, one per routing process): its subscriptions follow reloads.
        self.kv_events = self.precise.subscriber(self.metrics.registry, self.store) if self.precise is not None else None
        if self.kv_events is not None and isinstance(self.inflight, SharedInflightTable) and self.inflight.row is not None:
            # Its host-mates measure this worker's entries' progress with its index's count, as of its events.
            self.kv_events.on_progress = self.inflight.publish_count
        if self.kv_events is not None:
            on_reload.append(self.kv_events.reload)
            if self.kv_events.drain_interval_s > 0:
                self.router.refresh = self.kv_events.drain  # every pick sees the events that have arrived
        if self.peer_load is not None:
            peer_load = self.peer_load

            def follow_peer_load(new: Config) -> None:
                peer_load.reload(new.routing.peer_load)
            on_reload.append(follow_peer_load)
        self.resilience = Resilience(
            config, store=self.store, inflight=self.inflight, router=self.router, monitor=monitor, queue=queue,
            metrics=resilience_metrics, build_policy=make_policy, close_idle=self._close_idle,
            control=control, data=data, admin_app=self.admin_app if control else None,
            admin_token=self.admin_token, config_path=self.config_path, backend_tls=self.backend_tls,
            on_reload=on_reload,
        )
        # The OpenAI pipeline (proxy/dataplane/openai.py), shared by HTTP/1.1 and the HTTP/2 bridge.
        orca = load_report
        if orca is None and self.telemetry is not None and config.telemetry.orca:
            orca = self.telemetry.observe_orca
        self.openai: OpenAIPipeline[Any] = OpenAIPipeline(
            self.router, self.upstream, self.metrics, retries=self.resilience.retries if data else None,
            load_report=orca, debug_headers=config.debug_headers, max_body_bytes=config.limits.max_body_bytes,
            session_header=config.routing.session_header, observability=self.observability,
            response_homes=self._response_homes,
        )
        # The HTTP/2 side (proxy/grpc): a data-plane service sharing this process's router and in-flight table.
        # It serves the HTTP/2 connections of the main listener (one port for every protocol) and, with
        # `grpc_listen`, a port of its own. TLS contexts are built here, in each process (they do not pickle).
        self.grpc: GrpcListener | None = None
        self.tls: dict[str, ServerTls] = {}
        for name, tls_cfg in (("listen", config.listen.tls), ("admin", config.admin.tls),
                              ("grpc_listen", config.grpc_listen.tls if config.grpc_listen else None)):
            built = server_tls(tls_cfg, name)
            if built is not None and (data if name != "admin" else control):
                self.tls[name] = built
        if data:
            grpc_listen = config.grpc_listen
            self.grpc = GrpcListener(
                grpc_listen.host if grpc_listen else None, grpc_listen.port if grpc_listen else 0, config.grpc,
                router=self.router, retries=self.resilience.retries, openai=self.openai,
                store=self.store, inflight=self.inflight, admin_token=self.admin_token,
                connect_timeout_s=config.timeouts.connect_s, drain_s=config.timeouts.drain_s,
                reuse_port=self.reuse_port, tls=self.tls.get("grpc_listen"), backend_tls=self.backend_tls,
                # The main port serves gRPC too: the admin rule judges the more exposed of the two hosts.
                admin_host=config.listen.host if grpc_listen is None or not is_loopback(config.listen.host)
                else grpc_listen.host,
            )
            self.add_service(self.grpc, data_plane=True)
        if self.kv_events is not None:
            self.add_service(self.kv_events, data_plane=True)
        self.add_service(self.resilience, data_plane=self.role == "data")

    async def _close_idle(self, spec: BackendSpec) -> None:
        """A backend left: close its idle upstream connections now (proxy/control/membership.py)."""
        n = 0
        if self.session is not None:
            n = await close_idle_connections(self.session, spec)
        n += self.upstream.close_idle(spec.url)  # the data plane's relay pool
        if n:
            log.info("closed %d idle upstream connections to %s", n, spec.name)

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._started = True
        cfg = self.config
        self.session = create_session(cfg, self.backend_tls)
        self.upstream.start()
        if self.role != "control":
            tmo = cfg.timeouts
            self.http = HttpDataPlane(
                self.openai, self.session, self.metrics,
                max_header_bytes=cfg.limits.max_header_bytes, connect_timeout_s=tmo.connect_s,
                limits=ClientLimits(
                    max_header_bytes=cfg.limits.max_header_bytes, header_s=tmo.client_header_s,
                    body_idle_s=tmo.client_body_idle_s, body_s=tmo.client_body_s, keepalive_s=tmo.client_keepalive_s,
                    max_per_client=cfg.limits.max_connections_per_client),
            )
            if self.grpc is not None:
                await self.grpc.start()  # before the main listener hands it HTTP/2 connections
            sock = listening_socket(cfg.listen.host, cfg.listen.port, reuse_port=self.reuse_port)
            tls = self.tls.get("listen")
            self._http_runner = await self.http.listen(
                sock, drain_s=tmo.drain_s + DRAIN_GRACE_S, backlog=DATA_BACKLOG, h2=self.grpc.protocol if self.grpc else None,
                ssl_context=tls.context if tls else None,
            )
        if self.role != "data":
            self._admin_runner = web.AppRunner(self.admin_app, access_log=None)
            await self._admin_runner.setup()
            sock = listening_socket(cfg.admin.host, cfg.admin.port, backlog=ADMIN_BACKLOG)
            tls = self.tls.get("admin")
            await web.SockSite(self._admin_runner, sock, backlog=ADMIN_BACKLOG,
                               ssl_context=tls.context if tls else None).start()
        for name in ("listen", "admin"):  # grpc_listen's is the gRPC listener's own
            if name in self.tls:
                self.tls[name].start()
        for service, data_plane in self._services:
            if self._runs(data_plane):
                await service.start()
        # Closes quiet windows on time and writes out a quiet proxy's access-log lines, every second.
        self._observer_task = asyncio.create_task(self.observer.run(), name="observer")
        self._lag_task = asyncio.create_task(self.loop_lag.run(), name="loop-lag")
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

        async def deadline() -> None:
            # At timeouts.drain_s, streams still open end with an OpenAI error event and requests not yet
            # answered with a 503 (HTTP/1.1 and the HTTP/2 bridge alike); gRPC calls end UNAVAILABLE in
            # GrpcListener.stop at the same deadline.
            await asyncio.sleep(self.config.timeouts.drain_s)
            n = self.openai.expire()
            if n:
                log.warning("drain deadline (%g s) passed: ended %d requests still in flight",
                            self.config.timeouts.drain_s, n)

        expiry = asyncio.create_task(deadline()) if self._runs(True) else None
        results = await asyncio.gather(*drains, return_exceptions=True)
        if expiry is not None:
            expiry.cancel()
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
        await cancel_and_wait(self._observer_task)
        self._observer_task = None
        await cancel_and_wait(self._lag_task)
        self._lag_task = None
        self.observer.close()
        if self.tracing is not None:
            # Exports what is still queued; off the loop, which may serve the collector itself (tests).
            await asyncio.to_thread(self.tracing.shutdown)
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        for tls in self.tls.values():
            await tls.stop()
        if self.session is not None:
            await self.session.close()
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
    def _url(runner: web.BaseRunner | HttpListener | None, tls: bool = False) -> str:
        if runner is None or not runner.addresses:
            raise RuntimeError("not started")
        host, port = runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if tls else 'http'}://{host}:{port}"

    @property
    def http_url(self) -> str:
        return self._url(self._http_runner, "listen" in self.tls)

    @property
    def admin_url(self) -> str:
        return self._url(self._admin_runner, "admin" in self.tls)
