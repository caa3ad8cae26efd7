"""Paged KV cache with vLLM-style automatic prefix caching (pure, no clock).

The cache is a pool of fixed-size blocks (16 tokens each in vLLM on CUDA). A block that is full gets a key
that chains its parent's key and its own tokens, so equal keys mean equal *prefixes*, not just equal
16-token windows; the chain is seeded by the model and LoRA adapter because an adapter changes every
layer's K and V. A new sequence reuses the longest run of leading blocks whose keys are cached.

Freed blocks keep their key and stay reusable until the space is needed: they sit in a free queue in the
order they were freed (a sequence's blocks are freed tail first, so the end of a sequence goes before its
shared beginning) and allocation takes from the front, evicting the key of the block it reuses. This is
vLLM V1's `FreeKVCacheBlockQueue` + `cached_block_hash_to_block` design, shrunk to what routing cares about.

KV-cache events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`): a pool built with
`record_events=True` logs, in the order they happen, every key that becomes reusable (`Stored`, logged by
the engine, which knows the tokens) and every key it evicts or drops (`Removed`); `take_events()` hands the
log over. A key is announced once, when it first becomes cached, and withdrawn once, when it stops being
cached, exactly the pairs a subscriber needs to mirror `_cached`. `sim/kv_events.py` publishes them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence, Union

import xxhash

_SEP = "\x1f"


def chain_seed(model: str, adapter: str | None) -> int:
    """The key the first block of a sequence chains from: different model or adapter, different cache."""
    return xxhash.xxh3_64_intdigest(f"{model}{_SEP}{adapter or ''}".encode("utf-8", "surrogatepass"))


def extend_block_keys(keys: list[int], tokens: Sequence[str], block_size: int, seed: int) -> None:
    """Append keys for every full block of `tokens` not yet keyed (keys[i] covers tokens[:16*(i+1)])."""
    parent = keys[-1] if keys else seed
    for i in range(len(keys), len(tokens) // block_size):
        parent = xxhash.xxh3_64_intdigest(_SEP.join(tokens[i * block_size : (i + 1) * block_size]).encode("utf-8", "surrogatepass"), seed=parent)
        keys.append(parent)


@dataclass(frozen=True, slots=True)
class Stored:
    """Keys that became reusable, in chain order: keys[0]'s parent is `parent` (None: a sequence start)."""

    keys: tuple[int, ...]
    parent: int | None
    tokens: tuple[str, ...]  # block_size tokens per key
    adapter: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


PoolEvent = Union[Stored, Removed, Cleared]


class BlockPool:
    """Block allocation, reference counts, the key→block map and the LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        # Insertion order = eviction order (front evicted first). Never-used blocks first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0
        self.events: list[PoolEvent] | None = [] if record_events else None

    def take_events(self) -> list[PoolEvent]:
        """The events logged since the last call (always empty unless built with record_events)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def log_stored(self, keys: Sequence[int], parent: int | None, tokens: Sequence[str], adapter: str | None) -> None:
        if self.events is not None and keys:
            self.events.append(Stored(tuple(keys), parent, tuple(tokens), adapter))

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache: forget every reusable key; False (nothing done) while blocks are in use."""
        if self.num_used:
            return False
        self._cached.clear()
        self._key = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(Cleared())
        return True

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a reusable key (referenced or not)."""
        return len(self._cached)

    def usage(self) -> float:
        """Share of blocks referenced by live sequences (vLLM's kv_cache_usage_perc)."""
        return self.num_used / self.num_blocks

    def match(self, keys: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of `keys` (not acquired: see `acquire`)."""
        blocks: list[int] = []
        cached = self._cached
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free_after_acquire(self, blocks: Sequence[int]) -> int:
        """How many blocks stay allocatable once `blocks` (cache hits) are acquired."""
        return len(self._free) - sum(1 for b in blocks if self._ref[b] == 0)

    def acquire(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks from the front of the free queue, evicting their old keys; None if short."""
        if n > len(self._free):
            return None
        out: list[int] = []
        evicted: list[int] | None = [] if self.events is not None else None
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key[b]
            if key is not None:
                if self._cached.get(key) == b:
                    del self._cached[key]
                    if evicted is not None:
                        evicted.append(key)
                self._key[b] = None
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        if evicted:
            self.events.append(Removed(tuple(evicted)))  # type: ignore[union-attr]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue tail first."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def commit(self, block: int, key: int) -> bool:
        """Mark a full block reusable under `key` (a duplicate of an already cached key stays private);
        True if `key` became cached now."""
        if self._key[block] is not None:
            return False
        if key in self._cached:
            return False
        self._key[block] = key
        self._cached[key] = block
        return True
