"""The GPU agent with an injected fake NVML: what it exports, where each value comes from, how it fails."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.control.adapters import MetricsReader
from proxy.agent.gpu_agent import EngineProbe, GpuAgent, cmd_gpu_agent
from tests.support import FakeMetrics, until

ROOT = Path(__file__).resolve().parents[2]


class FakeNvml:
    """The subset of pynvml the agent calls, with pynvml's error class layout."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    def __init__(self, gpus: list[dict[str, float]] | None = None, missing_library: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [
            {"used": 60e9, "total": 80e9, "util": 91},
            {"used": 20e9, "total": 80e9, "util": 12},
        ]
        self.missing_library = missing_library
        self.initialised = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.missing_library:
            raise self.NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self.gpus[h]
        return SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self.gpus[h]["util"], memory=0)


def vllm_page(running: int, waiting: int, kv_usage: float) -> str:
    return (
        "# HELP cuda_kernel_queue_length not ours\n# TYPE cuda_kernel_queue_length gauge\n"
        "cuda_kernel_queue_length 99\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv_usage}\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
    )


@pytest.fixture
async def engine() -> AsyncIterator[FakeMetrics]:
    e = await FakeMetrics(vllm_page(3, 2, 0.25)).start()
    yield e
    await e.stop()


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


async def test_agent_exports_nvml_and_engine_series(engine: FakeMetrics) -> None:
    nvml = FakeNvml()
    agent = GpuAgent(nvml, host="127.0.0.1", port=0, engine_url=engine.url, interval_s=0.02)
    await agent.start()
    try:
        assert agent.engine is not None
        await until(lambda: agent.engine.up, timeout=5, message="the engine probe has run")
        text = await scrape(agent.url)
    finally:
        await agent.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition
    used = {s.labels["gpu"]: s.value for s in families["gpu_memory_used_bytes"].samples}
    assert used == {"0": 60e9, "1": 20e9}
    util = {s.labels["uuid"]: s.value for s in families["gpu_utilization_ratio"].samples}
    assert util == {"GPU-fake-0": 0.91, "GPU-fake-1": 0.12}
    assert families["cuda_kernel_queue_length"].samples[0].value == 5.0  # engine running + waiting
    assert families["gpu_agent_engine_up"].samples[0].value == 1.0
    # what the proxy's poller reads from it: the GPU gauges and, passed through, the engine's own series
    r = MetricsReader().read(text)
    assert r.engine == "vllm"
    assert (r.mem_used_bytes, r.mem_total_bytes, r.kernel_queue) == (80e9, 160e9, 5.0)
    assert (r.running, r.waiting, r.kv_usage, r.kv_capacity_tokens) == (3.0, 2.0, 0.25, 16000.0)
    # an engine page carrying the agent's own names (as the simulator's does) is not duplicated
    assert [ln for ln in text.splitlines() if ln.startswith("cuda_kernel_queue_length")] == ["cuda_kernel_queue_length 5.0"]
    assert nvml.shutdowns == 1


async def test_agent_without_engine_omits_engine_series() -> None:
    agent = GpuAgent(FakeNvml(), host="127.0.0.1", port=0, engine_url="http://127.0.0.1:9", interval_s=0.02)
    await agent.start()
    try:
        await asyncio.sleep(0.05)
        text = await scrape(agent.url)
    finally:
        await agent.stop()
    assert "gpu_memory_used_bytes" in text
    assert "gpu_agent_engine_up 0.0" in text
    assert "vllm:" not in text
    # a dead engine is not an idle one: no queue and no KV rate rather than zeros
    assert "cuda_kernel_queue_length" not in text and "kvcache_tokens_per_second" not in text


def test_kv_growth_rate_over_the_last_second() -> None:
    probe = EngineProbe("http://127.0.0.1:1")
    probe.observe(vllm_page(1, 0, 0.10), 100.0)  # 1600 tokens of 16000
    assert probe.kv_tokens_per_s is None  # one point is no rate
    probe.observe(vllm_page(1, 0, 0.15), 100.5)  # +800 tokens in 0.5 s
    assert probe.kv_tokens_per_s == pytest.approx(1600.0)
    probe.observe(vllm_page(1, 0, 0.12), 101.0)  # shrinking over the window is no load, not negative
    assert probe.kv_tokens_per_s == pytest.approx(320.0)  # (1920 - 1600) / 1.0 s: net growth over the window
    probe.observe(vllm_page(1, 0, 0.05), 101.6)
    assert probe.kv_tokens_per_s == 0.0
    assert probe.queue == 1.0
    probe.lost()
    assert probe.queue is None and probe.kv_tokens_per_s is None


def test_engine_url_gets_metrics_path() -> None:
    assert EngineProbe("http://h:8000").url == "http://h:8000/metrics"
    assert EngineProbe("http://h:8000/metrics").url == "http://h:8000/metrics"


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(port=0, host="127.0.0.1", engine_url=None, interval_ms=200)
    base.update(kw)
    return argparse.Namespace(**base)


def test_no_driver_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_gpu_agent(_args(), nvml=FakeNvml(missing_library=True)) == 1
    err = capsys.readouterr().err
    assert err == "gpu-agent: cannot read GPUs: NVMLError_LibraryNotFound (NVML Shared Library Not Found)\n"


def test_no_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_gpu_agent(_args(), nvml=FakeNvml(gpus=[])) == 1
    assert capsys.readouterr().err == "gpu-agent: no NVIDIA GPU found by NVML\n"


def test_real_cli_without_a_gpu_exits_with_one_line() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver: the agent would start")
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "gpu-agent", "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-agent: cannot read GPUs: NVMLError")


async def test_poller_reads_a_backend_through_its_agent() -> None:
    """Sim engine <- gpu-agent (fake NVML) <- the proxy's poller via metrics_url: one scrape, both halves."""
    from sim.fleet import start_fleet
    from proxy.control.poller import Poller
    from proxy.control.store import SnapshotStore
    from proxy.control.telemetry_config import TelemetryConfig
    from proxy.core.snapshot import BackendSpec, Snapshot

    fleet = await start_fleet(1, flavor="vllm", speed=20.0)
    agent = GpuAgent(FakeNvml(gpus=[{"used": 70e9, "total": 80e9, "util": 50}]), host="127.0.0.1", port=0,
                     engine_url=fleet.servers[0].url, interval_s=0.02)
    await agent.start()
    try:
        await fleet.servers[0].set_faults({"background_requests": 8})
        assert agent.engine is not None
        await until(lambda: agent.engine.up and (agent.engine.queue or 0) >= 8, timeout=5,
                    message="the agent has seen the engine with its load")
        spec = BackendSpec(name="gpu-0", url=fleet.servers[0].url, metrics_url=agent.url + "/metrics")
        store = SnapshotStore(Snapshot.initial([spec]))
        poller = Poller(store, TelemetryConfig())
        await poller.open()
        try:
            snap = await poller.poll_once()
        finally:
            await poller.stop()
    finally:
        await agent.stop()
        await fleet.stop()
    s = snap.backends[0].signals
    assert s is not None and s.engine == "vllm"
    assert (s.mem_used_bytes, s.mem_total_bytes, s.gpu_utilization) == (70e9, 80e9, 0.5)  # from NVML
    assert s.kernel_queue is not None and s.kernel_queue >= 8  # the agent's, from the engine's queue
    assert s.running is not None and s.kv_capacity_tokens  # the engine's own series, passed through
    assert snap.backends[0].load_score is not None and not snap.backends[0].stale
