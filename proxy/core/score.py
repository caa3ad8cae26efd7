"""Turning one backend's telemetry into a load score (0 = idle, 1 = full), and a request's cost.

Pure functions of plain values: no clock, no I/O. The poller calls `load_score` once per backend per
round and stores the result in the snapshot; routing policies read it from there.

Three kinds, chosen in YAML (`telemetry.score.kind`):

- ``design`` (default), the design's formula::

      0.4·mem_used/mem_total + 0.35·min(kernel_queue/100, 1) + 0.25·min(kv_tokens_per_s/512, 1)

  Weights and normalisers are configurable.
- ``qps_memory``: ``α·min(qps/qps_full, 1) + β·memory`` where the QPS weight
  ``α = clamp(1 − latency_ms/2000, 0.3, 0.7)`` and ``β = 1 − α``: while latency is low the request rate
  is the better predictor of the next second's load; once latency climbs, memory pressure (what makes
  requests queue and get preempted) dominates.
- ``request_cost``: the estimated seconds (`request_cost_s`) a reference request would take on the
  backend, divided by `cost_full_s`.

Missing inputs are never read as zero: a term whose input was not reported is left out and the remaining
weights are renormalised; with no usable term at all the score is None (unknown), and routing falls back
to the proxy's own in-flight accounting, exactly as for a stale backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from proxy.core.bounds import above, at_least, check_config
from proxy.core.snapshot import Signals

ScoreKind = Literal["design", "qps_memory", "request_cost"]
SCORE_KINDS: tuple[str, ...] = ("design", "qps_memory", "request_cost")


@dataclass(frozen=True, slots=True)
class ScoreConfig:
    """Weights and normalisers of the load score; the defaults are the design's formula."""

    kind: ScoreKind = "design"
    # design
    memory_weight: float = at_least(0.4, 0)
    queue_weight: float = at_least(0.35, 0)
    kv_rate_weight: float = at_least(0.25, 0)
    queue_full: float = above(100.0, 0)  # kernel queue length that counts as saturated
    kv_tokens_per_s_full: float = above(512.0, 0)  # KV growth rate that counts as saturated
    # qps_memory
    qps_full: float = above(50.0, 0)  # requests/s that count as saturated
    latency_pivot_ms: float = above(2000.0, 0)  # α = clamp(1 - latency_ms / latency_pivot_ms, alpha_min, alpha_max)
    alpha_min: float = 0.3
    alpha_max: float = 0.7
    # request_cost (see request_cost_s); defaults are Llama-3-8B on one H100 class GPU under vLLM
    prefill_tokens_per_s: float = above(10000.0, 0)  # uncached prompt tokens prefilled per second
    decode_s_per_token: float = at_least(0.012, 0)  # inter-token latency of one sequence at batch 1
    batch_slowdown_per_seq: float = at_least(0.01, 0)  # relative ITL growth per running sequence (bandwidth sharing)
    queue_s_per_waiting: float = at_least(0.2, 0)  # delay each request already waiting adds before this one starts
    reference_prompt_tokens: int = at_least(512, 0)  # the request `load_score` prices for the request_cost kind
    reference_max_tokens: int = at_least(128, 0)
    cost_full_s: float = above(30.0, 0)  # cost that counts as a full backend (score 1)

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.kind not in SCORE_KINDS:
            yield "kind", f"must be one of {', '.join(SCORE_KINDS)}, not {self.kind!r}"
        if self.memory_weight + self.queue_weight + self.kv_rate_weight <= 0:
            yield "memory_weight", "memory_weight + queue_weight + kv_rate_weight must be > 0"
        if not 0 <= self.alpha_min <= self.alpha_max <= 1:
            yield "alpha_min", "alpha_min and alpha_max must satisfy 0 <= alpha_min <= alpha_max <= 1"


def _clamp01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def memory_fraction(s: Signals) -> float | None:
    """GPU memory in use, 0..1: NVML/engine bytes when reported, else the KV cache's usage.

    vLLM and SGLang pre-allocate most of the GPU for the KV cache, so their device memory reads ~90%
    whatever the load; where only the engine is scraped its KV usage is the memory pressure that matters.
    """
    if s.mem_used_bytes is not None and s.mem_total_bytes:
        return _clamp01(s.mem_used_bytes / s.mem_total_bytes)
    if s.kv_usage is not None:
        return _clamp01(s.kv_usage)
    return None


def kernel_queue(s: Signals) -> float | None:
    """The agent's cuda_kernel_queue_length, else the engine's running + waiting requests."""
    if s.kernel_queue is not None:
        return s.kernel_queue
    if s.running is None and s.waiting is None:
        return None
    return (s.running or 0.0) + (s.waiting or 0.0)


def _weighted(terms: list[tuple[float, float | None]]) -> float | None:
    total_w = 0.0
    acc = 0.0
    for weight, value in terms:
        if value is None or weight <= 0:
            continue
        total_w += weight
        acc += weight * value
    if total_w <= 0:
        return None
    return _clamp01(acc / total_w)


def design_score(s: Signals, cfg: ScoreConfig) -> float | None:
    mem = memory_fraction(s)
    q = kernel_queue(s)
    rate = s.kv_tokens_per_s
    return _weighted([
        (cfg.memory_weight, mem),
        (cfg.queue_weight, None if q is None else _clamp01(q / cfg.queue_full)),
        (cfg.kv_rate_weight, None if rate is None else _clamp01(rate / cfg.kv_tokens_per_s_full)),
    ])


def qps_alpha(latency_ms: float | None, cfg: ScoreConfig) -> float:
    """The QPS weight: high while latency is low. Unknown latency takes the midpoint of the range."""
    if latency_ms is None:
        return (cfg.alpha_min + cfg.alpha_max) / 2
    a = 1.0 - latency_ms / cfg.latency_pivot_ms
    return min(max(a, cfg.alpha_min), cfg.alpha_max)


def qps_memory_score(s: Signals, cfg: ScoreConfig) -> float | None:
    alpha = qps_alpha(s.latency_ms, cfg)
    qps = None if s.qps is None else _clamp01(s.qps / cfg.qps_full)
    return _weighted([(alpha, qps), (1.0 - alpha, memory_fraction(s))])


def request_cost_s(
    uncached_prompt_tokens: int,
    max_tokens: int | None,
    signals: Signals | None,
    cfg: ScoreConfig,
    inflight_requests: int = 0,
    inflight_tokens: int | None = None,
) -> float:
    """Estimated seconds this request would take on this backend, queueing included.

    queue  = waiting · queue_s_per_waiting
    prefill = uncached_prompt_tokens / prefill_tokens_per_s
    decode = max_tokens · decode_s_per_token · (1 + batch_slowdown_per_seq · running)

    Only the prompt tokens the backend does not already hold in its prefix cache are prefilled, which is
    what makes a cache hit on a busier backend cheaper than a miss on an idle one. The batch it joins is
    the larger of what telemetry reports running and the proxy's own in-flight count for the backend
    (`inflight_requests`: current, where a scrape is up to one interval old); with no telemetry (`signals`
    None, or no running/waiting reported) the in-flight count alone, never zero.

    With `inflight_tokens` (the estimated prompt + max_tokens of the proxy's in-flight requests there) the
    proxy's own requests count by how long they overlap this one: min(requests, tokens / max_tokens). A
    2,048-token generation joining three 128-token ones shares the batch with them for a small part of its
    life; joining three 2,048-token ones, for all of it. Telemetry's running requests beyond the proxy's own
    (another client's) count fully.
    """
    running: float | None = None
    waiting: float | None = None
    if signals is not None:
        running, waiting = signals.running, signals.waiting
        if running is None and waiting is None and signals.kernel_queue is not None:
            running = signals.kernel_queue
    if running is None:
        running = float(inflight_requests)
    else:
        # Requests the proxy sent since the scrape are in the batch too (or queued for it).
        running = max(running, float(inflight_requests) - (waiting or 0.0))
    if inflight_tokens is not None and max_tokens and inflight_requests > 0:
        overlap = min(float(inflight_requests), max(inflight_tokens, 0) / max_tokens)
        running = overlap + max(0.0, running - inflight_requests)
    queue = (waiting or 0.0) * cfg.queue_s_per_waiting
    prefill = max(uncached_prompt_tokens, 0) / cfg.prefill_tokens_per_s
    decode = max(max_tokens or 0, 0) * cfg.decode_s_per_token * (1.0 + cfg.batch_slowdown_per_seq * running)
    return queue + prefill + decode


def request_cost_score(s: Signals, cfg: ScoreConfig) -> float | None:
    if s.running is None and s.waiting is None and s.kernel_queue is None:
        return None
    cost = request_cost_s(cfg.reference_prompt_tokens, cfg.reference_max_tokens, s, cfg)
    return _clamp01(cost / cfg.cost_full_s)


def load_score(signals: Signals | None, cfg: ScoreConfig) -> float | None:
    """The backend's load in 0..1 by the configured kind, or None when its inputs are unknown."""
    if signals is None:
        return None
    if cfg.kind == "design":
        return design_score(signals, cfg)
    if cfg.kind == "qps_memory":
        return qps_memory_score(signals, cfg)
    return request_cost_score(signals, cfg)
