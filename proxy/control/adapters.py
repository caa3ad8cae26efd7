"""Engine adapters: which series of which engine mean which signal.

Every engine names the same few facts differently. An adapter lists the sample names it needs (so the
scanner reads only those) and turns their samples into a `Reading`: the instantaneous values of one
scrape plus the counters rates are computed from (`Deriver`, in the poller, keeps the previous reading).

Where each value comes from:

| signal            | vLLM                                   | SGLang                   | TGI                        | Triton (TensorRT-LLM backend)                         | our GPU agent / design names |
|-------------------|----------------------------------------|--------------------------|----------------------------|-------------------------------------------------------|------------------------------|
| running           | vllm:num_requests_running              | sglang:num_running_reqs  | tgi_batch_current_size     | nv_trt_llm_request_metrics{request_type="scheduled"}  | –                            |
| waiting           | vllm:num_requests_waiting              | sglang:num_queue_reqs    | tgi_queue_size             | ...{request_type="waiting"} or nv_inference_pending_request_count | –                |
| kv_usage (0..1)   | vllm:kv_cache_usage_perc (v1) / vllm:gpu_cache_usage_perc (v0) | sglang:token_usage | – | nv_trt_llm_kv_cache_block_metrics fraction (or used/max) | – |
| kv_capacity_tokens| vllm:cache_config_info block_size × num_gpu_blocks | sglang:max_total_num_tokens | – | kv blocks max × tokens_per                          | –                            |
| loaded_adapters   | vllm:lora_requests_info running_lora_adapters (latest sample) | – | –                   | –                                                     | –                            |
| mem used / total  | – (pre-allocated; kv_usage stands in)  | –                        | –                          | nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes  | gpu_memory_used_bytes / gpu_memory_total_bytes (NVML) |
| kernel_queue      | running + waiting                      | running + waiting        | running + waiting          | running + waiting                                     | cuda_kernel_queue_length (the engine's running + waiting: NVML has no queue) |
| kv_tokens_per_s   | growth of kv_usage × capacity          | growth of sglang:num_used_tokens | growth of tgi_batch_current_max_tokens | growth of used blocks × tokens_per        | kvcache_tokens_per_second    |
| qps               | rate of vllm:request_success_total     | rate of e2e latency count | rate of tgi_request_success | rate of nv_inference_request_success                | –                            |
| latency_ms        | TTFT histogram Δsum/Δcount             | TTFT histogram           | –                          | nv_inference_first_response_histogram_ms              | –                            |
| gpu_utilization   | –                                      | –                        | –                          | nv_gpu_utilization                                    | gpu_utilization_ratio, or rate of gpu_busy_seconds_total |

The design's own names are read on every page whatever the engine (the GPU agent, and our simulator,
export them next to the engine's) and win over values derived from the engine's series. The YAML
`metric_map` is applied last and wins over both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Mapping

from proxy.control.scrape import Samples, parse_labels, parse_selector, scan, select

# Signals a metric_map entry may target; aliases are the names the docs and the YAML use.
SIGNAL_NAMES: dict[str, str] = {
    "mem_used_bytes": "mem_used_bytes",
    "memory_used": "mem_used_bytes",
    "mem_total_bytes": "mem_total_bytes",
    "memory_total": "mem_total_bytes",
    "kernel_queue": "kernel_queue",
    "queue_length": "kernel_queue",
    "running": "running",
    "waiting": "waiting",
    "kv_usage": "kv_usage",
    "kv_tokens_per_s": "kv_tokens_per_s",
    "kv_tokens_per_second": "kv_tokens_per_s",
    "kv_capacity_tokens": "kv_capacity_tokens",
    "kv_capacity": "kv_capacity_tokens",
    "loaded_adapters": "loaded_adapters",
    "adapters": "loaded_adapters",
    "gpu_utilization": "gpu_utilization",
    "latency_ms": "latency_ms",
    "qps": "qps",
}
_MEAN_SIGNALS = frozenset({"kv_usage", "gpu_utilization", "latency_ms"})
ADAPTER_LABELS = ("running_lora_adapters", "lora_name", "adapter", "lora")


@dataclass(slots=True)
class Reading:
    """What one scrape said. None = not reported. Counters feed rates; gauges go straight to Signals."""

    engine: str | None = None
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    kernel_queue: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    kv_tokens_per_s: float | None = None
    kv_capacity_tokens: float | None = None
    loaded_adapters: frozenset[str] | None = None
    gpu_utilization: float | None = None
    latency_ms: float | None = None
    qps: float | None = None
    # inputs of rates
    kv_used_tokens: float | None = None
    requests_total: float | None = None
    latency_sum_s: float | None = None
    latency_count: float | None = None
    busy_seconds_total: float | None = None


READING_FIELDS = frozenset(f.name for f in fields(Reading))


def _labels(raw: str) -> dict[str, str]:
    """Labels of one sample, or {} when malformed: one bad line must not blind the router to the page."""
    try:
        return parse_labels(raw)
    except ValueError:
        return {}


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _first(*values: float | None) -> float | None:
    for v in values:
        if v is not None:
            return v
    return None


@dataclass(frozen=True, slots=True)
class Adapter:
    """One engine: the sample names it reads, how they fill a Reading, and how to recognise its page."""

    engine: str
    names: frozenset[str]
    extract: Callable[[Samples, Reading], None]
    # Line-start prefixes only this engine's pages carry; `detect_engine` tries the adapters in table order.
    markers: tuple[str, ...] = ()


def _vllm(s: Samples, r: Reading) -> None:
    r.running = _sum(select(s, "vllm:num_requests_running"))
    r.waiting = _sum(select(s, "vllm:num_requests_waiting"))
    r.kv_usage = _first(_mean(select(s, "vllm:kv_cache_usage_perc")), _mean(select(s, "vllm:gpu_cache_usage_perc")))
    for raw, _ in s.get("vllm:cache_config_info", ()):
        labels = _labels(raw)
        try:
            r.kv_capacity_tokens = float(labels["block_size"]) * float(labels["num_gpu_blocks"])
        except (KeyError, ValueError):
            continue
        break
    lora = s.get("vllm:lora_requests_info")
    if lora:
        # A gauge whose value is the time of the last change; each change is a new label set.
        raw, _ = max(lora, key=lambda sample: sample[1])
        running = _labels(raw).get("running_lora_adapters", "")
        r.loaded_adapters = frozenset(a.strip() for a in running.split(",") if a.strip())
    r.requests_total = _first(_sum(select(s, "vllm:request_success_total")),
                              _sum(select(s, "vllm:e2e_request_latency_seconds_count")))
    r.latency_sum_s = _sum(select(s, "vllm:time_to_first_token_seconds_sum"))
    r.latency_count = _sum(select(s, "vllm:time_to_first_token_seconds_count"))


def _sglang(s: Samples, r: Reading) -> None:
    r.running = _sum(select(s, "sglang:num_running_reqs"))
    r.waiting = _sum(select(s, "sglang:num_queue_reqs"))
    r.kv_usage = _mean(select(s, "sglang:token_usage"))
    r.kv_capacity_tokens = _sum(select(s, "sglang:max_total_num_tokens"))
    r.kv_used_tokens = _sum(select(s, "sglang:num_used_tokens"))
    r.requests_total = _sum(select(s, "sglang:e2e_request_latency_seconds_count"))
    r.latency_sum_s = _sum(select(s, "sglang:time_to_first_token_seconds_sum"))
    r.latency_count = _sum(select(s, "sglang:time_to_first_token_seconds_count"))


def _tgi(s: Samples, r: Reading) -> None:
    r.running = _sum(select(s, "tgi_batch_current_size"))
    r.waiting = _sum(select(s, "tgi_queue_size"))
    r.kv_used_tokens = _sum(select(s, "tgi_batch_current_max_tokens"))
    r.requests_total = _sum(select(s, "tgi_request_success"))


def _triton(s: Samples, r: Reading) -> None:
    req = {_labels(raw).get("request_type"): v for raw, v in s.get("nv_trt_llm_request_metrics", ())}
    r.running = _first(req.get("scheduled"), req.get("active"))
    # An ensemble and its tensorrt_llm step count the same request once each: take the largest, not the sum.
    pending = _max(select(s, "nv_inference_pending_request_count"))
    r.waiting = _first(req.get("waiting"), pending)
    blocks = {_labels(raw).get("kv_cache_block_type"): v
              for raw, v in s.get("nv_trt_llm_kv_cache_block_metrics", ())}
    used, total, per = blocks.get("used"), blocks.get("max"), blocks.get("tokens_per")
    frac = blocks.get("fraction")
    if frac is None and used is not None and total:
        frac = used / total
    r.kv_usage = frac
    if total is not None and per is not None:
        r.kv_capacity_tokens = total * per
    if used is not None and per is not None:
        r.kv_used_tokens = used * per
    r.mem_used_bytes = _sum(select(s, "nv_gpu_memory_used_bytes"))
    r.mem_total_bytes = _sum(select(s, "nv_gpu_memory_total_bytes"))
    r.gpu_utilization = _mean(select(s, "nv_gpu_utilization"))
    r.requests_total = _max(select(s, "nv_inference_request_success"))
    ms_sum = _sum(select(s, "nv_inference_first_response_histogram_ms_sum"))
    r.latency_sum_s = None if ms_sum is None else ms_sum / 1000.0
    r.latency_count = _sum(select(s, "nv_inference_first_response_histogram_ms_count"))


def _agent_only(s: Samples, r: Reading) -> None:
    """Engine-less pages (our GPU agent on its own): the design names below carry everything."""


DESIGN_NAMES = frozenset({
    "gpu_memory_used_bytes", "gpu_memory_total_bytes", "cuda_kernel_queue_length",
    "kvcache_tokens_per_second", "gpu_utilization_ratio", "gpu_busy_seconds_total",
})


def _design(s: Samples, r: Reading) -> None:
    """The design's own names (GPU agent, simulator): they win over values derived from engine series."""
    for name, attr in (("gpu_memory_used_bytes", "mem_used_bytes"), ("gpu_memory_total_bytes", "mem_total_bytes"),
                       ("cuda_kernel_queue_length", "kernel_queue"), ("kvcache_tokens_per_second", "kv_tokens_per_s"),
                       ("gpu_busy_seconds_total", "busy_seconds_total")):
        v = _sum(select(s, name))
        if v is not None:
            setattr(r, attr, v)
    util = _mean(select(s, "gpu_utilization_ratio"))
    if util is not None:
        r.gpu_utilization = util


# The one table of engine adapters (name -> adapter): adding an engine is its function above plus one
# entry here; the YAML `telemetry.engine` choices, detection and the tests all read this table.
_ADAPTER_LIST = (
    Adapter("vllm", frozenset({
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:lora_requests_info",
        "vllm:request_success_total", "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"}), _vllm,
        ("vllm:",)),
    Adapter("sglang", frozenset({
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:max_total_num_tokens",
        "sglang:num_used_tokens", "sglang:e2e_request_latency_seconds_count",
        "sglang:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_count"}), _sglang,
        ("sglang:",)),
    Adapter("triton", frozenset({
        "nv_trt_llm_request_metrics", "nv_inference_pending_request_count", "nv_trt_llm_kv_cache_block_metrics",
        "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes", "nv_gpu_utilization",
        "nv_inference_request_success", "nv_inference_first_response_histogram_ms_sum",
        "nv_inference_first_response_histogram_ms_count"}), _triton,
        ("nv_trt_llm_", "nv_inference_")),
    Adapter("tgi", frozenset({
        "tgi_batch_current_size", "tgi_queue_size", "tgi_batch_current_max_tokens", "tgi_request_success"}), _tgi,
        ("tgi_",)),
    # Last: an engine's page may carry the agent's names too (the simulator exports both).
    Adapter("agent", frozenset(), _agent_only, ("gpu_memory_used_bytes", "cuda_kernel_queue_length")),
)
ADAPTERS: Mapping[str, Adapter] = {a.engine: a for a in _ADAPTER_LIST}


def detect_engine(text: str) -> str | None:
    """The engine behind an exposition, from the prefixes only it uses (checked at line starts)."""
    head = text if text.startswith("\n") else "\n" + text
    for adapter in ADAPTERS.values():
        if any("\n" + marker in head for marker in adapter.markers):
            return adapter.engine
    return None


@dataclass(frozen=True, slots=True)
class MapEntry:
    name: str
    labels: dict[str, str]
    signal: str


def compile_metric_map(metric_map: Mapping[str, str]) -> tuple[MapEntry, ...]:
    """YAML `metric_map: {'<metric>{<label>="<v>"}': <signal>}` -> entries; errors name the bad key."""
    entries = []
    for selector, signal in metric_map.items():
        target = SIGNAL_NAMES.get(signal)
        if target is None:
            raise ValueError(
                f"metric_map[{selector!r}]: unknown signal {signal!r}; one of {', '.join(sorted(SIGNAL_NAMES))}"
            )
        name, labels = parse_selector(selector)
        entries.append(MapEntry(name, labels, target))
    return tuple(entries)


@dataclass(slots=True)
class MetricsReader:
    """Reads one metrics page: detects (or is told) the engine, scans only the needed names, fills a Reading.

    (Not to be confused with proxy/grpc/extractors.py's `Extractor`, which reads a gRPC request message.)"""

    engine: str = "auto"
    metric_map: tuple[MapEntry, ...] = ()
    _names: dict[str | None, tuple[str, ...]] = field(default_factory=dict)

    def names_for(self, engine: str | None) -> tuple[str, ...]:
        cached = self._names.get(engine)
        if cached is None:
            wanted = set(DESIGN_NAMES) | {e.name for e in self.metric_map}
            if engine is not None and engine in ADAPTERS:
                wanted |= ADAPTERS[engine].names
            cached = self._names[engine] = tuple(sorted(wanted))
        return cached

    def read(self, text: str) -> Reading:
        engine = detect_engine(text) if self.engine == "auto" else self.engine
        samples = scan(text, self.names_for(engine))
        r = Reading(engine=engine)
        if engine is not None and engine in ADAPTERS:
            ADAPTERS[engine].extract(samples, r)
        _design(samples, r)
        for entry in self.metric_map:
            _apply_entry(samples, entry, r)
        return r


def _apply_entry(samples: Samples, entry: MapEntry, r: Reading) -> None:
    if entry.signal == "loaded_adapters":
        found = samples.get(entry.name)
        if found is None:
            return
        names: set[str] = set()
        for raw, value in found:
            labels = _labels(raw)
            if value <= 0 or any(labels.get(k) != v for k, v in entry.labels.items()):
                continue
            for key in ADAPTER_LABELS:
                if key in labels:
                    names.update(a.strip() for a in labels[key].split(",") if a.strip())
                    break
        r.loaded_adapters = frozenset(names)
        return
    values = select(samples, entry.name, entry.labels)
    if values:
        setattr(r, entry.signal, _mean(values) if entry.signal in _MEAN_SIGNALS else _sum(values))
