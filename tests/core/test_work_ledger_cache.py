"""What a pick with the peer load keeps between picks (issue 13, round 5b): per backend, the fleet's
queued prefill is computed once and kept until one of its inputs changes, and the other replicas'
entries are never merged per refresh (each published row is bisected where a pick needs it). Both must
give exactly the entry-by-entry merge (round 5's: this worker's own entries first, then its mates'; with
KV events since round 15, the host's entries in the order they were sent), merged with the other hosts'
by age, and a kept answer must never outlive a change of what it was computed from: a new view, a
mate's record or tick, this worker's record or tick, a live count."""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import pytest

from proxy.control.peer_load import merge_loads
from proxy.core.affinity import AffinityPolicy
from proxy.core.decision import Inflight
from proxy.core.host_rings import with_unrecorded
from proxy.core.inflight import SharedInflightTable, SharedLayout
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


def _reference_host(view: Mapping[str, Any], world: "_Host", name: str) -> float:
    """Round 15's: the host's own entries (each worker's newest `recent` of the backend, its ring) in the
    order they were sent, each aged by its own worker's epochs (never younger than a newer one), merged
    entry by entry with the other hosts' by age (the host's first on a tie); the newest K of them."""
    me = world.tables[0]
    peer = view.get(name)
    own = me.own(name)
    req, tok = me.mates(name)
    rest = sorted(peer[3], key=lambda e: e[0]) if peer is not None and len(peer) > 3 else []
    if peer is not None:
        req, tok = req + peer[0], tok + peer[1]
    live = req + (own.requests if own is not None else 0)
    if live <= 0:
        got = 0.0
    else:
        tokens = tok + (own.tokens if own is not None else 0)
        sends = [(i, w, t, ep) for i, (w, n, t, ep) in enumerate(world.log) if n == name]
        kept = [e for w in range(3) for e in [x for x in sends if x[1] == w][-world.recent:]]
        kept.sort(reverse=True)  # newest first
        mine: list[tuple[int, float]] = []
        oldest = 0
        for _i, w, t, ep in kept:
            oldest = max(oldest, world.epochs[w] - ep)
            mine.append((oldest, t))
        total, known, a, b = 0.0, 0, 0, 0
        while known < live and (a < len(mine) or b < len(rest)):
            if a < len(mine) and (b >= len(rest) or mine[a][0] <= rest[b][0]):
                total += mine[a][1]
                a += 1
            else:
                total += rest[b][1]
                b += 1
            known += 1
        got = with_unrecorded(total, known, live, tokens)
    if peer is not None and len(peer) == 3:
        got += peer[2]
    return got


class _Host:
    """A host of 3 workers (w0 routes; w1 and w2 are its mates) and the other hosts' rows."""

    def __init__(self, names: list[str], recent: int = 8, events: bool = False) -> None:
        self.names = names
        layout = SharedLayout(rows=3, slots=len(names), recent=recent)
        buf = memoryview(bytearray(layout.size))
        self.tables = [SharedInflightTable(buf, layout, r) for r in range(3)]
        # With the engines' KV events (an engine that never progresses: the estimates are the sums).
        self.progress: dict[str, int] | None = {n: 0 for n in names} if events else None
        for t in self.tables:
            t.assign({n: k for k, n in enumerate(names)})
            if self.progress is not None:
                t.follow_progress(self.progress)
        self.ledgers = [WorkLedger(progress=self.progress) for _ in self.tables]
        self.live: list[list[str]] = [[], [], []]
        self.recent = recent
        self.epochs = [0, 0, 0]
        self.log: list[tuple[int, str, float, int]] = []  # every send: (worker, backend, tokens, its epoch)

    def send(self, w: int, name: str, uncached: float) -> None:
        self.ledgers[w].record(name, uncached, self.tables[w])
        self.tables[w].acquire(name, 100)
        self.live[w].append(name)
        self.log.append((w, name, uncached, self.epochs[w]))

    def finish(self, w: int, rng: random.Random) -> None:
        if self.live[w]:
            self.tables[w].release(self.live[w].pop(rng.randrange(len(self.live[w]))), 100)

    def tick(self, w: int) -> None:
        self.ledgers[w].tick()
        self.tables[w].tick()
        self.epochs[w] += 1

    def pending(self, view: Mapping[str, Any]) -> dict[str, float]:
        _out, pending = AffinityPolicy._with_peers(view, self.tables[0], self.ledgers[0])
        return {n: pending(n, None) for n in self.names}

    def reference(self, view: Mapping[str, Any]) -> dict[str, float]:
        if self.progress is not None:
            return {n: _reference_host(view, self, n) for n in self.names}
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


@pytest.mark.parametrize("events", [False, True])
def test_every_estimate_is_the_entry_by_entry_merge(events: bool) -> None:
    """Without KV events round 5's merge (this worker's own entries, then its mates', then the other
    hosts' on a tie of ages); with them the host's entries in the order they were sent (round 15)."""
    rng = random.Random(7)
    names = ["a", "b", "c", "d"]
    host = _Host(names, events=events)
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


@pytest.mark.parametrize("events", [False, True])
def test_a_kept_estimate_follows_each_change_of_its_inputs(events: bool) -> None:
    """Each entry a power of two, so that every sum names the entries in it."""
    host = _Host(["a", "b"], events=events)

    def record(w: int, *tokens: float) -> None:
        for t in tokens:
            host.ledgers[w].record("a", t, host.tables[w])
            host.log.append((w, "a", t, host.epochs[w]))

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
    if not events:
        # The newest K over every source (ties: own, the mates by row, the other hosts'), K = the live count.
        assert steps == [4 + 2 + 1 + 16, 23, 4 + 2 + 1 + 256 + 16, 4 + 2 + 1 + 32 + 64, 4 + 2 + 1 + 32 + 512,
                         2048 + 4 + 2 + 1 + 32, 32 + 512 + 1024 + 2048 + 4, 32 + 512 + 1024 + 2048,
                         32 + 512 + 1024 + 2048 + 4]
        return
    # With KV events: the newest K of the host's entries in the order they were sent, each aged by its own
    # worker's epochs (never younger than a newer one), and the other hosts' (the host's first on a tie).
    assert steps == [32 + 16 + 8 + 4, 60, 256 + 32 + 16 + 8 + 4,
                     64 + 256 + 32 + 16 + 8,  # the mate's tick aged its entries and everything sent before
                     512 + 1024 + 256 + 32 + 16, 2048 + 512 + 1024 + 256 + 32, 512 + 1024 + 2048 + 256 + 32,
                     512 + 1024 + 2048 + 256, 512 + 1024 + 2048 + 256 + 32]


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
