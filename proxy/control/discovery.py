"""DNS discovery: a backend whose URL host is a DNS name becomes one backend per resolved address.

This is what makes a Kubernetes headless Service work: its name resolves to the pod IPs, and pods come
and go. Every `discovery.interval_ms` each service name is re-resolved (`loop.getaddrinfo`, or an injected
resolver in tests); the addresses become backends named ``<name>@<ip>:<port>`` with the same path, weight,
models and limits, and `Membership` joins the new ones (after their first passing check) and drains the
ones that disappeared, exactly as for a config reload.

A resolution that fails or times out keeps the previous addresses: a DNS outage must not empty the fleet.
The gRPC and metrics addresses follow the pod when they name the same host as the URL.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import replace
from typing import Awaitable, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from proxy.control.membership import Membership
from proxy.config import DiscoveryConfig, is_dns_name, url_host_port
from proxy.core.snapshot import BackendSpec, duplicate_urls

log = logging.getLogger("affinity_proxy.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]
SOURCE = "discovery"


def split_services(specs: Sequence[BackendSpec]) -> tuple[list[BackendSpec], list[BackendSpec]]:
    """(static backends, DNS-named services)."""
    static: list[BackendSpec] = []
    services: list[BackendSpec] = []
    for s in specs:
        (services if is_dns_name(url_host_port(s.url)[0]) else static).append(s)
    return static, services


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _swap_host(url: str, old_host: str, ip: str) -> str:
    parts = urlsplit(url)
    if parts.hostname != old_host:
        return url
    host = f"[{ip}]" if ":" in ip else ip
    netloc = host + (f":{parts.port}" if parts.port else "")
    if parts.username:
        netloc = f"{parts.username}{':' + parts.password if parts.password else ''}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def expand(service: BackendSpec, addresses: Sequence[str]) -> list[BackendSpec]:
    """One spec per address (deduplicated, sorted so the backend order is stable across resolutions)."""
    host, port = url_host_port(service.url)
    assert host is not None
    out = []
    for ip in sorted(set(addresses)):
        grpc = service.grpc_address
        if grpc is not None:
            g_host, _, g_port = grpc.rpartition(":")
            if g_host == host:
                grpc = f"[{ip}]:{g_port}" if ":" in ip else f"{ip}:{g_port}"
        metrics = service.metrics_url
        if metrics is not None:
            metrics = _swap_host(metrics, host, ip)
        addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        out.append(replace(service, name=f"{service.name}@{addr}", url=_swap_host(service.url, host, ip),
                           grpc_address=grpc, metrics_url=metrics))
    return out


def service_of(name: str) -> str | None:
    """The service a discovered backend's name came from (`expand` names them ``<service>@<address>``)."""
    service, at, _ = name.rpartition("@")
    return service if at else None


def unique_urls(specs: Sequence[BackendSpec]) -> list[BackendSpec]:
    """`specs` without the ones whose URL an earlier one has (two services resolving to one pod): the same
    rule as the config's (proxy/core/snapshot.duplicate_urls), applied by dropping, since a DNS answer cannot
    be refused. Each address was already checked as a BackendSpec (weight, limits) when it was built."""
    dropped = {i for i, _ in duplicate_urls(specs)}
    for i, j in sorted(duplicate_urls(specs)):
        log.warning("discovery: %s has the same URL as %s (%s); ignoring it", specs[i].name, specs[j].name,
                    specs[i].url)
    return [s for i, s in enumerate(specs) if i not in dropped]


class Discovery:
    def __init__(
        self,
        membership: Membership,
        cfg: DiscoveryConfig,
        services: Sequence[BackendSpec] = (),
        *,
        resolver: Resolver = system_resolver,
        at_startup: bool = True,
    ) -> None:
        self.membership = membership
        self.cfg = cfg
        self.resolver = resolver
        self.services: tuple[BackendSpec, ...] = tuple(services)
        self.addresses: dict[str, tuple[str, ...]] = {}  # service name -> last good addresses
        self.failures = 0
        # The first view of a discovery running from start-up is the fleet the proxy starts with (serve at
        # once); one switched on by a reload joins like any later address (after its first passing check).
        self._first = at_startup
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()

    def set_services(self, services: Sequence[BackendSpec], cfg: DiscoveryConfig | None = None) -> None:
        """New service list (reload); resolved at once by the running loop."""
        self.services = tuple(services)
        if cfg is not None:
            self.cfg = cfg
        names = {s.name for s in services}
        self.addresses = {k: v for k, v in self.addresses.items() if k in names}
        self._kick.set()

    async def _resolve(self, service: BackendSpec) -> tuple[str, ...] | None:
        host, port = url_host_port(service.url)
        assert host is not None
        try:
            async with asyncio.timeout(self.cfg.timeout_ms / 1000.0):
                found = await self.resolver(host, port)
        except (OSError, TimeoutError) as exc:
            self.failures += 1
            log.warning("resolving %s (%s) failed, keeping %d known addresses: %r",
                        service.name, host, len(self.addresses.get(service.name, ())), exc)
            return None
        if not found:
            self.failures += 1
            log.warning("%s (%s) resolved to no address; keeping the previous ones", service.name, host)
            return None
        return tuple(sorted(set(found)))

    async def refresh(self) -> None:
        """Resolve every service once and hand the expansion to Membership."""
        results = await asyncio.gather(*(self._resolve(s) for s in self.services))
        for service, found in zip(self.services, results):
            if found is not None:
                if found != self.addresses.get(service.name):
                    log.info("%s resolves to %s", service.name, ", ".join(found))
                self.addresses[service.name] = found
        specs: list[BackendSpec] = []
        for service in self.services:
            specs.extend(expand(service, self.addresses.get(service.name, ())))
        self.membership.set_source(SOURCE, unique_urls(specs), joining=not self._first)
        self._first = False

    async def run(self) -> None:
        while True:
            self._kick.clear()
            await self.refresh()
            try:
                await asyncio.wait_for(self._kick.wait(), self.cfg.interval_ms / 1000.0)
            except asyncio.TimeoutError:
                pass


__all__ = ["Discovery", "expand", "is_dns_name", "service_of", "split_services", "system_resolver", "unique_urls",
           "url_host_port"]
