"""The load a routing policy compares backends by: telemetry score plus the proxy's own in-flight work.

Two sources, with opposite strengths:

- the telemetry `load_score` in the snapshot (0 idle .. 1 full, computed by proxy/core/score.py from the
  engine's own metrics) sees everything on the GPU, including work from other proxies, but is up to one
  scrape interval old, and can be stale or missing altogether;
- the proxy's `Inflight` accounting is exact and current but sees only this proxy's requests.

`effective_load` adds them: the score, plus the in-flight work normalised by the backend's capacity. The
in-flight part makes a burst sent since the last scrape count immediately (otherwise every request of the
burst goes to the backend that looked idle 200 ms ago). Some of that work is also inside the score, but it
is counted the same way for every backend, so the ranking is what matters and it stays right.

A backend whose telemetry is stale or missing is assumed to be at least as loaded as the fleet's fresh
mean and never below `LoadConfig.stale_score`: a broken metrics endpoint must not read as an idle GPU, which
is how routers send everything to the one backend they cannot see.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from proxy.core.decision import Inflight
from proxy.core.routing_config import LoadConfig
from proxy.core.snapshot import BackendState

_NO_INFLIGHT = Inflight()
_DEFAULT_CFG = LoadConfig()


def telemetry_score(state: BackendState) -> float | None:
    """The backend's telemetry score if it can be trusted now, else None."""
    if state.stale or state.load_score is None:
        return None
    return state.load_score


def assumed_score(states: Iterable[BackendState], cfg: LoadConfig = _DEFAULT_CFG) -> float:
    """The score to assume for a backend without fresh telemetry: max(fresh fleet mean, stale_score)."""
    total = 0.0
    count = 0
    for s in states:
        score = telemetry_score(s)
        if score is not None:
            total += score
            count += 1
    mean = total / count if count else 0.0
    return max(mean, cfg.stale_score)


def inflight_load(state: BackendState, inflight: Inflight | None, cfg: LoadConfig = _DEFAULT_CFG) -> float:
    """In-flight work as a fraction of the backend's capacity (requests or tokens, whichever is fuller)."""
    if inflight is None:
        return 0.0
    req_full = state.spec.max_inflight or cfg.inflight_requests_full
    tok_full = float(cfg.inflight_tokens_full)
    if state.signals is not None and state.signals.kv_capacity_tokens:
        tok_full = float(state.signals.kv_capacity_tokens)
    return max(inflight.requests / req_full, inflight.tokens / tok_full)


def effective_load(
    state: BackendState,
    inflight: Inflight | None,
    cfg: LoadConfig = _DEFAULT_CFG,
    *,
    assumed: float | None = None,
) -> float:
    """Routing load of one backend: telemetry score (or `assumed` when stale/missing) + in-flight load.

    `assumed` is the score used when the backend's telemetry cannot be trusted; pass
    `assumed_score(snapshot.backends, cfg)` when ranking a fleet so that stale backends read as average-or-
    worse. Without it, `cfg.stale_score` is assumed. 0 means idle; values above 1 are possible and mean
    "more than full" (queueing).
    """
    score = telemetry_score(state)
    if score is None:
        score = cfg.stale_score if assumed is None else assumed
    return score + inflight_load(state, inflight, cfg)


def fleet_loads(
    states: Iterable[BackendState],
    inflight: Mapping[str, Inflight],
    cfg: LoadConfig = _DEFAULT_CFG,
) -> dict[str, float]:
    """`effective_load` of each backend, stale ones at the fleet's assumed score."""
    states = tuple(states)
    assumed = assumed_score(states, cfg)
    return {s.name: effective_load(s, inflight.get(s.name, _NO_INFLIGHT), cfg, assumed=assumed) for s in states}
