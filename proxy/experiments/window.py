"""Per-arm measurement: cumulative totals (the Prometheus series) and a sliding window (what rules read).

Fed once per finished attempt from `Lease.finish()` (proxy/dataplane/router.py), on the event loop, so
plain ints and lists suffice. The window is a ring of fixed-width time buckets: adding is O(1), reading
the window sums the live buckets. Percentiles come from log-spaced histogram buckets (±7% resolution),
interpolated inside the bucket, which is finer than any guardrail threshold ("1.2 x control").
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from typing import Any

from proxy.core.decision import Outcome
from proxy.core.experiments import ArmWindow

# Fine buckets for window percentiles: 1 ms .. ~20 min, x1.15 each.
FINE_BOUNDS: tuple[float, ...] = tuple(0.001 * 1.15 ** i for i in range(100))
# Exported histogram buckets (Prometheus): TTFT spans tens of ms to seconds; e2e to minutes.
EXPORT_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                                    5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_FAILURES = {Outcome.CONNECT_FAILURE, Outcome.RESET, Outcome.STREAM_FAILURE, Outcome.STATUS_5XX}
_decoder = json.JSONDecoder()


def error_kind(status: int, outcome: Outcome | None) -> str | None:
    """What went wrong with an attempt, for the per-arm error series; None when nothing did. A client that
    went away (499) or a 4xx is not the arm's failure."""
    if outcome is not None and outcome in _FAILURES and outcome is not Outcome.STATUS_5XX:
        return outcome.value
    if status >= 500 or outcome is Outcome.STATUS_5XX:
        return "5xx"
    return None


def usage_of(body: bytes | None) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) from a JSON answer's `usage`, when it reports them."""
    if not body:
        return None
    i = body.rfind(b'"usage"')
    if i < 0:
        return None
    j = body.find(b":", i)
    if j < 0:
        return None
    try:
        usage, _ = _decoder.raw_decode(body[j + 1:].decode("utf-8", "replace").lstrip())
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int) or isinstance(prompt, bool):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return prompt, cached if isinstance(cached, int) and not isinstance(cached, bool) else 0


class _Bucket:
    __slots__ = ("start", "requests", "errors", "ttft", "e2e", "prompt_tokens", "cached_tokens")

    def __init__(self, start: int) -> None:
        self.start = start
        self.requests = 0
        self.errors = 0
        self.ttft: dict[int, int] = {}
        self.e2e: dict[int, int] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0


def _percentile(counts: dict[int, int], q: float) -> float | None:
    total = sum(counts.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for idx in sorted(counts):
        n = counts[idx]
        if seen + n >= rank:
            lo = FINE_BOUNDS[idx - 1] if idx > 0 else 0.0
            hi = FINE_BOUNDS[idx] if idx < len(FINE_BOUNDS) else FINE_BOUNDS[-1] * 1.15
            return lo + (hi - lo) * ((rank - seen) / n)
        seen += n
    return FINE_BOUNDS[-1]


class ArmStats:
    """Totals since start and a sliding window of one arm."""

    def __init__(self, window_s: float, bucket_s: float = 1.0) -> None:
        self.bucket_s = bucket_s
        self.window_s = window_s
        self._ring: list[_Bucket | None] = [None] * (int(math.ceil(window_s / bucket_s)) + 1)
        # totals (exported)
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.ttft_counts = [0] * (len(EXPORT_BOUNDS) + 1)
        self.ttft_sum = 0.0
        self.e2e_counts = [0] * (len(EXPORT_BOUNDS) + 1)
        self.e2e_sum = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def resize(self, window_s: float) -> None:
        if window_s != self.window_s:
            self.window_s = window_s
            self._ring = [None] * (int(math.ceil(window_s / self.bucket_s)) + 1)

    def _bucket(self, now: float) -> _Bucket:
        start = int(now // self.bucket_s)
        ring = self._ring
        slot = start % len(ring)
        b = ring[slot]
        if b is None or b.start != start:
            b = ring[slot] = _Bucket(start)
        return b

    def observe(self, now: float, status: int, outcome: Outcome | None, e2e_s: float, ttft_s: float | None,
                usage: tuple[int, int] | None) -> None:
        b = self._bucket(now)
        self.requests += 1
        b.requests += 1
        kind = error_kind(status, outcome)
        if kind is not None:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            b.errors += 1
        e2e_s = max(0.0, e2e_s)
        self.e2e_counts[bisect_left(EXPORT_BOUNDS, e2e_s)] += 1
        self.e2e_sum += e2e_s
        i = bisect_left(FINE_BOUNDS, e2e_s)
        b.e2e[i] = b.e2e.get(i, 0) + 1
        if ttft_s is not None and kind is None:
            ttft_s = max(0.0, ttft_s)
            self.ttft_counts[bisect_left(EXPORT_BOUNDS, ttft_s)] += 1
            self.ttft_sum += ttft_s
            i = bisect_left(FINE_BOUNDS, ttft_s)
            b.ttft[i] = b.ttft.get(i, 0) + 1
        if usage is not None:
            self.prompt_tokens += usage[0]
            self.cached_tokens += usage[1]
            b.prompt_tokens += usage[0]
            b.cached_tokens += usage[1]

    def window(self, now: float) -> ArmWindow:
        """The aggregates of the buckets that lie wholly or partly in (now - window_s, now]."""
        first = int((now - self.window_s) // self.bucket_s)  # the oldest bucket may be partly inside
        last = int(now // self.bucket_s)
        requests = errors = prompt = cached = 0
        ttft: dict[int, int] = {}
        e2e: dict[int, int] = {}
        for b in self._ring:
            if b is None or not first <= b.start <= last:
                continue
            requests += b.requests
            errors += b.errors
            prompt += b.prompt_tokens
            cached += b.cached_tokens
            for k, n in b.ttft.items():
                ttft[k] = ttft.get(k, 0) + n
            for k, n in b.e2e.items():
                e2e[k] = e2e.get(k, 0) + n
        return ArmWindow(requests, errors, _percentile(ttft, 0.99), _percentile(e2e, 0.99), prompt, cached)

    def totals_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": dict(self.errors), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}


def window_json(w: ArmWindow) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 6)

    return {"requests": w.requests, "errors": w.errors, "error_rate": r(w.error_rate), "ttft_p99_s": r(w.ttft_p99),
            "e2e_p99_s": r(w.e2e_p99), "prompt_tokens": w.prompt_tokens, "cached_tokens": w.cached_tokens,
            "hit_ratio": r(w.hit_ratio)}
