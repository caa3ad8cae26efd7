"""A fleet of simulated GPU servers in one process: what tests, load tests and `affinity-proxy demo` run on.

Each `SimServer` is one GPU server: its own engine and cache (`SimBackend`), its own HTTP listener and,
optionally, its own gRPC listener, all on one event loop. Several servers share the loop cheaply because
the engine is a model, not a computation: a 2-core machine hosts eight of them.

    fleet = await start_fleet(4, profile="llama3-8b-h100", flavor="vllm", speed=1.0)
    fleet.servers[0].url            # "http://127.0.0.1:PORT"
    fleet.servers[0].grpc_address   # "127.0.0.1:PORT" or None
    fleet.servers[0].backend        # SimBackend (generate(), engine, faults)
    await fleet.servers[0].set_faults({"fail_rate": 0.5})
    await fleet.stop()
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from aiohttp import web

from .backend import SimBackend
from .faults import Faults
from .kv_events import KVEventsConfig
from .profiles import Profile, get_profile
from .server import SimHttpApp


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def grpc_available() -> bool:
    try:
        from . import grpc as _grpc  # noqa: F401
    except ImportError:
        return False
    return True


class SimServer:
    """One simulated GPU server: backend + HTTP listener (+ gRPC listener)."""

    def __init__(self, backend: SimBackend, *, host: str, port: int, grpc_port: int | None, flavor: str,
                 fleet: Fleet | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        """`tls_cert`/`tls_key`: PEM chain and key; HTTP (https://) and gRPC (grpcs://) are then served over TLS."""
        self.backend = backend
        self.tls_cert = tls_cert
        self.tls_key = tls_key
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self.flavor = flavor
        self._fleet = fleet
        self.http = SimHttpApp(backend, flavor=flavor, on_faults_change=self._sync_listeners, lookup=self._lookup)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._grpc: Any = None
        self._listening = False
        self._lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls_cert else 'http'}://{host}:{self.port}"

    @property
    def grpc_address(self) -> str | None:
        if self.grpc_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'grpcs://' if self.tls_cert else ''}{host}:{self.grpc_port}"

    @property
    def grpc_server(self) -> Any:
        """The gRPC front end (`sim.grpc.SimGrpcServer`) or None."""
        return self._grpc

    def _lookup(self, name: str) -> SimHttpApp | None:
        if self._fleet is None:
            return None
        server = self._fleet.by_name(name)
        return server.http if server is not None else None

    async def start(self) -> None:
        await self.backend.start()
        self._runner = web.AppRunner(self.http.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await self._open()

    async def _open(self) -> None:
        assert self._runner is not None
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock, ssl_context=self._tls_context())
        await self._site.start()
        if self.grpc_port is not None:
            from .grpc import start_grpc_server

            self._grpc = await start_grpc_server(self.backend, self.host, self.grpc_port, ssl=self._tls_context())
            self.grpc_port = self._grpc.port
            self._grpc.set_serving(not self.backend.faults.health_fail)
        self._listening = True

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    async def _close_listeners(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._grpc is not None:
            self._grpc.kill()  # a refused/dead server: open gRPC connections die too
            await self._grpc.close()
            self._grpc = None
        self._listening = False

    async def _sync_listeners(self) -> None:
        """Bring the listeners and gRPC health in line with the fault switches."""
        async with self._lock:
            want = not self.backend.faults.refuse_connections and not self.backend.stopped
            if want and not self._listening:
                await self._open()
            elif not want and self._listening:
                await self._close_listeners()
            if self._grpc is not None:
                self._grpc.set_serving(not self.backend.faults.health_fail)

    async def set_faults(self, changes: Mapping[str, Any]) -> None:
        """Same keys as POST /sim/faults; refused connections take effect before this returns."""
        await self.http.apply_faults(dict(changes))
        await self._sync_listeners()

    async def stop(self) -> None:
        self.backend.stopped = True
        async with self._lock:
            if self._listening:
                await self._close_listeners()
        await self.backend.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass
class Fleet:
    servers: list[SimServer] = field(default_factory=list)

    def by_name(self, name: str) -> SimServer | None:
        return next((s for s in self.servers if s.name == name), None)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_fleet(
    n: int = 4,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    grpc_port: int | None = None,
    profile: str | Profile = "llama3-8b-h100",
    flavor: str | Sequence[str] = "vllm",
    seed: int = 0,
    faults: Faults | Mapping[str, Any] | None = None,
    speed: float = 1.0,
    adapters: Sequence[str] = (),
    model_name: str | None = None,
    name_prefix: str = "sim",
    profile_overrides: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
    kv_events: KVEventsConfig | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Fleet:
    """Start `n` simulated servers; HTTP on `port`, `port+1`, ... (0 = free ports), gRPC likewise.

    `flavor` may be one name or one per server (a mixed fleet). `faults` (a `Faults` or its JSON keys)
    is copied into every server. `speed` > 1 runs simulated time faster than the wall clock. Server i is
    named f"{name_prefix}-{i}" and seeded with `seed + i`. `max_model_len` overrides the profile's
    context length (same architecture, longer context). `kv_events` turns on vLLM-style KV-cache event
    publishing (`sim/kv_events.py`); server i publishes on `kv_events.for_server(i)` and
    `server.backend.kv_publisher.endpoint` says where.
    `tls_cert`/`tls_key` (PEM files): every server speaks TLS (https:// and grpcs://) with that pair.
    """
    if n < 1:
        raise ValueError("a fleet needs at least one server")
    if grpc_port is not None and not grpc_available():
        raise RuntimeError("--grpc-port needs sim/grpc.py (the simulator's gRPC front end), which is missing")
    prof = profile if isinstance(profile, Profile) else get_profile(profile)
    if profile_overrides:
        prof = prof.with_overrides(**profile_overrides)
    if max_model_len:
        # e.g. Llama-3.1-8B: Llama-3-8B's architecture with a 128k context.
        prof = prof.with_overrides(model=replace(prof.model, max_model_len=max_model_len))
    flavors = [flavor] * n if isinstance(flavor, str) else list(flavor)
    if len(flavors) != n:
        raise ValueError(f"{len(flavors)} flavors given for {n} servers")
    fleet = Fleet()
    try:
        for i in range(n):
            f = Faults()
            if isinstance(faults, Faults):
                f.update(faults.to_json())
            elif faults:
                f.update(faults)
            backend = SimBackend(prof, name=f"{name_prefix}-{i}", seed=seed + i, adapters=tuple(adapters),
                                 model_name=model_name, speed=speed, faults=f,
                                 kv_events=kv_events.for_server(i) if kv_events is not None else None)
            server = SimServer(
                backend,
                host=host,
                port=port + i if port else 0,
                grpc_port=(grpc_port + i if grpc_port else 0) if grpc_port is not None else None,
                flavor=flavors[i],
                fleet=fleet,
                tls_cert=tls_cert,
                tls_key=tls_key,
            )
            fleet.servers.append(server)
            await server.start()
            if f.refuse_connections:
                await server._sync_listeners()
    except BaseException:
        await fleet.stop()
        raise
    return fleet
