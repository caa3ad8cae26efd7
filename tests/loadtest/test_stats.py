"""Metrics math: percentiles, p99 fluctuation, utilisation spread and the one-cache hit-ratio bound."""

from __future__ import annotations

import pytest

from loadtest import stats
from loadtest.workloads.bound import one_cache_bound
from loadtest.workloads.model import WorkItem
from loadtest.workloads.text import Segment


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 100) == 10.0
    assert stats.percentile(xs, 90) == pytest.approx(7.6)  # numpy.percentile(xs, 90)
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile([], 50) is None


def test_window_p99_and_fluctuation() -> None:
    times = [i * 0.5 for i in range(60)]  # 30 s, 20 requests per 10 s window
    values = [1.0] * 20 + [2.0] * 20 + [3.0] * 20
    ws = stats.window_p99s(times, values, 10.0, 10)
    assert ws == [1.0, 2.0, 3.0]
    f = stats.fluctuation(ws)
    assert f["cv"] == pytest.approx((2 / 3) ** 0.5 / 2.0)
    assert f["half_range"] == pytest.approx(0.5)
    assert stats.window_p99s(times, values, 10.0, 25) == []
    assert stats.fluctuation([4.0])["cv"] is None


def test_utilisation_per_window_and_spread() -> None:
    busy = {
        "a": [(float(t), 1.0 * t) for t in range(0, 21)],  # always busy
        "b": [(float(t), 0.5 * t) for t in range(0, 21)],  # half busy
    }
    per = stats.windowed_utilisation(busy, 10.0)
    assert per["a"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert per["b"] == [pytest.approx(0.5), pytest.approx(0.5)]
    spread = stats.utilisation_spread(per)
    assert spread["mean"] == pytest.approx(0.75) and spread["std"] == pytest.approx(0.25)
    assert stats.counter_rate([(0.0, 0.0), (1.0, 5.0), (2.0, 1.0), (3.0, 3.0)]) == pytest.approx(7 / 3)


def item(*blocks: tuple[int, int]) -> WorkItem:
    segs = tuple(Segment(b, n) for b, n in blocks)
    return WorkItem(0.0, sum(n for _, n in blocks), 1, segs)


def test_one_cache_bound_counts_longest_cached_prefix_only() -> None:
    items = [
        item((1, 512), (2, 512)),
        item((1, 512), (2, 512), (3, 100)),  # 1024 of 1124 hit
        item((9, 512), (2, 512)),  # block 2 after another prefix is not a hit
        item((1, 512), (3, 100)),  # (1) hits; (3 after 1) is a different chain than (3 after 1,2)
    ]
    b = one_cache_bound(items)
    assert b.hit_tokens == 1024 + 512
    assert b.query_tokens == 1024 + 1124 + 1024 + 612
    assert b.ratio == pytest.approx(b.hit_tokens / b.query_tokens)


def test_lru_bound_evicts_and_never_beats_the_infinite_cache() -> None:
    items = [item((i % 5, 500)) for i in range(50)]
    inf = one_cache_bound(items)
    assert inf.hit_tokens == 45 * 500
    small = one_cache_bound(items, capacity_tokens=1000)  # 2 of 5 cyclic keys fit: LRU always misses
    assert small.hit_tokens == 0
    big = one_cache_bound(items, capacity_tokens=2500)
    assert big.hit_tokens == inf.hit_tokens


def test_the_bounds_leave_out_prompts_no_engine_computed() -> None:
    """A prompt every engine refused (too long: 400, no first token) is in neither the measured hit
    ratio's queries nor any cache: it must not dilute the bounds or evict from the one cache."""
    from loadtest.records import Record, RunResult
    from loadtest.report import summarize
    from loadtest.workloads.model import Workload

    items = [item((1, 500)), item((7, 900)), item((1, 500))]
    wl = Workload("w", items)
    recs = [Record(0, 0.0, 0.0, 500, 200, 0.1, 0.2, None, 1), Record(1, 1.0, 1.0, 900, 400, error="too long"),
            Record(2, 2.0, 2.0, 500, 200, 0.1, 0.2, None, 1)]
    s = summarize(RunResult({}, recs, [], {"b": 1000}, 3.0), wl)
    # served: 500 + 500 tokens asked, the second 500 hit (the refused 900 would have evicted block 1)
    assert s["bound_inf"] == pytest.approx(0.5) and s["bound_lru"] == pytest.approx(0.5)


def test_placed_caches_split_the_bound_by_placement() -> None:
    """N caches of one engine each, in the bound's own cache model: with every request on one cache of
    the fleet's size they are the bound; the placement alone decides what separate caches keep."""
    from loadtest.workloads.bound import placed_caches

    # Three prompts of 600 tokens cycling: one cache of 1,800 holds all three, a cache of 600 only the last.
    items = [item((i % 3, 600)) for i in range(30)]
    assert placed_caches(items, [0] * 30, 1, 1800) == one_cache_bound(items, 1800)
    assert placed_caches(items, [0] * 30, 3, 600).hit_tokens == 0  # all on one small cache: thrash
    # Each prompt on its own cache: every repeat hits, as the one big cache does.
    spread = placed_caches(items, [i % 3 for i in range(30)], 3, 600)
    assert spread.hit_tokens == one_cache_bound(items, 1800).hit_tokens == 27 * 600
    # The rules: a repeat goes to its holder; a new prompt by its rule. Round robin and churn balancing
    # put the three on three caches; the hash home (block id mod N) puts blocks 0 and 2 together on cache 0
    # of 2, where they evict each other.
    for rule in ("round_robin", "least_inserted"):
        assert placed_caches(items, rule, 3, 600).hit_tokens == 27 * 600
    hashed = placed_caches(items, "hash", 2, 600)
    assert hashed.hit_tokens == 9 * 600  # only block 1, alone on cache 1, hits
    skipped = placed_caches(items, [None] * 15 + [0] * 15, 1, 1800)
    assert skipped.query_tokens == 15 * 600  # a request no engine computed is in no cache and no query
    with pytest.raises(ValueError):
        placed_caches(items, "nearest", 3, 600)
    with pytest.raises(ValueError):
        placed_caches(items, [0], 3, 600)


def test_seeded_placement_draws_another_hash_home_per_seed() -> None:
    """`placed_caches(..., seed=k)`: the hash home under the k-th hash function, or a random cache drawn
    from k. The same seed gives the same placement; over seeds the hash rule reaches both outcomes of the
    fixed rule's example above (blocks 0 and 2 on one cache, or each alone); unseeded rules refuse a seed."""
    from loadtest.workloads.bound import placed_caches

    items = [item((i % 3, 600)) for i in range(30)]
    for rule in ("hash", "random", "least_inserted"):
        assert all(placed_caches(items, rule, 2, 600, seed=k) == placed_caches(items, rule, 2, 600, seed=k)
                   for k in range(5))
    # The hash home is fixed per prompt within a seed: three prompts over two caches of one prompt each,
    # so either one prompt sits alone and hits on its 9 repeats while the other two thrash, or all three
    # share a cache and none hits. Both come up over 40 hash functions.
    assert {placed_caches(items, "hash", 2, 600, seed=k).hit_tokens for k in range(40)} == {0, 9 * 600}
    # A random cache is drawn again at every miss, so the seeds spread over many outcomes.
    assert len({placed_caches(items, "random", 2, 600, seed=k).hit_tokens for k in range(40)}) > 3
    # Churn balanced keeps the three apart on three caches whatever the noise: a new prompt goes to a
    # cache that took nothing yet.
    assert {placed_caches(items, "least_inserted", 3, 600, seed=k).hit_tokens for k in range(10)} == {27 * 600}
    with pytest.raises(ValueError):
        placed_caches(items, "round_robin", 2, 600, seed=1)


def test_perturbed_rows_group_the_learned_index_apart() -> None:
    """`scaleout.py spread` compares each configuration's seeds with one process of the same settings: a
    learned-index row must not land in (and overwrite) the precise row of the same shape and seed."""
    from loadtest.results.scaleout import _perturbed

    def row(flags: str) -> dict:
        return {"load": "mooncake", "window": [0, 300], "speed": 1.0, "busy": "~96% busy", "flags": flags}

    rows = [row("--policies affinity --index precise --kv-event-delay-ms 50 --arrival-jitter-ms 1"),
            row("--policies affinity --arrival-jitter-ms 1"),
            row("--policies affinity --seed 1 --arrival-jitter-ms 1 --affinity-set cost_epsilon=1"),
            row("--policies affinity --index precise --kv-event-delay-ms 50")]  # not perturbed: left out
    groups = _perturbed(rows)[("mooncake", (0, 300), 1.0, "~96% busy")]
    assert sorted(c[4] for c in groups) == ["", "learned index", "learned index, cost_epsilon=1"]
    assert all(len(by_seed) == 1 for by_seed in groups.values())


def test_bound_steps_are_the_bound_request_by_request() -> None:
    """`bound_steps`: the bound's hits one request at a time (they add up to `one_cache_bound`), the
    request that last touched the deepest block hit, and how near eviction that block was: the share of
    the cache used more recently (0: the newest; close to 1: the next to go)."""
    from loadtest.workloads.bound import bound_steps

    items = [item((1, 600)), item((2, 600)), item((1, 600)), item((3, 300)), item((2, 600))]
    # A cache of 1,200: A's repeat finds B's 600 tokens above it (depth 0.5); C then evicts B, the least
    # recent, so B's repeat misses.
    steps = bound_steps(items, 1200)
    assert [s.hit_tokens for s in steps] == [0, 0, 600, 0, 0]
    assert sum(s.hit_tokens for s in steps) == one_cache_bound(items, 1200).hit_tokens
    assert [s.source for s in steps] == [None, None, 0, None, None]
    assert steps[2].depth == pytest.approx(0.5)
    # A cache of 3,000 keeps everything: B's repeat hits what request 1 computed, under A and C (900).
    big = bound_steps(items, 3000)
    assert [s.hit_tokens for s in big] == [0, 0, 600, 0, 600]
    assert sum(s.hit_tokens for s in big) == one_cache_bound(items, 3000).hit_tokens
    assert big[4].source == 1 and big[4].depth == pytest.approx(900 / 3000)
    assert big[2].depth == pytest.approx(600 / 3000)


def test_split_loss_names_where_a_repeats_hit_went() -> None:
    """`scaleout.py losses`: a request's bound hit minus its hit at admission, split into the engines'
    evictions before it arrived (or its source not computed yet), the cost check's move off a holder, and
    what its own engine lost while it queued; the parts always add up to the loss."""
    from loadtest.results.scaleout import split_loss

    cases = [
        ((1000, [0, 0], 0, 0, False), {"evicted": 1000}),
        ((1000, [0, 0], 0, 0, True), {"pending": 1000}),
        ((1000, [0, 1000], 0, 0, False), {"moved": 1000}),
        ((1000, [1000, 0], 0, 200, False), {"queued": 800}),
        ((1000, [400, 0], 0, 400, False), {"evicted": 600}),
        ((1000, [1600, 0], 0, 1600, False), {"beyond": -600}),
        ((1000, [0, 0], 0, 512, False), {"evicted": 1000, "queued": -512}),  # computed while it queued
    ]
    for args, want in cases:
        got = split_loss(*args)
        assert {k: v for k, v in got.items() if v} == want, (args, got)
        assert sum(got.values()) == args[0] - args[3]


def test_mooncake_loads_are_named_by_window_and_speed() -> None:
    """`scaleout.py decompose|losses --load 0:300x1` (and ledger_progress.py): the load of that window and
    speed; a name no load has exits with a message naming it."""
    from loadtest.results.scaleout import mooncake_load

    name, _trace, window, speed, _busy = mooncake_load("900:1200x0.6")
    assert (name, window, speed) == ("mooncake", (900.0, 1200.0), 0.6)
    with pytest.raises(SystemExit, match="0:300x2"):
        mooncake_load("0:300x2")
