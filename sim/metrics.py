"""Prometheus text exposition of one simulated server, in the dialect of the engine it pretends to be.

The proxy's telemetry adapters parse the real engines' series; the simulator must emit exactly those names
and types (vLLM, SGLang, TGI, Triton/TensorRT-LLM) or the adapters are tested against fiction. Every flavor
also carries the series our own GPU agent exports (memory, kernel queue, KV token rate, busy seconds), which
a real deployment gets from the agent running beside the engine.

Written by hand rather than with prometheus_client's registry: one registry per simulated server times
eight servers per process, re-rendered every 200 ms by the poller, costs more than formatting ~40 lines.
"""

from __future__ import annotations

import time
from typing import Callable

from .backend import SimBackend
from .engine import Histogram

FLAVORS = ("vllm", "sglang", "tgi", "triton")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, typ: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {typ}")

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {_num(value)}")

    def gauge(self, name: str, value: float, help_: str, labels: dict[str, str] | None = None) -> None:
        self.family(name, "gauge", help_)
        self.sample(name, value, labels)

    def counter(self, name: str, value: float, help_: str, labels: dict[str, str] | None = None) -> None:
        """`name` without the `_total` suffix (it is added to the sample, as the exposition format wants)."""
        self.family(name, "counter", help_)
        self.sample(name + "_total", value, labels)

    def histogram(self, name: str, hist: Histogram, help_: str, labels: dict[str, str]) -> None:
        self.family(name, "histogram", help_)
        cum = 0
        for le, n in zip(hist.buckets, hist.counts):
            cum += n
            self.sample(name + "_bucket", cum, {**labels, "le": repr(float(le))})
        self.sample(name + "_bucket", hist.count, {**labels, "le": "+Inf"})
        self.sample(name + "_count", hist.count, labels)
        self.sample(name + "_sum", hist.sum, labels)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(backend: SimBackend, flavor: str) -> str:
    try:
        fn = _RENDERERS[flavor]
    except KeyError:
        raise ValueError(f"unknown metrics flavor {flavor!r}; known: {', '.join(FLAVORS)}") from None
    w = _Writer()
    fn(w, backend)
    _agent(w, backend)
    _simulator(w, backend)
    return w.text()


def _vllm(w: _Writer, b: SimBackend) -> None:
    e, st, p = b.engine, b.engine.stats, b.profile
    lab = {"model_name": e.model_name}
    w.gauge("vllm:num_requests_running", e.num_running, "Number of requests in model execution batches.", lab)
    w.gauge("vllm:num_requests_waiting", e.num_waiting, "Number of requests waiting to be processed.", lab)
    w.gauge("vllm:kv_cache_usage_perc", e.kv_usage, "KV-cache usage. 1 means 100 percent usage.", lab)
    w.counter(
        "vllm:prefix_cache_queries",
        st.prefix_queries_tokens,
        "Prefix cache queries, in terms of number of queried tokens.",
        lab,
    )
    w.counter("vllm:prefix_cache_hits", st.prefix_hits_tokens, "Prefix cache hits, in terms of number of cached tokens.", lab)
    w.counter("vllm:num_preemptions", st.num_preemptions, "Cumulative number of preemption from the engine.", lab)
    w.counter("vllm:prompt_tokens", st.prompt_tokens, "Number of prefill tokens processed.", lab)
    w.counter("vllm:generation_tokens", st.generation_tokens, "Number of generation tokens processed.", lab)
    w.family("vllm:request_success", "counter", "Count of successfully processed requests.")
    w.sample("vllm:request_success_total", st.finished_stop, {**lab, "finished_reason": "stop"})
    w.sample("vllm:request_success_total", st.finished_length, {**lab, "finished_reason": "length"})
    w.histogram("vllm:time_to_first_token_seconds", st.ttft, "Histogram of time to first token in seconds.", lab)
    w.histogram("vllm:e2e_request_latency_seconds", st.e2e, "Histogram of e2e request latency in seconds.", lab)
    w.gauge(
        "vllm:lora_requests_info",
        time.time(),
        "Running stats on lora requests.",
        {
            "max_lora": str(p.max_loras),
            "running_lora_adapters": ",".join(e.running_adapters()),
            "waiting_lora_adapters": ",".join(e.waiting_adapters()),
        },
    )
    w.gauge(
        "vllm:cache_config_info",
        1.0,
        "Information of the LLMEngine CacheConfig",
        {
            "block_size": str(p.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": str(p.gpu_memory_utilization),
            "num_cpu_blocks": "0",
            "num_gpu_blocks": str(e.pool.num_blocks),
        },
    )


def _sglang(w: _Writer, b: SimBackend) -> None:
    e, st = b.engine, b.engine.stats
    lab = {"model_name": e.model_name}
    hit_rate = st.prefix_hits_tokens / st.prefix_queries_tokens if st.prefix_queries_tokens else 0.0
    w.gauge("sglang:num_running_reqs", e.num_running, "The number of running requests.", lab)
    w.gauge("sglang:num_queue_reqs", e.num_waiting, "The number of requests in the waiting queue.", lab)
    w.gauge("sglang:token_usage", e.kv_usage, "The token usage.", lab)
    w.gauge("sglang:num_used_tokens", e.num_tokens_in_use, "The number of used tokens.", lab)
    w.gauge("sglang:cache_hit_rate", hit_rate, "The prefix cache hit rate.", lab)
    w.gauge("sglang:gen_throughput", b.tokens_per_second(), "The generation throughput (token/s).", lab)
    w.counter("sglang:prompt_tokens", st.prompt_tokens, "Number of prefill tokens processed.", lab)
    w.counter("sglang:generation_tokens", st.generation_tokens, "Number of generation tokens processed.", lab)
    w.counter("sglang:cached_tokens", st.prefix_hits_tokens, "Number of cached prompt tokens.", lab)
    w.gauge("sglang:max_total_num_tokens", e.pool.num_blocks * b.profile.block_size, "Maximum total number of tokens in the KV cache.", lab)
    w.histogram("sglang:time_to_first_token_seconds", st.ttft, "Histogram of time to first token in seconds.", lab)
    w.histogram("sglang:e2e_request_latency_seconds", st.e2e, "Histogram of E2E request latency in seconds", lab)


def _tgi(w: _Writer, b: SimBackend) -> None:
    e, st = b.engine, b.engine.stats
    w.gauge("tgi_queue_size", e.num_waiting, "Number of requests waiting in the queue.")
    w.gauge("tgi_batch_current_size", e.num_running, "Current batch size.")
    w.gauge("tgi_batch_current_max_tokens", e.num_tokens_in_use, "Maximum tokens for the current batch.")
    # TGI's exporter (metrics-rs) writes counters without the `_total` suffix; so do we.
    w.family("tgi_request_count", "counter", "Number of requests received.")
    w.sample("tgi_request_count", st.requests_added)
    w.family("tgi_request_success", "counter", "Number of successful requests.")
    w.sample("tgi_request_success", st.finished_length + st.finished_stop)
    w.histogram("tgi_request_duration", st.e2e, "End-to-end request duration in seconds.", {})


def _triton(w: _Writer, b: SimBackend) -> None:
    e, p = b.engine, b.profile
    lab = {"model": "tensorrt_llm", "version": "1"}
    w.family("nv_trt_llm_request_metrics", "gauge", "TRT LLM request metrics")
    for kind, value in (
        ("context", e.num_prefilling),
        ("scheduled", e.num_running),
        ("max", p.max_num_seqs),
        ("active", e.num_running + e.num_waiting),
        ("waiting", e.num_waiting),
    ):
        w.sample("nv_trt_llm_request_metrics", value, {**lab, "request_type": kind})
    pool = e.pool
    w.family("nv_trt_llm_kv_cache_block_metrics", "gauge", "TRT LLM KV cache block metrics")
    for kind, value in (
        ("max", pool.num_blocks),
        ("free", pool.num_free),
        ("used", pool.num_used),
        ("tokens_per", p.block_size),
        ("fraction", e.kv_usage),
    ):
        w.sample("nv_trt_llm_kv_cache_block_metrics", value, {**lab, "kv_cache_block_type": kind})
    st = e.stats
    w.counter("nv_inference_request_success", st.finished_length + st.finished_stop, "Number of successful inference requests", lab)
    w.counter("nv_inference_count", st.requests_added, "Number of inferences performed", lab)
    w.gauge("nv_inference_pending_request_count", e.num_waiting, "Instantaneous number of pending requests awaiting execution per-model.", lab)
    gpu = {"gpu_uuid": f"GPU-sim-{b.name}"}
    w.gauge("nv_gpu_memory_used_bytes", b.memory_used_bytes(), "GPU used memory, in bytes", gpu)
    w.gauge("nv_gpu_memory_total_bytes", p.total_memory_bytes, "GPU total memory, in bytes", gpu)


def _agent(w: _Writer, b: SimBackend) -> None:
    """The series our GPU agent (proxy/agent/gpu_agent.py) exports next to every engine."""
    e = b.engine
    w.gauge("gpu_memory_used_bytes", b.memory_used_bytes(), "GPU memory holding weights, reserve and live KV blocks.")
    w.gauge("gpu_memory_total_bytes", b.profile.total_memory_bytes, "GPU memory in total (all tensor-parallel GPUs).")
    w.gauge("cuda_kernel_queue_length", e.num_running + e.num_waiting, "Sequences with work queued on the GPU.")
    w.gauge("kvcache_tokens_per_second", b.tokens_per_second(), "KV-cache tokens written per second (last second).")
    w.counter("gpu_busy_seconds", b.busy_seconds(), "Seconds the GPU spent running steps (utilisation = rate).")


def _simulator(w: _Writer, b: SimBackend) -> None:
    """The simulator's own: how far its driver fell behind the engine model (a live load test on a busy
    machine reads its latencies against this, loadtest/live_replicas.py)."""
    w.counter("sim_steps", b.steps, "Engine steps the simulator ran.")
    w.counter("sim_step_late_seconds", b.late_seconds,
              "Wall seconds each step's outputs went out after the engine model's time for them, summed.")
    w.gauge("sim_step_late_max_seconds", b.late_max_seconds, "The most one step's outputs went out late.")


_RENDERERS: dict[str, Callable[[_Writer, SimBackend], None]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "tgi": _tgi,
    "triton": _triton,
}
