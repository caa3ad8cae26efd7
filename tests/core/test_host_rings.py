"""The host's rings walked as a merge (proxy/core/host_rings.py) against the sort they replace: every
worker's entries gathered, sorted newest first by (seq, row, ...), walked (round 15's host read)."""

from __future__ import annotations

import math
import random
from itertools import accumulate

from proxy.core.host_rings import host_order, host_source_of, host_walk


def _rings(rng: random.Random, rows: int) -> tuple[list[list[int]], list[list[int]], list[list[float]],
                                                    list[list[int]], list[list[float]]]:
    """Per row, entries oldest first with increasing seqs; rows share seqs often (sends at one moment)."""
    seqs: list[list[int]] = [[] for _ in range(rows)]
    stamps: list[list[int]] = [[] for _ in range(rows)]
    tokens: list[list[float]] = [[] for _ in range(rows)]
    marks: list[list[int]] = [[] for _ in range(rows)]
    engine: list[list[float]] = [[] for _ in range(rows)]
    seq = 0
    for _ in range(rng.randrange(0, 40)):
        senders = rng.sample(range(rows), rng.choice((1, 1, 2)) if rows > 1 else 1)  # a tie: 2 at one seq
        for r in senders:
            seqs[r].append(seq)
            stamps[r].append(seq // 5)
            tokens[r].append(float(rng.randrange(1, 5000)))
            marks[r].append(rng.randrange(0, 10_000))
            engine[r].append(rng.randrange(1, 5000) / 1.2)
        seq += rng.randrange(1, 3)
    return seqs, stamps, tokens, marks, engine


def _sorted(seqs: list[list[int]], stamps: list[list[int]], tokens: list[list[float]], marks: list[list[int]],
            engine: list[list[float]]) -> list[tuple[int, int, int, float, int, float]]:
    entries = [(q, r, s, t, m, e) for r in range(len(seqs))
               for q, s, t, m, e in zip(seqs[r], stamps[r], tokens[r], marks[r], engine[r])]
    entries.sort(reverse=True)
    return entries


def test_the_merge_walks_the_rings_in_the_order_of_the_sort_ties_to_the_higher_row() -> None:
    rng = random.Random(7)
    ties = 0
    for case in range(400):
        rows = rng.randrange(1, 5)
        seqs, stamps, tokens, marks, engine = _rings(rng, rows)
        ordered = _sorted(seqs, stamps, tokens, marks, engine)
        ties += sum(1 for a, b in zip(ordered, ordered[1:]) if a[0] == b[0])
        assert host_order(seqs, stamps, tokens, marks, engine) == (
            [e[1] for e in ordered], [e[2] for e in ordered], [e[3] for e in ordered],
            [e[4] for e in ordered], [e[5] for e in ordered]), case

        nows = [rng.randrange(0, 12_000) for _ in range(rows)]
        k = rng.randrange(0, len(ordered) + 3)
        total = sent = 0.0
        parts = [-math.inf] * rows
        for q, r, _s, t, m, e in ordered[:k]:
            total += t
            sent += e
            parts[r] = max(parts[r], sent - max(nows[r] - m, 0))
        assert host_walk(seqs, tokens, engine, marks, nows, k) == (total, min(k, len(ordered)), parts), case
    assert ties > 100  # the cases do exercise two workers' sends at one seq


def test_the_host_source_ages_sums_and_marks_are_the_sorts() -> None:
    rng = random.Random(11)
    for case in range(300):
        rows = rng.randrange(1, 4)
        seqs, stamps, tokens, marks, engine = _rings(rng, rows)
        order = host_order(seqs, stamps, tokens, marks, engine)
        ordered = _sorted(seqs, stamps, tokens, marks, engine)
        epochs = [rng.randrange(0, 12) for _ in range(rows)]
        nows = [rng.randrange(0, 12_000) for _ in range(rows)]
        row = rng.randrange(rows)
        k = rng.randrange(0, len(ordered) + 3)
        head = ordered[:k]
        mine = epochs[row]
        ages = list(accumulate([max(epochs[e[1]] - e[2], 0) for e in head], max))
        want = ([mine - a for a in reversed(ages)], mine, list(accumulate([e[3] for e in head], initial=0.0)),
                [e[4] + nows[row] - nows[e[1]] for e in head], [e[5] for e in head])
        assert host_source_of(order, k, epochs, nows, row) == want, case
