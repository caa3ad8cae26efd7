"""Which backends exist: joins, spec changes and drains, whoever asked (config reload, DNS discovery, admin).

Several sources declare backends: the config file (static URLs) and DNS discovery (one backend per resolved
address of a service name). `Membership` keeps each source's latest list and reconciles their union with
the snapshot:

- a new name joins unroutable until its first passing health check (traffic must not reach an address
  nobody has seen answer), unless it is part of the very first view of a source (nothing to protect yet);
- a name whose spec changed keeps its health and counters; the admin weight override is dropped only when
  the configured weight itself changed (the operator edited the file: the file wins);
- a name that disappeared turns DRAINING: it gets no new request, its in-flight requests and streams
  finish, and once it is idle (or the drain deadline passed) it leaves the snapshot and its idle upstream
  connections are closed, so no ghost connection to a departed server stays in the pool;
- a draining name that reappears before it left is restored, keeping its health.

The admin API drains and restores backends by hand through the same object (`drain` / `restore`); a
hand-drained backend stays in the snapshot until restored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Awaitable, Callable, Mapping, Sequence

from proxy.control.checks import HealthMonitor
from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.control.store import SnapshotStore
from proxy.core.bounds import check_value
from proxy.core.decision import Inflight
from proxy.core.snapshot import WEIGHT_BOUNDS, BackendSpec, BackendState, Health, Snapshot

log = logging.getLogger("affinity_proxy.membership")

CloseIdle = Callable[[BackendSpec], Awaitable[None]]


class Membership:
    def __init__(
        self,
        store: SnapshotStore,
        monitor: HealthMonitor,
        inflight: Mapping[str, Inflight],
        *,
        drain_timeout_s: float = 30.0,
        close_idle: CloseIdle | None = None,
        metrics: ResilienceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.05,
    ) -> None:
        self.store = store
        self.monitor = monitor
        self.inflight = inflight
        self.drain_timeout_s = drain_timeout_s
        self.close_idle = close_idle
        self.metrics = metrics if metrics is not None else monitor.metrics
        self.clock = clock
        self.poll_s = poll_s
        self._sources: dict[str, tuple[BackendSpec, ...]] = {}
        self._removing: dict[str, tuple[float, BackendSpec]] = {}  # name -> (deadline, spec)
        self._manual: set[str] = set()  # drained by the admin API
        self._wake = asyncio.Event()
        self.drained: list[tuple[str, str]] = []  # (name, how) of backends that left, newest last

    # ------------------------------------------------------------------------------------------ sources

    def seed(self, source: str, specs: Sequence[BackendSpec]) -> None:
        """Declare what a source contributed to the initial snapshot, without touching the snapshot."""
        self._sources[source] = tuple(specs)

    def set_source(self, source: str, specs: Sequence[BackendSpec], *, joining: bool = True) -> Snapshot:
        """Replace one source's backends and reconcile. Returns the snapshot now current."""
        self._sources[source] = tuple(specs)
        return self._reconcile(joining)

    def drop_source(self, source: str) -> Snapshot:
        self._sources.pop(source, None)
        return self._reconcile(True)

    def desired(self) -> dict[str, BackendSpec]:
        out: dict[str, BackendSpec] = {}
        for specs in self._sources.values():
            for spec in specs:
                out.setdefault(spec.name, spec)
        return out

    @property
    def removing(self) -> frozenset[str]:
        return frozenset(self._removing)

    def _reconcile(self, joining: bool) -> Snapshot:
        cur = self.store.current
        desired = self.desired()
        now = self.clock()
        states: list[BackendState] = []
        for name, spec in desired.items():
            b = cur.get(name)
            if b is None:
                health = self.monitor.add(name, joining=joining)
                states.append(BackendState(spec=spec, health=health))
                log.info("backend %s joins (%s)", name, spec.url)
                continue
            weight = b.weight if b.spec.weight == spec.weight else None
            health = b.health
            if name in self._removing:
                del self._removing[name]
                if name not in self.monitor.fleet:
                    self.monitor.add(name, joining=joining)
                health = Health.DRAINING if name in self._manual else self.monitor.health(name)
                log.info("backend %s is back before it finished draining", name)
            states.append(replace(b, spec=spec, weight=weight, health=health))
        for b in cur.backends:
            if b.name in desired:
                continue
            if b.name not in self._removing:
                self._removing[b.name] = (now + self.drain_timeout_s, b.spec)
                log.info("backend %s removed: draining (%d in flight)", b.name, self._inflight(b.name))
            states.append(replace(b, health=Health.DRAINING))
        if tuple(states) == cur.backends:
            return cur
        self._wake.set()
        return self.store.publish(cur.evolve(states))

    # ------------------------------------------------------------------------------------------ admin

    def drain(self, name: str) -> Snapshot:
        """Stop sending new work to `name` until `restore` (admin API)."""
        cur = self.store.current
        if name not in cur:
            raise KeyError(name)
        self._manual.add(name)
        state = cur.get(name)  # not None: `name in cur` above
        if state is not None and state.health is Health.DRAINING:
            return cur
        return self.store.publish(cur.replace_backend(name, health=Health.DRAINING))

    def restore(self, name: str) -> Snapshot:
        cur = self.store.current
        if name not in cur:
            raise KeyError(name)
        if name in self._removing:
            raise ValueError(f"backend {name!r} was removed from the configuration and is leaving")
        self._manual.discard(name)
        health = self.monitor.health(name)
        state = cur.get(name)  # not None: `name in cur` above
        if state is not None and state.health is health:
            return cur
        return self.store.publish(cur.replace_backend(name, health=health))

    def set_weight(self, name: str, weight: float | None) -> Snapshot:
        cur = self.store.current
        if name not in cur:
            raise KeyError(name)
        if weight is not None:
            check_value("weight", weight, WEIGHT_BOUNDS)  # the YAML weight's bound: finite, >= 0
        return self.store.publish(cur.replace_backend(name, weight=weight))

    # ------------------------------------------------------------------------------------------ drains

    def _inflight(self, name: str) -> int:
        entry = self.inflight.get(name)
        return 0 if entry is None else entry.requests

    async def finish_drains_once(self) -> list[str]:
        """Remove the draining backends that are idle or past their deadline; returns their names."""
        now = self.clock()
        gone: list[tuple[str, BackendSpec, str]] = []
        for name, (deadline, spec) in list(self._removing.items()):
            busy = self._inflight(name)
            if busy == 0 or now >= deadline:
                how = "idle" if busy == 0 else "deadline"
                if busy:
                    log.warning("backend %s: drain deadline passed with %d requests still in flight", name, busy)
                gone.append((name, spec, how))
                del self._removing[name]
        if not gone:
            return []
        names = {n for n, _, _ in gone}
        self.store.update(lambda s: s.evolve(b for b in s.backends if b.name not in names))
        for name, spec, how in gone:
            self.monitor.remove(name)
            self._manual.discard(name)
            self.metrics.drained.labels(how).inc()
            self.drained.append((name, how))
            log.info("backend %s left the fleet (%s)", name, how)
            if self.close_idle is not None:
                try:
                    await self.close_idle(spec)
                except Exception:
                    log.exception("closing idle connections to %s failed", name)
        return [n for n, _, _ in gone]

    async def run(self) -> None:
        """Lifetime task: poll draining backends while there are any, sleep otherwise."""
        while True:
            if not self._removing:
                self._wake.clear()
                await self._wake.wait()
            await self.finish_drains_once()
            if self._removing:
                await asyncio.sleep(self.poll_s)


__all__ = ["Membership"]


async def close_idle_connections(session: object, spec: BackendSpec) -> int:
    """Close the pooled idle connections of an upstream session to `spec`'s host and port now.

    aiohttp has no public per-host close: this reaches into the connector's pool (`_conns`, keyed by
    ConnectionKey(host, port, ...)). Should that private structure change, nothing breaks: the keep-alive
    TTL (`upstream.keepalive_s`) still closes them within seconds. Connections still carrying a request are
    not in the pool and close when their request ends.
    """
    from urllib.parse import urlsplit

    connector = getattr(session, "connector", None)
    conns = getattr(connector, "_conns", None)
    if not isinstance(conns, dict):
        return 0
    parts = urlsplit(spec.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    closed = 0
    for key in list(conns):
        if getattr(key, "host", None) == parts.hostname and getattr(key, "port", None) == port:
            for proto, _ in conns.pop(key):
                proto.close()
                closed += 1
    return closed
