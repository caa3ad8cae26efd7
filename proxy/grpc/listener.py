"""The HTTP/2 side: gRPC calls relayed per stream, plain HTTP/2 requests bridged to the OpenAI pipeline.

`GrpcListener` is a data-plane service. It always serves the HTTP/2 connections that the main data
listener hands over (ALPN h2 or the h2c preface, proxy/listen.py `ProtocolSniffer`, through `protocol()`),
and when ``grpc_listen`` is configured it also binds a port of its own (h2c, or TLS with ``grpc_listen.tls``). It is given the process's `Router`
(same policy, same in-flight table, same metrics as HTTP, so gRPC and HTTP traffic are balanced as one),
the shared `RetryController`, and the OpenAI pipeline that plain HTTP/2 requests go through; at start it
builds the `RelayContext` every connection and call of the listener reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping

from proxy.control.store import SnapshotStore
from proxy.core.decision import Inflight
from proxy.dataplane.openai import OpenAIPipeline
from proxy.dataplane.retry import RetryController
from proxy.dataplane.router import Router
from proxy.grpc.connection import Flusher, quiet_hpack_logging
from proxy.grpc.context import LOCAL_BACKEND, RelayContext
from proxy.grpc.downstream import Downstream
from proxy.grpc.extractors import ExtractorRegistry
from proxy.grpc.grpc_config import GrpcOptions
from proxy.grpc.local import LocalServices
from proxy.grpc.upstream import BackendPool, PoolOptions, Pools
from proxy.listen import DATA_BACKLOG, listening_socket
from proxy.tls import ClientTls, ServerTls

log = logging.getLogger("affinity_proxy.grpc")
DRAIN_GRACE_S = 1.0  # after the drain deadline, for bridged HTTP/2 requests to write their final answers


class GrpcListener:
    """Data-plane service: ``async start()`` binds host:port; ``async stop()`` drains then closes."""

    def __init__(
        self, host: str | None, port: int, options: GrpcOptions, *, router: Router, retries: RetryController,
        openai: OpenAIPipeline[None], store: SnapshotStore, inflight: Mapping[str, Inflight],
        admin_token: str | None, connect_timeout_s: float, drain_s: float, reuse_port: bool = False,
        tls: ServerTls | None = None, backend_tls: ClientTls | None = None, admin_host: str | None = None,
    ) -> None:
        """`host` None: no port of its own, only the connections the main listener hands over. `tls`: this
        listener's own TLS (grpc_listen.tls); `backend_tls`: the contexts of grpcs:// backends."""
        self.host = host
        # The most exposed address the admin service is reachable on (this port, or the main port that hands
        # over its HTTP/2 connections): off loopback, its writes need the admin token.
        self._admin_host = admin_host if admin_host is not None else (host or "127.0.0.1")
        self.requested_port = port
        self.options = options
        self._router = router
        self._retries = retries
        self._openai = openai
        self._store = store
        self._inflight = inflight
        self._admin_token = admin_token
        self._connect_timeout_s = connect_timeout_s
        self._drain_s = drain_s
        self._reuse_port = reuse_port
        self._tls = tls
        self._backend_tls = backend_tls
        self._started = False
        self.ctx: RelayContext | None = None
        self.local: LocalServices | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def protocol(self) -> Downstream:
        """A server connection for an HTTP/2 transport (the main listener's hand-over; start() first)."""
        assert self.ctx is not None, "start() first"
        return Downstream(self.ctx)

    async def start(self) -> None:
        """Idempotent: the proxy starts it before the main listener, which hands it connections."""
        if self._started:
            return
        self._started = True
        quiet_hpack_logging()  # after logging is configured: hpack keeps its debug lines when asked for
        options = self.options
        self.local = LocalServices(self._store, self._inflight, admin=options.admin_service,
                                   admin_token=self._admin_token, listener_host=self._admin_host)
        await self.local.start()
        loop = asyncio.get_running_loop()
        flusher = Flusher(loop)
        pools = Pools(
            PoolOptions(
                max_concurrent_streams=options.max_concurrent_streams,
                stream_window_bytes=options.stream_window_bytes,
                connection_window_bytes=options.connection_window_bytes,
                max_connections_per_backend=options.max_connections_per_backend,
                connect_timeout_s=self._connect_timeout_s,
                ping_interval_s=options.upstream_ping_interval_s,
                ping_timeout_s=options.upstream_ping_timeout_s,
                idle_timeout_s=options.upstream_idle_timeout_s,
            ),
            flusher,
            self._backend_tls,
        )
        self.ctx = ctx = RelayContext(
            options=options, router=self._router, retries=self._retries, registry=ExtractorRegistry(options),
            flusher=flusher, pools=pools,
            local_pool=BackendPool(LOCAL_BACKEND, self.local.address, pools.options, flusher),
            openai=self._openai,
        )
        pools.start()
        if self.host is None:
            return
        sock = listening_socket(self.host, self.requested_port, reuse_port=self._reuse_port)
        ssl_context = self._tls.context if self._tls is not None else None
        self._server = await loop.create_server(lambda: Downstream(ctx), sock=sock, backlog=DATA_BACKLOG,
                                                ssl=ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        if self._tls is not None:
            self._tls.start()
        log.info("gRPC/%s listener on %s", "h2 over TLS" if self._tls else "h2c", self.address)

    async def stop(self) -> None:
        """Stop accepting; let calls in flight finish for up to timeouts.drain_s; then close everything."""
        if self._server is not None:
            self._server.close()
        ctx = self.ctx
        if ctx is not None:
            deadline = time.monotonic() + self._drain_s
            for down in list(ctx.downstreams):
                down.goaway()
            while any(d.calls or d.others for d in ctx.downstreams) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # The deadline passed: calls still open end UNAVAILABLE (the client may retry elsewhere); plain
            # HTTP/2 requests end through the OpenAI pipeline's own expiry (an SSE error event or a 503).
            for down in list(ctx.downstreams):
                down.expire_calls(f"the proxy is shutting down: drain deadline ({self._drain_s:g} s) passed")
            grace = time.monotonic() + DRAIN_GRACE_S
            while any(d.others for d in ctx.downstreams) and time.monotonic() < grace:
                await asyncio.sleep(0.02)
            ctx.flusher.run()
            for down in list(ctx.downstreams):
                down.close()
            ctx.pools.close()
            ctx.local_pool.close()
            ctx.flusher.run()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._tls is not None:
            await self._tls.stop()
        if self.local is not None:
            await self.local.stop()
            self.local = None


__all__ = ["GrpcListener"]
