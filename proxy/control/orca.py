"""ORCA load reports: the `endpoint-load-metrics` response header (as recent vLLM sends it).

A backend that reports its load on every response gives the router a value milliseconds old instead of up
to one scrape interval old. Two encodings are read (the third, binary protobuf, is ignored):

    endpoint-load-metrics: TEXT cpu_utilization=0.3, mem_utilization=0.8, named_metrics.kv_cache_usage_perc=0.4
    endpoint-load-metrics: JSON {"rps_fractional": 12.5, "named_metrics": {"num_requests_waiting": 3}}

Only values that map onto a `Signals` field are kept; everything else is ignored, never guessed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

HEADER = "endpoint-load-metrics"
FORMAT_HEADER = "endpoint-load-metrics-format"  # request header asking the backend for a report (TEXT | JSON)

# ORCA / engine names -> Signals field.
_NAMED: dict[str, str] = {
    "kv_cache_usage_perc": "kv_usage",
    "kv_cache_utilization": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",
    "kv_usage": "kv_usage",
    "num_requests_running": "running",
    "running": "running",
    "num_requests_waiting": "waiting",
    "waiting": "waiting",
    "queue_size": "waiting",
    "cuda_kernel_queue_length": "kernel_queue",
    "kernel_queue": "kernel_queue",
    "kvcache_tokens_per_second": "kv_tokens_per_s",
    "kv_tokens_per_s": "kv_tokens_per_s",
    "gpu_memory_used_bytes": "mem_used_bytes",
    "gpu_memory_total_bytes": "mem_total_bytes",
}
_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
_TOP: dict[str, str] = {"rps_fractional": "qps", "application_utilization": "gpu_utilization"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x >= 0 else None


def _collect(flat: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    mem_fraction: float | None = None
    for key, raw in flat.items():
        value = _number(raw)
        if value is None:
            continue
        if key.startswith("named_metrics."):
            target = _NAMED.get(key[len("named_metrics."):])
        elif key == "mem_utilization":
            mem_fraction = value
            continue
        else:
            target = _TOP.get(key)
        if target is not None:
            out[target] = value
    if mem_fraction is not None:
        out["mem_fraction"] = mem_fraction  # turned into bytes by the caller, who knows the total
    return out


def parse_orca(header: str) -> dict[str, float]:
    """Signals field -> value from one header; {} for anything unreadable (it must never fail a response)."""
    header = header.strip()
    fmt, _, body = header.partition(" ")
    fmt = fmt.upper()
    if fmt == "TEXT":
        flat: dict[str, Any] = {}
        for part in body.split(","):
            key, sep, value = part.strip().partition("=")
            if sep:
                flat[key.strip()] = value.strip()
        return _collect(flat)
    if fmt == "JSON":
        try:
            doc = json.loads(body)
        except ValueError:
            return {}
        if not isinstance(doc, dict):
            return {}
        flat = {}
        for key, value in doc.items():
            key = _CAMEL.sub(r"_\1", key).lower()  # protobuf JSON spells fields rpsFractional, namedMetrics
            if isinstance(value, dict):
                for sub, subvalue in value.items():
                    flat[f"{key}.{sub}"] = subvalue
            else:
                flat[key] = value
        return _collect(flat)
    return {}
