"""An estimate of the prefill work each backend still has queued, from what this policy sent it.

Why: the bounded-load rule counts requests, but on long-context traffic requests differ by 100x in cost
(a 90k-token document vs. a 500-token chat turn), and a request's time to first token is dominated by
the prefill queued ahead of it on its GPU (engines schedule running prefills first, in arrival order).
Telemetry sees the queue only once per scrape; the data plane's `Inflight` knows how many requests are
live right now but not how much prefill each still needs (its token count includes prompt tokens the
backend already had cached).

So the policy remembers, per backend, the estimated *uncached* prompt tokens of the requests it sent
there, newest last, and reads the live count from `Inflight`: with k requests still in flight, the
newest k entries are the ones most likely still waiting for or doing their prefill (engines finish
prefills in arrival order; the oldest live requests are usually decoding). Live requests this policy did
not record (from before a restart) count at the data plane's own per-request average. Pure and bounded:
no clock, at most `depth` entries per backend.

With `--workers N` the in-flight mapping is a `SharedInflightTable` (proxy/core/inflight.py): `record`
also hands the estimate to it, each worker publishes the same estimate for its own live requests into its
row of the shared block, and `pending` reads the sum over every worker (`SharedInflight.queued`), so the
cost check sees the prefill every worker has queued on a backend, as one process would.

Across proxy replicas (`routing.peer_load`) the estimate must be the fleet's, and "the newest k entries"
is not additive: the sum over replicas of each one's newest k_r (k_r its own live count) is not the
fleet's newest K (K the fleet's live count). Requests do not finish in the order they were sent (a long
conversation decodes for seconds while short ones come and go), so each replica keeps counting its old,
long, long-since-prefilled requests, where the fleet's newest K has moved past them (measured in the
replay: the per-replica sum costs R = 4 +11% TTFT mean on the multi-turn Mooncake load at ~96% busy; the
fleet's newest K closes the gap; loadtest/results/scaleout.md, Round 4). So the ledger also keeps each
entry's *epoch*: `tick()` is called once per peer-load refresh (a count, not a clock: the core reads no
time), `recent()` gives the newest entries as (age in epochs, tokens) for the published row, and
`fleet_pending()` merges the other replicas' published entries with this process's own by age and sums
the fleet's newest K, as one process holding every entry would.

The host-wide shared sum above has the same flaw within one `--workers` host (each worker's newest k_w,
summed). With `routing.peer_load` each worker publishes its own part for the other hosts
(proxy/control/peer_load.py) and reads its host-mates' counts and newest entries from the shared block
(`SharedInflightTable.mates`, `.mates_recent`, both of one moment), so `fleet_pending` is called with the
worker's own row of the shared table as `own` and every other worker's entries, the mates' merged with
the other hosts' (`merge_recent`), each once.

What a pick pays for that (round 5b, loadtest/results/scaleout.md): nothing is merged entry by entry. The
other replicas' entries stay one part per published row (`PeerRecent`: each row's ages ascending and the
prefix sums of its tokens, cut once per refresh when a pick first asks); this ledger's own entries, the
mates' rings (`SharedInflightTable.mate_sources`) and those parts are sources sorted by age, and the
newest K of their merge (ties: own, the mates by row, the rows in the order they came: the order round
5's merges had) is found by bisecting each for the K-th entry's age (`newest_k`, starting from the last
answer's), the sum read off the prefix sums. And `fleet_queued` keeps each backend's answer until one of
its inputs changes (the live count, a record or tick here, a mate's record or tick, a new view). The sum
is the entry-by-entry merge's exactly when the entries are, like the policy's estimates, multiples of a
power of two (here quarters of a token: every partial sum is exact, in any order).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate, chain, islice, repeat
from operator import itemgetter, le, sub
from typing import Any, Iterator, Mapping, Sequence, overload

from proxy.core.decision import Inflight
from proxy.core.inflight import (MateSource, SharedInflight, SharedInflightTable, newest_sum,
                                 with_unrecorded)

# One published entry of another replica: (age in its refresh epochs, estimated uncached prompt tokens).
RecentEntry = tuple[int, float]
_AGE = itemgetter(0)
_TOK = itemgetter(1)
# One source of entries sorted by age (newest first): ages[lo:hi] ascending, and running sums of their
# tokens in that order, cum[lo] before the first (the sum of its newest c: cum[lo + c] - cum[lo]). A
# packed row's backends share the row's arrays (one pass per row, none per backend or entry).
Part = tuple[Sequence[int], int, int, Sequence[float]]


def part_of(entries: Sequence[RecentEntry]) -> Part:
    """The ages and running sums of one replica's published entries (sorted by age first, stably, if
    they are not: what merging them into the others' by a stable sort did)."""
    ages = list(map(_AGE, entries))
    if not all(map(le, ages, islice(ages, 1, None))):
        entries = sorted(entries, key=_AGE)
        ages = list(map(_AGE, entries))
    return ages, 0, len(ages), list(accumulate(map(_TOK, entries), initial=0.0))


class EntryColumns(Sequence[RecentEntry]):
    """One backend's entries of a packed row (proxy/control/peer_load.py `parse_packed`): its slice of
    the row's ages, tokens and running sums (`part`, for a pick); as a sequence, (age, tokens) pairs."""

    __slots__ = ("_ages", "_toks", "_cum", "_at", "_n")

    def __init__(self, ages: Sequence[int], toks: Sequence[float], cum: Sequence[float], at: int, n: int) -> None:
        self._ages, self._toks, self._cum, self._at, self._n = ages, toks, cum, at, n

    def part(self) -> Part:
        return self._ages, self._at, self._at + self._n, self._cum

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> RecentEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RecentEntry]: ...
    def __getitem__(self, i: int | slice) -> RecentEntry | Sequence[RecentEntry]:
        return list(self)[i]

    def __iter__(self) -> Iterator[RecentEntry]:
        a, n = self._at, self._n
        return zip(self._ages[a:a + n], self._toks[a:a + n])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list, EntryColumns)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to a tuple, not hashable

    def __repr__(self) -> str:
        return f"EntryColumns({list(self)!r})"


class PeerRecent(Sequence[RecentEntry]):
    """The other replicas' newest entries of one backend, as the exchange read them: one part per
    published row, each sorted by age, in the order the rows came. As a sequence it is their merge by
    age (stable: the rows' order on a tie), what round 5 sorted at every refresh; a pick reads the parts
    instead (`columns`: each one's ages and prefix sums, built at the first pick that asks, once per
    refresh), so nothing is merged or sorted per refresh and a pick bisects each part."""

    __slots__ = ("parts", "_columns", "_merged")

    def __init__(self, parts: list[Sequence[RecentEntry]]) -> None:
        self.parts = parts
        self._columns: list[Part] | None = None
        self._merged: tuple[RecentEntry, ...] | None = None

    def columns(self) -> list[Part]:
        cols = self._columns
        if cols is None:
            cols = self._columns = [p.part() if isinstance(p, EntryColumns) else part_of(p) for p in self.parts if p]
        return cols

    def _all(self) -> tuple[RecentEntry, ...]:
        merged = self._merged
        if merged is None:
            merged = self._merged = tuple(sorted(chain.from_iterable(self.parts), key=_AGE))
        return merged

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    @overload
    def __getitem__(self, i: int) -> RecentEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RecentEntry]: ...
    def __getitem__(self, i: int | slice) -> RecentEntry | Sequence[RecentEntry]:
        return self._all()[i]

    def __iter__(self) -> Iterator[RecentEntry]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PeerRecent):
            return self._all() == other._all()
        if isinstance(other, (tuple, list)):
            return list(self._all()) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence: equal to a tuple, not hashable

    def __repr__(self) -> str:
        return f"PeerRecent({self._all()!r})"


def newest_k(k: int, stamped: Sequence[tuple[Sequence[int], int]], parts: Sequence[Part],
             hint: int) -> tuple[list[int], int]:
    """How many entries of each source the newest `k` over all of them take (their merge by age; on a
    tie the earlier source first, and within a source its newest first), and the age of the k-th.

    `stamped`: sources in epochs (ascending, oldest first) with their current epoch (an entry's age is
    max(0, epoch now - its epoch)): this process's ledger, then its host-mates' rings; `parts`: sources
    in ages (`Part`). `hint`: where to start looking for the k-th age (the last answer for this backend:
    it moves little between picks). Returns the counts in the order stamped + parts (and -1 for the age
    when k takes every entry). Each count stays within its source even for a part whose ages are out of
    order (a malformed row: its estimate is then wrong, never an error)."""
    seqs = [s for s, _now in stamped]
    nows = [now for _s, now in stamped]
    n_st = sum(map(len, seqs))
    ages = [p[0] for p in parts]
    los = [p[1] for p in parts]
    his = [p[2] for p in parts]
    base = sum(los)
    total = n_st + sum(his) - base
    if k >= total:
        return [*map(len, seqs), *map(sub, his, los)], -1

    def at_most(a: int) -> int:  # entries of age <= a (a >= 0)
        return (n_st - sum(map(bisect_left, seqs, map(sub, nows, repeat(a))))
                + sum(map(bisect_right, ages, repeat(a), los, his)) - base)

    # The smallest age a with at_most(a) >= k: from the hint, out by doubling steps, then halving.
    a = hint if hint > 0 else 0
    if at_most(a) >= k:
        hi, step = a, 1
        lo = a - 1
        while lo >= 0 and at_most(lo) >= k:
            hi = lo
            lo = hi - step
            step *= 2
        lo = max(lo, -1)
    else:
        lo, step = a, 1
        hi = a + 1
        while at_most(hi) < k:
            lo = hi
            step *= 2
            hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at_most(mid) >= k:
            hi = mid
        else:
            lo = mid
    # Every entry younger than the k-th's age, then of its age in source order up to k.
    if hi > 0:
        b = hi - 1
        younger = [len(s) - bisect_left(s, now - b) for s, now in stamped]
        younger += map(sub, map(bisect_right, ages, repeat(b), los, his), los)
    else:
        younger = [0] * (len(seqs) + len(ages))
    same = [len(s) - bisect_left(s, now - hi) for s, now in stamped]
    same += map(sub, map(bisect_right, ages, repeat(hi), los, his), los)
    left = k - sum(younger)
    got: list[int] = []
    for y, upto in zip(younger, same):
        take = upto - y
        if take > left:
            take = left
        if take < 0:  # only with ages out of order
            take = 0
        got.append(y + take)
        left -= take
    return got, hi


def merge_recent(first: Sequence[RecentEntry], second: Sequence[RecentEntry], n: int) -> Sequence[RecentEntry]:
    """The newest `n` of two lists of entries each sorted by age, sorted by age (stable: `first`'s on a
    tie): what `fleet_pending` reads of a worker's host-mates' entries and the other hosts'."""
    if not first:
        return second
    if not second:
        return first
    return sorted([*first, *second], key=_AGE)[:n]


class WorkLedger:
    """Per backend, the estimated uncached prompt tokens of the most recent requests routed there."""

    __slots__ = ("_depth", "_entries", "_epochs", "_epoch", "_serial", "_last", "_memo", "_hints", "_plain")

    def __init__(self, depth: int = 1024) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._depth = depth
        self._entries: dict[str, deque[float]] = {}
        self._epochs: dict[str, deque[int]] = {}  # the epoch each entry was recorded in (see `tick`)
        self._epoch = 0
        # What `fleet_queued` keeps between picks: the records so far and the serial of each backend's
        # last (its entries changed iff that did); per backend its last answer with everything it was
        # computed from, the k-th entry's last age, and a plain sequence of the others' entries as a part.
        self._serial = 0
        self._last: dict[str, int] = {}
        self._memo: dict[str, tuple[int, int, int, tuple[Any, ...], object, float, int]] = {}
        self._hints: dict[str, int] = {}
        self._plain: dict[str, tuple[Sequence[RecentEntry], list[Part]]] = {}

    def record(self, backend: str, tokens: float, inflight: Mapping[str, Inflight] | None = None) -> None:
        """Remember a request routed to `backend`; `inflight` is the mapping the policy picked with (a
        shared one learns the estimate too)."""
        entries = self._entries.get(backend)
        if entries is None:
            entries = self._entries[backend] = deque(maxlen=self._depth)
            self._epochs[backend] = deque(maxlen=self._depth)
        entries.append(tokens)
        self._epochs[backend].append(self._epoch)
        self._serial += 1
        self._last[backend] = self._serial
        if isinstance(inflight, SharedInflightTable) and inflight.row is not None:
            inflight.record_queued(backend, tokens)

    def pending(self, backend: str, inflight: Inflight | None) -> float:
        """Estimated prefill tokens still ahead of a new request on `backend`."""
        if inflight is None:
            return 0.0
        if isinstance(inflight, SharedInflight):
            return inflight.queued
        return newest_sum(self._entries.get(backend), inflight.requests, inflight.tokens)

    def tick(self) -> None:
        """One peer-load refresh has passed (the unit of the entries' ages; not a clock)."""
        self._epoch += 1

    def recent(self, backend: str, n: int) -> tuple[RecentEntry, ...]:
        """The newest `n` entries of `backend`, newest first, as (age in epochs, tokens): what this
        replica publishes for the others' `fleet_pending`."""
        entries = self._entries.get(backend)
        if entries is None or n <= 0:
            return ()
        ages = map(self._epoch.__sub__, islice(reversed(self._epochs[backend]), n))
        return tuple(zip(ages, islice(reversed(entries), n)))

    def fleet_pending(self, backend: str, own: Inflight | None, peer_requests: int, peer_tokens: int,
                      peer_recent: Sequence[RecentEntry]) -> float:
        """The fleet's queued prefill on `backend`, as one process holding every entry would estimate it:
        the newest K entries of this process's own and the other replicas' published ones merged by age
        (ties: this process's first), K = this process's live requests + the others'; live requests
        beyond the entries at the per-request average. `peer_recent`: the others' entries (sorted by age
        here if they are not; a `PeerRecent` as the exchange reads them). `fleet_queued` is the same with
        a host's mates, and what it computed kept between picks."""
        live = (own.requests if own is not None else 0) + peer_requests
        if live <= 0:
            return 0.0
        tokens = (own.tokens if own is not None else 0) + peer_tokens
        if isinstance(peer_recent, PeerRecent):
            parts = peer_recent.columns()
        else:
            parts = [part_of(peer_recent)] if peer_recent else []
        total, known = self._newest(backend, live, [], parts)
        return with_unrecorded(total, known, live, tokens)

    def fleet_queued(self, backend: str, own: Inflight | None, peer_requests: int, peer_tokens: int,
                     peer_recent: Sequence[RecentEntry], host: SharedInflightTable | None) -> float:
        """`fleet_pending`, the entries of `host`'s other workers (its host-mates, now) merged in after
        this process's own and before the other replicas' (what `fleet_pending` of `merge_recent` of
        `host.mates_recent` and the others' reads). The answer is kept per backend until one of its
        inputs changes (the live count, a record or a tick here, a mate's record or tick, other entries
        from the others: a new view), which most picks do not see for most backends. The others' entries are
        not merged at all: each part (a published row) is bisected where a pick needs it."""
        live = (own.requests if own is not None else 0) + peer_requests
        if live <= 0:
            return 0.0
        tokens = (own.tokens if own is not None else 0) + peer_tokens
        mates_key, mates = host.mate_sources(backend) if host is not None else ((), [])
        serial = self._last.get(backend, 0)
        memo = self._memo.get(backend)
        if (memo is not None and memo[0] == live and memo[1] == serial and memo[2] == self._epoch
                and memo[4] is peer_recent and memo[3] == mates_key):
            return with_unrecorded(memo[5], memo[6], live, tokens)
        if isinstance(peer_recent, PeerRecent):
            parts = peer_recent.columns()
        elif not peer_recent:
            parts = []
        else:
            plain = self._plain.get(backend)
            if plain is None or plain[0] is not peer_recent:
                plain = self._plain[backend] = (peer_recent, [part_of(peer_recent)])
            parts = plain[1]
        total, known = self._newest(backend, live, mates, parts)
        self._memo[backend] = (live, serial, self._epoch, mates_key, peer_recent, total, known)
        return with_unrecorded(total, known, live, tokens)

    def _newest(self, backend: str, k: int, mates: Sequence[MateSource], parts: Sequence[Part]) -> tuple[float, int]:
        """The sum of the newest `k` entries of this ledger's, the mates' and the parts' merged by age
        (ties in that order), and how many there were (fewer than k if that is all)."""
        entries = self._entries.get(backend)
        stamped: list[tuple[Sequence[int], int]] = [(self._epochs[backend], self._epoch)] if entries else []
        stamped.extend((m[0], m[1]) for m in mates)
        counts, age = newest_k(k, stamped, parts, self._hints.get(backend, 0))
        if age >= 0:
            self._hints[backend] = age
        i = 0
        total = 0.0
        if entries:
            if counts[0]:
                total += sum(islice(reversed(entries), counts[0]))
            i = 1
        for m in mates:
            total += m[2][counts[i]]
            i += 1
        for _ages, lo, _hi, cum in parts:
            total += cum[lo + counts[i]] - cum[lo]
            i += 1
        return total, sum(counts)

    def discard(self, backend: str) -> None:
        """Forget a backend removed from the fleet."""
        self._entries.pop(backend, None)
        self._epochs.pop(backend, None)
        self._serial += 1
        self._last[backend] = self._serial

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
