"""The host's shared chunk block (`--workers N`): one worker's tokenised chunk is read by the others, an
overwritten one is never returned, a copy torn by a concurrent writer is thrown away, and a tokenizer
that finds a chunk there does not tokenise it again."""

from __future__ import annotations

import mmap
import multiprocessing
import random
import time

import pytest

from proxy.dataplane.shared_chunks import ChunkLayout, SharedChunks
from proxy.dataplane.tokenize import ModelTokenizer
from proxy.multiproc.shared_load import SharedChunkBlock
from sim.tokenizer import LOADTEST_WORDS, TOKENIZER_DIR


def _block(rows: int = 2, slots: int = 64, arena: int = 1024) -> tuple[ChunkLayout, memoryview]:
    layout = ChunkLayout(rows=rows, slots=slots, arena_tokens=arena)
    return layout, memoryview(bytearray(layout.size))


def test_a_chunk_one_row_stored_is_read_from_every_row() -> None:
    layout, buf = _block()
    w0, w1 = SharedChunks(buf, layout, 0), SharedChunks(buf, layout, 1)
    assert w1.get(12345, 40) is None
    assert w0.put(12345, 40, [7, 8, 9, 2**32 - 1])
    assert w1.get(12345, 40) == [7, 8, 9, 2**32 - 1]
    assert w0.get(12345, 40) == [7, 8, 9, 2**32 - 1]
    assert w1.get(12345, 41) is None  # same key, another length: not that chunk
    assert w1.get(12346, 40) is None
    reader = SharedChunks(buf, layout, None)
    assert reader.get(12345, 40) == [7, 8, 9, 2**32 - 1] and not reader.put(1, 1, [1])
    assert w1.hits == 1 and reader.hits == 1


def test_the_ring_wraps_and_overwritten_chunks_are_misses_never_other_ids() -> None:
    layout, buf = _block(rows=1, slots=1024, arena=1024)
    w = SharedChunks(buf, layout, 0)
    rng = random.Random(5)
    stored: list[tuple[int, list[int]]] = []
    for key in range(1, 400):
        ids = [rng.randrange(2**32) for _ in range(rng.randrange(1, 200))]
        assert w.put(key, len(ids), ids)
        stored.append((key, ids))
    live = 0
    for key, ids in stored:
        got = w.get(key, len(ids))
        assert got is None or got == ids  # an overwritten span is a miss, never another chunk's ids
        live += got is not None
    # The newest chunks that fit in the ring are all there (the last one wraps across its end).
    newest, used = 0, 0
    for key, ids in reversed(stored):
        if used + len(ids) > layout.arena_tokens:
            break
        used += len(ids)
        newest += 1
        assert w.get(key, len(ids)) == ids
    assert 0 < newest <= live < len(stored)
    assert not w.put(999, 1, list(range(layout.max_chunk_tokens + 1)))  # one chunk never takes the whole ring
    assert not w.put(999, 1, [])


def test_a_restarted_worker_voids_a_write_its_predecessor_left_half_done() -> None:
    layout, buf = _block(rows=1)
    w = SharedChunks(buf, layout, 0)
    assert w.put(5, 3, [1, 2, 3])
    words = buf[: 16].cast("Q")
    words[0] = words[1] + 50  # died after reserving 50 tokens, before advancing head
    again = SharedChunks(buf, layout, 0)
    assert words[1] == words[0]
    assert again.put(6, 2, [4, 5]) and again.get(6, 2) == [4, 5] and again.get(5, 3) == [1, 2, 3]


def _hammer(fd: int, layout: ChunkLayout, seconds: float) -> None:
    block = SharedChunkBlock.attach(fd, layout)
    w = block.view(0)
    rng = random.Random(1)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = rng.randrange(1, 200)
        n = 1 + key % 97
        w.put(key, n, [key * 1000 + j for j in range(n)])


def test_a_reader_never_keeps_a_copy_torn_by_a_concurrent_writer() -> None:
    """A writer process fills its small ring as fast as it can; the reader only ever gets whole chunks
    (each id says which chunk and which position it is), and some reads do catch a write in progress."""
    layout = ChunkLayout(rows=2, slots=256, arena_tokens=1024)
    block = SharedChunkBlock.create(2)  # the real memfd; a smaller layout inside it
    assert block.layout.size >= layout.size
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_hammer, args=(block.fd, layout, 0.7))
    writer.start()
    try:
        r = SharedChunks(memoryview(mmap.mmap(block.fd, layout.size)), layout, 1)
        got = 0
        end = time.monotonic() + 0.4  # (~450 reads catch a write in progress in that time here)
        while time.monotonic() < end:
            for key in range(1, 200):
                n = 1 + key % 97
                ids = r.get(key, n)
                if ids is not None:
                    assert ids == [key * 1000 + j for j in range(n)], key
                    got += 1
        assert got > 100
        assert r.torn > 0, "no read overlapped a write: the torn-copy check was never exercised"
    finally:
        writer.join(5)
    assert writer.exitcode == 0


def _prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(LOADTEST_WORDS) for _ in range(words))


def test_a_tokenizer_reads_the_chunks_another_worker_tokenised() -> None:
    block = SharedChunkBlock.create(2)
    a = ModelTokenizer.from_dir(TOKENIZER_DIR, chunk_chars=256, shared=block.view(0))
    b = ModelTokenizer.from_dir(TOKENIZER_DIR, chunk_chars=256, shared=block.view(1))
    alone = ModelTokenizer.from_dir(TOKENIZER_DIR, chunk_chars=256)
    assert a.identity == b.identity != 0
    text = _prompt(3, 600)
    ids = a.encode(text)
    assert ids == alone.encode(text) and a.misses > 5 and a.shared_hits == 0
    # b has never seen it: every chunk is already "cached" (the host's), and comes out identical.
    assert b.uncached_chars(text) == 0
    assert b.encode(text) == ids
    assert b.misses == 0 and b.shared_hits == a.misses
    # A continuation: only its new tail is tokenised, by whichever worker sees it.
    longer = text + " " + _prompt(4, 100)
    assert b.encode(longer) == alone.encode(longer) and 0 < b.misses < 4
    # Another tokenizer (another identity) never reads these ids.
    other = ModelTokenizer.from_dir(TOKENIZER_DIR, chunk_chars=256, shared=block.view(1), identity=a.identity + 1)
    assert other.uncached_chars(text) == len(text) and other.encode(text) == ids and other.shared_hits == 0


def test_the_layout_checks_its_sizes() -> None:
    with pytest.raises(ValueError):
        ChunkLayout(rows=0)
    with pytest.raises(ValueError):
        ChunkLayout(rows=1, slots=1000)
    with pytest.raises(ValueError):
        SharedChunks(memoryview(bytearray(10)), ChunkLayout(rows=1), 0)
    with pytest.raises(ValueError):
        SharedChunks(memoryview(bytearray(ChunkLayout(rows=1).size)), ChunkLayout(rows=1), 1)
