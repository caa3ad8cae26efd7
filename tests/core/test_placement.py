"""Eviction-aware placement (proxy/core/placement.py): the precise index's eviction age per backend, the
rule, and the affinity policy's new-prompt step with `eviction_band_tokens` on (off by default)."""

from __future__ import annotations

from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight, Reason
from proxy.core.kv_index import KVIndex, PreciseMatch
from proxy.core.placement import oldest_lru
from proxy.core.request import RequestSummary
from proxy.core.snapshot import Snapshot
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.work_ledger import WorkLedger

from .helpers import fleet, prompt

BS = 4


def _index(*backends: str) -> KVIndex:
    index = KVIndex(eviction_ages=True)
    for b in backends:
        index.track(b, model="m")
        index.mark_fresh(b)
    return index


def _store(index: KVIndex, backend: str, hashes: list[int], base: int) -> None:
    """Blocks stored as one chain from a sequence start (token ids base, base+1, ...)."""
    index.stored(backend, hashes, None, list(range(base, base + BS * len(hashes))), BS)


def test_lru_front_is_the_newest_store_sequence_an_engine_has_evicted() -> None:
    index = _index("a", "b")
    _store(index, "a", [1, 2], 0)      # sequence numbers 0, 1
    _store(index, "b", [11, 12], 100)  # 2, 3
    _store(index, "a", [3, 4], 200)    # 4, 5
    assert dict(index.lru_front) == {}  # nobody evicts yet: both keep everything
    index.removed("a", [2])
    assert dict(index.lru_front) == {"a": 1}
    index.removed("a", [1, 3])
    assert index.lru_front["a"] == 4  # the newest block it dropped
    index.removed("a", [99])  # unknown hash: nothing learned
    assert index.lru_front["a"] == 4
    _store(index, "b", [13], 300)  # 6
    index.removed("b", [13, 11])
    assert index.lru_front["b"] == 6
    index.removed("b", [12])  # an older block evicted later does not make the cache look older
    assert index.lru_front["b"] == 6


def test_a_block_named_by_two_engine_hashes_leaves_the_cache_with_the_last() -> None:
    index = _index("a")
    _store(index, "a", [1], 0)
    _store(index, "a", [2], 0)  # the same tokens under another engine hash: one own key, two refs
    index.removed("a", [1])
    assert "a" not in index.lru_front
    index.removed("a", [2])
    assert index.lru_front["a"] == 0


def test_a_cleared_or_untracked_backend_has_no_eviction_age() -> None:
    index = _index("a", "b")
    _store(index, "a", [1], 0)
    _store(index, "b", [2], 10)
    index.removed("a", [1])
    index.removed("b", [2])
    index.clear("a")  # an emptied cache evicts nothing until it is full again
    assert dict(index.lru_front) == {"b": 1}
    index.untrack("b")
    assert dict(index.lru_front) == {}


def test_the_rule_prefers_the_backend_evicting_the_oldest_blocks_within_the_band() -> None:
    fresh = {"a", "b", "c"}
    cands = [("a", 100.0, 0.9), ("b", 500.0, 0.1), ("c", 5000.0, 0.5)]
    assert oldest_lru(cands, {"a": 50, "b": 10, "c": 1}, fresh, 1000.0) == "b"  # c is outside the band
    assert oldest_lru(cands, {"a": 50, "b": 10}, fresh, 10000.0) == "c"  # not evicting: the oldest of all
    assert oldest_lru(cands, {"a": 50, "b": 10, "c": 1}, fresh, 0.0) is None  # only the cheapest in the band
    assert oldest_lru(cands, {"a": 50, "b": 10}, {"a", "c"}, 1000.0) is None  # b without fresh events
    # equal ages: the cheaper, then the higher rendezvous score
    assert oldest_lru([("a", 100.0, 0.1), ("b", 50.0, 0.2)], {}, fresh, 1000.0) == "b"
    assert oldest_lru([("a", 50.0, 0.1), ("b", 50.0, 0.2)], {}, fresh, 1000.0) == "b"
    assert oldest_lru([("a", 1.0, 0.5)], {}, fresh, 1000.0) is None


def _policy(band: int, match: PreciseMatch, work: WorkLedger | None = None) -> AffinityPolicy:
    cfg = RoutingConfig(affinity=AffinityConfig(eviction_band_tokens=band))
    return AffinityPolicy(cfg, precise=lambda req: match, work=work)


def _four_backends() -> tuple[Snapshot, list[str], RequestSummary, str, str, dict[str, int]]:
    """A 4-backend fleet, a new prompt, its hash home, another backend evicting the oldest KV, the fronts."""
    snap = fleet(4)
    names = [b.name for b in snap.backends]
    req = prompt("word " * 400)
    home = AffinityPolicy().pick(req, snap, {}).backend
    oldest = next(n for n in names if n != home)
    return snap, names, req, home, oldest, {n: (5 if n == oldest else 50) for n in names}


def test_a_new_prompt_goes_where_the_oldest_kv_is_evicted() -> None:
    snap, names, req, home, oldest, fronts = _four_backends()
    nothing = {n: 0 for n in names}
    d = _policy(2048, PreciseMatch(400, nothing, 16, fronts)).pick(req, snap, {})
    assert d.backend == oldest and d.reason is Reason.OVERLOAD_FALLBACK
    # off (the default): the hash home, as before
    assert _policy(0, PreciseMatch(400, nothing, 16, fronts)).pick(req, snap, {}).backend == home
    assert AffinityConfig().eviction_band_tokens == 0
    # the hash home evicting the oldest keeps its reason
    fronts[home] = 1
    d = _policy(2048, PreciseMatch(400, nothing, 16, fronts)).pick(req, snap, {})
    assert d.backend == home and d.reason is Reason.HASH


def test_the_band_bounds_the_queue_it_accepts_and_held_prompts_are_left_alone() -> None:
    snap, names, req, home, oldest, fronts = _four_backends()
    work = WorkLedger()
    work.record(oldest, 3000.0)
    inflight = {oldest: Inflight(1, 3000)}
    nothing = {n: 0 for n in names}
    # 3000 tokens queued there: outside a 2048-token band, inside a 4096-token one
    assert _policy(2048, PreciseMatch(400, nothing, 16, fronts), work).pick(req, snap, inflight).backend != oldest
    assert _policy(4096, PreciseMatch(400, nothing, 16, fronts), work).pick(req, snap, inflight).backend == oldest
    # a backend holding some of the prompt (below a KV hit): the rule abstains, the cost check decides
    some = {**nothing, names[-1] if names[-1] != oldest else names[0]: 16}
    d = _policy(4096, PreciseMatch(400, some, 16, fronts), work).pick(req, snap, inflight)
    assert d.backend != oldest
    # a backend without fresh events in the band: the rule abstains
    partial = {n: 0 for n in names if n != oldest}
    assert _policy(2048, PreciseMatch(400, partial, 16, fronts)).pick(req, snap, {}).backend == home


def test_without_eviction_ages_the_index_reports_none_and_the_rule_abstains() -> None:
    index = KVIndex()  # the default: no sequence number per block
    index.track("a", model="m")
    index.mark_fresh("a")
    _store(index, "a", [1], 0)
    index.removed("a", [1])
    assert index.lru_front is None
    snap = fleet(4)
    req = prompt("word " * 400)
    home = AffinityPolicy().pick(req, snap, {}).backend
    nothing = {b.name: 0 for b in snap.backends}
    assert _policy(2048, PreciseMatch(400, nothing, 16, None)).pick(req, snap, {}).backend == home


def test_the_proxy_keeps_eviction_ages_only_with_the_band_on() -> None:
    from proxy.config import parse_config
    from proxy.control.kv_events import build_precise_routing
    from sim.tokenizer import TOKENIZER_DIR

    base = ("backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n"
            f"telemetry:\n  kv_events:\n    tokenizers: {{m: '{TOKENIZER_DIR}'}}\n"
            "    backends:\n      a: {endpoint: 'tcp://127.0.0.1:5557'}\n")
    off = build_precise_routing(parse_config(base))
    on = build_precise_routing(parse_config(base + "routing:\n  affinity:\n    eviction_band_tokens: 2048\n"))
    assert off is not None and off.index.lru_front is None
    assert on is not None and on.index.lru_front is not None


def test_a_negative_band_is_refused_by_the_one_bounds_checker() -> None:
    import pytest

    from proxy.core.bounds import ConfigValueError

    with pytest.raises(ConfigValueError, match="eviction_band_tokens"):
        AffinityConfig(eviction_band_tokens=-1)
