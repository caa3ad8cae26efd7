"""Generational approximate-LRU index: bounded, prefix matching, recency."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.prefix_index import GenerationalMap, PrefixIndex


def chain(tag: int, n: int) -> list[int]:
    return [tag * 1_000_000 + i for i in range(n)]


@given(st.integers(min_value=1, max_value=200), st.lists(st.integers(min_value=0, max_value=300), max_size=60))
@settings(max_examples=100, deadline=None)
def test_never_holds_more_than_capacity(capacity, lengths):
    idx = PrefixIndex(capacity)
    for tag, n in enumerate(lengths):
        idx.add(chain(tag, n))
        assert len(idx) <= capacity


def test_match_is_the_longest_recorded_prefix():
    idx = PrefixIndex(1000)
    idx.add(chain(1, 10))
    assert idx.match(chain(1, 10)) == 10
    assert idx.match(chain(1, 25)) == 10
    assert idx.match(chain(1, 4)) == 4
    assert idx.match(chain(2, 10)) == 0
    assert idx.match(chain(1, 10), at_least=11) == 0  # cannot reach 11 blocks
    assert idx.match(chain(1, 10), at_least=6) == 10
    assert idx.match([]) == 0


def test_recently_touched_entries_survive_eviction():
    idx = PrefixIndex(20)  # generations of 10
    hot = chain(0, 5)
    idx.add(hot)
    for tag in range(1, 30):
        idx.add(chain(tag, 5))
        idx.add(hot)  # routed again: stays young
        assert idx.match(hot) == 5
    assert idx.match(chain(1, 5)) == 0  # cold and long gone


def test_chain_longer_than_a_generation_keeps_its_leading_blocks():
    idx = PrefixIndex(8)
    idx.add(chain(3, 100))
    assert idx.match(chain(3, 100)) == 4
    assert len(idx) <= 8


def test_resize_bounds_memory():
    idx = PrefixIndex(1000)
    for tag in range(20):
        idx.add(chain(tag, 40))
    idx.resize(50)
    assert len(idx) <= 50 and idx.capacity == 50
    for tag in range(20):
        idx.add(chain(tag, 40))
        assert len(idx) <= 50


def test_generational_map_is_bounded_and_forgets_values():
    m: GenerationalMap[str] = GenerationalMap(10)
    for i in range(100):
        m.put(i, f"b{i % 3}")
        assert len(m) <= 10
    assert m.get(99) == "b0" and m.get(0) is None
    m.discard_value("b0")
    assert m.get(99) is None and m.get(98) == "b2"
