"""The h2c (prior knowledge) listener: gRPC calls relayed per stream, plain HTTP/2 requests bridged.

`GrpcListener` is a data-plane service of `AffinityProxy` (``grpc_listen`` in the config): it shares the
proxy's `Router` (same policy, same in-flight table, same metrics) with the HTTP data plane, so gRPC and
HTTP traffic are balanced as one. `RelayContext` is what every connection and call of the listener reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from proxy.config import Config
from proxy.core.decision import Outcome
from proxy.core.request import RequestSummary
from proxy.dataplane.router import Router
from proxy.grpc.bridge import HttpBridgeCall
from proxy.grpc.extractors import ExtractorRegistry
from proxy.grpc.connection import Flusher, quiet_hpack_logging
from proxy.grpc.local import LOCAL_PREFIXES, LocalServices
from proxy.grpc.call import Downstream
from proxy.grpc.grpc_config import GrpcOptions
from proxy.grpc.upstream import BackendPool, PoolOptions, Pools
from proxy.dataplane.retry import RetryController

if TYPE_CHECKING:
    from proxy.app import AffinityProxy
    from proxy.http.server import HttpDataPlane

log = logging.getLogger("affinity_proxy.grpc")

LOCAL_BACKEND = "<proxy>"


class RelayContext:
    """Everything calls on the listener share: options, extractors, router, pools, counters."""

    def __init__(self, config: Config, options: GrpcOptions, router: Router,
                 http_plane: Callable[[], "HttpDataPlane | None"]) -> None:
        loop = asyncio.get_running_loop()
        self.options = options
        self.router = router
        self.inflight = router.inflight
        self.metrics = router.metrics
        self.registry = ExtractorRegistry(options)
        self.flusher = Flusher(loop)
        self.pools = Pools(
            PoolOptions(
                max_concurrent_streams=options.max_concurrent_streams,
                stream_window_bytes=options.stream_window_bytes,
                connection_window_bytes=options.connection_window_bytes,
                max_connections_per_backend=options.max_connections_per_backend,
                connect_timeout_s=config.timeouts.connect_s,
                ping_interval_s=options.upstream_ping_interval_s,
                ping_timeout_s=options.upstream_ping_timeout_s,
                idle_timeout_s=options.upstream_idle_timeout_s,
            ),
            self.flusher,
        )
        self.local_pool: BackendPool = BackendPool(LOCAL_BACKEND, "127.0.0.1:0", self.pools.options, self.flusher)
        self.local_prefixes = LOCAL_PREFIXES
        self.downstreams: set[Downstream] = set()
        self.max_body_bytes = config.limits.max_body_bytes
        self.http_session_header = config.routing.session_header
        # The HTTP data plane (its relay pool, ORCA hook and retry controller) for plain HTTP/2 requests.
        self.http_plane = http_plane
        self.retried = 0  # calls sent to another backend after a connection failure
        # The process-wide retry policy and budget (RESILIENCE's RetryController), shared with HTTP; None
        # outside a full AffinityProxy: then a failed first attempt is retried once.
        self.retry_controller: RetryController | None = None
        self.decompressed_for_routing = 0  # compressed first messages inflated (a copy) to be routed
        self._no_grpc_version = -1
        self._no_grpc: frozenset[str] = frozenset()

    def pick(self, summary: RequestSummary, exclude: frozenset[str]) -> tuple[str, str]:
        """Backend name and gRPC address for a call; backends without a gRPC address are never picked."""
        snapshot = self.router.store.current
        if snapshot.version != self._no_grpc_version:
            self._no_grpc = frozenset(b.name for b in snapshot.backends if not b.spec.grpc_address)
            self._no_grpc_version = snapshot.version
            self.pools.prune(lambda name: name in snapshot)
        _, backend = self.router.pick(summary, exclude | self._no_grpc if self._no_grpc else exclude)
        address = backend.spec.grpc_address
        assert address is not None
        return backend.name, address

    @staticmethod
    def tokens_of(summary: RequestSummary) -> int:
        return summary.prompt_tokens_est + (summary.max_tokens or 0)

    def finished(self, backend: str, grpc_status: int, started: float, failure: Outcome | None = None) -> None:
        """A call on `backend` ended. `failure` says how the backend itself failed it (reset, lost
        connection), which outlier detection weighs apart from a status the backend chose to answer."""
        status = http_status_for(grpc_status)
        self.metrics.finished(backend, status, time.monotonic() - started)
        if self.router.queue is not None:
            self.router.queue.notify_one()  # capacity freed: wake one request waiting in the overload queue
        report = self.router.on_outcome  # passive outlier detection (RESILIENCE), as for HTTP leases
        if report is None:
            return
        if failure is not None:
            report(backend, failure)
        elif grpc_status not in _CLIENT_CHOSEN:
            report(backend, Outcome.STATUS_5XX if status >= 500 else Outcome.SUCCESS)

    def attempt_failed(self, backend: str, failure: Outcome) -> None:
        """A first attempt failed before any response and the call goes to another backend."""
        self.metrics.error("grpc_retry")
        report = self.router.on_outcome
        if report is not None:
            report(backend, failure)

    def start_http_bridge(self, down: Downstream, sid: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        down.others[sid] = HttpBridgeCall(self, down, sid, headers, ended)


# grpc-status -> the HTTP status recorded in the shared request metrics (as grpc-gateway maps them).
# Endings the client chose, which say nothing about the backend: CANCELLED (the client left) and
# DEADLINE_EXCEEDED (the client's own grpc-timeout ran out, enforced here or by the backend). Counting a
# deadline as a backend failure would let one client with tight deadlines eject every backend in turn;
# a backend that is really slow or hung is caught by the active health checks (adaptive timeout).
_CLIENT_CHOSEN = frozenset({1, 4})

_HTTP_FOR_GRPC = {0: 200, 1: 499, 2: 500, 3: 400, 4: 504, 5: 404, 6: 409, 7: 403, 8: 429, 9: 400, 10: 409,
                  11: 400, 12: 501, 13: 500, 14: 503, 15: 500, 16: 401}


def http_status_for(grpc_status: int) -> int:
    return _HTTP_FOR_GRPC.get(grpc_status, 500)


class GrpcListener:
    """Data-plane service: ``async start()`` binds ``grpc_listen``; ``async stop()`` drains then closes."""

    def __init__(self, proxy: "AffinityProxy") -> None:
        self._proxy = proxy
        cfg = proxy.config
        if cfg.grpc_listen is None:
            raise ValueError("grpc_listen is not configured")
        self.host = cfg.grpc_listen.host
        self.requested_port = cfg.grpc_listen.port
        self.options: GrpcOptions = getattr(cfg, "grpc", GrpcOptions())
        self.ctx: RelayContext | None = None
        self.local: LocalServices | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        proxy = self._proxy
        quiet_hpack_logging()  # after logging is configured: hpack keeps its debug lines when asked for
        self.local = LocalServices(proxy.store, proxy.inflight, admin=self.options.admin_service,
                                   admin_token=proxy.admin_token)
        await self.local.start()
        self.ctx = ctx = RelayContext(proxy.config, self.options, proxy.router, lambda: proxy.http)
        ctx.local_pool = BackendPool(LOCAL_BACKEND, self.local.address, ctx.pools.options, ctx.flusher)
        resilience = getattr(proxy, "resilience", None)
        controller = getattr(resilience, "retries", None)
        if isinstance(controller, RetryController):
            ctx.retry_controller = controller
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Downstream(ctx), self.host, self.requested_port, backlog=4096,
            reuse_port=proxy.reuse_port or None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        ctx.pools.start()
        log.info("gRPC/h2c listener on %s", self.address)

    async def stop(self) -> None:
        """Stop accepting; let calls in flight finish for up to timeouts.drain_s; then close everything."""
        if self._server is not None:
            self._server.close()
        ctx = self.ctx
        if ctx is not None:
            deadline = time.monotonic() + self._proxy.config.timeouts.drain_s
            for down in list(ctx.downstreams):
                down.goaway()
            while any(d.calls or d.others for d in ctx.downstreams) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for down in list(ctx.downstreams):
                down.close()
            ctx.pools.close()
            ctx.local_pool.close()
            ctx.flusher.run()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self.local is not None:
            await self.local.stop()
            self.local = None
