"""Bounded, approximate LRU memories: per-backend prefix-block index, fleet-wide exact-fingerprint map.

Both are *generational* LRUs rather than exact ones: entries live in a young and an old generation of at
most capacity/2 entries each; touching an entry puts it in the young one, and when the young one is full it
becomes the old one and the old one is dropped whole. An entry therefore survives at least capacity/2 newer
insertions and at most `capacity`, and never costs more than one slot. Compared to an OrderedDict LRU this
stores no linked-list node per entry (about half the memory), inserts a whole 1024-block chain with one
C-level `set.update`, and reads are one or two hash lookups. Exactness does not matter here: the index only
approximates what a backend's KV cache (itself evicting on its own schedule) still holds.

Memory is bounded by configuration: a backend's index holds at most `capacity` block hashes (~60–90 bytes
each including the int object), whatever the traffic.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

V = TypeVar("V")


class PrefixIndex:
    """Block hashes recently routed to one backend."""

    __slots__ = ("_half", "_young", "_old", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._half = max(1, capacity // 2)
        self._young: set[int] = set()
        self._old: set[int] = set()

    def __len__(self) -> int:
        return len(self._young | self._old)

    def __contains__(self, block: int) -> bool:
        return block in self._young or block in self._old

    def resize(self, capacity: int) -> None:
        """New capacity (e.g. telemetry reported the backend's KV size); shrinking drops the old generation."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if capacity == self.capacity:
            return
        self.capacity = capacity
        self._half = max(1, capacity // 2)
        if len(self._young) > self._half:
            self._young = set()
        if len(self._old) > self._half or capacity == 1:
            self._old = set()

    def add(self, blocks: Sequence[int]) -> None:
        """Remember a prompt's chain (it was just routed here, so its KV is being built here)."""
        if len(blocks) > self._half:
            # A chain longer than a generation: its leading blocks are the ones other prompts can share.
            blocks = blocks[: self._half]
        if len(self._young) + len(blocks) > self._half:
            # With capacity 1 there is room for one generation only.
            self._old = self._young if self.capacity > 1 else set()
            self._young = set()
        self._young.update(blocks)

    def match(self, blocks: Sequence[int], at_least: int = 1) -> int:
        """Number of leading blocks of `blocks` present here, or 0 if fewer than `at_least`.

        A block hash names its whole prefix, so the presence of block k-1 alone proves that a prompt with
        these first k blocks was routed here; presence is (approximately) prefix-closed, which makes a
        binary search valid. `at_least` lets the caller skip backends that cannot beat the best match so
        far with a single lookup.
        """
        n = len(blocks)
        if at_least > n:
            return 0
        young, old = self._young, self._old
        h = blocks[at_least - 1]
        if h not in young and h not in old:
            return 0
        lo, hi = at_least, n  # invariant: blocks[lo-1] present; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = blocks[mid - 1]
            if h in young or h in old:
                lo = mid
            else:
                hi = mid - 1
        return lo


def holding(indexes: Sequence[PrefixIndex], block: int) -> list[int]:
    """Positions of the indexes that hold `block`: one pass without a method call per index.

    The affinity policy asks this of every backend for every new prompt; at 256 backends a per-index
    method call costs ~4x the membership tests themselves.
    """
    return [i for i, x in enumerate(indexes) if block in x._young or block in x._old]


class GenerationalMap(Generic[V]):
    """A bounded key -> value map with the same generational approximate-LRU eviction."""

    __slots__ = ("_half", "_young", "_old", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._half = max(1, capacity // 2)
        self._young: dict[int, V] = {}
        self._old: dict[int, V] = {}

    def __len__(self) -> int:
        return len(self._young.keys() | self._old.keys())

    def get(self, key: int) -> V | None:
        value = self._young.get(key)
        if value is None:
            value = self._old.get(key)
        return value

    def put(self, key: int, value: V) -> None:
        young = self._young
        if key not in young and len(young) >= self._half:
            self._old = young if self.capacity > 1 else {}
            self._young = young = {}
        young[key] = value

    def discard_value(self, value: V) -> None:
        """Forget every entry pointing at `value` (e.g. a backend removed from the fleet)."""
        for gen in (self._young, self._old):
            for k in [k for k, v in gen.items() if v == value]:
                del gen[k]
