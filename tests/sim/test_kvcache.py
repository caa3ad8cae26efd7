"""The paged prefix cache alone: chained keys, longest-prefix reuse, LRU eviction of freed blocks."""

from __future__ import annotations

from sim.kvcache import BlockPool, chain_seed, extend_block_keys


def keys_of(words: list[str], seed: int, block_size: int = 4) -> list[int]:
    keys: list[int] = []
    extend_block_keys(keys, words, block_size, seed)
    return keys


def test_keys_chain_prefixes_not_windows() -> None:
    seed = chain_seed("m", None)
    a = keys_of("a b c d e f g h".split(), seed)
    b = keys_of("a b c d e f g h x".split(), seed)  # a partial trailing block has no key
    c = keys_of("z b c d e f g h".split(), seed)  # same second window, different first block
    assert len(a) == 2 and a == b
    assert c[1] != a[1]


def test_keys_are_seeded_by_model_and_adapter() -> None:
    words = "a b c d".split()
    assert keys_of(words, chain_seed("m", None)) != keys_of(words, chain_seed("m", "lora1"))
    assert keys_of(words, chain_seed("m", None)) != keys_of(words, chain_seed("other", None))
    assert keys_of(words, chain_seed("m", "lora1")) == keys_of(words, chain_seed("m", "lora1"))


def test_extend_keys_is_incremental() -> None:
    seed = chain_seed("m", None)
    words = "a b c d e f g h i j k l".split()
    keys: list[int] = []
    extend_block_keys(keys, words[:5], 4, seed)
    extend_block_keys(keys, words, 4, seed)
    assert keys == keys_of(words, seed)


def test_freed_blocks_stay_cached_and_reusable() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.commit(blocks[0], 11)
    pool.commit(blocks[1], 22)
    pool.release(blocks)
    assert pool.num_free == 4 and pool.num_cached == 2
    hit = pool.match([11, 22, 33])
    assert hit == blocks
    pool.acquire(hit)
    assert pool.num_free == 2 and pool.usage() == 0.5


def test_match_stops_at_first_miss() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.commit(blocks[1], 22)
    assert pool.match([11, 22]) == []


def test_eviction_takes_never_used_then_least_recently_freed_tail_first() -> None:
    pool = BlockPool(4, 4)
    first = pool.allocate(2)
    assert first is not None
    pool.commit(first[0], 1)
    pool.commit(first[1], 2)
    pool.release(first)  # freed tail first: block of key 2 is older in the free queue than key 1
    fresh = pool.allocate(2)  # the two never-used blocks go first
    assert fresh is not None and set(fresh).isdisjoint(first)
    assert pool.num_cached == 2 and pool.evictions == 0
    one = pool.allocate(1)
    assert one == [first[1]]  # the tail block of the freed sequence is evicted before its head
    assert pool.match([1, 2]) == [first[0]]
    assert pool.evictions == 1


def test_allocate_refuses_when_short_and_referenced_blocks_are_never_evicted() -> None:
    pool = BlockPool(2, 4)
    held = pool.allocate(2)
    assert held is not None
    pool.commit(held[0], 5)
    assert pool.allocate(1) is None
    assert pool.match([5]) == [held[0]]


def test_duplicate_key_stays_private() -> None:
    pool = BlockPool(3, 4)
    a = pool.allocate(2)
    assert a is not None
    pool.commit(a[0], 7)
    pool.commit(a[1], 7)
    assert pool.match([7]) == [a[0]] and pool.num_cached == 1


def test_free_after_acquire_counts_unreferenced_hits() -> None:
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    assert a is not None
    pool.commit(a[0], 1)
    pool.commit(a[1], 2)
    pool.release([a[1]])
    assert pool.num_free == 3
    assert pool.free_after_acquire(a) == 2  # a[1] is free now and stops being free once acquired
