"""The metrics math behind every report, in one place so that live runs and offline replays agree.

Definitions (the report prints them too):
- percentile: linear interpolation between closest ranks (NumPy's default), on the values given.
- p99 fluctuation: requests are grouped into consecutive 10 s windows by the time they were sent; each
  window with at least `min_count` requests gets its p99 TTFT; the fluctuation is the coefficient of
  variation (population std-dev / mean) of those window p99s, printed as "±x%". A router that keeps tails
  steady scores low; one that lets a backend's queue build and drain scores high. The half-range
  ((max - min) / 2 / mean) is kept beside it because it is closer to how a "±" is often read.
- GPU utilisation std-dev: each backend's busy fraction (busy-time counter delta / wall time) per 10 s
  window; the population std-dev across backends per window, averaged over windows, in percentage points.
  Averaging the whole run first would hide imbalance that comes and goes; per second is too noisy
  (a step is either running or not).
"""

from __future__ import annotations

import math
from statistics import fmean, pstdev
from typing import Iterable, Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def window_p99s(
    times: Sequence[float], values: Sequence[float], window_s: float = 10.0, min_count: int = 10
) -> list[float]:
    """p99 of `values` per consecutive window of `times` (same length); windows with too few are skipped."""
    if len(times) != len(values):
        raise ValueError("times and values differ in length")
    if not times:
        return []
    t0 = min(times)
    buckets: dict[int, list[float]] = {}
    for t, v in zip(times, values):
        buckets.setdefault(int((t - t0) // window_s), []).append(v)
    out = []
    for k in sorted(buckets):
        if len(buckets[k]) >= min_count:
            p = percentile(buckets[k], 99.0)
            assert p is not None
            out.append(p)
    return out


def fluctuation(window_values: Sequence[float]) -> dict[str, float | None]:
    """Coefficient of variation and half-range of per-window values (fractions, not percent)."""
    if len(window_values) < 2:
        return {"cv": None, "half_range": None, "windows": len(window_values)}
    mean = fmean(window_values)
    if mean <= 0:
        return {"cv": None, "half_range": None, "windows": len(window_values)}
    return {
        "cv": pstdev(window_values) / mean,
        "half_range": (max(window_values) - min(window_values)) / 2.0 / mean,
        "windows": len(window_values),
    }


def counter_rate(samples: Sequence[tuple[float, float]]) -> float | None:
    """Average rate of a monotonically increasing counter over (time, value) samples; resets are skipped."""
    if len(samples) < 2:
        return None
    total = 0.0
    for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
        if v1 >= v0:
            total += v1 - v0
    span = samples[-1][0] - samples[0][0]
    return total / span if span > 0 else None


def windowed_utilisation(
    busy: Mapping[str, Sequence[tuple[float, float]]], window_s: float = 10.0
) -> dict[str, list[float | None]]:
    """Per backend, busy fraction in consecutive windows aligned on the earliest sample time.

    `busy` maps a backend to (wall time, busy-seconds counter) samples. A window's fraction is the counter's
    growth between the samples nearest its edges divided by the time between them.
    """
    if not busy:
        return {}
    t0 = min(s[0][0] for s in busy.values() if s)
    t1 = max(s[-1][0] for s in busy.values() if s)
    n = max(1, int((t1 - t0) // window_s))
    out: dict[str, list[float | None]] = {}
    for name, samples in busy.items():
        fracs: list[float | None] = []
        for k in range(n):
            lo, hi = t0 + k * window_s, t0 + (k + 1) * window_s
            inside = [s for s in samples if lo - 1e-9 <= s[0] <= hi + 1e-9]
            if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
                fracs.append(None)
                continue
            dv = inside[-1][1] - inside[0][1]
            fracs.append(max(0.0, min(1.0, dv / (inside[-1][0] - inside[0][0]))) if dv >= 0 else None)
        out[name] = fracs
    return out


def utilisation_spread(per_window: Mapping[str, Sequence[float | None]]) -> dict[str, float | None]:
    """Mean busy fraction and the mean over windows of the cross-backend std-dev (both 0..1)."""
    if not per_window:
        return {"mean": None, "std": None, "windows": 0}
    n = min(len(v) for v in per_window.values())
    stds: list[float] = []
    means: list[float] = []
    for k in range(n):
        vals = [v[k] for v in per_window.values()]
        if any(x is None for x in vals):
            continue
        xs = [float(x) for x in vals if x is not None]
        stds.append(pstdev(xs))
        means.append(fmean(xs))
    if not stds:
        return {"mean": None, "std": None, "windows": 0}
    return {"mean": fmean(means), "std": fmean(stds), "windows": len(stds)}


def safe_ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den in (None, 0):
        return None
    return num / den  # type: ignore[operator]


def mean_or_none(values: Iterable[float]) -> float | None:
    xs = list(values)
    return fmean(xs) if xs else None
