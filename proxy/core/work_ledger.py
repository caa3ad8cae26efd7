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
also hands the entry to it (into the worker's ring in the shared block, with its place among every
worker's sends to that backend), and `pending` reads the host's estimate (`SharedInflight.queued`,
`.backlog`), so the cost check sees the prefill every worker has queued on a backend. With the engines'
KV events that is the newest K of every worker's entries (K the host's live requests there), as one
process would read it (`SharedInflightTable.host_estimate`; until round 15 the sum of each worker's own
newest k_w, not additive, see below: a --workers 2 host lost 10% TTFT mean to one process on the
busiest Mooncake load). Without them it is still that sum (the newest K measured within the noise of a
host whose workers each learn only what they routed).

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

Within one `--workers` host with KV events the shared block orders every worker's entries (above). With
`routing.peer_load` each worker publishes its own part for the other hosts
(proxy/control/peer_load.py) and reads its host-mates' counts and newest entries from the shared block
(`SharedInflightTable.mates`, `.mates_recent`, both of one moment), so `fleet_pending` is called with the
worker's own row of the shared table as `own` and every other worker's entries, the mates' before the
other hosts' on a tie, each once. With KV events (round 15) the host's entries, its own and its
mates', are one source in the order they were sent (`SharedInflightTable.host_source`: aged by their
own worker's epochs, each counted from its own send in the bound), merged with the other hosts' by age:
round 5's order (own first, then the mates by row, each age's progress from the start of its epoch) cost
R = 1 x W = 2 7.4% and R = 4 x W = 2 2.3% TTFT mean on the busiest multi-turn Mooncake load.

What a pick pays for that (round 5b, loadtest/results/scaleout.md): nothing is merged entry by entry. The
other replicas' entries stay one part per published row (`PeerRecent`: each row's ages ascending and the
prefix sums of its tokens, cut once per refresh when a pick first asks); this ledger's own entries, the
mates' rings (`SharedInflightTable.mate_sources`) and those parts are sources sorted by age, and the
newest K of their merge (ties: own, the mates by row, the rows in the order they came: the order round
5's merges had) is found by bisecting each for the K-th entry's age (`newest_k`, starting from the last
answer's), the sum read off the prefix sums. And a pick (`FleetView`) keeps each backend's answer until one of
its inputs changes (the live count, a record or tick here, a mate's record or tick, a new view). The sum
is the entry-by-entry merge's exactly when the entries are, like the policy's estimates, multiples of a
power of two (here quarters of a token: every partial sum is exact, in any order).

Progress (with the engines' KV events, `progress`: `KVIndex.progress`, the tokens each engine has stored).
The newest-k sum counts a request's whole uncached prompt for as long as it is live, decoding included,
and none of the prefill the engine has done since: on the busiest Mooncake load it overestimated what
the engines really had left by +48k tokens on average (loadtest/results/scaleout.md, Round 12), enough to
send a 34k-token repeat away from the engine holding it. An engine stores a block as soon as it has
computed it, so with events on the estimate is a backlog bound instead: whatever was queued before an
entry's record, the backlog now is at least the tokens sent from that entry on less the tokens the
backend stored since (Lindley's recursion, read backwards), so the estimate is the largest such
difference over the counted entries, floored at 0. Since the oldest counted entry alone (round 13's
first try) is not enough: a conversation that decodes for a minute keeps the oldest entry old, and a
minute of every request's decode blocks (stored like prefill) wipes out a long prompt sent a second
ago; from the newest entries on, that prompt still counts. Where each entry's moment comes from, per
load path:
- one process: each entry keeps the backend's count when it was recorded (`BacklogBound`, O(log k) a
  read);
- a --workers host without peers (`SharedInflight.backlog`): each entry in the shared block keeps its
  worker's count at its record, and each worker publishes its count after every batch of events, so a
  read takes the bound over the host's newest K entries as one process does (`host_estimate`;
  differences within one worker's index, so the workers' indexes need not agree on a count);
- across replicas (`fleet_pending`, `FleetView`): entries carry ages in refresh epochs, so `tick` also
  keeps each backend's count at every epoch (the last `history`), and the bound runs over the fleet's
  newest K by age, each age's progress counted from the start of its epoch (up to one refresh, ~10 ms,
  more than since the record). Every replica hears the same events, so each reads the same bound.
The entries are the policy's estimates (prompt bytes / 4), the events count the engine's tokens: the
bound runs in tokens, each entry divided by `ratio` (estimated per real prompt token, from every prompt
the precise lookup tokenised: `calibrate`), and its answer is multiplied back (on the simulator's
word-level tokenizer ~1.2; with a BPE tokenizer on English text ~1).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate, chain, islice, repeat
from operator import getitem, itemgetter, le, sub
from typing import Any, Callable, Iterator, Mapping, Sequence, overload

from proxy.core.decision import Inflight
from proxy.core.host_rings import HostSource, with_unrecorded
from proxy.core.inflight import BacklogBound, MateSource, SharedInflight, SharedInflightTable, newest_sum

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


# Parts as `newest_k` reads them: their ages, los, his and running sums as four lists, the sum of
# cum[lo] over them and how many entries they hold.
Columns = tuple[list[Sequence[int]], list[int], list[int], list[Sequence[float]], float, int]
_NO_COLUMNS: Columns = ([], [], [], [], 0.0, 0)


def columns_of(parts: Sequence[Part]) -> Columns:
    if not parts:
        return _NO_COLUMNS
    ages = [p[0] for p in parts]
    los = [p[1] for p in parts]
    his = [p[2] for p in parts]
    cums = [p[3] for p in parts]
    return ages, los, his, cums, sum(map(getitem, cums, los)), sum(his) - sum(los)


class PeerRecent(Sequence[RecentEntry]):
    """The other replicas' newest entries of one backend, as the exchange read them: one part per
    published row, each sorted by age, in the order the rows came. As a sequence it is their merge by
    age (stable: the rows' order on a tie), what round 5 sorted at every refresh; a pick reads the parts
    instead (`columns`: each one's ages and prefix sums, built at the first pick that asks, once per
    refresh), so nothing is merged or sorted per refresh and a pick bisects each part."""

    __slots__ = ("parts", "_columns", "_vector", "_merged")

    def __init__(self, parts: list[Sequence[RecentEntry]]) -> None:
        self.parts = parts
        self._columns: list[Part] | None = None
        self._vector: Columns | None = None
        self._merged: tuple[RecentEntry, ...] | None = None

    def columns(self) -> list[Part]:
        cols = self._columns
        if cols is None:
            cols = self._columns = [p.part() if isinstance(p, EntryColumns) else part_of(p) for p in self.parts if p]
        return cols

    def vector(self) -> Columns:
        """`columns` as `Columns` (what `newest_k` reads), built once."""
        vec = self._vector
        if vec is None:
            vec = self._vector = columns_of(self.columns())
        return vec

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


def newest_k(k: int, seqs: list[Sequence[int]], nows: list[int], cols: Columns,
             hint: int) -> tuple[list[int], int]:
    """How many entries of each source the newest `k` over all of them take (their merge by age; on a
    tie the earlier source first, and within a source its newest first), and the age of the k-th.

    `seqs`/`nows`: sources in epochs (ascending, oldest first) with their current epoch (an entry's age
    is max(0, epoch now - its epoch)): this process's ledger, then its host-mates' rings; `cols`: the
    parts, sources in ages (`Columns`). `hint`: where to look first for the k-th age (the last answer
    for this backend: it moves little between picks). Returns the counts in the order seqs + parts (and
    -1 for the age when k takes every entry). Each count stays within its source even for a part whose
    ages are out of order (a malformed row: its estimate is then wrong, never an error)."""
    ages, los, his, _cums, _base, n_parts = cols
    lens = list(map(len, seqs))
    if k >= sum(lens) + n_parts:
        return [*lens, *map(sub, his, los)], -1

    def upto(a: int) -> list[int]:  # per source, its entries of age <= a (a >= 0)
        out = list(map(sub, lens, map(bisect_left, seqs, map(sub, nows, repeat(a)))))
        out += map(sub, map(bisect_right, ages, repeat(a), los, his), los)
        return out

    a = hint if hint > 0 else 0
    at = upto(a)
    if sum(at) >= k:
        if a == 0:
            return _fill(k, [0] * len(at), at), 0
        below = upto(a - 1)
        if sum(below) < k:
            return _fill(k, below, at), a
        hi, step = a - 1, 1  # the k-th is younger than the hint: in by doubling steps
        while True:
            lo = hi - step
            if lo < 0:
                lo = -1
                break
            if sum(upto(lo)) < k:
                break
            hi = lo
            step *= 2
    else:
        above = upto(a + 1)
        if sum(above) >= k:
            return _fill(k, at, above), a + 1
        lo, hi, step = a + 1, a + 2, 2  # older: out by doubling steps
        while sum(upto(hi)) < k:
            lo = hi
            step *= 2
            hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(upto(mid)) >= k:
            hi = mid
        else:
            lo = mid
    return _fill(k, upto(hi - 1) if hi > 0 else [0] * (len(seqs) + len(ages)), upto(hi)), hi


def _parts_sum(cols: Columns, counts: Sequence[int], first: int) -> float:
    """The tokens of the parts' newest entries, as many of each as `counts[first:]` says."""
    ages, los, _his, cums, base, _n = cols
    if not ages:
        return 0.0
    return sum([cum[lo + c] for cum, lo, c in zip(cums, los, islice(counts, first, None))]) - base


def _parts_pairs(cols: Columns, counts: Sequence[int], first: int) -> list[tuple[int, float]]:
    """The parts' newest entries, as many of each as `counts[first:]` says, as (age, tokens)."""
    ages, los, _his, cums, _base, _n = cols
    pairs: list[tuple[int, float]] = []
    for part_ages, lo, cum, c in zip(ages, los, cums, islice(counts, first, None)):
        pairs += [(part_ages[lo + x], cum[lo + x + 1] - cum[lo + x]) for x in range(c)]
    return pairs


def _fill(k: int, younger: list[int], same: list[int]) -> list[int]:
    """Every entry younger than the k-th's age, then of its age in source order, up to k."""
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
    return got


class WorkLedger:
    """Per backend, the estimated uncached prompt tokens of the most recent requests routed there."""

    __slots__ = ("_depth", "_entries", "_epochs", "_epoch", "_serial", "_last", "_kept", "_memo", "_hints", "_plain",
                 "_progress", "_bounds", "_history", "_history_len", "_est", "_exact", "ratio")

    def __init__(self, depth: int = 1024, progress: Mapping[str, int] | None = None, history: int = 8192) -> None:
        """`progress`: per backend, the tokens its engine has stored so far (`KVIndex.progress`, a live
        view), to subtract the prefill done since the counted entries were recorded ("Progress" above);
        None: the plain newest-k sum. `history`: how many refresh epochs of it `tick` keeps."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._depth = depth
        self._progress = progress
        self._bounds: dict[str, BacklogBound] = {}  # with progress: per backend, its entries' backlog bound
        # with progress: per backend, its count at the start of each of the last `history` epochs (a ring
        # indexed by epoch), from the epoch it was first seen
        self._history: dict[str, tuple[int, list[int]]] = {}
        self._history_len = history
        # Estimated prompt tokens per real one (`calibrate`), and the sums it is their ratio of.
        self._est = 0.0
        self._exact = 0.0
        self.ratio = 1.0
        self._entries: dict[str, deque[float]] = {}
        self._epochs: dict[str, deque[int]] = {}  # the epoch each entry was recorded in (see `tick`)
        self._epoch = 0
        # What a `FleetView` keeps between picks: the records so far and the serial of each backend's
        # last (its entries changed iff that did); what the kept answers hold for (the view, the host,
        # this ledger's epoch, the mates' epochs); per backend its last answer with the rest of what it
        # was computed from, the k-th entry's last age, and a plain sequence of the others' entries as
        # columns.
        self._serial = 0
        self._last: dict[str, int] = {}
        self._kept: tuple[object, object, int, object] = (None, None, -1, None)
        self._memo: dict[str, tuple[int, int, object, object, float, int, float, bool]] = {}
        self._hints: dict[str, tuple[int, int]] = {}
        self._plain: dict[str, Columns] = {}

    @property
    def follows_progress(self) -> bool:
        """Whether the engines' progress bounds the queued prefill (a ledger given `progress`)."""
        return self._progress is not None

    def calibrate(self, estimated: float, exact: int) -> None:
        """A prompt the policy estimated at `estimated` tokens had `exact` (its precise lookup's count):
        `ratio` follows their running ratio (halved sums past 10M tokens, so it tracks the traffic)."""
        if exact <= 0 or estimated <= 0.0:
            return
        self._est += estimated
        self._exact += exact
        if self._exact > 1e7:
            self._est *= 0.5
            self._exact *= 0.5
        self.ratio = self._est / self._exact

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
        progress = self._progress
        if progress is not None:
            bound = self._bounds.get(backend)
            if bound is None:
                bound = self._bounds[backend] = BacklogBound(self._depth)
            bound.append(tokens / self.ratio, progress.get(backend, 0))
            if backend not in self._history:
                self._see(backend, progress.get(backend, 0))
        if isinstance(inflight, SharedInflightTable) and inflight.row is not None:
            inflight.record_queued(backend, tokens, self.ratio)

    def pending(self, backend: str, inflight: Inflight | None, weight: float = 1.0) -> float:
        """Estimated prefill tokens still ahead of a new request on `backend`. With progress, `weight`
        (`routing.affinity.running_weight`) is how much of the newest-k sum above the backlog bound counts
        (the prompts of live requests the events show computed): 1 the sum, 0 the bound."""
        if inflight is None:
            return 0.0
        if isinstance(inflight, SharedInflight):
            if weight >= 1.0:
                return inflight.queued
            total, backlog = inflight.backlog()
            return backlog + weight * (total - backlog)
        entries = self._entries.get(backend)
        got = newest_sum(entries, inflight.requests, inflight.tokens)
        if weight >= 1.0:
            return got
        progress = self._progress
        bound = self._bounds.get(backend) if progress is not None else None
        if bound is not None and progress is not None and entries and got > 0.0:
            known = min(inflight.requests, len(entries))
            backlog = self.ratio * bound.backlog(known, progress.get(backend, 0))
            if backlog > got:
                backlog = got
            if known < inflight.requests:  # the live requests nobody recorded, on top as before
                backlog += got - sum(islice(reversed(entries), known), 0.0)
            got = backlog + weight * (got - backlog)
        return got

    def tick(self) -> None:
        """One peer-load refresh has passed (the unit of the entries' ages; not a clock). With `progress`,
        each backend's count now is where its progress since this epoch starts."""
        self._epoch += 1
        progress = self._progress
        if progress is not None:
            at = self._epoch % self._history_len
            history = self._history
            for backend, count in progress.items():
                seen = history.get(backend)
                if seen is None:
                    self._see(backend, count)
                else:
                    seen[1][at] = count

    def _see(self, backend: str, count: int) -> None:
        """Start a backend's history at `count` (as far back as it goes: no progress before it was seen)."""
        self._history[backend] = (self._epoch, [count] * self._history_len)

    def progress_since(self, backend: str, age: int) -> int:
        """The tokens `backend` has stored since the start of the epoch `age` refreshes ago (0 without
        `progress`; an age beyond the history or before the backend was first seen: since then)."""
        progress = self._progress
        if progress is None or backend not in self._history:
            return 0
        done = progress.get(backend, 0) - self._count_at(backend, age)
        return done if done > 0 else 0

    def _count_at(self, backend: str, age: int) -> int:
        """`backend`'s count at the start of the epoch `age` refreshes ago (a seen backend's)."""
        seen = self._history[backend]
        epoch = self._epoch - age
        oldest = max(seen[0], self._epoch - self._history_len + 1)
        if epoch < oldest:
            epoch = oldest
        return seen[1][epoch % self._history_len]

    def _bound_of(self, backend: str, pairs: list[tuple[int, float]],
                  exact: Sequence[tuple[int, float, int]] = ()) -> float:
        """max over the ages a of the counted entries (age, tokens) of (their tokens of age <= a, in
        engine tokens, + the backend's count at the start of a's epoch): the backlog bound plus the count
        now, in engine tokens. `exact`: a --workers host's own entries (age, engine tokens, the count at
        its send), newest first, ages ascending: each counts from its own send, after the younger entries
        and the host's newer ones of its age (before the other hosts' of its age)."""
        pairs.sort(key=_AGE)
        best = -math.inf
        sent = 0.0
        n = len(pairs)
        per = 1.0 / self.ratio
        i, m = 0, len(exact)
        j = 0
        while i < m or j < n:
            if i < m and (j >= n or exact[i][0] <= pairs[j][0]):
                _a, e, c = exact[i]
                sent += e
                v = sent + c
                if v > best:
                    best = v
                i += 1
                continue
            a, t = pairs[j]
            sent += t * per
            if j + 1 == n or pairs[j + 1][0] != a:
                v = sent + self._count_at(backend, a)
                if v > best:
                    best = v
            j += 1
        return best

    def recent(self, backend: str, n: int) -> tuple[RecentEntry, ...]:
        """The newest `n` entries of `backend`, newest first, as (age in epochs, tokens): what this
        replica publishes for the others' `fleet_pending`."""
        entries = self._entries.get(backend)
        if entries is None or n <= 0:
            return ()
        ages = map(self._epoch.__sub__, islice(reversed(self._epochs[backend]), n))
        return tuple(zip(ages, islice(reversed(entries), n)))

    def fleet_pending(self, backend: str, own: Inflight | None, peer_requests: int, peer_tokens: int,
                      peer_recent: Sequence[RecentEntry], weight: float = 1.0) -> float:
        """The fleet's queued prefill on `backend`, as one process holding every entry would estimate it:
        the newest K entries of this process's own and the other replicas' published ones merged by age
        (ties: this process's first), K = this process's live requests + the others'; live requests
        beyond the entries at the per-request average. `peer_recent`: the others' entries (sorted by age
        here if they are not; a `PeerRecent` as the exchange reads them). A pick reads the same through
        `fleet_view`, which also merges a host's mates and keeps what it computed."""
        live = (own.requests if own is not None else 0) + peer_requests
        if live <= 0:
            return 0.0
        tokens = (own.tokens if own is not None else 0) + peer_tokens
        if isinstance(peer_recent, PeerRecent):
            cols = peer_recent.vector()
        else:
            cols = columns_of([part_of(peer_recent)]) if peer_recent else _NO_COLUMNS
        total, known, best = self._newest(backend, live, [], cols, weight < 1.0)
        return self._with_bound(backend, with_unrecorded(total, known, live, tokens), total, best, weight)

    def _with_bound(self, backend: str, got: float, total: float, best: float, weight: float) -> float:
        """The newest-K estimate `got` (of which `total` the entries'), with progress the backlog bound
        (`best`, `_bound_of`, less the count now, floored at 0) plus `weight` x what the sum counts above
        it, the unrecorded part on top."""
        progress = self._progress
        if progress is None or best == -math.inf or weight >= 1.0:
            return got
        backlog = self.ratio * (best - progress.get(backend, 0))
        if backlog < 0.0:
            backlog = 0.0
        if backlog > total:
            backlog = total
        return backlog + weight * (total - backlog) + (got - total)

    def fleet_view(self, view: Mapping[str, Any], inflight: Mapping[str, Inflight],
                   weight: float = 1.0) -> "FleetView":
        """One pick's reader of the fleet's queued prefill with the peer `view` and this process's
        `inflight` (a --workers worker's shared table: its own row, and its mates' counts and entries
        now); see `FleetView`."""
        host = inflight if isinstance(inflight, SharedInflightTable) and inflight.row is not None else None
        ring = host.ring_state() if host is not None else None
        state = (view, host, self._epoch, ring[1] if ring is not None else None)
        kept = self._kept
        if kept[0] is not view or kept[1] is not host or kept[2] != state[2] or kept[3] != state[3]:
            self._kept = state
            self._memo = {}
            if kept[0] is not view:
                self._plain = {}
        return FleetView(self, view, host, ring[0] if ring is not None else None,
                         host.own if host is not None else inflight.get, weight)

    def _newest(self, backend: str, k: int, mates: Sequence[MateSource],
                cols: Columns, bound: bool = False, host: HostSource | None = None) -> tuple[float, int, float]:
        """The sum of the newest `k` entries of this ledger's, the mates' and the parts' merged by age
        (ties in that order), how many there were (fewer than k if that is all), and with `bound` and
        progress their `_bound_of` (else, or with none counted, -inf). `host`: a --workers worker's host
        (its own entries and its mates' in the order they were sent, `SharedInflightTable.host_source`),
        in place of this ledger's and `mates`."""
        if host is not None:
            return self._newest_host(backend, k, host, cols, bound)
        entries = self._entries.get(backend)
        if entries:
            seqs: list[Sequence[int]] = [self._epochs[backend]]
            nows = [self._epoch]
        else:
            seqs, nows = [], []
        for m in mates:
            seqs.append(m[0])
            nows.append(m[1])
        counts = self._newest_counts(backend, k, seqs, nows, cols)
        total = 0.0
        i = 0
        if entries:
            if counts[0]:
                total += sum(islice(reversed(entries), counts[0]))
            i = 1
        for m in mates:
            total += m[2][counts[i]]
            i += 1
        total += _parts_sum(cols, counts, i)
        if not bound or self._progress is None or backend not in self._history:
            return total, sum(counts), -math.inf
        # Every counted entry as (age, tokens), for the backlog bound.
        pairs: list[tuple[int, float]] = []
        j = 0
        if entries:
            now = self._epoch
            c = counts[0]
            pairs += [(now - e if now > e else 0, t) for e, t in zip(islice(reversed(self._epochs[backend]), c),
                                                                      islice(reversed(entries), c))]
            j = 1
        for m in mates:
            stamps, now, pre = m
            c = counts[j]
            last = len(stamps) - 1
            pairs += [(now - stamps[last - x] if now > stamps[last - x] else 0, pre[x + 1] - pre[x]) for x in range(c)]
            j += 1
        pairs += _parts_pairs(cols, counts, j)
        return total, sum(counts), self._bound_of(backend, pairs) if pairs else -math.inf

    def _newest_counts(self, backend: str, k: int, seqs: list[Sequence[int]], nows: list[int],
                       cols: Columns) -> list[int]:
        """`newest_k`'s counts per source, starting from where the k-th was last, moved by the refreshes
        since (every age has grown by about as many)."""
        hint = self._hints.get(backend)
        counts, age = newest_k(k, seqs, nows, cols, 0 if hint is None else hint[0] + self._epoch - hint[1])
        if age >= 0:
            self._hints[backend] = (age, self._epoch)
        return counts

    def _newest_host(self, backend: str, k: int, host: HostSource, cols: Columns,
                     bound: bool) -> tuple[float, int, float]:
        """`_newest` with the host's entries as one source, before the other hosts' parts on a tie."""
        epochs, now, pre, marks, engine = host
        counts = self._newest_counts(backend, k, [epochs], [now], cols)
        c = counts[0]
        total = pre[c] + _parts_sum(cols, counts, 1)
        if not bound or self._progress is None or backend not in self._history:
            return total, sum(counts), -math.inf
        last = len(epochs) - 1
        exact = [(now - epochs[last - x], engine[x], marks[x]) for x in range(c)]
        return total, sum(counts), self._bound_of(backend, _parts_pairs(cols, counts, 1), exact)

    def discard(self, backend: str) -> None:
        """Forget a backend removed from the fleet."""
        self._entries.pop(backend, None)
        self._epochs.pop(backend, None)
        self._bounds.pop(backend, None)
        self._history.pop(backend, None)
        self._serial += 1
        self._last[backend] = self._serial

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())


class FleetView:
    """One pick's reader of the fleet's queued prefill (`WorkLedger.fleet_view`; `queued` is the
    policy's `pending`): per backend `fleet_pending`, for a --workers worker with its host-mates'
    counts now and their entries merged after its own and before the other hosts' (what round 5's
    `fleet_pending` of the mates' ring entries merged with the view's by age read), and an older
    replica's sum (a row without entries) added. The answer is kept (in the ledger) until one of its
    inputs changes: the live count, a record here or by a mate on that backend, a tick here or of a
    mate, a new view; most picks see none of that for most backends."""

    __slots__ = ("_work", "_view", "_host", "_counts", "_slots", "_rows", "_own_of", "_req", "_tok", "_own_req",
                 "_own_tok", "_asked", "_weight")

    def __init__(self, work: WorkLedger, view: Mapping[str, Any], host: SharedInflightTable | None,
                 counts: list[int] | None, own_of: Callable[[str], Inflight | None], weight: float = 1.0) -> None:
        self._work = work
        self._weight = weight  # `WorkLedger.pending`'s
        self._view = view
        self._host = host
        self._own_of = own_of  # this process's own in-flight work on a backend (a worker: its own row)
        self._counts = counts  # the ring counts per cell, now
        self._asked: dict[str, float] = {}  # one pick asks for a backend's queue up to twice
        if host is not None:
            self._req, self._tok, self._own_req, self._own_tok = host.slot_counts()
            self._slots = host.slot_map
            self._rows = host.layout.rows

    def host_counts(self) -> tuple[list[int], list[int]]:
        """Per slot, every worker's requests and tokens in flight, as this pick read them."""
        return self._req, self._tok

    def queued(self, name: str, _merged: Inflight | None) -> float:
        got = self._asked.get(name)
        if got is not None:
            return got
        work = self._work
        host = self._host
        peer = self._view.get(name)
        if host is not None:
            own = self._own_of(name)
            s = self._slots.get(name)
            if s is None:
                req = tok = 0
                key: object = None
            else:
                req = self._req[s] - self._own_req[s]
                tok = self._tok[s] - self._own_tok[s]
                key = self._counts[s * self._rows:(s + 1) * self._rows]  # type: ignore[index]  # with a host
        else:
            if peer is None or len(peer) < 4:
                got = work.pending(name, self._own_of(name), self._weight)
                if peer is not None:
                    got += peer[2]
                self._asked[name] = got
                return got
            own = self._own_of(name)
            req = tok = 0
            key = None
        recent: Sequence[RecentEntry] = ()
        if peer is not None:
            req += peer[0]
            tok += peer[1]
            if len(peer) > 3:
                recent = peer[3]
        live = req + (own.requests if own is not None else 0)
        if live <= 0:
            got = 0.0
        else:
            serial = work._last.get(name, 0)
            memo = work._memo.get(name)
            bounded = self._weight < 1.0  # (a memo made without the bound does not answer with it)
            if (memo is not None and memo[0] == live and memo[1] == serial and memo[3] is recent
                    and memo[2] == key and (memo[7] or not bounded)):
                total, known, best = memo[4], memo[5], memo[6]
            else:
                if isinstance(recent, PeerRecent):
                    cols = recent.vector()
                elif not recent:
                    cols = _NO_COLUMNS
                else:
                    plain = work._plain.get(name)
                    if plain is None:
                        plain = work._plain[name] = columns_of([part_of(recent)])
                    cols = plain
                # With KV events, a worker's host as one source (its own entries and its mates' in the
                # order they were sent, each with its own progress), the other hosts' parts merged with it
                # by age; without, round 5's: its own, its mates' rings, the parts (not measured to matter
                # there, and the host source costs a pick ~1.9x the CPU).
                if host is not None and key is not None and host.follows_progress:
                    total, known, best = work._newest(name, live, [], cols, bounded, host.host_source(name, live))
                else:
                    mates = host.mate_sources(name)[1] if host is not None and key is not None else []
                    total, known, best = work._newest(name, live, mates, cols, bounded)
                work._memo[name] = (live, serial, key, recent, total, known, best, bounded)
            got = work._with_bound(name, with_unrecorded(total, known, live, (own.tokens if own is not None else 0) + tok),
                                   total, best, self._weight)
        if peer is not None and len(peer) == 3:  # an older replica's row: its sum only
            got += peer[2]
        self._asked[name] = got
        return got
