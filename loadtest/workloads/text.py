"""Prompt text from block ids: the bridge from a trace's `hash_ids` to bytes on the wire.

Traces such as Mooncake's publish no text, only the ids of 512-token prefix blocks: two requests that share
their leading ids shared that prefix in production. To reproduce the KV-cache reuse faithfully, every id
becomes a deterministic block of whitespace-separated words (the simulator counts one word as one token),
and a prompt is its blocks joined by single spaces. Equal leading ids therefore give byte-identical
prefixes, which is exactly what the proxy's prefix index and the simulator's prefix cache key on; distinct
ids give unrelated word sequences, so no accidental sharing appears beyond the first word or two.

Blocks are cached (bounded LRU) because a long document's blocks are re-rendered for every question asked
about it, and generating 512 pseudo-random words costs more than a dictionary hit.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

# A vocabulary of pronounceable, distinct words. Every word is one whitespace token for the simulator; the
# proxy estimates tokens from bytes, so short words keep its estimate near the word count (about 4-6 bytes
# per word including the space), like real English text under a BPE tokenizer.
_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"
VOCABULARY: tuple[str, ...] = tuple(
    c1 + v1 + c2 + v2 for c1 in _CONSONANTS for v1 in _VOWELS for c2 in _CONSONANTS for v2 in _VOWELS
)


@dataclass(frozen=True, slots=True)
class Segment:
    """`words` words of the block named `block`: a whole block, or the leading part of one."""

    block: int
    words: int


class BlockText:
    """Renders block ids to text. `namespace` separates traces whose ids would otherwise collide."""

    def __init__(self, block_tokens: int = 512, *, namespace: int = 0, cache_blocks: int = 16384) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.block_tokens = block_tokens
        self.namespace = namespace
        self._cache: OrderedDict[int, list[str]] = OrderedDict()
        self._cache_blocks = cache_blocks

    def words(self, block: int) -> list[str]:
        cached = self._cache.get(block)
        if cached is not None:
            self._cache.move_to_end(block)
            return cached
        # Seed from (namespace, block) so the text of a block never depends on rendering order. Two random
        # bytes per word (C speed) index the vocabulary; the modulo bias (65536 % 7225) is irrelevant here.
        rng = random.Random((self.namespace << 40) ^ (block * 0x9E3779B1) ^ 0x5DEECE66D)
        vocab, n = VOCABULARY, len(VOCABULARY)
        words = [vocab[i % n] for i in memoryview(rng.randbytes(2 * self.block_tokens)).cast("H")]
        self._cache[block] = words
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return words

    def render(self, segments: Iterable[Segment]) -> str:
        parts: list[str] = []
        for seg in segments:
            words = self.words(seg.block)
            if seg.words > len(words):
                raise ValueError(f"segment of block {seg.block} asks {seg.words} words of {len(words)}")
            parts.append(" ".join(words if seg.words == len(words) else words[: seg.words]))
        return " ".join(parts)


def segments_for(
    hash_ids: Iterable[int], input_length: int, block_tokens: int, *, fresh: Callable[[], int]
) -> tuple[Segment, ...]:
    """Mooncake semantics: ids name consecutive `block_tokens` blocks; the last one holds the remainder.

    Published traces occasionally disagree by one block between `input_length` and the number of ids. The
    length is the load, so it wins: surplus ids are dropped, and missing blocks get ids from `fresh`
    (never shared, as an unknown block cannot be assumed to be cached anywhere).
    """
    if input_length <= 0:
        return ()
    needed = -(-input_length // block_tokens)
    ids = list(hash_ids)[:needed]
    while len(ids) < needed:
        ids.append(fresh())
    last = input_length - block_tokens * (needed - 1)
    return tuple(Segment(b, block_tokens) for b in ids[:-1]) + (Segment(ids[-1], last),)
