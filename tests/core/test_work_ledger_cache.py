"""What a pick with the peer load keeps between picks (issue 13, round 5b): per backend, the fleet's
queued prefill is computed once and kept until one of its inputs changes, and the other replicas'
entries are never merged per refresh (each published row is bisected where a pick needs it). Both must
give exactly round 5's estimate (the mates' rings merged with the other hosts' entries by age, then with
this worker's own, entry by entry), and a kept answer must never outlive a change of what it was
computed from: a new view, a mate's record or tick, this worker's record or tick, a live count."""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from proxy.control.peer_load import merge_loads
from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight
from proxy.core.inflight import SharedInflightTable, SharedLayout, with_unrecorded
from proxy.core.work_ledger import PeerRecent, RecentEntry, WorkLedger


def merge_recent(first: Sequence[RecentEntry], second: Sequence[RecentEntry], n: int) -> Sequence[RecentEntry]:
    """Round 5's merge of a worker's host-mates' entries (`first`) with the other hosts' (`second`), each
    sorted by age: the newest `n`, sorted by age (stable: `first`'s on a tie). Part of the reference."""
    if not first:
        return second
    if not second:
        return first
    return sorted([*first, *second], key=lambda e: e[0])[:n]


def _old_fleet_pending(work: WorkLedger, backend: str, own: Inflight | None, peer_requests: int,
                       peer_tokens: int, peer_recent: Sequence[RecentEntry]) -> float:
    """Round 5's `WorkLedger.fleet_pending`, entry by entry: the reference."""
    live = (own.requests if own is not None else 0) + peer_requests
    if live <= 0:
        return 0.0
    tokens = (own.tokens if own is not None else 0) + peer_tokens
    peer_recent = sorted(peer_recent, key=lambda e: e[0])
    entries = work._entries.get(backend)
    mine = zip(reversed(entries), reversed(work._epochs[backend])) if entries is not None else iter(())
    now = work._epoch
    total, known, p, n_peer = 0.0, 0, 0, len(peer_recent)
    nxt = next(mine, None)
    while known < live and (nxt is not None or p < n_peer):
        if nxt is not None and (p >= n_peer or now - nxt[1] <= peer_recent[p][0]):
            total += nxt[0]
            nxt = next(mine, None)
        else:
            total += peer_recent[p][1]
            p += 1
        known += 1
    return with_unrecorded(total, known, live, tokens)


def _reference(view: Mapping[str, Any], host: SharedInflightTable, work: WorkLedger, name: str) -> float:
    """Round 5's `_with_peers` pending of a --workers worker."""
    peer = view.get(name)
    own = host.own(name)
    req, tok = host.mates(name)
    rest = tuple(peer[3]) if peer is not None and len(peer) > 3 else ()
    if peer is not None:
        req, tok = req + peer[0], tok + peer[1]
    live = req + (own.requests if own is not None else 0)
    got = _old_fleet_pending(work, name, own, req, tok, merge_recent(host.mates_recent(name, live), rest, live))
    if peer is not None and len(peer) == 3:
        got += peer[2]
    return got


class _Host:
    """A host of 3 workers (w0 routes; w1 and w2 are its mates) and the other hosts' rows."""

    def __init__(self, names: list[str], recent: int = 8) -> None:
        self.names = names
        layout = SharedLayout(rows=3, slots=len(names), recent=recent)
        buf = memoryview(bytearray(layout.size))
        self.tables = [SharedInflightTable(buf, layout, r) for r in range(3)]
        for t in self.tables:
            t.assign({n: k for k, n in enumerate(names)})
        self.ledgers = [WorkLedger() for _ in self.tables]
        self.live: list[list[str]] = [[], [], []]

    def send(self, w: int, name: str, uncached: float) -> None:
        self.ledgers[w].record(name, uncached, self.tables[w])
        self.tables[w].acquire(name, 100)
        self.live[w].append(name)

    def finish(self, w: int, rng: random.Random) -> None:
        if self.live[w]:
            self.tables[w].release(self.live[w].pop(rng.randrange(len(self.live[w]))), 100)

    def tick(self, w: int) -> None:
        self.ledgers[w].tick()
        self.tables[w].tick()

    def pending(self, view: Mapping[str, Any]) -> dict[str, float]:
        _out, pending = AffinityPolicy._with_peers(view, self.tables[0], self.ledgers[0])
        return {n: pending(n, None) for n in self.names}

    def reference(self, view: Mapping[str, Any]) -> dict[str, float]:
        return {n: _reference(view, self.tables[0], self.ledgers[0], n) for n in self.names}


def _rows(rng: random.Random, names: list[str], n_rows: int) -> list[dict[str, Any]]:
    """The other hosts' published rows: ages with ties, tokens in quarters (as the proxy's estimates)."""
    rows = []
    for _ in range(n_rows):
        row: dict[str, Any] = {}
        for n in names:
            k = rng.randrange(0, 12)
            ages = sorted(rng.randrange(0, 6) for _ in range(k))
            row[n] = (rng.randrange(0, 6), rng.randrange(0, 600), float(rng.randrange(0, 4000)),
                      tuple((a, rng.randrange(0, 20000) / 4) for a in ages))
        if rng.random() < 0.1:  # an older replica's row: the sums only
            row[names[0]] = row[names[0]][:3]
        rows.append(row)
    return rows


def test_every_estimate_is_round_5s_entry_by_entry_merge() -> None:
    rng = random.Random(7)
    names = ["a", "b", "c", "d"]
    host = _Host(names)
    checked = 0
    view: Mapping[str, Any] = {}
    for step in range(400):
        w = rng.randrange(3)
        action = rng.random()
        if action < 0.45:
            host.send(w, rng.choice(names), rng.randrange(0, 40000) / 4)
        elif action < 0.8:
            host.finish(w, rng)
        else:
            host.tick(w)
        if step % 9 == 0:  # a refresh: the other hosts' rows, as the exchange merges them, or plain
            rows = _rows(rng, names, rng.randrange(0, 4))
            merged = merge_loads(rows)
            if rng.random() < 0.3:  # a view of plain tuples (the replay's W = 1 views, tests)
                merged = {n: (*v[:3], tuple(v[3])) if len(v) > 3 else v for n, v in merged.items()}
            view = merged
        assert host.pending(view) == host.reference(view), step
        checked += 1
    assert checked == 400


def test_a_kept_estimate_follows_each_change_of_its_inputs() -> None:
    """Each entry a power of two, so that every sum names the entries in it."""
    host = _Host(["a", "b"])

    def record(w: int, *tokens: float) -> None:
        for t in tokens:
            host.ledgers[w].record("a", t, host.tables[w])

    record(0, 1.0, 2.0, 4.0)
    host.tables[0].acquire("a", 100)
    record(1, 8.0, 16.0)
    host.tables[1].acquire("a", 100)
    record(2, 32.0)
    host.tables[2].acquire("a", 100)
    view: Mapping[str, Any] = merge_loads([{"a": (1, 100, 0.0, ((0, 64.0), (2, 128.0)))}])
    steps = []

    def check() -> None:
        got = host.pending(view)["a"]
        assert got == host.reference(view)["a"]
        steps.append(got)

    check()
    check()  # nothing changed: the kept answer
    record(1, 256.0)  # a mate's record, and one more live request there
    host.tables[1].acquire("a", 100)
    check()
    host.tick(1)  # a mate's tick: its entries are now older than the others'
    check()
    view = merge_loads([{"a": (1, 100, 0.0, ((0, 512.0), (0, 1024.0)))}])  # a refresh: other entries
    check()
    record(0, 2048.0)  # this worker's own record (no live request more)
    check()
    host.tick(0)  # its own tick
    check()
    host.tables[0].release("a", 100)  # one live request fewer
    check()
    host.tables[2].acquire("a", 100)  # a mate's live request more
    check()
    # The newest K over every source (ties: own, the mates by row, the other hosts'), K = the live count.
    assert steps == [4 + 2 + 1 + 16, 23, 4 + 2 + 1 + 256 + 16, 4 + 2 + 1 + 32 + 64, 4 + 2 + 1 + 32 + 512,
                     2048 + 4 + 2 + 1 + 32, 32 + 512 + 1024 + 2048 + 4, 32 + 512 + 1024 + 2048,
                     32 + 512 + 1024 + 2048 + 4]


def test_the_others_entries_read_as_their_merge_by_age() -> None:
    """A `PeerRecent` is, as a sequence, the stable merge round 5 sorted at every refresh."""
    merged = merge_loads([{"a": (1, 1, 1.0, ((0, 1.0), (2, 2.0)))}, {"a": (1, 1, 1.0, ((0, 3.0), (1, 4.0)))},
                          {"a": (1, 1, 1.0, ())}])
    recent = merged["a"][3]  # type: ignore[misc]  # the 4-tuple
    assert isinstance(recent, PeerRecent)
    assert recent == ((0, 1.0), (0, 3.0), (1, 4.0), (2, 2.0)) and len(recent) == 4
    assert list(recent) == [(0, 1.0), (0, 3.0), (1, 4.0), (2, 2.0)] and recent[1] == (0, 3.0)
    assert recent.columns() == [([0, 2], 0, 2, [0.0, 1.0, 3.0]), ([0, 1], 0, 2, [0.0, 3.0, 7.0])]
    unsorted = PeerRecent([((3, 1.0), (1, 2.0), (1, 5.0))])  # sorted stably where a row is not
    assert unsorted.columns() == [([1, 1, 3], 0, 3, [0.0, 2.0, 7.0, 8.0])]
    w = WorkLedger()
    w.record("a", 10.0)
    assert w.fleet_pending("a", Inflight(1, 10), 2, 20, unsorted) == 10.0 + 2.0 + 5.0
