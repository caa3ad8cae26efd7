"""The precise KV index: own keys from token ids, removals by engine hash, freshness, matching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from proxy.core.kv_index import (
    FRESH,
    STALE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVIndex,
    block_keys,
    chain_seed,
    extend_block_keys,
)

BS = 4
MODEL = "m"


def _ids(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def _fresh(*backends: str) -> KVIndex:
    index = KVIndex()
    for b in backends:
        index.track(b, model=MODEL)
        index.mark_fresh(b)
    return index


def test_keys_chain_the_whole_prefix_and_depend_on_the_seed() -> None:
    a = block_keys(_ids(12), BS, chain_seed(MODEL))
    assert len(a) == 3 and len(set(a)) == 3
    b = block_keys(_ids(8) + [99, 9, 10, 11], BS, chain_seed(MODEL))
    assert b[:2] == a[:2] and b[2] != a[2]
    # the same third block behind a different second block is a different key
    c = block_keys(_ids(4) + [77, 5, 6, 7] + _ids(4, 8), BS, chain_seed(MODEL))
    assert c[0] == a[0] and c[1] != a[1] and c[2] != a[2]
    assert block_keys(_ids(12), BS, chain_seed("lora-x")) != a
    assert block_keys(_ids(11), BS, chain_seed(MODEL)) == a[:2]  # partial tail not keyed


def test_extend_continues_a_prefix_without_rehashing() -> None:
    seed = chain_seed(MODEL)
    keys = block_keys(_ids(9), BS, seed)
    assert extend_block_keys(keys, _ids(17), BS, seed) is keys
    assert keys == block_keys(_ids(17), BS, seed)


def test_bad_token_ids_raise_value_error() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2, 3, "x"], 2, 0)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        block_keys([1, 2, 1 << 70, 4], 2, 0)
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, 0)


def test_a_block_with_an_id_outside_uint32_is_keyed_on_its_own_ids_and_apart() -> None:
    # Blocks are hashed as uint32s, and a block holding an id outside 0..2^32-1 as a zero byte then int64s.
    # A block's key must depend on its own ids only (the same block keys alike whatever the rest of the
    # prompt holds), and no wide block may share its bytes, so its key, with a narrow one.
    seed = chain_seed(MODEL)
    plain = block_keys(_ids(16), BS, seed)
    for wide_id in (1 << 32, 1 << 40, (1 << 63) - 1, -1):
        ids = _ids(4) + [wide_id, 5, 6, 7] + _ids(8, 16)
        keys = block_keys(ids, BS, seed)
        assert keys[0] == plain[0] and keys[1] != plain[1] and keys[2] != plain[2]
        # the keys after it chain from its key as any block's do
        assert keys[2:] == block_keys(ids[8:], BS, keys[1])
        # and the first block is keyed alike whether or not a later block is wide
        assert block_keys(ids[:4], BS, seed) == keys[:1]
    # ids equal modulo 2^32 are different blocks
    assert block_keys([1 << 32, 0, 0, 0], BS, seed) != block_keys([0, 0, 0, 0], BS, seed)
    # a wide block of 4 ids against a narrow one of 8 whose bytes are the wide one's int64s: apart
    narrow = [1, 0, 2, 0, 3, 0, 0xFFFFFFFF, 0x7FFFFFFF]
    assert block_keys([1, 2, 3, (1 << 63) - 1], 4, seed) != block_keys(narrow, 8, seed)
    # a failing block leaves a list being extended as it was
    keys = block_keys(_ids(4), BS, seed)
    with pytest.raises(ValueError):
        extend_block_keys(keys, _ids(4) + [1, 2, 1 << 70, 4], BS, seed)
    assert keys == plain[:1]


def test_stored_blocks_match_by_recomputed_keys_not_engine_hashes() -> None:
    index = _fresh("b0", "b1")
    # engine hashes are arbitrary (bytes here, as sha256 engines send): ours are recomputed
    index.apply("b0", BlockStored((b"h1", b"h2"), None, tuple(_ids(8)), BS))
    index.apply("b0", BlockStored((b"h3",), b"h2", tuple(_ids(4, 8)), BS))
    assert index.num_blocks("b0") == 3
    assert index.match(_ids(14), MODEL) == {"b0": 12, "b1": 0}
    assert index.match(_ids(6) + [0] * 8, MODEL) == {"b0": 4, "b1": 0}
    assert index.match(_ids(14), "other-model") == {"b0": 0, "b1": 0}
    keys = block_keys(_ids(16), BS, chain_seed(MODEL))
    assert index.match_keys(keys, BS) == {"b0": 3, "b1": 0}
    assert index.match(_ids(16), MODEL, {BS: keys}) == {"b0": 12, "b1": 0}


def test_removed_blocks_cut_the_match_and_cleared_empties() -> None:
    index = _fresh("b0")
    index.apply("b0", BlockStored((1, 2, 3), None, tuple(_ids(12)), BS))
    assert index.removed("b0", [2, 42]) == 1
    assert index.match(_ids(12), MODEL) == {"b0": 4}  # block 3 is still held, but the prefix stops at 2
    index.apply("b0", BlockRemoved((1,)))
    assert index.match(_ids(12), MODEL) == {"b0": 0} and index.num_blocks("b0") == 1
    index.apply("b0", AllBlocksCleared())
    assert index.num_blocks("b0") == 0 and index.stats("b0")["clears"] == 1


def test_lora_blocks_are_keyed_by_the_adapter_name() -> None:
    index = _fresh("b0")
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS, lora_id=3, lora_name="sql"))
    assert index.match(_ids(4), "sql") == {"b0": 4}
    assert index.match(_ids(4), MODEL) == {"b0": 0}
    index.apply("b0", BlockStored((2,), None, tuple(_ids(4)), BS, lora_id=5))  # no name: matches nothing
    assert index.match(_ids(4), MODEL) == {"b0": 0} and index.num_blocks("b0") == 2


def test_blocks_hashed_with_extra_inputs_never_match_plain_token_ids() -> None:
    index = _fresh("b0")
    # block 0: plain; block 1: an image's placeholder tokens (mm hash in extra_keys); block 2: after it
    index.apply("b0", BlockStored((1, 2, 3), None, tuple(_ids(12)), BS, extra_keys=(None, (("img", 0),), None)))
    assert index.match(_ids(12), MODEL) == {"b0": 4} and index.num_blocks("b0") == 3
    index.apply("b0", BlockStored((4,), 3, tuple(_ids(4, 12)), BS))  # a child of the image chain
    assert index.match(_ids(16), MODEL) == {"b0": 4}
    # a LoRA name alone is no extra input: the seed carries it
    index.apply("b0", BlockStored((5,), None, tuple(_ids(4, 50)), BS, lora_name="sql", extra_keys=(["sql"],)))
    assert index.match(_ids(4, 50), "sql") == {"b0": 4}


def test_unknown_parent_is_an_orphan_and_never_over_reports() -> None:
    index = _fresh("b0")
    assert index.stored("b0", (7,), 6, _ids(4, 4), BS) == 0
    assert index.stats("b0")["orphans"] == 1 and index.num_blocks("b0") == 0
    index.apply("b0", BlockStored((8,), 7, tuple(_ids(4, 8)), BS))  # child of an orphan: orphan too
    assert index.stats("b0")["orphans"] == 2


def test_inconsistent_event_raises_and_leaves_the_index_unchanged() -> None:
    index = _fresh("b0")
    with pytest.raises(ValueError):
        index.stored("b0", (1, 2), None, _ids(7), BS)
    assert index.num_blocks("b0") == 0 and index.stats("b0")["rejected"] == 1
    with pytest.raises(KeyError):
        index.stored("nope", (1,), None, _ids(4), BS)
    with pytest.raises(TypeError):
        index.apply("b0", "BlockStored")  # type: ignore[arg-type]


def test_duplicate_engine_hashes_share_a_key_until_the_last_goes() -> None:
    index = _fresh("b0")
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS))
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS))  # replay overlap: idempotent
    index.apply("b0", BlockStored((9,), None, tuple(_ids(4)), BS))  # same tokens, other engine hash (salt)
    assert index.num_blocks("b0") == 1
    index.removed("b0", [1])
    assert index.match(_ids(4), MODEL) == {"b0": 4}
    index.removed("b0", [9])
    assert index.match(_ids(4), MODEL) == {"b0": 0}


class _RefCounts:
    """The index's bookkeeping written the plain way (a reference count per own key, one block at a time):
    what KVIndex's C-level fast paths must agree with."""

    def __init__(self) -> None:
        self.own: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.born: dict[int, int] = {}
        self.seq = 0
        self.front = -1
        self.stored = 0

    def store(self, hashes: list[int], keys: list[int]) -> None:
        new = 0
        for h, k in zip(hashes, keys):
            old = self.own.get(h)
            if old == k:
                continue
            new += 1
            if old is not None:
                self._unref(old)
            self.own[h] = k
            count = self.refs.get(k, 0)
            self.refs[k] = count + 1
            if not count:
                self.born[k] = self.seq
                self.seq += 1
        if new and len(hashes) > 1:
            self.stored += new * BS

    def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            k = self.own.pop(h, None)
            if k is not None:
                s = self._unref(k)
                if s is not None and s > self.front:
                    self.front = s

    def _unref(self, k: int) -> int | None:
        left = self.refs.get(k, 0) - 1
        if left > 0:
            self.refs[k] = left
            return None
        self.refs.pop(k, None)
        return self.born.pop(k, None)


_event = st.one_of(
    # stored from the seed: 1-3 blocks whose tokens come from a small set (own keys repeat across events)
    # under engine hashes from a small range (repeated, re-used for other blocks, twice in one event)
    st.tuples(st.just("store"), st.lists(st.integers(0, 2), min_size=1, max_size=3),
              st.lists(st.integers(0, 7), min_size=3, max_size=3)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 9), max_size=4)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=30))
def test_stores_and_removals_agree_with_plain_reference_counting(events: list) -> None:
    index = KVIndex(eviction_ages=True)
    index.track("b0", model=MODEL)
    index.mark_fresh("b0")
    ref = _RefCounts()
    seen: set[int] = set()
    for kind, a, b in [(e[0], e[1], e[2] if len(e) > 2 else None) for e in events]:
        if kind == "store":
            tokens = [t for choice in a for t in _ids(BS, 100 * choice)]
            hashes = b[: len(a)]
            keys = block_keys(tokens, BS, chain_seed(MODEL))
            seen.update(keys)
            index.stored("b0", hashes, None, tokens, BS)
            ref.store(hashes, keys)
        else:
            index.removed("b0", a)
            ref.remove(a)
        assert index.num_blocks("b0") == len(ref.refs)
        assert {k for k in seen if index.match_keys([k], BS) == {"b0": 1}} == set(ref.refs)
        assert index.lru_front is not None and index.lru_front.get("b0", -1) == ref.front
        assert index.progress.get("b0", 0) == ref.stored


def test_stale_backends_are_left_out_of_every_answer() -> None:
    index = KVIndex()
    index.track("b0", model=MODEL)
    index.track("b1", model=MODEL)
    assert index.state("b0") == STALE  # no events yet is not "empty cache"
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS))
    assert index.match(_ids(4), MODEL) == {}
    index.mark_fresh("b0")
    index.mark_fresh("b1")
    assert index.match(_ids(4), MODEL) == {"b0": 4, "b1": 0}
    index.mark_stale("b0")
    assert index.state("b0") == STALE and index.match(_ids(4), MODEL) == {"b1": 0}
    assert index.block_sizes() == set()
    index.mark_fresh("b0")
    assert index.state("b0") == FRESH and index.block_sizes() == {BS}
    index.untrack("b0")
    assert "b0" not in index and index.tracked() == ["b1"]


def test_block_size_change_voids_old_keys_and_sizes_match_separately() -> None:
    index = _fresh("b0", "b1")
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS))
    index.apply("b1", BlockStored((1,), None, tuple(_ids(8)), 8))
    assert index.match(_ids(8), MODEL) == {"b0": 4, "b1": 8}
    assert index.match_keys(block_keys(_ids(8), 8, chain_seed(MODEL)), 8) == {"b1": 1}
    index.apply("b0", BlockStored((2,), None, tuple(_ids(8, 100)), 8))
    assert index.num_blocks("b0") == 1 and index.match(_ids(8), MODEL) == {"b0": 0, "b1": 8}


def test_retracking_with_another_model_clears() -> None:
    index = _fresh("b0")
    index.apply("b0", BlockStored((1,), None, tuple(_ids(4)), BS))
    index.track("b0", model=MODEL)
    assert index.num_blocks("b0") == 1 and index.is_fresh("b0")
    index.track("b0", model="m2")
    assert index.num_blocks("b0") == 0 and not index.is_fresh("b0")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(0, 9), max_size=30))
def test_index_agrees_with_a_model_of_stored_prefixes(prompt_choices: list[int], removals: list[int]) -> None:
    """Store chains of random prompts, remove random engine blocks: the match is the model's answer."""
    prompts = [[(c * 7 + j) % 5 for j in range(BS * (1 + c % 3))] for c in prompt_choices]
    index = _fresh("b")
    held: dict[int, tuple[int, ...]] = {}  # engine hash -> prefix tokens it covers
    engine: dict[tuple[int, ...], int] = {}
    for p in prompts:
        parent = None
        for i in range(len(p) // BS):
            prefix = tuple(p[: BS * (i + 1)])
            h = engine.setdefault(prefix, len(engine))
            if h not in held:
                index.apply("b", BlockStored((h,), parent, prefix[-BS:], BS))
                held[h] = prefix
            parent = h
    for r in removals:
        if r in held:
            index.apply("b", BlockRemoved((r,)))
            del held[r]
    cached = set(held.values())
    for p in prompts:
        want = 0
        while want + BS <= len(p) and tuple(p[: want + BS]) in cached:
            want += BS
        assert index.match(p, MODEL) == {"b": want}


# ---- the precise step of the affinity policy (proxy/core/affinity.py, step 1b) ---------------------------

from proxy.core.affinity import AffinityPolicy  # noqa: E402
from proxy.core.decision import Reason  # noqa: E402
from proxy.core.kv_index import PreciseMatch  # noqa: E402

from .helpers import chat, fleet, prompt  # noqa: E402


def _policy_with(answer: PreciseMatch | None) -> AffinityPolicy:
    return AffinityPolicy(precise=lambda req: answer)


def test_a_kv_hit_wins_over_the_hash_home_and_learned_state() -> None:
    snap = fleet(4)
    text = "word " * 400
    home = AffinityPolicy().pick(prompt(text), snap, {}).backend
    other = next(b.name for b in snap.backends if b.name != home)
    pol = _policy_with(PreciseMatch(400, {home: 0, other: 400}))
    d = pol.pick(prompt(text), snap, {})
    assert d.backend == other and d.reason is Reason.PREFIX_HIT and d.prefix_blocks_matched > 0
    # a repeat asks the events again (not the exact index recorded a moment ago)
    pol._precise = lambda req: PreciseMatch(400, {home: 400, other: 0})
    assert pol.pick(prompt(text), snap, {}).backend == home


def test_the_decision_says_what_the_engines_held_whatever_it_chose() -> None:
    """kv_holder / kv_cached (the access log's fields): the engine holding the most of the prompt and its
    tokens, also when that was too little to be a hit; None without a precise lookup or an answer."""
    snap = fleet(4)
    text = "word " * 400
    names = [b.name for b in snap.backends]
    hit = _policy_with(PreciseMatch(400, {names[0]: 16, names[1]: 320, names[2]: 320})).pick(prompt(text), snap, {})
    assert hit.reason is Reason.PREFIX_HIT and (hit.kv_holder, hit.kv_cached) == (names[1], 320)
    low = _policy_with(PreciseMatch(400, {names[0]: 16, names[3]: 96})).pick(prompt(text), snap, {})
    assert low.reason is Reason.HASH and (low.kv_holder, low.kv_cached) == (names[3], 96)  # under min_prefix_ratio
    none = _policy_with(PreciseMatch(400, {n: 0 for n in names})).pick(prompt(text), snap, {})
    assert (none.kv_holder, none.kv_cached) == (None, 0)
    for pol in (_policy_with(None), AffinityPolicy()):
        d = pol.pick(prompt(text), snap, {})
        assert (d.kv_holder, d.kv_cached) == (None, None)


def test_a_short_or_absent_kv_match_falls_through_to_the_learned_steps() -> None:
    snap = fleet(4)
    text = "word " * 400
    home = AffinityPolicy().pick(prompt(text), snap, {}).backend
    other = next(b.name for b in snap.backends if b.name != home)
    for answer in (None, PreciseMatch(400, {}), PreciseMatch(400, {other: 16})):  # 16 of 400: below the ratio
        d = _policy_with(answer).pick(prompt(text), snap, {})
        assert d.backend == home and d.reason is Reason.HASH
    # chat: a match inside the shared system prompt is no hit
    req = chat([("system", "s " * 300), ("user", "question one")])
    home = AffinityPolicy().pick(req, snap, {}).backend
    other = next(b.name for b in snap.backends if b.name != home)
    assert _policy_with(PreciseMatch(310, {other: 290})).pick(req, snap, {}).backend == home
    assert _policy_with(PreciseMatch(310, {other: 310})).pick(req, snap, {}).backend == other
    # in whole engine blocks: reaching the start of the block that ends the first turn is enough
    assert _policy_with(PreciseMatch(310, {other: 288}, block_size=16)).pick(req, snap, {}).backend == home
    assert _policy_with(PreciseMatch(310, {other: 304}, block_size=16)).pick(req, snap, {}).backend == other
