"""The precise index: which KV blocks each engine really holds, rebuilt from the engines' own KV-cache events.

The learned index (`prefix_index.py`) remembers what *this* process routed where; this one is fed by the
engines (vLLM's `--kv-events-config`, decoded by `proxy/wire/kv_events.py`, delivered by
`proxy/control/kv_events.py`), so every worker and every replica that subscribes holds the same view.

Keys are OUR OWN, never the engine's: an engine's block hash depends on its hash algorithm
(`--prefix-caching-hash-algo`), its `PYTHONHASHSEED`-derived `NONE_HASH`, its version and extra keys, none of
which the proxy can reproduce for an incoming prompt. So every `BlockStored` is re-keyed from its token ids:
block i's key is xxh3_64 of its `block_size` token ids (packed little-endian uint32; a block with an id
outside 0..2^32-1 as a zero byte then int64s, a length no uint32 block has), seeded by block i-1's key,
and block 0 is seeded by `chain_seed(model)`, where `model` is the name a client sends in "model" for
those blocks (the LoRA adapter's name when the event names one, else the backend's base model). Equal keys
therefore mean equal *prefixes* for the same model/adapter, exactly the engine's own prefix-cache semantics.
The engine-hash -> own-key map is kept per backend so `BlockRemoved` (which carries engine hashes only) and
the `parent_block_hash` of a later `BlockStored` can be resolved.

API (stable; the offline replay on the `scaleout` branch uses it):

    seed = chain_seed("llama-3-8b")                   # or the adapter's name
    keys = block_keys(token_ids, 16, seed)            # full blocks only; `extend_block_keys` continues a list
    index = KVIndex()
    index.track("b0", model="llama-3-8b")             # a backend whose events we follow (starts STALE)
    index.apply("b0", BlockStored(block_hashes=(h1, h2), parent_block_hash=None,
                                  token_ids=(...32 ids...), block_size=16, lora_name=None))
    index.apply("b0", BlockRemoved(block_hashes=(h2,)))
    index.apply("b0", AllBlocksCleared())
    index.mark_fresh("b0")                            # the subscriber decides freshness (sequence, liveness)
    index.match_keys(keys, 16)   -> {"b0": 1}         # leading cached blocks, FRESH backends of that block size
    index.match(token_ids, "llama-3-8b") -> {"b0": 16}  # the same in tokens, every fresh backend
    index.state("b0") -> "fresh" | "stale"; index.num_blocks("b0"); index.block_sizes(); index.untrack("b0")
    PreciseMatch(prompt_tokens, cached={"b0": 16})   # what routing receives (proxy/core/affinity.py)

Freshness: a tracked backend starts stale and is stale whenever its event stream cannot be trusted (a
sequence gap not yet replayed, a restart, silence); `match*` leaves stale backends out of the answer
entirely, so the caller falls back to the learned index for them and never reads "no events" as "empty
cache". A backend that is fresh and answers 0 really holds nothing of that prompt (as far as events say).

Blocks whose engine hash took extra inputs (vLLM's `extra_keys`: multimodal ids, a cache salt; a LoRA name
alone does not count, the seed already carries it) get keys that no prompt's token ids produce, so an
image prompt's placeholder tokens never match another image's; their children chain from those keys.

A `BlockStored` whose parent is unknown (stored before we subscribed, or lost in a gap) cannot be keyed,
because its key names the whole prefix: such blocks are counted in `orphans` and skipped. The index then
under-reports, never over-reports. Several engine hashes may map to one own key (the engine keys on extra
inputs, e.g. a cache salt, that ours ignore); a reference count keeps the key until the last one is removed.

Pure: no I/O, no clock, no asyncio. Cost: `match_keys` is one dict lookup per leading cached block per
backend; keying is one C-level xxh3 call per block (~0.2 µs) plus packing the ids.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType
from typing import Hashable, Iterable, Mapping, Sequence, Union, cast

import xxhash

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "FRESH",
    "KVEvent",
    "KVIndex",
    "PreciseMatch",
    "STALE",
    "block_keys",
    "chain_seed",
    "extend_block_keys",
]

FRESH = "fresh"
STALE = "stale"
_SEP = b"\x1f"
_SWAP = sys.byteorder != "little"  # keys must not depend on the host: pack little-endian everywhere

EngineHash = Hashable  # vLLM sends int (64-bit) or bytes (sha256 hashes), depending on version and algorithm


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks an engine stored (vLLM `BlockStored`); `token_ids` covers all of them, in order."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # vLLM's per-block extra hash inputs (multimodal ids, cache salt, LoRA name), one entry or None per
    # block; a block with inputs beyond the LoRA name gets a key no prompt's token ids can produce.
    extra_keys: tuple[object, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class PreciseMatch:
    """What the precise index says about one prompt: its length in tokens and, per FRESH backend, how many
    of its leading tokens that backend's engine holds (stale backends absent: use the learned index)."""

    prompt_tokens: int
    cached: Mapping[str, int]
    # The engines' block size: a prefix is cached in whole blocks only, so a match may stop up to one
    # block short of any point in the prompt (0: unknown).
    block_size: int = 0
    # Per backend whose engine is evicting: how old the blocks it evicts are (`KVIndex.lru_front`: the
    # newest store sequence number among its evicted blocks; lower = older). A fresh backend absent here
    # has not evicted since its cache was (re)filled. Read by the eviction-aware placement of new prompts
    # (proxy/core/placement.py); None: not tracked (the placement then abstains).
    lru_front: Mapping[str, int] | None = None


def chain_seed(model: str) -> int:
    """The key block 0 chains from: the name clients address those blocks by (base model or adapter)."""
    return xxhash.xxh3_64_intdigest(_SEP + model.encode("utf-8", "surrogatepass"))


# A block's ids as hashed: 4-byte unsigned integers, little-endian. Every real token id fits (vocabularies
# are < 2^20), and packing them is 3x faster than as int64 (array's uint32 path converts each int in C
# without the int64 path's overflow handling). A block with an id outside 0..2^32-1 is packed as a zero
# byte then little-endian int64s: 8 * size + 1 bytes, never a multiple of 4, so no uint32 block has its
# bytes. Either way the key is a function of the block's own ids, whatever the rest of the prompt holds.
_U32 = next(code for code in ("I", "L") if array(code).itemsize == 4)


def _pack_block(token_ids: Sequence[int]) -> bytes:
    """One block's bytes as hashed: uint32s, or a zero byte then int64s when an id does not fit in uint32."""
    try:
        packed = array(_U32, token_ids)
        wide = False
    except (OverflowError, TypeError):
        try:
            packed = array("q", token_ids)
        except OverflowError as exc:
            raise ValueError(f"token ids must fit in a signed 64-bit integer: {exc}") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
        wide = True
    if _SWAP:
        packed.byteswap()
    return b"\x00" + packed.tobytes() if wide else packed.tobytes()


def _chain(out: list[int], token_ids: Sequence[int], block_size: int, parent: int) -> None:
    """Append to `out` the keys of the full blocks of `token_ids`, chained from `parent`.

    Raises ValueError (`out` unchanged) for ids that are not integers or do not fit in int64."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return
    digest = xxhash.xxh3_64_intdigest
    try:
        packed = array(_U32, token_ids)  # the partial tail too: cheaper than copying the ids without it
    except (OverflowError, TypeError):  # an id outside uint32 (or not an int): block by block
        keys: list[int] = []
        for start in range(0, n_full * block_size, block_size):
            parent = digest(_pack_block(token_ids[start : start + block_size]), parent)
            keys.append(parent)
        out.extend(keys)
        return
    if _SWAP:
        packed.byteswap()
    data = packed.tobytes()
    width = 4 * block_size
    # Slicing bytes and a positional seed: 2x faster than memoryview slices and seed= (30k ids: 220 vs 475 µs).
    for off in range(0, n_full * width, width):
        parent = digest(data[off : off + width], parent)
        out.append(parent)


def extend_block_keys(keys: list[int], token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Append the keys of every full block of `token_ids` not keyed yet (keys[i] covers ids[:bs*(i+1)]).

    `keys` must have been computed from a prefix of these same ids with the same block size and seed; a
    continuation of a prompt therefore costs only its new blocks. Returns `keys`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    start = len(keys)
    if start >= len(token_ids) // block_size:
        return keys
    _chain(keys, token_ids[start * block_size :], block_size, keys[-1] if keys else seed)
    return keys


def block_keys(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained keys of the full blocks of `token_ids` (the partial tail is not keyed: engines cache full
    blocks only)."""
    return extend_block_keys([], token_ids, block_size, seed)


def _mark_extra(keys: list[int], extra_keys: Sequence[object], lora_name: str | None) -> None:
    """Re-key, from the first block whose engine hash took inputs other than its tokens and LoRA name
    (an image, a cache salt), every block of this event: text-identical prompts must not match them."""
    parent: int | None = None
    for i, extra in enumerate(extra_keys[: len(keys)]):
        if parent is None:
            if extra is None or (isinstance(extra, (list, tuple)) and list(extra) in ([], [lora_name])):
                continue
            parent = keys[i - 1] if i else 0
        parent = xxhash.xxh3_64_intdigest(repr((keys[i], extra)).encode("utf-8", "surrogatepass"), seed=parent)
        keys[i] = parent
    if parent is not None:
        for j in range(i + 1, len(keys)):
            parent = xxhash.xxh3_64_intdigest(keys[j].to_bytes(8, "little"), seed=parent)
            keys[j] = parent


class _Backend:
    __slots__ = ("model", "state", "block_size", "own_by_engine", "held", "extra", "orphans", "stores", "removes",
                 "clears", "rejected")

    def __init__(self, model: str) -> None:
        self.model = model
        self.state = STALE
        self.block_size: int | None = None
        self.own_by_engine: dict[EngineHash, int] = {}
        # The blocks held: own key -> the index's store sequence number when it became held (KVIndex._seq:
        # its age; 0 without eviction ages). One dict read per block to match, one write to store, one pop
        # to remove.
        self.held: dict[int, int] = {}
        # own key -> how many engine hashes name it beyond the first (rare: the engine keyed on an input
        # ours ignore, such as a cache salt); a key leaves `held` with its last engine hash.
        self.extra: dict[int, int] = {}
        self.orphans = 0  # blocks skipped: parent unknown
        self.stores = 0
        self.removes = 0
        self.clears = 0
        self.rejected = 0  # events that contradicted themselves (ValueError raised)

    def clear(self) -> None:
        self.own_by_engine = {}
        self.held = {}
        self.extra = {}


class KVIndex:
    """Per backend: the own keys of the blocks its engine holds, and whether that view is fresh.

    Eviction age (for `proxy/core/placement.py`): every block that becomes held gets the index's store
    sequence number (blocks stored so far over every backend: the index has no clock, and "how many blocks
    the fleet has stored since" is the unit a fleet-wide LRU cache ages in). A backend's `lru_front` is the
    newest sequence number among the blocks its engine has evicted (since its last clear): an engine frees
    a finished request's blocks together, tail first, and evicts in the order it freed them, and a
    request's newest block is stored just before it is freed, so this tracks (from below) when the blocks
    being evicted now were last used, a prefix re-used by a later turn included. The lower it is, the
    older the blocks that engine is dropping, i.e. the longer it keeps a prefix. O(1) per block of an event;
    kept only with `eviction_ages` (a sequence number per held block: about a third more memory), else
    `lru_front` is None.
    """

    __slots__ = ("_backends", "_ages", "_seq", "_front", "lru_front", "_stored", "progress")

    def __init__(self, *, eviction_ages: bool = False) -> None:
        self._backends: dict[str, _Backend] = {}
        self._ages = eviction_ages
        self._seq = 0
        self._front: dict[str, int] = {}
        # Read-only live view of `_front` (no copy per request): what PreciseMatch.lru_front carries.
        self.lru_front: Mapping[str, int] | None = MappingProxyType(self._front) if eviction_ages else None
        # Per backend, the prefill its engine has computed since this index first heard of it: the tokens
        # of every BlockStored of more than one block, a count that only grows (a clear, a restart or an
        # untrack leaves it). An engine stores a request's newly full blocks once per step: a prefill
        # chunk fills many, a decode step one at most (every block_size tokens), and decode blocks are
        # not the prefill the work ledger estimates (a prefill's one-block tail is missed, which errs
        # towards more queued). What the ledger's backlog bound reads (proxy/core/work_ledger.py,
        # "Progress"); `progress` is its read-only live view.
        self._stored: dict[str, int] = {}
        self.progress: Mapping[str, int] = MappingProxyType(self._stored)

    # ---- membership and freshness -------------------------------------------------------------------
    def track(self, backend: str, *, model: str) -> None:
        """Follow `backend`, whose base model is `model` (seeds keys of blocks without a LoRA name).
        Starts stale and empty; tracking an already tracked backend only updates its model."""
        b = self._backends.get(backend)
        if b is None:
            self._backends[backend] = _Backend(model)
        elif b.model != model:
            b.model = model
            b.clear()  # its keys were seeded by the old name
            self._front.pop(backend, None)
            b.state = STALE

    def untrack(self, backend: str) -> None:
        self._backends.pop(backend, None)
        self._front.pop(backend, None)

    def tracked(self) -> list[str]:
        return list(self._backends)

    def __contains__(self, backend: str) -> bool:
        return backend in self._backends

    def _get(self, backend: str) -> _Backend:
        try:
            return self._backends[backend]
        except KeyError:
            raise KeyError(f"backend {backend!r} is not tracked by the KV index") from None

    def mark_fresh(self, backend: str) -> None:
        self._get(backend).state = FRESH

    def mark_stale(self, backend: str) -> None:
        self._get(backend).state = STALE

    def state(self, backend: str) -> str:
        return self._get(backend).state

    def is_fresh(self, backend: str) -> bool:
        b = self._backends.get(backend)
        return b is not None and b.state == FRESH

    def clear(self, backend: str) -> None:
        """Forget every block of `backend` (engine restarted, or AllBlocksCleared); freshness unchanged."""
        b = self._get(backend)
        b.clear()
        self._front.pop(backend, None)  # an empty cache evicts nothing until it is full again
        b.clears += 1

    # ---- events ---------------------------------------------------------------------------------------
    def apply(self, backend: str, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.stored(backend, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                        lora_name=event.lora_name, lora_id=event.lora_id, extra_keys=event.extra_keys)
        elif isinstance(event, BlockRemoved):
            self.removed(backend, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear(backend)
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")

    def apply_all(self, backend: str, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(backend, event)

    def stored(
        self,
        backend: str,
        block_hashes: Sequence[EngineHash],
        parent_block_hash: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> int:
        """Record stored blocks; returns how many were keyed (0 when the parent is unknown: orphans).

        Raises ValueError (index unchanged) when the event contradicts itself: token ids that are not
        exactly len(block_hashes) full blocks, a non-positive block size, non-integer ids.
        """
        b = self._get(backend)
        n = len(block_hashes)
        if block_size < 1 or len(token_ids) != n * block_size:
            b.rejected += 1
            raise ValueError(f"BlockStored: {len(token_ids)} token ids for {n} blocks of {block_size}")
        resized = b.block_size is not None and block_size != b.block_size
        if parent_block_hash is None:
            if lora_name is not None:
                model = lora_name
            elif lora_id is not None:
                model = f"{b.model}\x1flora#{lora_id}"  # no name: such blocks match no request by name
            else:
                model = b.model
            parent = chain_seed(model)
        else:
            known = None if resized else b.own_by_engine.get(parent_block_hash)
            if known is None:
                b.orphans += n
                b.stores += 1
                if n > 1:  # computed all the same
                    self._stored[backend] = self._stored.get(backend, 0) + n * block_size
                return 0
            parent = known
        keys: list[int] = []
        try:
            _chain(keys, token_ids, block_size, parent)
        except ValueError:
            b.rejected += 1
            raise
        if extra_keys:
            _mark_extra(keys, extra_keys, lora_name)
        if resized:
            # One engine, one block size: a change means a new engine configuration; its old keys are void.
            b.clear()
            self._front.pop(backend, None)
        b.block_size = block_size
        b.stores += 1
        own_by_engine, held = b.own_by_engine, b.held
        step = 1 if self._ages else 0
        seq = self._seq
        new = 0
        if (own_by_engine.keys().isdisjoint(block_hashes) and held.keys().isdisjoint(keys)
                and len(set(keys)) == n and len(set(block_hashes)) == n):
            # The usual event: blocks new to the engine and to this index, each named once. The loop
            # below would do the same, one block at a time; done in C (~2x less CPU per block).
            own_by_engine.update(zip(block_hashes, keys))
            held.update(zip(keys, range(seq, seq + n)) if step else zip(keys, repeat(seq)))
            seq += n * step
            new = n
        else:
            for engine_hash, key in zip(block_hashes, keys):
                old = own_by_engine.get(engine_hash)
                if old == key:
                    continue  # stored again (replay overlap): idempotent
                new += 1
                if old is not None:
                    self._unref(b, old)
                own_by_engine[engine_hash] = key
                if key in held:
                    b.extra[key] = b.extra.get(key, 0) + 1
                else:
                    held[key] = seq
                    seq += step
        self._seq = seq
        if new and n > 1:
            self._stored[backend] = self._stored.get(backend, 0) + new * block_size
        return n

    def removed(self, backend: str, block_hashes: Iterable[EngineHash]) -> int:
        """Forget blocks by engine hash; returns how many were known."""
        b = self._get(backend)
        b.removes += 1
        own_by_engine, held, extra = b.own_by_engine, b.held, b.extra
        front = self._front.get(backend, -1)
        # One C-level pass per dict (map over the bound methods) rather than a Python loop per block.
        keys = list(map(own_by_engine.pop, block_hashes, repeat(None)))
        known = len(keys) - keys.count(None)
        if extra:  # some key is named by several engine hashes: drop references one at a time
            for key in keys:
                if key is not None and (s := self._unref(b, key)) is not None and s > front:
                    front = s
        elif known:
            # (a None, an unknown hash, pops nothing: -1)
            front = max(front, max(map(held.pop, cast("list[int]", keys), repeat(-1))))
        if self._ages and front >= 0:
            self._front[backend] = front
        return known

    @staticmethod
    def _unref(b: _Backend, key: int) -> int | None:
        """Drop one engine hash's reference to `key`; the key's store sequence number when that was the
        last one (the block left the cache), else None."""
        left = b.extra.get(key, 0)
        if left > 0:
            if left > 1:
                b.extra[key] = left - 1
            else:
                del b.extra[key]
            return None
        return b.held.pop(key, None)

    # ---- lookups --------------------------------------------------------------------------------------
    def block_sizes(self) -> set[int]:
        """Block sizes of the fresh backends (the caller keys a prompt once per size, usually one)."""
        return {b.block_size for b in self._backends.values() if b.state == FRESH and b.block_size is not None}

    def match_keys(self, keys: Sequence[int], block_size: int) -> dict[str, int]:
        """Leading blocks of `keys` each FRESH backend of that block size holds (0 included)."""
        out: dict[str, int] = {}
        for name, b in self._backends.items():
            if b.state != FRESH or (b.block_size is not None and b.block_size != block_size):
                continue
            held = b.held
            n = 0
            for key in keys:
                if key not in held:
                    break
                n += 1
            out[name] = n
        return out

    def match(self, token_ids: Sequence[int], model: str,
              keys_by_size: Mapping[int, Sequence[int]] | None = None) -> dict[str, int]:
        """Cached prefix length in TOKENS per fresh backend, for `token_ids` addressed to `model`.

        `keys_by_size` may hold precomputed `block_keys(token_ids, size, chain_seed(model))` per block size;
        missing sizes are computed here. A fresh backend that has seen no event yet (block size unknown)
        answers 0.
        """
        out: dict[str, int] = {}
        seed: int | None = None
        computed: dict[int, Sequence[int]] = dict(keys_by_size or {})
        for size in self.block_sizes():
            if size not in computed:
                if seed is None:
                    seed = chain_seed(model)
                computed[size] = block_keys(token_ids, size, seed)
            for name, blocks in self.match_keys(computed[size], size).items():
                out[name] = blocks * size
        for name, b in self._backends.items():
            if b.state == FRESH and b.block_size is None:
                out[name] = 0
        return out

    # ---- counts -----------------------------------------------------------------------------------------
    def num_blocks(self, backend: str) -> int:
        """Distinct blocks (own keys) the backend holds according to its events."""
        return len(self._get(backend).held)

    def stats(self, backend: str) -> dict[str, int]:
        b = self._get(backend)
        return {"blocks": len(b.held), "engine_hashes": len(b.own_by_engine), "orphans": b.orphans,
                "stores": b.stores, "removes": b.removes, "clears": b.clears, "rejected": b.rejected}
