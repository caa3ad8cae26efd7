"""What a perfect cache could have saved: the trace's one-cache upper bound on the prefix-cache hit ratio.

Routing can only lose hits relative to one cache shared by the whole fleet: every request then finds the
longest prefix any earlier request computed. Two bounds are given:

- `infinite`: the cache never evicts (the "ideal hit ratio" of the Mooncake paper, here in tokens);
- `lru(capacity)`: one LRU cache as large as the whole fleet's KV memory. This is the fair target for a
  router: N separate caches of capacity C can at best behave like one cache of N*C.

Prefixes are chains of segments; a segment is (block id, words), so a block only matches an equal block
at the same position after an equal prefix (as vLLM's chained block hashes do).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

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


def one_cache_bound(items: Iterable[WorkItem], capacity_tokens: int | None = None) -> Bound:
    """Replay the prompts through one prefix cache; count the tokens of the longest cached prefix."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = 0
    hits = queries = 0
    for item in items:
        keys = _keys(item)
        queries += item.input_tokens
        matched = 0
        for key, words in keys:
            if key in cache:
                matched += words
            else:
                break
        hits += min(matched, item.input_tokens)
        # Insert/touch leaf-first so that a chain's parents end up most recent: LRU then evicts leaves
        # before the prefixes they hang from (vLLM frees a request's blocks in reverse for the same reason).
        for key, words in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = words
                used += words
        if capacity_tokens is not None:
            while used > capacity_tokens and cache:
                _, words = cache.popitem(last=False)
                used -= words
    return Bound(hits, queries, capacity_tokens)
