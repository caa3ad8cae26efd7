"""`affinity-proxy gpu-agent`: the design's GPU gauges for one node, for the proxy's poller to scrape.

Runs beside an inference server on a GPU node and serves, on `--port` (default 9400) at `/metrics`:

| series                                   | source                                                            |
|------------------------------------------|-------------------------------------------------------------------|
| gpu_memory_used_bytes{gpu,uuid}          | NVML nvmlDeviceGetMemoryInfo().used, per GPU                      |
| gpu_memory_total_bytes{gpu,uuid}         | NVML nvmlDeviceGetMemoryInfo().total, per GPU                     |
| gpu_utilization_ratio{gpu,uuid}          | NVML nvmlDeviceGetUtilizationRates().gpu / 100: the share of the  |
|                                          | driver's last sample period (1/6 s to 1 s) in which a kernel ran  |
| cuda_kernel_queue_length                 | the LOCAL ENGINE's running + waiting requests, from its /metrics  |
|                                          | (vllm:num_requests_running + _waiting, sglang:num_running_reqs +  |
|                                          | num_queue_reqs, tgi_batch_current_size + tgi_queue_size, Triton's |
|                                          | scheduled + waiting). NVML exposes no kernel queue depth at all;  |
|                                          | the engine's request queue is the closest observable stand-in.    |
| kvcache_tokens_per_second                | growth rate of the local engine's KV cache usage in tokens, over  |
|                                          | the last second (KV usage × capacity, or its used-token gauge);   |
|                                          | shrinking counts as 0, not as negative load                       |
| gpu_agent_engine_up                      | 1 if the last engine scrape succeeded                             |

With `--engine-url`, the engine's own page follows the agent's series in the same response (minus any
series named like the agent's), so the proxy reads a backend whole from one scrape of its agent: point the
backend's `metrics_url` at the agent. The engine series are absent (not zero) while the engine cannot be
scraped, so the proxy never mistakes a dead engine for an idle one. NVML is read in a background thread
every 200 ms, because its calls block for a few milliseconds and must not stall the HTTP server; the
engine is scraped on the event loop.

With no NVIDIA driver or no GPU the agent exits at once with one line on stderr (exit status 1), e.g.
``gpu-agent: cannot read GPUs: NVMLError_LibraryNotFound (NVML Shared Library Not Found)``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.control.adapters import MetricsReader

log = logging.getLogger("affinity_proxy.gpu_agent")

KV_RATE_WINDOW_S = 1.0


class AgentError(Exception):
    """A condition the agent reports in one line and exits on (no GPU, no driver)."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    mem_used: float
    mem_total: float
    utilization: float | None  # 0..1; None where the GPU does not report it (e.g. some MIG modes)


def _load_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py

    return pynvml


def _nvml_error_text(nvml: Any, exc: BaseException) -> str:
    name = type(exc).__name__
    try:
        detail = str(exc)
    except Exception:  # pynvml builds its message by calling into the library, which may be absent
        detail = ""
    return f"{name} ({detail})" if detail and detail != name else name


class NvmlSampler:
    """Reads every GPU's memory and utilisation in a daemon thread; `latest` is swapped whole, never torn."""

    def __init__(self, nvml: Any, interval_s: float = 0.2) -> None:
        self.nvml = nvml
        self.interval_s = interval_s
        self.latest: tuple[GpuSample, ...] = ()
        self.sampled_at: float | None = None
        self._handles: list[tuple[int, str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Initialise NVML and find the GPUs; AgentError (one line) when that is impossible."""
        nvml = self.nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            for i in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                self._handles.append((i, uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))
        except nvml.NVMLError as exc:
            raise AgentError(f"cannot read GPUs: {_nvml_error_text(nvml, exc)}") from None
        if not self._handles:
            raise AgentError("no NVIDIA GPU found by NVML")
        self.sample()

    def sample(self) -> None:
        nvml = self.nvml
        out = []
        for i, uuid, handle in self._handles:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except nvml.NVMLError:
                util = None
            out.append(GpuSample(i, uuid, float(mem.used), float(mem.total), util))
        self.latest = tuple(out)
        self.sampled_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except self.nvml.NVMLError as exc:  # e.g. a GPU fell off the bus: keep serving the last values
                log.warning("NVML sample failed: %s", _nvml_error_text(self.nvml, exc))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


class EngineProbe:
    """Scrapes the local engine's /metrics: its request queue and the growth of its KV cache."""

    def __init__(self, url: str, interval_s: float = 0.2) -> None:
        self.url = url.rstrip("/") + "/metrics" if not url.rstrip("/").endswith("/metrics") else url
        self.interval_s = interval_s
        self.extractor = MetricsReader()
        self.queue: float | None = None
        self.kv_tokens_per_s: float | None = None
        self.up = False
        self.page: str | None = None  # the engine's last page, passed through while the engine answers
        self._kv: collections.deque[tuple[float, float]] = collections.deque()

    def observe(self, text: str, t: float) -> None:
        self.page = text
        r = self.extractor.read(text)
        if r.running is None and r.waiting is None:
            self.queue = None
        else:
            self.queue = (r.running or 0.0) + (r.waiting or 0.0)
        used = r.kv_used_tokens
        if used is None and r.kv_usage is not None and r.kv_capacity_tokens is not None:
            used = r.kv_usage * r.kv_capacity_tokens
        if used is None:
            self._kv.clear()
            self.kv_tokens_per_s = None
            return
        self._kv.append((t, used))
        while len(self._kv) > 2 and t - self._kv[0][0] > KV_RATE_WINDOW_S:
            self._kv.popleft()
        t0, used0 = self._kv[0]
        self.kv_tokens_per_s = max(0.0, (used - used0) / (t - t0)) if t > t0 else None

    def lost(self) -> None:
        self.up = False
        self.page = None
        self.queue = None
        self.kv_tokens_per_s = None
        self._kv.clear()

    async def run(self, session: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.interval_s * 0.9, 0.05))
        while True:
            try:
                async with session.get(self.url, timeout=timeout) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    text = await resp.text(errors="replace")
                self.observe(text, time.monotonic())
                self.up = True
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.debug("engine scrape failed: %r", exc)
                self.lost()
            await asyncio.sleep(self.interval_s)


_OWN_NAMES = ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_utilization_ratio", "cuda_kernel_queue_length",
              "kvcache_tokens_per_second", "gpu_agent_")


def passthrough(page: str) -> str:
    """The engine's page minus any series the agent itself exports (so no family appears twice).

    Passing the engine's own series through lets the proxy read everything about a backend from one
    scrape of the agent: the GPU gauges and the engine's queue, KV usage and capacity, LoRA adapters.
    """
    out = []
    for line in page.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE", "UNIT") else ""
            if parts[1:2] == ["EOF"]:
                continue
        else:
            name = line
        if name.startswith(_OWN_NAMES):
            continue
        out.append(line)
    return "\n".join(out) + "\n" if out else ""


class AgentCollector(Collector):
    def __init__(self, sampler: NvmlSampler, engine: EngineProbe | None) -> None:
        self.sampler = sampler
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        labels = ["gpu", "uuid"]
        used = GaugeMetricFamily("gpu_memory_used_bytes", "GPU memory in use (NVML memory info .used).", labels=labels)
        total = GaugeMetricFamily("gpu_memory_total_bytes", "GPU memory installed (NVML memory info .total).",
                                  labels=labels)
        util = GaugeMetricFamily("gpu_utilization_ratio",
                                 "Share of NVML's last sample period in which a kernel ran (utilization.gpu / 100).",
                                 labels=labels)
        for g in self.sampler.latest:
            key = [str(g.index), g.uuid]
            used.add_metric(key, g.mem_used)
            total.add_metric(key, g.mem_total)
            if g.utilization is not None:
                util.add_metric(key, g.utilization)
        out: list[Metric] = [used, total, util]
        if self.sampler.sampled_at is not None:
            age = GaugeMetricFamily("gpu_agent_nvml_sample_age_seconds", "Seconds since the last NVML sample.")
            age.add_metric([], max(0.0, time.monotonic() - self.sampler.sampled_at))
            out.append(age)
        e = self.engine
        if e is not None:
            up = GaugeMetricFamily("gpu_agent_engine_up", "1 if the last scrape of the local engine succeeded.")
            up.add_metric([], 1.0 if e.up else 0.0)
            out.append(up)
            if e.queue is not None:
                q = GaugeMetricFamily("cuda_kernel_queue_length",
                                      "The local engine's running + waiting requests (NVML has no kernel queue).")
                q.add_metric([], e.queue)
                out.append(q)
            if e.kv_tokens_per_s is not None:
                k = GaugeMetricFamily("kvcache_tokens_per_second",
                                      "Growth of the local engine's KV cache usage, tokens/s over the last second.")
                k.add_metric([], e.kv_tokens_per_s)
                out.append(k)
        return out


class GpuAgent:
    """The agent as a start/stop object, so tests run it in-process with a fake NVML."""

    def __init__(self, nvml: Any, *, host: str = "0.0.0.0", port: int = 9400, engine_url: str | None = None,
                 interval_s: float = 0.2) -> None:
        self.sampler = NvmlSampler(nvml, interval_s)
        self.engine = EngineProbe(engine_url, interval_s) if engine_url else None
        self.host, self.port = host, port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(self.sampler, self.engine))
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._engine_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sampler.open()  # raises AgentError before anything listens
        self.sampler.start()
        app = web.Application()

        async def metrics(request: web.Request) -> web.Response:
            body = generate_latest(self.registry)
            page = self.engine.page if self.engine is not None else None
            if page is not None:
                body += passthrough(page).encode()
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        if self.engine is not None:
            self._session = aiohttp.ClientSession()
            self._engine_task = asyncio.create_task(self.engine.run(self._session), name="engine-probe")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        if self._engine_task is not None:
            self._engine_task.cancel()
            await asyncio.gather(self._engine_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.sampler.close()


async def _serve(agent: GpuAgent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
    except BaseException:
        await agent.stop()  # whatever part had started (the NVML thread, the listener)
        raise
    try:
        print(f"gpu-agent: {len(agent.sampler.latest)} GPU(s), serving {agent.url}/metrics", flush=True)
        await stop.wait()
    finally:
        await agent.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=9400, help="port of /metrics (default 9400)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: the proxy scrapes it)")
    p.add_argument("--engine-url", default=None, metavar="URL",
                   help="the local inference server, e.g. http://127.0.0.1:8000, for the queue and KV growth")
    p.add_argument("--interval-ms", type=int, default=200, help="NVML and engine sampling period (default 200)")


def cmd_gpu_agent(args: argparse.Namespace, nvml: Any = None) -> int:
    import uvloop

    if args.interval_ms <= 0:
        print("gpu-agent: --interval-ms must be > 0", file=sys.stderr)
        return 2
    try:
        module = nvml if nvml is not None else _load_nvml()
    except ImportError:
        print("gpu-agent: the nvidia-ml-py package (import pynvml) is not installed", file=sys.stderr)
        return 1
    agent = GpuAgent(module, host=args.host, port=args.port, engine_url=args.engine_url,
                     interval_s=args.interval_ms / 1000.0)
    try:
        uvloop.run(_serve(agent))
    except AgentError as exc:
        print(f"gpu-agent: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the port is taken
        print(f"gpu-agent: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
