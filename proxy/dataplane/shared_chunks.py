"""The tokenizer's chunk cache, shared by the workers of one host (`--workers N`).

Why: with the precise index every worker tokenises the prompts it routes (proxy/dataplane/tokenize.py),
and a conversation's turns reach the workers at random (the kernel spreads connections). Each worker's
own chunk cache only knows the turns it saw, so at `--workers 2` a continuation is re-tokenised about half
the time by a worker that never saw the earlier turns: measured in round 17, 1.8x the tokenising CPU of
one worker and ~50% more requests waiting for their tokenisation (~22 ms each on 20k-token prompts). Here
a chunk one worker tokenised is read by the others at the cost of a copy.

The block (this module only interprets a buffer; proxy/multiproc/shared_load.py creates and maps it):
one row per worker, and each worker writes only its own row, so no two processes ever write the same
word and there is no lock between processes. A row is

    [claim, head]                    two uint64: tokens reserved / written into the arena, ever
    slots x [version, key, start, n << 32 | chars]   a direct-mapped table of the row's newest chunks
    arena: `arena_tokens` uint32     the token ids, a ring; entry i lies at start % arena_tokens

A write reserves its span in the ring (`claim`), copies the ids, advances `head`, then fills its slot
between two bumps of the slot's version (odd while it is being written). A reader takes a slot whose
version is even and the same before and after it read the fields, copies the ids, then re-reads the
row's `claim`: if the writer has reserved past `start + arena_tokens` since, the copy may be torn and is
thrown away. Aligned 8-byte loads and stores are single instructions and x86-64 keeps stores in order and
loads in order (as proxy/core/inflight.py's rows also rely on), so a reader never keeps a torn copy.

Keys are 64-bit xxh3 digests of the chunk's UTF-8 text, seeded with the tokenizer's identity (a digest of
its tokenizer.json), and a slot also records the chunk's length in characters. A collision would give a
request another prompt's ids for one chunk: its pick would be worse (the precise index is only routing's
hint), never its answer, and at 2**-64 per pair it is left at that.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ChunkLayout", "SharedChunks"]

_HEADER_WORDS = 2
_SLOT_WORDS = 4


@dataclass(frozen=True)
class ChunkLayout:
    rows: int  # one per worker
    slots: int = 16384  # per row, a power of two (a slot per chunk: 16384 chunks of ~2 KB of text)
    arena_tokens: int = 1 << 22  # per row: 16 MiB of uint32 ids (4.2M tokens, ~8k chunks of 512 tokens)

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError("rows must be >= 1")
        if self.slots < 1 or self.slots & (self.slots - 1):
            raise ValueError("slots must be a power of two")
        if self.arena_tokens < 1024:
            raise ValueError("arena_tokens must be >= 1024")

    @property
    def row_words(self) -> int:
        """8-byte words of a row's header and slots (its arena follows, in 4-byte ids)."""
        return _HEADER_WORDS + _SLOT_WORDS * self.slots

    @property
    def row_bytes(self) -> int:
        return 8 * self.row_words + 4 * self.arena_tokens

    @property
    def size(self) -> int:
        return self.rows * self.row_bytes

    @property
    def max_chunk_tokens(self) -> int:
        """The longest chunk a row takes: a quarter of its ring, so one chunk never evicts the whole row."""
        return self.arena_tokens // 4


class SharedChunks:
    """One process's view of the block: `get` reads every row, `put` writes row `row` (None: read only).
    Thread-safe within the process (the event loop and the tokenizer's executor threads share it)."""

    def __init__(self, buf: memoryview, layout: ChunkLayout, row: int | None) -> None:
        if len(buf) < layout.size:
            raise ValueError(f"the buffer has {len(buf)} bytes; the layout needs {layout.size}")
        if row is not None and not 0 <= row < layout.rows:
            raise ValueError(f"row {row} is not one of the layout's {layout.rows}")
        self.layout = layout
        self.row = row
        self._mask = layout.slots - 1
        self._ring = layout.arena_tokens
        self._words = []  # per row: its header and slots as uint64
        self._arenas = []  # per row: its ring as uint32
        for r in range(layout.rows):
            base = r * layout.row_bytes
            words_end = base + 8 * layout.row_words
            self._words.append(buf[base:words_end].cast("Q"))
            self._arenas.append(buf[words_end:base + layout.row_bytes].cast("I"))
        self._lock = threading.Lock()
        self.hits = 0  # chunks found in the block
        self.torn = 0  # chunks found but overwritten while they were copied (read as misses)
        self.puts = 0
        if row is not None:  # a worker restarted into this row: a write its predecessor left half done is void
            w = self._words[row]
            if w[0] != w[1]:
                w[1] = w[0]

    def get(self, key: int, chars: int) -> list[int] | None:
        """The ids stored for (key, chars) by any worker, or None."""
        key = key or 1  # 0 marks an empty slot
        i = _HEADER_WORDS + _SLOT_WORDS * (key & self._mask)
        ring = self._ring
        for words, arena in zip(self._words, self._arenas):
            version = words[i]
            if version & 1 or words[i + 1] != key:
                continue
            start = words[i + 2]
            sizes = words[i + 3]
            if words[i] != version or sizes & 0xFFFFFFFF != chars:
                continue
            if words[0] > start + ring:  # overwritten since: the row's older chunks are gone
                continue
            n = sizes >> 32
            a = start % ring
            if a + n <= ring:
                ids = arena[a:a + n].tolist()
            else:
                ids = arena[a:].tolist() + arena[:a + n - ring].tolist()
            if words[0] > start + ring:  # reserved over while it was read: the copy may be torn
                self.torn += 1
                continue
            self.hits += 1
            return ids
        return None

    def put(self, key: int, chars: int, ids: Sequence[int]) -> bool:
        """Store `ids` for (key, chars) in this process's row (False: read only, empty, or too long)."""
        n = len(ids)
        if self.row is None or n == 0 or n > self.layout.max_chunk_tokens or not 0 <= chars <= 0xFFFFFFFF:
            return False
        key = key or 1
        data = array("I", ids)
        words, arena, ring = self._words[self.row], self._arenas[self.row], self._ring
        i = _HEADER_WORDS + _SLOT_WORDS * (key & self._mask)
        with self._lock:
            start = words[1]
            words[0] = start + n  # reserve first: a reader of what this overwrites sees it
            a = start % ring
            if a + n <= ring:
                arena[a:a + n] = data
            else:
                cut = ring - a
                arena[a:] = data[:cut]
                arena[:n - cut] = data[cut:]
            words[1] = start + n
            version = words[i]
            words[i] = version + 1
            words[i + 1] = key
            words[i + 2] = start
            words[i + 3] = n << 32 | chars
            words[i] = version + 2
            self.puts += 1
        return True

    def release(self) -> None:
        for m in (*self._words, *self._arenas):
            m.release()
