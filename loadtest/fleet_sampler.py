"""Once-a-second samples of the backends' own /metrics during a load run.

What the report needs from the GPUs is what only the engines know: busy time (utilisation), KV usage,
prefix-cache hits and queries, queue lengths. The engines export these as Prometheus text; a targeted line
parser reads the few series needed (prometheus_client's parser costs ~10 ms per exposition, which on two
shared cores would disturb the run being measured).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Report field -> metric names tried in order (vLLM flavour first; the simulator exports these, and so
# do real vLLM servers, except the busy-time counter which is the simulator's / GPU agent's).
SERIES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "busy_s": ("gpu_busy_seconds_total", "sim_gpu_busy_seconds_total", "vllm:gpu_busy_seconds_total"),
    # The simulator's own (sim/metrics.py): how far its driver fell behind the engine model.
    "steps": ("sim_steps_total",),
    "late_s": ("sim_step_late_seconds_total",),
    "late_max_s": ("sim_step_late_max_seconds",),
    # The engines' own time to first token (vLLM's histogram; the simulator exports it too): against the
    # client's, what the path in between (the proxy) added on average.
    "ttft_sum": ("vllm:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_sum"),
    "ttft_count": ("vllm:time_to_first_token_seconds_count", "sglang:time_to_first_token_seconds_count"),
    # ... and their end-to-end latency: the client's e2e less it is the path both ways, to the last token.
    "e2e_sum": ("vllm:e2e_request_latency_seconds_sum", "sglang:e2e_request_latency_seconds_sum"),
    "e2e_count": ("vllm:e2e_request_latency_seconds_count", "sglang:e2e_request_latency_seconds_count"),
}


def parse_exposition(text: str) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """Sum each wanted series over its labels; also return the labels of ``vllm:cache_config_info``."""
    wanted = {name for names in SERIES.values() for name in names}
    sums: dict[str, float] = {}
    info: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            labels_s, rest = line[brace + 1 : close], line[close + 1 :].strip()
        else:
            name, labels_s, rest = line[:space], "", line[space + 1 :].strip()
        if name == "vllm:cache_config_info":
            info[name] = _labels(labels_s)
            continue
        if name not in wanted and not (name.endswith("busy_seconds_total")):
            continue
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums, info


def _labels(s: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in s.split(","):
        k, _, v = part.partition("=")
        if k.strip():
            out[k.strip()] = v.strip().strip('"')
    return out


def pick(sums: dict[str, float], key: str) -> float | None:
    for name in SERIES[key]:
        if name in sums:
            return sums[name]
    if key == "busy_s":
        for name, v in sums.items():
            if name.endswith("busy_seconds_total"):
                return v
    return None


@dataclass
class FleetSampler:
    """Polls every backend's /metrics each `interval_s` until stopped; samples keep wall-clock times."""

    metrics_urls: dict[str, str]  # backend name -> /metrics URL
    interval_s: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    capacity_tokens: dict[str, int] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None

    async def sample_once(self) -> None:
        assert self._session is not None
        results = await asyncio.gather(
            *(self._scrape(name, url) for name, url in self.metrics_urls.items()), return_exceptions=True
        )
        for r in results:
            if isinstance(r, dict):
                self.samples.append(r)

    async def _scrape(self, name: str, url: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            text = await resp.text()
        now = time.monotonic()
        sums, info = parse_exposition(text)
        cfg = info.get("vllm:cache_config_info")
        if cfg and name not in self.capacity_tokens:
            try:
                self.capacity_tokens[name] = int(float(cfg["num_gpu_blocks"])) * int(float(cfg["block_size"]))
            except (KeyError, ValueError):
                pass
        return {"t": now, "backend": name, **{k: pick(sums, k) for k in SERIES}}

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self.sample_once()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sample_once()
            except Exception:  # a failed scrape is a missing sample, never a failed run
                pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            try:
                await self.sample_once()
            finally:
                await self._session.close()
