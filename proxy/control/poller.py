"""The telemetry poller: every backend's metrics, every 200 ms, into the routing snapshot.

One round scrapes all backends concurrently, each bounded by `timeout_ms`, which config validation keeps
below the interval, over the poller's own connections (so scrapes never queue behind data-plane traffic in
the per-backend connection limits): plain http:// through the lean keep-alive client in httpget.py (~4x
less CPU per scrape than aiohttp's), anything else through one aiohttp ClientSession. So a slow or dead
backend costs its own scrape and nothing else, and rounds never overlap. The round then derives rates (KV
growth, request rate, recent TTFT) against the previous reading of each backend and publishes ONE new
snapshot through `SnapshotStore.update`, whose change function is synchronous, so it composes with the
health checker and reload writing the same store.

Staleness: a backend whose last good scrape is older than `stale_after_intervals` intervals is marked
stale and its load score set to None; the policies then fall back to the proxy's own in-flight accounting
for it. Its last signals stay visible (admin API) with their age, but are never read as "idle".

LoRA adapters: every `ADAPTER_DISCOVERY_ROUNDS` rounds (the first included) each backend's `/v1/models` is read
too; its entries with a `parent` (vLLM lists every loaded LoRA adapter so, with its base model as parent)
join the `loaded_adapters` its metrics report. A failed read keeps what the last one found.

ORCA: `observe_orca(backend, header)` takes a response's `endpoint-load-metrics` header from the data plane
and folds it into that backend's signals between scrapes; reports are coalesced so a busy proxy publishes
at most one snapshot per `orca_flush_s`, not one per response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Callable

import aiohttp

from proxy.aio import cancel_and_wait
from proxy.control.adapters import MetricsReader, Reading, compile_metric_map
from proxy.control.httpget import HttpStatusError, MetricsHttpClient, ProtocolError
from proxy.tls import ClientTls
from proxy.control.orca import parse_orca
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_config import TelemetryConfig
from proxy.control.telemetry_metrics import TelemetryMetrics
from proxy.core.score import load_score
from proxy.core.snapshot import BackendSpec, BackendState, Signals, Snapshot

log = logging.getLogger("affinity_proxy.telemetry")

Clock = Callable[[], float]


# Plain text exposition (not OpenMetrics), uncompressed: on a LAN, gzip costs both ends more CPU than the
# ~30 KB it saves.
_SCRAPE_HEADERS = (("Accept", "text/plain"), ("Accept-Encoding", "identity"), ("User-Agent", "affinity-proxy"))


def metrics_url(spec: BackendSpec) -> str:
    return spec.metrics_url or spec.url.rstrip("/") + "/metrics"


class ScrapeError(Exception):
    """A scrape that produced no signals; `kind` is the metric label (timeout, connect, http_5xx, ...)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Deriver:
    """Per-backend memory of the previous reading, to turn counters and levels into rates."""

    __slots__ = ("_prev", "_prev_t", "_latency_ms")

    def __init__(self) -> None:
        self._prev: Reading | None = None
        self._prev_t = 0.0
        self._latency_ms: float | None = None

    def signals(self, r: Reading, t: float) -> Signals:
        prev, dt = self._prev, t - self._prev_t
        kv_used = r.kv_used_tokens
        if kv_used is None and r.kv_usage is not None and r.kv_capacity_tokens is not None:
            kv_used = r.kv_usage * r.kv_capacity_tokens
            r.kv_used_tokens = kv_used
        kv_rate = r.kv_tokens_per_s
        qps = r.qps
        gpu_util = r.gpu_utilization
        if prev is not None and dt > 0:
            if kv_rate is None and kv_used is not None and prev.kv_used_tokens is not None:
                # Growth only: a cache draining as requests finish is not negative load.
                kv_rate = max(0.0, (kv_used - prev.kv_used_tokens) / dt)
            if qps is None:
                qps = _rate(r.requests_total, prev.requests_total, dt)
            if gpu_util is None:
                busy = _rate(r.busy_seconds_total, prev.busy_seconds_total, dt)
                gpu_util = None if busy is None else min(busy, 1.0)
            if r.latency_ms is None and r.latency_count is not None and prev.latency_count is not None:
                dc = r.latency_count - prev.latency_count
                if dc > 0 and r.latency_sum_s is not None and prev.latency_sum_s is not None:
                    self._latency_ms = max(0.0, (r.latency_sum_s - prev.latency_sum_s) / dc * 1000.0)
                elif dc < 0:  # engine restarted: its old latency says nothing about the new process
                    self._latency_ms = None
        latency = r.latency_ms if r.latency_ms is not None else self._latency_ms
        self._prev, self._prev_t = r, t
        queue = r.kernel_queue
        if queue is None and (r.running is not None or r.waiting is not None):
            queue = (r.running or 0.0) + (r.waiting or 0.0)
        return Signals(
            scraped_at=t,
            engine=r.engine,
            mem_used_bytes=r.mem_used_bytes,
            mem_total_bytes=r.mem_total_bytes,
            kernel_queue=queue,
            running=r.running,
            waiting=r.waiting,
            kv_usage=r.kv_usage,
            kv_tokens_per_s=kv_rate,
            kv_capacity_tokens=r.kv_capacity_tokens,
            loaded_adapters=r.loaded_adapters if r.loaded_adapters is not None else frozenset(),
            latency_ms=latency,
            qps=qps,
            gpu_utilization=gpu_util,
        )


def _rate(now: float | None, before: float | None, dt: float) -> float | None:
    if now is None or before is None or now < before:  # missing, or a counter reset
        return None
    return (now - before) / dt


def _has_signal(r: Reading) -> bool:
    return any(
        v is not None
        for v in (r.mem_used_bytes, r.kernel_queue, r.running, r.waiting, r.kv_usage, r.kv_tokens_per_s,
                  r.kv_used_tokens, r.requests_total)
    )


# Adapters change when an operator or the adapter pool loads one, not per request: every 25 rounds (5 s at
# the default 200 ms interval) is fresh enough and costs one small GET per backend per 5 s.
ADAPTER_DISCOVERY_ROUNDS = 25


def adapters_from_models(body: str) -> frozenset[str]:
    """The LoRA adapters in an OpenAI `/v1/models` answer: the entries with a `parent` model (vLLM)."""
    data = json.loads(body).get("data")
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    return frozenset(str(m["id"]) for m in data if isinstance(m, dict) and m.get("parent") and "id" in m)


class Poller:
    """The telemetry control-plane service (`start`/`stop`), plus `poll_once` for tests and benchmarks."""

    # False sends plain http:// scrapes through aiohttp too (loadtest/bench_control.py --compare-aiohttp).
    fast_http: bool = True

    def __init__(
        self,
        store: SnapshotStore,
        config: TelemetryConfig,
        *,
        metrics: TelemetryMetrics | None = None,
        session: aiohttp.ClientSession | None = None,
        clock: Clock = time.monotonic,
        orca_flush_s: float = 0.02,
        tls: ClientTls | None = None,  # the contexts of https:// metrics URLs (proxy/tls.py)
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.orca_flush_s = orca_flush_s
        self._extractor = MetricsReader(engine=config.engine, metric_map=compile_metric_map(config.metric_map))
        self._session = session
        self._own_session = session is None
        self._derivers: dict[str, Deriver] = {}
        self._adapters: dict[str, frozenset[str]] = {}  # backend -> adapters its /v1/models lists
        self._task: asyncio.Task[None] | None = None
        self._orca_pending: dict[str, dict[str, float]] = {}
        self._orca_handle: asyncio.TimerHandle | None = None
        self.rounds = 0
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._http = MetricsHttpClient(config.timeout_s, headers=dict(_SCRAPE_HEADERS),
                                       tls=tls.for_url if tls is not None else None)

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.open()
        self._task = asyncio.create_task(self.run(), name="telemetry-poller")

    async def open(self) -> None:
        """Connections only, no loop: for driving rounds by hand with `poll_once` (tests, benchmarks)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
                timeout=self._timeout,
                headers=dict(_SCRAPE_HEADERS),
            )

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._orca_handle is not None:
            self._orca_handle.cancel()
            self._orca_handle = None
        self._http.close()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        """Rounds at a fixed rate; a round that overran the interval is followed at once, never overlapped."""
        interval = self.config.interval_s
        next_t = self.clock()
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end telemetry for the proxy's lifetime
                log.exception("telemetry round failed")
            next_t += interval
            now = self.clock()
            if next_t < now:
                next_t = now
            await asyncio.sleep(next_t - now)

    # ------------------------------------------------------------------------------------ one round

    async def poll_once(self) -> Snapshot:
        snap = self.store.current
        specs = [b.spec for b in snap.backends]
        started = self.clock()
        if self.rounds % ADAPTER_DISCOVERY_ROUNDS == 0:
            results, _ = await asyncio.gather(asyncio.gather(*(self._scrape(spec) for spec in specs)),
                                              asyncio.gather(*(self._discover_adapters(spec) for spec in specs)))
        else:
            results = await asyncio.gather(*(self._scrape(spec) for spec in specs))
        adapters = self._adapters
        fresh = {
            spec.name: sig if not adapters.get(spec.name) else dataclasses.replace(
                sig, loaded_adapters=sig.loaded_adapters | adapters[spec.name])
            for spec, sig in zip(specs, results) if sig is not None
        }
        live = {b.name for b in self.store.current.backends}
        for name in list(self._derivers):
            if name not in live:
                del self._derivers[name]
        for name in list(adapters):
            if name not in live:
                del adapters[name]
        now = self.clock()
        self.rounds += 1  # before publishing, so store listeners see the number of the round they got
        published = self.store.update(lambda current: self._apply(current, fresh, now))
        if self.metrics is not None:
            self.metrics.round_duration.observe(now - started)
        return published

    async def _scrape(self, spec: BackendSpec) -> Signals | None:
        t0 = self.clock()
        try:
            text = await self._fetch(metrics_url(spec))
            t = self.clock()
            reading = self._extractor.read(text)
            if not _has_signal(reading):
                raise ScrapeError("no_signals", "no series the load score understands")
        except ScrapeError as exc:
            self._failed(spec.name, exc.kind, str(exc))
            return None
        except asyncio.TimeoutError:
            self._failed(spec.name, "timeout", f"no answer within {self.config.timeout_ms} ms")
            return None
        except aiohttp.ClientConnectionError as exc:
            self._failed(spec.name, "connect", repr(exc))
            return None
        except aiohttp.ClientError as exc:
            self._failed(spec.name, "http", repr(exc))
            return None
        except Exception as exc:  # a page or an answer we cannot read: this backend's problem, not the round's
            log.warning("scrape of %s failed: %r", spec.name, exc)
            self._failed(spec.name, "invalid", repr(exc))
            return None
        if self.metrics is not None:
            self.metrics.scrape_duration.observe(t - t0)
        deriver = self._derivers.get(spec.name)
        if deriver is None:
            deriver = self._derivers[spec.name] = Deriver()
        return deriver.signals(reading, t)

    async def _discover_adapters(self, spec: BackendSpec) -> None:
        try:
            found = adapters_from_models(await self._fetch(spec.url.rstrip("/") + "/v1/models"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine without /v1/models, or a page we cannot read: keep the last list
            log.debug("adapter discovery on %s failed: %r", spec.name, exc)
            return
        if found != self._adapters.get(spec.name, frozenset()):
            log.info("backend %s has LoRA adapters %s", spec.name, sorted(found))
        self._adapters[spec.name] = found

    def discovered_adapters(self, backend: str) -> frozenset[str]:
        """What the last read of `backend`'s /v1/models listed (for tests and the admin API)."""
        return self._adapters.get(backend, frozenset())

    async def _fetch(self, url: str) -> str:
        if self.fast_http and url.startswith(("http://", "https://")):
            try:
                body = await self._http.get(url)
            except HttpStatusError as exc:
                raise ScrapeError(f"http_{exc.status // 100}xx", str(exc)) from None
            except ProtocolError as exc:
                raise ScrapeError("http", str(exc)) from None
            except OSError as exc:  # refused, reset, unreachable (TimeoutError is caught by the caller first)
                if isinstance(exc, TimeoutError):
                    raise
                raise ScrapeError("connect", repr(exc)) from None
            return body.decode("utf-8", "replace")
        session = self._session
        if session is None:
            raise RuntimeError("Poller.start() was not called")
        async with session.get(url, timeout=self._timeout) as resp:
            if resp.status != 200:
                raise ScrapeError(f"http_{resp.status // 100}xx", f"HTTP {resp.status}")
            body = await resp.read()
        return body.decode("utf-8", "replace")

    def _failed(self, backend: str, kind: str, detail: str) -> None:
        log.debug("scrape of %s failed: %s", backend, detail)
        if self.metrics is not None:
            self.metrics.scrape_error(backend, kind)

    def _apply(self, snap: Snapshot, fresh: dict[str, Signals], now: float) -> Snapshot:
        return snap.evolve(self._judge(b, fresh.get(b.name, b.signals), now) for b in snap.backends)

    def _judge(self, b: BackendState, signals: Signals | None, now: float) -> BackendState:
        stale = signals is None or now - signals.scraped_at > self.config.stale_after_s
        score = None if stale else load_score(signals, self.config.score)
        if signals is b.signals and stale == b.stale and score == b.load_score:
            return b
        return dataclasses.replace(b, signals=signals, stale=stale, load_score=score)

    # ------------------------------------------------------------------------------------ ORCA

    def observe_orca(self, backend: str, header: str) -> None:
        """Fold a response's `endpoint-load-metrics` header into the backend's signals (coalesced)."""
        if not self.config.orca:
            return
        values = parse_orca(header)
        if not values:
            return
        if self.metrics is not None:
            self.metrics.orca_reports.inc()
        self._orca_pending.setdefault(backend, {}).update(values)
        if self._orca_handle is None:
            loop = asyncio.get_running_loop()
            self._orca_handle = loop.call_later(self.orca_flush_s, self._flush_orca)

    def _flush_orca(self) -> None:
        self._orca_handle = None
        pending, self._orca_pending = self._orca_pending, {}
        if pending:
            self.store.update(lambda snap: self._apply_orca(snap, pending))

    def _apply_orca(self, snap: Snapshot, pending: dict[str, dict[str, float]]) -> Snapshot:
        now = self.clock()
        out = []
        for b in snap.backends:
            values = pending.get(b.name)
            s = b.signals
            # A stale backend stays stale: ORCA refreshes values between scrapes, it does not stand in for
            # a metrics endpoint that stopped answering (its reports would cover only part of the signals).
            if values is None or s is None or b.stale:
                out.append(b)
                continue
            # Signals field name -> value; the names come from the adapter tables, so the checker sees str keys
            changes: dict[str, Any] = {k: v for k, v in values.items() if k != "mem_fraction"}
            if "mem_fraction" in values and s.mem_total_bytes:
                changes["mem_used_bytes"] = values["mem_fraction"] * s.mem_total_bytes
            if ("running" in changes or "waiting" in changes) and "kernel_queue" not in changes:
                running = changes.get("running", s.running)
                waiting = changes.get("waiting", s.waiting)
                changes["kernel_queue"] = (running or 0.0) + (waiting or 0.0)
            signals = dataclasses.replace(s, **changes)
            out.append(self._judge(b, signals, now))
        return snap.evolve(out)
