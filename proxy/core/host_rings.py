"""A `--workers` host's ledger rings of one backend, read as one process holding every worker's entries.

Compiled with the hot path (proxy/native). `HostRings` is a worker's reader of the rings in the shared
block (`SharedInflightTable`, proxy/core/inflight.py, owns the block and writes its own row): it copies each
worker's ring of a backend out (its newest entries, oldest first: the order that worker sent them) and
walks the rings together newest first by host sequence. Each ring is already in send order,
so the walk is a merge of the rings, not a sort: O(entries x workers) with nothing allocated per entry.
Ties of the sequence (two workers' sends at the same moment) go to the higher row first, the order a sort
of (seq, row, ...) newest first gives.
"""

from __future__ import annotations

import math
from typing import Mapping, cast

# Every worker's ring of one backend as one source for a pick with peer load (`SharedInflightTable.
# host_source`): its entries in the order they were sent (seq), their epochs oldest first in the reading
# worker's epochs (an entry's age in its own worker's, never less than a newer entry's), the reader's epoch
# now, the prefix sums of their tokens newest first, and newest first each entry's engine count at its
# send in the reader's index (its mark, moved by how far the reader's count is from its worker's) and its
# engine tokens. For a worker that follows the engines' progress.
HostSource = tuple[list[int], int, list[float], list[int], list[float]]


def _next_row(seqs: list[list[int]], pos: list[int]) -> int:
    """The row whose next entry (at `pos`, walking down; -1: none left) has the highest seq, the higher
    row on a tie; -1 when every ring is spent."""
    best = -1
    top = -1
    for r in range(len(seqs)):
        p = pos[r]
        if p >= 0:
            q = seqs[r][p]
            if q >= top:
                top = q
                best = r
    return best


def host_walk(seqs: list[list[int]], tokens: list[list[float]], engine: list[list[float]],
              marks: list[list[int]], nows: list[int], k: int) -> tuple[float, int, list[float]]:
    """The newest `k` of every worker's entries (per row r: `seqs[r]`, their ledger `tokens`, `engine`
    tokens and `marks`, oldest first) by seq: their tokens' sum, how many there were, and per worker the
    largest (engine tokens sent from its entry j on, newest first over every worker, less the progress
    since j: its worker's count `nows[r]` less j's mark, at least 0) over its counted entries, -inf for
    a worker with none counted (`SharedInflightTable.host_estimate`'s bound, as `WorkLedger.pending`'s
    for one process)."""
    rows = len(seqs)
    pos = [len(s) - 1 for s in seqs]
    parts = [-math.inf] * rows
    total = 0.0
    sent = 0.0
    known = 0
    while known < k:
        r = _next_row(seqs, pos)
        if r < 0:
            break
        p = pos[r]
        pos[r] = p - 1
        total += tokens[r][p]
        sent += engine[r][p]
        now = nows[r]
        m = marks[r][p]
        if sent - (now - m if now > m else 0) > parts[r]:
            parts[r] = sent - (now - m if now > m else 0)
        known += 1
    return total, known, parts


def host_order(seqs: list[list[int]], stamps: list[list[int]], tokens: list[list[float]],
               marks: list[list[int]], engine: list[list[float]]
               ) -> tuple[list[int], list[int], list[float], list[int], list[float]]:
    """Every worker's entries (per row as `host_walk`'s, with their epoch `stamps`) as one list newest
    first by seq: per entry its row, stamp, tokens, mark and engine tokens."""
    pos = [len(s) - 1 for s in seqs]
    rows_of: list[int] = []
    stamps_of: list[int] = []
    tokens_of: list[float] = []
    marks_of: list[int] = []
    engine_of: list[float] = []
    while True:
        r = _next_row(seqs, pos)
        if r < 0:
            break
        p = pos[r]
        pos[r] = p - 1
        rows_of.append(r)
        stamps_of.append(stamps[r][p])
        tokens_of.append(tokens[r][p])
        marks_of.append(marks[r][p])
        engine_of.append(engine[r][p])
    return rows_of, stamps_of, tokens_of, marks_of, engine_of


def host_source_of(order: tuple[list[int], list[int], list[float], list[int], list[float]], k: int,
                   epochs: list[int], nows: list[int], row: int) -> HostSource:
    """The newest `k` entries of `order` (`host_order`'s) as the reading worker (`row`) sees them now,
    with every worker's epoch `epochs` and count `nows` (see `HostSource`)."""
    rows_of, stamps, tokens, marks, engine = order
    c = min(k, len(rows_of))
    mine = epochs[row]
    ages = [0] * c
    oldest = 0  # an entry is never younger than a newer one
    pre = [0.0] * (c + 1)
    acc = 0.0
    moved = [0] * c
    reader = nows[row]
    for i in range(c):
        r = rows_of[i]
        e = epochs[r]
        s = stamps[i]
        age = e - s if e > s else 0
        if age > oldest:
            oldest = age
        ages[c - 1 - i] = mine - oldest
        acc += tokens[i]
        pre[i + 1] = acc
        moved[i] = marks[i] + reader - nows[r]
    return ages, mine, pre, moved, engine[:c]


Order = tuple[list[int], list[int], list[float], list[int], list[float]]


class _Kept:
    """What `HostRings.estimate` last read of one slot and answered."""

    __slots__ = ("live", "counts", "tokens", "ratio", "got", "total", "parts", "nows", "answer")

    def __init__(self, live: list[int], counts: list[int], tokens: int, ratio: float, got: float, total: float,
                 parts: list[float], nows: list[int], answer: tuple[float, float]) -> None:
        self.live = live  # per worker its live requests
        self.counts = counts  # per worker its entries appended
        self.tokens = tokens  # the tokens in flight, every worker's
        self.ratio = ratio
        self.got = got  # the estimate
        self.total = total  # its entries' sum
        self.parts = parts  # per worker its part of the bound, before the floor
        self.nows = nows  # the counts it was read at
        self.answer = answer


class HostRings:
    """A worker's (`row`) reader of the ledger rings of its host's shared block: `ints` (requests, tokens
    in flight per slot and row, `tok_off` apart) and the rings' int64 cells `rints` (epochs, then per cell
    (slot x rows + row) its entries appended, then `depth`-deep rings of stamps, marks and seqs at
    `stamps_at`, `marks_at`, `seqs_at`, then each worker's published count at `counts_at`) and float64
    cells `rfloats` (ledger tokens, engine tokens at `engine_at`); see `SharedLayout`. `progress`: this
    worker's index's count per backend (`KVIndex.progress`, set by `SharedInflightTable.follow_progress`);
    `ratio`: its ledger's tokens per engine token, as of its last record. Its answers are kept per slot
    until what they read changes; `forget` when a slot changes hands."""

    def __init__(self, ints: memoryview[int], rints: memoryview[int], rfloats: memoryview[float], rows: int,
                 depth: int, row: int, tok_off: int, stamps_at: int, marks_at: int, seqs_at: int, counts_at: int,
                 engine_at: int) -> None:
        self._ints = ints
        self._rints = rints
        self._rfloats = rfloats
        self._rows = rows
        self._depth = depth
        self._row = row
        self._tok_off = tok_off
        self._stamps_at = stamps_at
        self._marks_at = marks_at
        self._seqs_at = seqs_at
        self._counts_at = counts_at
        self._engine_at = engine_at
        self.progress: Mapping[str, int] = {}
        self.ratio = 1.0
        self._kept: dict[int, _Kept] = {}
        # slot -> (its rings' counts and newest seqs, their entries newest first: `host_order`)
        self._orders: dict[int, tuple[list[int], Order]] = {}

    def forget(self) -> None:
        """Drop every kept answer (a slot given to another backend)."""
        self._kept.clear()
        self._orders.clear()

    def newest_seq(self, cell: int, count: int) -> int:
        """The seq of the newest entry of the ring of `cell` (slot x rows + row) with `count` entries
        appended, or -1 with none."""
        if count <= 0:
            return -1
        depth = self._depth
        return self._rints[self._seqs_at + cell * depth + (count - 1) % depth]

    def next_seq(self, slot: int) -> int:
        """One more than the newest entry's seq of any worker on `slot` (0 with none): entries of every
        worker in the order they were sent (two workers' sends at the same moment may tie), also after a
        worker restarted (its row cleared)."""
        rows = self._rows
        first = slot * rows
        counts = self._rints[rows + first:rows + first + rows].tolist()
        top = -1
        for r in range(rows):
            q = self.newest_seq(first + r, counts[r])
            if q >= top:
                top = q
        return top + 1

    def _span(self, cell: int, count: int, n: int) -> tuple[int, int, int]:
        """Where the newest `n` (> 0, at most the ring's) of the `count` entries of `cell`'s ring lie, as
        index ranges into its arrays, oldest first: [a, b), then [base, c) when they wrap (else c = base)."""
        depth = self._depth
        base = cell * depth
        lo = (count - n) % depth
        hi = count % depth
        if hi == 0:
            hi = depth
        if lo < hi:
            return base + lo, base + hi, base
        return base + lo, base + depth, base + hi

    def _ints_of(self, at: int, a: int, b: int, base: int, c: int) -> list[int]:
        out = self._rints[at + a:at + b].tolist()
        if c > base:
            out += self._rints[at + base:at + c].tolist()
        return out

    def _floats_of(self, at: int, a: int, b: int, base: int, c: int) -> list[float]:
        out = cast("list[float]", self._rfloats[at + a:at + b].tolist())
        if c > base:
            out += cast("list[float]", self._rfloats[at + base:at + c].tolist())
        return out

    def rings(self, first: int, counts: list[int], n: int, stamps: bool
              ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[list[int]], list[list[int]]]:
        """Per worker (row), the newest min(`n`, its count, the ring's) entries of the rings of slot
        `first // rows`, oldest first: their seqs, ledger tokens, engine tokens, marks and (with `stamps`,
        else empty) epochs."""
        depth = self._depth
        seqs: list[list[int]] = []
        tokens: list[list[float]] = []
        engine: list[list[float]] = []
        marks: list[list[int]] = []
        epochs: list[list[int]] = []
        for r in range(len(counts)):
            count = counts[r]
            m = min(n, count, depth)
            base = (first + r) * depth
            a, b, c = self._span(first + r, count, m) if m > 0 else (base, base, base)  # none: empty ranges
            seqs.append(self._ints_of(self._seqs_at, a, b, base, c))
            tokens.append(self._floats_of(0, a, b, base, c))
            engine.append(self._floats_of(self._engine_at, a, b, base, c))
            marks.append(self._ints_of(self._marks_at, a, b, base, c))
            epochs.append(self._ints_of(self._stamps_at, a, b, base, c) if stamps else [])
        return seqs, tokens, engine, marks, epochs

    def estimate(self, backend: str, slot: int) -> tuple[float, float]:
        """`SharedInflightTable.host_estimate` of `backend` (its `slot`)."""
        ratio = self.ratio
        rows = self._rows
        ints, rints = self._ints, self._rints
        first = slot * rows
        live = ints[first:first + rows].tolist()
        k = 0
        for x in live:
            k += x
        if k <= 0:
            return 0.0, 0.0
        tokens = 0
        for x in ints[self._tok_off + first:self._tok_off + first + rows].tolist():
            tokens += x
        counts = rints[rows + first:rows + first + rows].tolist()
        nows = rints[self._counts_at + first:self._counts_at + first + rows].tolist()
        nows[self._row] = self.progress.get(backend, 0)
        kept = self._kept.get(slot)
        if kept is not None and kept.live == live and kept.counts == counts and kept.tokens == tokens \
                and kept.ratio == ratio:
            # The same entries: only the counts may have moved, and an entry's progress with its own
            # worker's count, so each worker's part of the bound by as much.
            then = kept.nows
            if nows == then:
                return kept.answer
            moved: list[float] = []
            grown = True
            for r in range(rows):
                if nows[r] < then[r]:
                    grown = False
                    break
                moved.append(kept.parts[r] - (nows[r] - then[r]))
            if grown:
                answer = _answer(kept.got, kept.total, max(moved), ratio)
                kept.parts, kept.nows, kept.answer = moved, nows, answer
                return answer
        seqs, ests, engine, marks, _ = self.rings(first, counts, k, False)
        total, known, parts = host_walk(seqs, ests, engine, marks, nows, k)
        got = with_unrecorded(total, known, k, tokens)
        answer = _answer(got, total, max(parts), ratio)
        self._kept[slot] = _Kept(live, counts, tokens, ratio, got, total, parts, nows, answer)
        return answer

    def source(self, backend: str, slot: int, k: int) -> HostSource:
        """`SharedInflightTable.host_source` of `backend` (its `slot`)."""
        rows, depth = self._rows, self._depth
        rints = self._rints
        first = slot * rows
        counts = rints[rows + first:rows + first + rows].tolist()
        # Each ring's count and newest seq (a restarted worker that sent as many again has other seqs).
        key = list(counts)
        for r in range(rows):
            key.append(self.newest_seq(first + r, counts[r]))
        kept = self._orders.get(slot)
        if kept is not None and kept[0] == key:
            order = kept[1]
        else:
            seqs, tokens, engine, marks, stamps = self.rings(first, counts, depth, True)
            order = host_order(seqs, stamps, tokens, marks, engine)
            self._orders[slot] = (key, order)
        nows = rints[self._counts_at + first:self._counts_at + first + rows].tolist()
        nows[self._row] = self.progress.get(backend, 0)
        return host_source_of(order, k, rints[0:rows].tolist(), nows, self._row)


def with_unrecorded(total: float, known: int, live: int, tokens: int) -> float:
    """`total`, the newest `known` records, plus the `live - known` live requests nobody recorded, at the
    data plane's per-request average (or, without token counts, at the average of the records)."""
    if live > known:
        per_request = tokens / live if tokens > 0 else (total / known if known else 0.0)
        total += (live - known) * per_request
    return total


def _answer(got: float, total: float, bound: float, ratio: float) -> tuple[float, float]:
    """`HostRings.estimate`'s answer from the newest-K estimate `got` (`total` of it the entries') and the
    bound in engine tokens before its floor, as `WorkLedger.pending` reads one process's."""
    backlog = ratio * bound if bound > 0.0 else 0.0
    if backlog > got:
        backlog = got
    return got, backlog + got - total
