"""The gRPC services the proxy answers itself: grpc.health.v1.Health and the admin service.

They run in a grpclib server on a private loopback port, and the listener relays calls for them there
like calls to any backend (same frame path, no second HTTP/2 implementation): grpclib handles the
protocol details (Health.Watch streaming, status codes) and these services stay plain async methods.

Health is SERVING while at least one backend is routable (UNKNOWN counts: a fresh proxy must serve before
its first health check), updated on every snapshot publish. The admin service mirrors the HTTP admin API
and changes the fleet only through `SnapshotStore.update`, so a weight change or a drain reaches the very
next call, on every connection.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, cast

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health
from grpclib.server import Server, Stream

from proxy.control.store import SnapshotStore
from proxy.core.admin_access import write_refusal
from proxy.core.decision import Inflight
from proxy.core.bounds import check_value
from proxy.core.snapshot import WEIGHT_BOUNDS, BackendState, Snapshot
from proxy.core.snapshot import Health as BackendHealth
from proxy.protos import admin_pb2 as pb
from proxy.protos.admin_grpc import ProxyAdminBase

LOCAL_PREFIXES = ("/grpc.health.v1.Health/", "/affinity.admin.v1.ProxyAdmin/")


def backend_status(b: BackendState, inflight: Mapping[str, Inflight]) -> pb.BackendStatus:
    entry = inflight.get(b.name)
    return pb.BackendStatus(
        name=b.name,
        url=b.spec.url,
        grpc_address=b.spec.grpc_address or "",
        health=b.health.value,
        weight=b.effective_weight,
        configured_weight=b.spec.weight,
        routable=b.routable,
        stale=b.stale,
        load_score=b.load_score or 0.0,
        has_load_score=b.load_score is not None,
        inflight_requests=entry.requests if entry else 0,
        inflight_tokens=max(entry.tokens, 0) if entry else 0,
    )


class AdminService(ProxyAdminBase):
    """Reads are open like the HTTP admin's GET endpoints; writes follow the one admin rule of both doors
    (proxy/core/admin_access.py): with the admin token configured (`admin.token` / `admin.token_env`) they
    need ``authorization: Bearer <token>`` metadata; without one they are refused unless the listener they
    came through (`listener_host`, the gRPC listener's address) is loopback."""

    def __init__(self, store: SnapshotStore, inflight: Mapping[str, Inflight], token: str | None = None,
                 listener_host: str = "127.0.0.1") -> None:
        # With --workers, `store` is the worker's WorkerStore: an update here is forwarded to the
        # supervisor, whose next snapshot carries it to every worker (proxy/multiproc/serve.py).
        self._store = store
        self._inflight = inflight
        self._token = token
        self._listener_host = listener_host

    def _authorize(self, stream: Stream[Any, Any]) -> None:
        given = stream.metadata.get("authorization") if stream.metadata is not None else None
        refusal = write_refusal(self._token, self._listener_host, given if isinstance(given, str) else None)
        if refusal is None:
            return
        if refusal.kind == "forbidden":
            raise GRPCError(Status.PERMISSION_DENIED, refusal.message.replace("admin listener", "gRPC listener"))
        raise GRPCError(Status.UNAUTHENTICATED, "admin writes need 'authorization: Bearer <admin token>'")

    def _get(self, snapshot: Snapshot, name: str) -> BackendState:
        b = snapshot.get(name)
        if b is None:
            raise GRPCError(Status.NOT_FOUND, f"no backend named '{name}'")
        return b

    async def ListBackends(self, stream: Stream[pb.ListBackendsRequest, pb.ListBackendsResponse]) -> None:
        await stream.recv_message()
        snap = self._store.current
        await stream.send_message(pb.ListBackendsResponse(
            snapshot_version=snap.version, backends=[backend_status(b, self._inflight) for b in snap.backends]))

    async def GetBackend(self, stream: Stream[pb.GetBackendRequest, pb.BackendStatus]) -> None:
        req = await stream.recv_message()
        assert req is not None
        await stream.send_message(backend_status(self._get(self._store.current, req.name), self._inflight))

    async def SetWeight(self, stream: Stream[pb.SetWeightRequest, pb.BackendStatus]) -> None:
        self._authorize(stream)
        req = await stream.recv_message()
        assert req is not None
        try:
            check_value("weight", req.weight, WEIGHT_BOUNDS)  # the bound of YAML's and the HTTP admin's weight
        except ValueError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        self._get(self._store.current, req.name)
        snap = self._store.update(lambda s: s.replace_backend(req.name, weight=req.weight))
        await stream.send_message(backend_status(self._get(snap, req.name), self._inflight))

    async def Drain(self, stream: Stream[pb.DrainRequest, pb.BackendStatus]) -> None:
        self._authorize(stream)
        req = await stream.recv_message()
        assert req is not None
        current = self._get(self._store.current, req.name)
        if req.drain:
            health = BackendHealth.DRAINING
        elif current.health is BackendHealth.DRAINING:
            # Back to "not yet checked": the health checker decides from here on.
            health = BackendHealth.UNKNOWN
        else:
            health = current.health
        snap = self._store.update(lambda s: s.replace_backend(req.name, health=health))
        await stream.send_message(backend_status(self._get(snap, req.name), self._inflight))


class LocalServices:
    """The private grpclib server behind the listener's local routes."""

    def __init__(self, store: SnapshotStore, inflight: Mapping[str, Inflight], *, admin: bool = True,
                 admin_token: str | None = None, listener_host: str = "127.0.0.1") -> None:
        self.status = ServiceStatus()
        self._store = store
        services: list[object] = []
        checks: dict[object, list[ServiceStatus]] = {OVERALL: [self.status]}
        if admin:
            admin_service = AdminService(store, inflight, admin_token, listener_host)
            services.append(admin_service)
            checks[admin_service] = [self.status]
        services.append(Health(checks))  # type: ignore[arg-type]  # grpclib types the keys as its own service base, not object
        self._server = Server(services)  # type: ignore[arg-type]  # grpclib wants IServable; ours are its generated bases
        self.port = 0
        self._update(store.current)
        store.subscribe(self._update)

    def _update(self, snapshot: Snapshot) -> None:
        self.status.set(bool(snapshot.routable()))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self._server.start("127.0.0.1", 0)
        assert self._server._server is not None  # noqa: SLF001 - grpclib exposes no bound-address accessor
        server = cast("asyncio.Server", self._server._server)  # noqa: SLF001 - grpclib types it AbstractServer; loop.create_server made a Server
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()


__all__ = ["AdminService", "LOCAL_PREFIXES", "LocalServices", "backend_status"]
