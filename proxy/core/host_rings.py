"""A `--workers` host's ledger rings of one backend, read as one process holding every worker's entries.

Pure and compiled with the hot path (proxy/native): `SharedInflightTable` (proxy/core/inflight.py) copies
each worker's ring out of the shared block (its newest entries, oldest first: the order that worker sent
them) and these walk the rings together newest first by host sequence. Each ring is already in send order,
so the walk is a merge of the rings, not a sort: O(entries x workers) with nothing allocated per entry.
Ties of the sequence (two workers' sends at the same moment) go to the higher row first, the order a sort
of (seq, row, ...) newest first gives.
"""

from __future__ import annotations

import math

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
