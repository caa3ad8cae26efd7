"""The LoRA adapter pool: keep hot adapters loaded on enough backends, cold ones unloaded (off by default).

Every `interval_s` the pool reads the demand per adapter the router counted since the last look
(`Router.take_adapter_demand`: requests whose model is a LoRA adapter) and acts through the engines'
runtime LoRA API (vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`, served when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set):

- **hot**: an adapter asked for at `rate` requests/s wants ceil(rate / `target_rps_per_backend`) backends
  (at least one, at most every routable backend); while it has fewer, it is loaded on the routable
  backends without it that have a free slot, fewest in-flight requests first.
- **cold**: an adapter not asked for during `idle_ttl_s` is unloaded everywhere the pool or the engine
  loaded it; the ones `backends[].adapters` declares stay (pinned by configuration).
- **slots**: a backend never gets more than `slots_per_backend` adapters from the pool (what it already
  has counts); an engine that refuses a load (its own limit) is logged and left alone.

A load or unload that succeeds updates the backend's `spec.adapters` in the snapshot at once, so routing
follows in the same instant (the poller's /v1/models discovery confirms it later). Every action is a log
line and a sample of `affinity_proxy_lora_pool_actions_total{action, adapter, backend, result}`.

Where it runs: once per host. A single process runs it on its own router's demand; with `--workers N` the
supervisor runs it (the control-plane role), on the demand every worker reports over its channel a few
times a round (`AdapterDemand`, summed by `Supervisor.take_adapter_demand`), and its snapshot changes reach
every worker as any other; the workers run no pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from proxy.aio import cancel_and_wait
from proxy.control.store import SnapshotStore
from proxy.core.bounds import check_config
from proxy.core.inflight import InflightTable
from proxy.core.snapshot import BackendState, Snapshot

log = logging.getLogger("affinity_proxy.lora_pool")


@dataclass(frozen=True)
class LoraPoolConfig:
    """YAML `lora_pool`: the adapter catalog (name -> path the engine loads it from) and the rules."""

    enabled: bool = False
    adapters: dict[str, str] = field(default_factory=dict)
    interval_s: float = field(default=1.0, metadata={"gt": 0})
    idle_ttl_s: float = field(default=300.0, metadata={"gt": 0})
    target_rps_per_backend: float = field(default=2.0, metadata={"gt": 0})
    slots_per_backend: int = field(default=4, metadata={"ge": 1})
    request_timeout_s: float = field(default=30.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_config(self)


class LoraPool:
    """The control-plane service (`start`/`stop`); `tick` runs one round (tests drive it by hand too).
    `demand`: requests per adapter since the last call (a router's, or the supervisor's sum of its workers')."""

    def __init__(self, store: SnapshotStore, demand: Callable[[], dict[str, int]], inflight: InflightTable,
                 config: LoraPoolConfig, registry: CollectorRegistry, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.demand = demand
        self.inflight = inflight
        self.config = config
        self.clock = clock
        self.actions = Counter("affinity_proxy_lora_pool_actions", "LoRA adapter loads and unloads by the pool.",
                               ["action", "adapter", "backend", "result"], registry=registry)
        # Adapters the configuration declares on a backend are pinned there: never unloaded by the pool.
        self._pinned = {(b.name, a) for b in store.current.backends for a in b.spec.adapters}
        self._last_used: dict[str, float] = {}
        self._since = clock()
        self._started_at = self._since
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s))
        self._task = asyncio.create_task(self.run(), name="lora-pool")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end the pool for the proxy's lifetime
                log.exception("LoRA pool round failed")

    # ------------------------------------------------------------------------------------------ round

    async def tick(self) -> None:
        cfg = self.config
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        self._since = now
        demand = {a: n for a, n in self.demand().items() if a in cfg.adapters and n > 0}
        for a in demand:
            self._last_used[a] = now
        snap = self.store.current
        routable = [b for b in snap.backends if b.routable]
        for adapter, n in sorted(demand.items()):
            want = min(len(routable), max(1, math.ceil(n / elapsed / cfg.target_rps_per_backend)))
            have = [b for b in routable if adapter in b.adapters]
            missing = want - len(have)
            if missing <= 0:
                continue
            free = [b for b in self.store.current.backends
                    if b.routable and adapter not in b.adapters and len(b.adapters) < cfg.slots_per_backend]
            free.sort(key=lambda b: (self.inflight[b.name].requests if b.name in self.inflight else 0, b.name))
            for b in free[:missing]:
                await self._load(b, adapter)
        for adapter in sorted(cfg.adapters):
            if now - self._last_used.get(adapter, self._started_at) < cfg.idle_ttl_s:
                continue
            for b in self.store.current.backends:
                if adapter in b.adapters and (b.name, adapter) not in self._pinned:
                    await self._unload(b, adapter)

    async def _post(self, backend: BackendState, path: str, body: dict[str, str]) -> tuple[int, str]:
        session = self._session
        if session is None:
            raise RuntimeError("LoraPool.start() was not called")
        async with session.post(backend.spec.url + path, json=body) as resp:
            return resp.status, (await resp.text())[:300]

    async def _load(self, backend: BackendState, adapter: str) -> None:
        try:
            status, text = await self._post(backend, "/v1/load_lora_adapter",
                                            {"lora_name": adapter, "lora_path": self.config.adapters[adapter]})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._record("load", adapter, backend.name, "error", repr(exc))
            return
        if status != 200:
            self._record("load", adapter, backend.name, "refused", f"HTTP {status}: {text}")
            return
        self._record("load", adapter, backend.name, "ok", "")
        self.store.update(lambda snap: _with_adapters(snap, backend.name, add=adapter))

    async def _unload(self, backend: BackendState, adapter: str) -> None:
        try:
            status, text = await self._post(backend, "/v1/unload_lora_adapter", {"lora_name": adapter})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._record("unload", adapter, backend.name, "error", repr(exc))
            return
        if status not in (200, 404):  # 404: the engine no longer has it, which is what we wanted
            self._record("unload", adapter, backend.name, "refused", f"HTTP {status}: {text}")
            return
        self._record("unload", adapter, backend.name, "ok", "")
        self.store.update(lambda snap: _with_adapters(snap, backend.name, remove=adapter))

    def _record(self, action: str, adapter: str, backend: str, result: str, detail: str) -> None:
        self.actions.labels(action, adapter, backend, result).inc()
        level = logging.INFO if result == "ok" else logging.WARNING
        log.log(level, "LoRA pool %s %s on %s: %s%s", action, adapter, backend, result,
                f" ({detail})" if detail else "")


def _with_adapters(snap: Snapshot, name: str, *, add: str | None = None, remove: str | None = None) -> Snapshot:
    b = snap.get(name)
    if b is None:
        return snap
    adapters = [a for a in b.spec.adapters if a != remove]
    if add is not None and add not in adapters:
        adapters.append(add)
    signals = b.signals
    if remove is not None and signals is not None and remove in signals.loaded_adapters:
        signals = dataclasses.replace(signals, loaded_adapters=signals.loaded_adapters - {remove})
    models = b.spec.models
    if add is not None and models and add not in models:
        models = (*models, add)  # a backend restricted to some models serves its adapters too (config.py)
    if remove is not None and remove in models and len(models) > 1:  # never down to () = "any model"
        models = tuple(m for m in models if m != remove)
    spec = dataclasses.replace(b.spec, adapters=tuple(adapters), models=models)
    return snap.replace_backend(name, spec=spec, signals=signals)
