"""What a perfect cache could have saved: the trace's one-cache upper bound on the prefix-cache hit ratio.

Routing can only lose hits relative to one cache shared by the whole fleet: every request then finds the
longest prefix any earlier request computed. Two bounds are given:

- `infinite`: the cache never evicts (the "ideal hit ratio" of the Mooncake paper, here in tokens);
- `lru(capacity)`: one LRU cache as large as the whole fleet's KV memory. This is the fair target for a
  router: N separate caches of capacity C can at best behave like one cache of N*C.

Prefixes are chains of segments; a segment is (block id, words), so a block only matches an equal block
at the same position after an equal prefix (as vLLM's chained block hashes do).

`placed_caches` is the same model over N caches of one engine's capacity each, with a placement per request
(a replay's, or one of `PLACEMENT_RULES`): what separate caches hit when nothing but the placement differs
from the bound (no queueing, no KV held by running requests, no engine timing). Against the bound and
against the replay itself it splits a router's gap into placement and engine timing
(`loadtest/results/scaleout.py decompose`).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

from loadtest.workloads.model import WorkItem


@dataclass(frozen=True, slots=True)
class Bound:
    hit_tokens: int
    query_tokens: int
    capacity_tokens: int | None  # None: infinite

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _keys(item: WorkItem) -> list[tuple[int, int]]:
    out = []
    key = 0
    for seg in item.chain:
        key = hash((key, seg.block, seg.words))
        out.append((key, seg.words))
    return out


class _LRU:
    """One prefix cache in tokens, as the bound models it."""

    __slots__ = ("cache", "used", "capacity")

    def __init__(self, capacity_tokens: int | None) -> None:
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.used = 0
        self.capacity = capacity_tokens

    def match(self, keys: list[tuple[int, int]]) -> int:
        matched = 0
        for key, words in keys:
            if key in self.cache:
                matched += words
            else:
                break
        return matched

    def insert(self, keys: list[tuple[int, int]]) -> int:
        """Touch the chain and add what is missing; returns the tokens added."""
        cache = self.cache
        added = 0
        # Insert/touch leaf-first so that a chain's parents end up most recent: LRU then evicts leaves
        # before the prefixes they hang from (vLLM frees a request's blocks in reverse for the same reason).
        for key, words in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = words
                added += words
        self.used += added
        if self.capacity is not None:
            while self.used > self.capacity and cache:
                _, words = cache.popitem(last=False)
                self.used -= words
        return added


def one_cache_bound(items: Iterable[WorkItem], capacity_tokens: int | None = None) -> Bound:
    """Replay the prompts through one prefix cache; count the tokens of the longest cached prefix."""
    cache = _LRU(capacity_tokens)
    hits = queries = 0
    for item in items:
        keys = _keys(item)
        queries += item.input_tokens
        hits += min(cache.match(keys), item.input_tokens)
        cache.insert(keys)
    return Bound(hits, queries, capacity_tokens)


@dataclass(frozen=True, slots=True)
class BoundStep:
    """What the bound's one cache did for one request: the tokens it hit, the earlier request that last
    touched the deepest block it hit (None: no hit), and how close to eviction that block was: the tokens
    the cache held that were used more recently, as a share of its capacity (1.0: the next block evicted)."""

    hit_tokens: int
    source: int | None
    depth: float


def bound_steps(items: Sequence[WorkItem], capacity_tokens: int) -> list[BoundStep]:
    """`one_cache_bound(items, capacity_tokens)` request by request (the same hits, in the same order)."""
    cache = _LRU(capacity_tokens)
    toucher: dict[int, int] = {}
    out: list[BoundStep] = []
    for i, item in enumerate(items):
        keys = _keys(item)
        hit = min(cache.match(keys), item.input_tokens)
        source: int | None = None
        depth = 0.0
        if hit > 0:
            deepest = keys[0][0]
            for key, _words in keys:
                if key not in cache.cache:
                    break
                deepest = key
            source = toucher.get(deepest)
            newer = 0
            for key in reversed(cache.cache):  # most recent first
                if key == deepest:
                    break
                newer += cache.cache[key]
            depth = newer / capacity_tokens
        cache.insert(keys)
        for key, _words in keys:
            toucher[key] = i
        out.append(BoundStep(hit, source, depth))
    return out


# How `placed_caches` places a request no cache holds any of (one that some cache holds goes to the one
# holding the longest prefix, ties to the lowest index): its first block's id modulo N (a hash home),
# in turn, or on the cache that took the fewest tokens lately (an exponential decay over the tokens
# inserted fleet-wide, with the fleet's capacity as its horizon: churn balanced).
PLACEMENT_RULES = ("hash", "round_robin", "least_inserted")
# The rules `placed_caches(..., seed=k)` draws per seed: a hash home from the first block's id hashed with
# seed k (another hash function, as another router's ring or another set of backend names would be), a
# uniformly random cache from a generator seeded with k, or churn balanced as seen through noise (each
# cache's decayed count scaled by its own uniform [0.9, 1.1) draw at every pick: an imperfect, lagging
# view such as KV events give). Over many seeds they give the spread of what load-blind placement alone
# keeps: the lottery of where a window's few large prompts land, against a rule that balances them.
SEEDED_RULES = ("hash", "random", "least_inserted")
CHURN_NOISE = 0.1


def placed_caches(items: Sequence[WorkItem], placements: Sequence[int | None] | str, n: int,
                  capacity_tokens: int, *, seed: int | None = None) -> Bound:
    """N LRU caches of `capacity_tokens` each; request i goes to cache `placements[i]` (None: skipped, as
    the bound skips a prompt no engine computed), or by the rule `placements` names (PLACEMENT_RULES; with
    `seed`, one of SEEDED_RULES drawn with that seed)."""
    draw: random.Random | None = None
    given: Sequence[int | None] | None = None  # the placements, when not a rule
    if isinstance(placements, str):
        rules = PLACEMENT_RULES if seed is None else SEEDED_RULES
        if placements not in rules:
            raise ValueError(f"unknown placement rule {placements!r}"
                             f"{'' if seed is None else ' with a seed'} (one of {', '.join(rules)})")
        rule: str | None = placements
        if seed is not None and rule in ("random", "least_inserted"):
            draw = random.Random(seed)
    else:
        rule, given = None, placements
        if len(placements) != len(items):
            raise ValueError(f"{len(placements)} placements for {len(items)} requests")
    caches = [_LRU(capacity_tokens) for _ in range(n)]
    churn = [0.0] * n  # tokens inserted lately, decayed (least_inserted)
    horizon = float(n * capacity_tokens)
    turn = 0
    hits = queries = 0
    for i, item in enumerate(items):
        keys = _keys(item)
        matches = [c.match(keys) for c in caches]
        j: int | None
        if given is not None:
            j = given[i]
            if j is None:
                continue
        else:
            best = max(matches)
            if best > 0:
                j = matches.index(best)
            elif rule == "random" and draw is not None:
                j = draw.randrange(n)
            elif rule == "hash":
                first = item.chain[0].block if item.chain else 0
                j = (first if seed is None else xxhash.xxh3_64_intdigest(str(first).encode(), seed=seed)) % n
            elif rule == "round_robin":
                j = turn % n
                turn += 1
            elif rule == "least_inserted" and draw is not None:  # seen through noise
                seen = [c * (1.0 + CHURN_NOISE * (2.0 * draw.random() - 1.0)) for c in churn]
                j = seen.index(min(seen))
            else:
                j = churn.index(min(churn))
        queries += item.input_tokens
        hits += min(matches[j], item.input_tokens)
        added = caches[j].insert(keys)
        if added:
            decay = math.exp(-added / horizon)
            churn = [c * decay for c in churn]
            churn[j] += added
    return Bound(hits, queries, capacity_tokens)
