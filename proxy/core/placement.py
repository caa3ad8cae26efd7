"""Eviction-aware placement of new prompts: put a prompt no backend holds where it evicts the oldest KV.

One LRU cache the size of the whole fleet (the bound the replay measures a router against) evicts the
fleet's oldest block. Four per-backend caches evict each backend's own oldest: a new prompt placed on a
backend whose cache churns fastest evicts blocks younger than those another backend would drop, and a
prefix that a global LRU would still hold is gone when its next request comes. So, among the backends the
bounded-load rule admits whose cost for this prompt is within `band` tokens of the cheapest (the cost check
calls them a near-equal fleet: there the hash home was only a tie-break), prefer the one whose engine
evicts the oldest blocks: the lowest `lru_front` (`proxy/core/kv_index.py`: the store sequence number of
its latest evicted blocks), a backend that is not evicting at all first of all.

Only backends whose KV events are fresh are judged (`fresh`): if any candidate of the band is not, the rule
abstains and the caller keeps its choice. Pure: no I/O, no clock (the age is in blocks stored, not time).

Off by default (`routing.affinity.eviction_band_tokens: 0`): in the replay it raised the hit ratio on the
busiest Mooncake load at R = 1 by a few points but lost hits on the multi-turn loads and broke "R = 4
within 5% of R = 1" (loadtest/results/scaleout.md, Round 5).
"""

from __future__ import annotations

from typing import Callable, Container, Mapping, Sequence

from proxy.core.kv_index import PreciseMatch

__all__ = ["oldest_lru", "place_new"]


def oldest_lru(
    candidates: Sequence[tuple[str, float, float]],
    lru_front: Mapping[str, float],
    fresh: Container[str],
    band: float,
) -> str | None:
    """`candidates`: (name, cost, rendezvous score) of the admissible backends, the caller's choice
    among them. Among those costing at most the cheapest + `band`, the one evicting the oldest blocks
    (not evicting: the oldest; ties: the cheaper, then the higher score). None when fewer than two are in
    the band or one of them has no fresh events (the caller keeps its own choice)."""
    if len(candidates) < 2:
        return None
    low = min(c for _n, c, _s in candidates)
    best: tuple[float, float, float] | None = None
    best_name: str | None = None
    inside = 0
    for name, cost, score in candidates:
        if cost > low + band:
            continue
        if name not in fresh:
            return None
        inside += 1
        rank = (lru_front.get(name, -1.0), cost, -score)
        if best is None or rank < best:
            best, best_name = rank, name
    return best_name if inside > 1 else None


def place_new(
    found: PreciseMatch,
    names: Sequence[str],
    scores: Sequence[float],
    can_take: Callable[[str], bool],
    cost_of: Callable[[int], tuple[float, int]],
    band: float,
) -> tuple[str, int] | None:
    """The affinity policy's hook (its cost check, new-prompt branch): ring member names, their rendezvous
    scores, the bounded-load rule and the cost check's cost (and blocks held) of ring member i. The
    backend chosen by `oldest_lru` and the blocks it holds; None: abstain."""
    costs = {i: cost_of(i) for i, n in enumerate(names) if can_take(n)}
    got = oldest_lru([(names[i], c, scores[i]) for i, (c, _m) in costs.items()], found.lru_front or {},
                     found.cached, float(band))
    return None if got is None else (got, costs[list(names).index(got)][1])
