"""What the affinity policy keys on: an exact fingerprint, chained prefix-block hashes, a hash key.

All three are xxh3_64 (the `xxhash` package) of the UTF-8 prompt bytes: fast in C, and, unlike Python's
`hash()`, not salted per process, so every worker process and every proxy replica computes the same values
for the same request (`PYTHONHASHSEED` plays no part anywhere in routing).

**Exact fingerprint** — the design's "prompt hash + max_tokens + temperature": xxh3 of the prompt bytes,
then of the request's media parts (`RequestSummary.media`: image/audio/file references), then xxh3 of the
other configured fields (`AffinityConfig.fingerprint_fields`) seeded with it. A repeat of
the very same request finds the backend that served it (exact-repeat affinity).

**Prefix blocks** — the prompt bytes cut into fixed-size blocks; block i's hash is xxh3(block i) seeded by
block i-1's hash, and block 0 is seeded by a hash of (model, adapter). A block hash therefore names the
whole prefix up to and including that block, for that model and adapter: two prompts share their leading
block hashes exactly as long as they share their leading bytes, and a backend's index of block hashes
answers "how much of this prompt's prefix did I recently send there" with one set lookup per probe. Only
full blocks are hashed; engines cache full KV blocks only, and a partial tail would just waste index slots.

Why 256 bytes per block (the default `block_bytes`):

- KV alignment: at ~4 bytes per token (the tokenizer rule of thumb used by `estimate_tokens`) a block is
  ~64 tokens, i.e. four of vLLM's 16-token KV blocks (SGLang's radix cache is token-granular). Byte blocks
  can never align exactly with token blocks anyway (token boundaries move with the text), so a finer
  granularity than a few KV blocks buys no precision, only cost; a coarser one loses up to a block of
  matchable prefix at every divergence point.
- Hashing cost: the chain is one Python-level xxh3 call per block (~0.1 µs each). A 64k-token prompt is
  ~256 KiB: 1024 blocks at 256 bytes is ~0.1 ms here, against ~0.4 ms at 64 bytes (16 tokens, one KV
  block) — a 64-byte block would spend the whole 1 ms budget of a 64k-token request on hashing alone.
  At 4k tokens it is 64 blocks, ~7 µs.
- Index memory: one entry per block per backend. A GPU with ~1M tokens of KV capacity needs ~16k entries
  (~1–1.5 MB of Python set + ints) to remember what fits in its cache; at 64 bytes per block that would be
  four times as much, at every backend and in every worker process.

**Hash key** — the "distinguishing prefix" that consistent hashing places when no learned state applies.
Not the first block: in real traffic most requests start with the same system prompt, and keying on it
sends everything to one GPU. For chat requests the data plane marks, in `RequestSummary.key_prefix_chars`,
where the first non-system message ends: a conversation keeps its first user turn as it grows, so all its
turns share the key (and the backend holding their KV), while conversations that only share a system prompt
get different keys and spread. Prompts without that structure are keyed on their first
`hash_prefix_max_blocks` x `block_bytes` bytes, i.e. on the whole prompt unless it is long. The key is one
C-level xxh3 pass seeded by (model, adapter), independent of the block chain, so an exact-fingerprint hit
never has to compute the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from proxy.core.request import RequestSummary
from proxy.core.routing_config import AffinityConfig

_xxh3 = xxhash.xxh3_64_intdigest

# Distinct domains so a fingerprint can never equal a block hash or a hash key by construction of inputs.
_FP_DOMAIN = b"affinity-proxy/fingerprint/v1"
_CHAIN_DOMAIN = b"affinity-proxy/prefix-chain/v1"
_KEY_DOMAIN = b"affinity-proxy/hash-key/v1"
_FP_SEED = _xxh3(_FP_DOMAIN)


def _opt_str(value: str | None) -> bytes:
    # None and "" must differ: a request naming no model is not one naming the empty model.
    return b"\x00" if value is None else b"\x01" + value.encode("utf-8", "surrogatepass")


def chain_seed(model: str | None, adapter: str | None) -> int:
    """Seed of the prefix chain: KV caches are per model and per adapter, so prefixes are too."""
    return _xxh3(_CHAIN_DOMAIN + b"\xff" + _opt_str(model) + b"\xff" + _opt_str(adapter))


def block_hashes(data: bytes, block_bytes: int, seed: int) -> list[int]:
    """Chained xxh3 hashes of the full `block_bytes`-sized blocks of `data`."""
    out: list[int] = []
    append = out.append
    h = seed
    for i in range(0, len(data) - block_bytes + 1, block_bytes):
        h = _xxh3(data[i : i + block_bytes], h)
        append(h)
    return out


def exact_fingerprint(req: RequestSummary, fields: tuple[str, ...], data: bytes | None = None) -> int:
    """xxh3 of the prompt bytes combined with the other configured request fields."""
    h = _xxh3(_FP_DOMAIN)
    if "prompt" in fields:
        h = _xxh3(req.prompt_bytes if data is None else data, h)
        if req.media:
            # Images, audio, files: part of the content though not of the prompt bytes (see RequestSummary).
            h = _xxh3(b"".join(m.to_bytes(8, "little") for m in req.media), h)
    rest: list[bytes] = []
    for name in fields:
        if name == "prompt":
            continue
        value = getattr(req, name)
        # repr() of a float is exact and the same on every platform; None stays distinct from 0.
        rest.append(name.encode() + b"=" + (b"\x00" if value is None else repr(value).encode("utf-8", "surrogatepass")))
    if rest:
        h = _xxh3(b"\xff".join(rest), h)
    return h


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """What the affinity policy derives from one request before it needs the block chain."""

    fingerprint: int
    hash_key: int  # hash of the distinguishing prefix, placed by rendezvous hashing
    key_blocks: int  # full blocks wholly inside the distinguishing prefix
    structured: bool  # True when the distinguishing prefix came from the request's structure
    data: bytes  # the prompt bytes
    seed: int  # the chain seed (model, adapter)


class Fingerprinter:
    """Computes `PromptKeys` and block chains for requests under one `AffinityConfig`.

    The chain is computed separately (`blocks`, `chain`) because it is the one cost that grows with the
    prompt (~0.1 ms at 64k tokens) and an exact-fingerprint hit does not need it. The affinity policy
    calls the parts on their own (`seeds`, `fingerprint`, `hash_key`, `chain`), each only when the step
    that reads it runs; `keys` bundles them for tests and tools.
    """

    __slots__ = ("block_bytes", "_fields", "_key_cap", "_seeds", "_with_prompt", "_named")

    def __init__(self, cfg: AffinityConfig) -> None:
        self.block_bytes = cfg.block_bytes
        self._fields = cfg.fingerprint_fields
        self._key_cap = cfg.hash_prefix_max_blocks * cfg.block_bytes
        # (model, adapter) -> (chain seed, hash-key seed)
        self._seeds: dict[tuple[str | None, str | None], tuple[int, int]] = {}
        # `exact_fingerprint`'s loop, unrolled once: whether the prompt takes part, and the other fields
        # with their "name=" labels in configured order.
        self._with_prompt = "prompt" in self._fields
        self._named = tuple((name, name.encode() + b"=") for name in self._fields if name != "prompt")

    def seeds(self, model: str | None, adapter: str | None) -> tuple[int, int]:
        """The chain seed and the hash key's seed of (model, adapter), cached."""
        got = self._seeds.get((model, adapter))
        if got is None:
            if len(self._seeds) >= 4096:  # bounded: model names come from clients
                self._seeds.clear()
            seed = chain_seed(model, adapter)
            got = self._seeds[(model, adapter)] = (seed, _xxh3(_KEY_DOMAIN, seed))
        return got

    def _seed(self, model: str | None, adapter: str | None) -> int:
        return self.seeds(model, adapter)[0]

    def fingerprint(self, req: RequestSummary, data: bytes) -> int:
        """`exact_fingerprint(req, fields, data)`, the same value, without re-reading the configuration."""
        h = _FP_SEED
        if self._with_prompt:
            h = _xxh3(data, h)
            if req.media:
                h = _xxh3(b"".join(m.to_bytes(8, "little") for m in req.media), h)
        named = self._named
        if named:
            rest: list[bytes] = []
            for name, label in named:
                value = getattr(req, name)
                rest.append(label + (b"\x00" if value is None else repr(value).encode("utf-8", "surrogatepass")))
            h = _xxh3(b"\xff".join(rest), h)
        return h

    def hash_key(self, req: RequestSummary, data: bytes, key_seed: int) -> tuple[int, int, bool]:
        """(hash key, full blocks inside the distinguishing prefix, whether the request's structure set
        that prefix)."""
        cut = req.key_prefix_chars
        prompt = req.prompt
        if cut is not None and 0 < cut <= len(prompt):
            key_bytes = cut if prompt.isascii() else len(prompt[:cut].encode("utf-8", "surrogatepass"))
            structured = True
        else:
            key_bytes = min(len(data), self._key_cap)
            structured = False
        # One C-level pass over the distinguishing prefix, seeded by (model, adapter) like the chain.
        return _xxh3(data[:key_bytes], key_seed), key_bytes // self.block_bytes, structured

    def keys(self, req: RequestSummary) -> PromptKeys:
        data = req.prompt_bytes
        seed, key_seed = self.seeds(req.model, req.adapter)
        hash_key, key_blocks, structured = self.hash_key(req, data, key_seed)
        return PromptKeys(self.fingerprint(req, data), hash_key, key_blocks, structured, data, seed)

    def blocks(self, keys: PromptKeys) -> list[int]:
        """The chained prefix-block hashes of the prompt."""
        return block_hashes(keys.data, self.block_bytes, keys.seed)

    def chain(self, data: bytes, seed: int) -> list[int]:
        """The chained prefix-block hashes of `data` under the chain seed `seed`."""
        return block_hashes(data, self.block_bytes, seed)
