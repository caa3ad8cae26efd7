"""The proxy's own in-flight accounting, shared by every data plane of one process (and, with
`--workers N`, by every worker of one host).

It is the one piece of shared mutable state in the data path (see ARCHITECTURE.md): the HTTP and gRPC
listeners both count into the same table, so a policy like least-request sees all the work this process
has sent to a backend, whatever protocol carried it. It is a plain `dict[str, Inflight]` subclass because
policies read it on every request (`Mapping[str, Inflight]` is all they need) and a dict lookup is the
cheapest thing Python has.

`SharedInflightTable` is the same mapping over a buffer that several processes map (the supervisor of
`--workers N` creates it, proxy/multiproc/shared_load.py): one row per worker, one fixed slot per backend
name. Each worker writes only its own row and readers sum the rows, so no two processes ever write the
same word and no lock or atomic is needed. Aligned 8-byte loads and stores are single instructions on the
64-bit platforms Python runs the proxy on, so a reader sees each cell either before or after a write,
never torn; a sum over the rows may be one update old, like any counter read concurrently. What each row
holds per backend: the worker's requests and tokens in flight, and its share of the queued uncached
prefill (the work ledger's estimate for that worker's live requests, see proxy/core/work_ledger.py), and
with the engines' KV events the progress its own index has seen since the oldest of those (the
ledger's "Progress") and its index's count now; its newest `recent` ledger entries in a ring (uncached
tokens, stamped with the worker's refresh epoch, its count at the send and the entry's place among every
worker's sends to the backend), with the worker's current epoch. A worker reads the host's queued
prefill from the rings, the newest K of every worker's entries as one process holding them all would
(`SharedInflightTable.host_estimate`); with routing.peer_load it reads its host-mates' entries and counts
from here, both of one moment, rather than as they last published them to Redis (`mates`,
`mates_recent`; proxy/core/affinity.py `_with_peers`). This module only interprets a buffer; it creates
no shared memory itself.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import add
from typing import Mapping, cast

from proxy.core.decision import Inflight
from proxy.core.host_rings import HostRings, HostSource, with_unrecorded


class InflightTable(dict[str, Inflight]):
    """Backend name -> Inflight, plus the process-wide total (for `limits.max_inflight_total`)."""

    def __init__(self) -> None:
        super().__init__()
        self.total_requests = 0

    def acquire(self, backend: str, tokens: int) -> None:
        entry = self.get(backend)
        if entry is None:
            entry = self[backend] = Inflight()
        entry.requests += 1
        entry.tokens += tokens
        self.total_requests += 1

    def release(self, backend: str, tokens: int) -> None:
        entry = self[backend]
        entry.requests -= 1
        entry.tokens -= tokens
        self.total_requests -= 1

    def requests(self, backend: str) -> int:
        entry = self.get(backend)
        return 0 if entry is None else entry.requests


def _floats(view: memoryview[float]) -> list[float]:
    """A float64 view's values (typeshed types every `tolist()` as ints; compiled code checks the type)."""
    return cast("list[float]", view.tolist())


def newest_sum(entries: deque[float] | None, live: int, tokens: int) -> float:
    """The work ledger's estimate of the prefill still queued on a backend with `live` requests (`tokens`
    estimated tokens) in flight: the newest `live` recorded uncached-token entries (engines finish
    prefills in arrival order), and live requests beyond the records at the per-request average."""
    if live <= 0:
        return 0.0
    known = 0 if entries is None else min(live, len(entries))
    if not known or entries is None:
        return with_unrecorded(0.0, 0, live, tokens)
    # A float sum (start 0.0), whatever the entries hold: compiled code (proxy/native) keeps `total` a double.
    total = sum(islice(reversed(entries), known), 0.0)
    return with_unrecorded(total, known, live, tokens)


class BacklogBound:
    """The work ledger's backlog bound for one backend (work_ledger "Progress"): over its newest k entries,
    the most that the tokens sent from an entry on exceed the progress made since that entry's record,
    max over j of (sent since j - done since j), floored at 0. With `mark_j` the backend's progress count
    at entry j's record and `cum_j` the tokens of every entry before j, that is max(mark_j - cum_j) + cum
    - now: a monotonic stack of (index, mark_j - cum_j) keeps the maximum of every window of newest
    entries, so an append is O(1) amortised and a read a bisection. Of the last `depth` entries."""

    __slots__ = ("_idx", "_val", "_head", "_n", "_cum", "_depth")

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._idx: list[int] = []  # entry indices, ascending, from _head on
        self._val: list[float] = []  # their mark_j - cum_j, descending
        self._head = 0
        self._n = 0
        self._cum = 0.0

    def append(self, tokens: float, mark: int) -> None:
        v = mark - self._cum
        idx, val, head = self._idx, self._val, self._head
        while len(val) > head and val[-1] <= v:
            idx.pop()
            val.pop()
        idx.append(self._n)
        val.append(v)
        self._n += 1
        self._cum += tokens
        lo = self._n - self._depth
        while head < len(idx) and idx[head] < lo:
            head += 1
        if head > 32 and 2 * head > len(idx):
            del idx[:head]
            del val[:head]
            head = 0
        self._head = head

    def backlog(self, k: int, now: int) -> float:
        """The bound over the newest `k` entries with the backend's count at `now` (0.0 with none)."""
        if k <= 0:
            return 0.0
        idx = self._idx
        i = bisect_left(idx, self._n - k, self._head)
        if i >= len(idx):
            return 0.0
        b = self._val[i] + self._cum - now
        return b if b > 0.0 else 0.0


class RecentWork:
    """The newest `depth` uncached-token records of one backend, with the sum of the newest k in O(1)
    (a ring of running totals), so that a worker republishes its queued prefill on every acquire and
    release for the price of two list reads. Same estimate as `newest_sum` over a deque of `depth`."""

    __slots__ = ("_cum", "_n", "_size", "_marks", "bound")

    def __init__(self, depth: int) -> None:
        self._size = depth + 1
        self._cum = [0.0] * self._size
        self._n = 0
        self._marks = [0] * self._size  # each entry's `mark` (by its index)
        self.bound = BacklogBound(depth)

    def append(self, tokens: float, mark: int = 0, engine_tokens: float = 0.0) -> None:
        """Record an entry; `mark`: the backend's progress count when it was recorded (see `progress`),
        `engine_tokens` its tokens in the engine's count (for `bound`)."""
        cum, n, size = self._cum, self._n, self._size
        cum[(n + 1) % size] = cum[n % size] + tokens
        self._marks[n % size] = mark
        self._n = n + 1
        self.bound.append(engine_tokens, mark)

    def progress(self, live: int, now: int) -> int:
        """The progress since the oldest entry `estimate` counts with `live` requests: `now` (the backend's
        count) less that entry's mark; 0 when it counts none."""
        known = min(live, self._n, self._size - 1)
        if known <= 0:
            return 0
        done = now - self._marks[(self._n - known) % self._size]
        return done if done > 0 else 0

    def estimate(self, live: int, tokens: int) -> float:
        if live <= 0:
            return 0.0
        n, size = self._n, self._size
        known = min(live, n, size - 1)
        total = self._cum[n % size] - self._cum[(n - known) % size]
        if live > known:
            return with_unrecorded(total, known, live, tokens)
        return total


# One host-mate's ring of one backend as a pick reads it (`SharedInflightTable.mate_sources`): its entries'
# epochs oldest first, its epoch now (an entry's age: max(0, now - its epoch)), and the prefix sums of its
# tokens newest first (pre[0] = 0.0, pre[c] the sum of its newest c).
MateSource = tuple[list[int], int, list[float]]


# The ledger entries of each worker a host-mate can read (the fleet's newest K rarely needs more of one
# process's; the same bound as a published row's, proxy/control/peer_load.py PEER_RECENT_MAX).
RECENT_RING = 64


@dataclass(frozen=True)
class SharedLayout:
    """Where each cell lives in the shared buffer: `rows` workers x `slots` backends.

    int64 cells: requests[slot][row], tokens[slot][row], total_requests[row]; then float64 cells:
    queued[slot][row], progress[slot][row] (the prefill its index saw the engine do since the oldest
    entry its queued counts), bound[slot][row] (its own entries' backlog bound, `BacklogBound`). A
    backend's rows are adjacent, so a read sums one short contiguous run. Then the
    ledger rings (`recent` entries per worker and backend): int64 epoch[row] (each worker's refresh
    count), appended[slot][row] (entries ever appended to the ring), stamp[slot][row][recent] (the epoch
    of each entry), mark[slot][row][recent] (the backend's progress count in that worker's index when
    the entry was recorded), seq[slot][row][recent] (the entry's place among every worker's sends to
    the backend: one more than the newest of any worker's when it was recorded), count[slot][row] (the
    worker's progress count as it last published it); float64 tokens[slot][row][recent] (the policy's
    estimate), engine[slot][row][recent] (the same in engine tokens): what a worker reads the host's
    newest K entries from (`SharedInflightTable.host_estimate`).
    """

    rows: int
    slots: int
    recent: int = RECENT_RING

    def __post_init__(self) -> None:
        if self.rows < 1 or self.slots < 1 or self.recent < 1:
            raise ValueError(f"a shared in-flight layout needs rows, slots and recent >= 1, got {self}")

    @property
    def int_cells(self) -> int:
        return 2 * self.slots * self.rows + self.rows

    @property
    def _base(self) -> int:
        return 8 * (self.int_cells + 3 * self.slots * self.rows)

    @property
    def ring_int_cells(self) -> int:
        return self.rows + self.slots * self.rows * (2 + 3 * self.recent)

    # Where each array of the rings starts, in `ring_views`' int64 cells (the `_at`s) and float64 cells.
    @property
    def stamps_at(self) -> int:
        return self.rows + self.slots * self.rows

    @property
    def marks_at(self) -> int:
        return self.stamps_at + self.slots * self.rows * self.recent

    @property
    def seqs_at(self) -> int:
        return self.marks_at + self.slots * self.rows * self.recent

    @property
    def counts_at(self) -> int:
        return self.seqs_at + self.slots * self.rows * self.recent

    @property
    def engine_at(self) -> int:
        return self.slots * self.rows * self.recent

    @property
    def size(self) -> int:
        """Bytes the buffer must have."""
        return self._base + 8 * (self.ring_int_cells + 2 * self.slots * self.rows * self.recent)

    def views(self, buf: memoryview) -> tuple[memoryview[int], memoryview[float]]:
        """The int64 and float64 cells of `buf` (in-flight work; queued prefill and its progress)."""
        if len(buf) < self.size:
            raise ValueError(f"shared in-flight buffer has {len(buf)} bytes, the layout needs {self.size}")
        split = 8 * self.int_cells
        return buf[:split].cast("q"), buf[split:self._base].cast("d")

    def ring_views(self, buf: memoryview) -> tuple[memoryview[int], memoryview[float]]:
        """The ledger rings' int64 cells (epochs, appended, stamps, marks, counts) and float64 cells
        (tokens, engine tokens) of `buf`."""
        if len(buf) < self.size:
            raise ValueError(f"shared in-flight buffer has {len(buf)} bytes, the layout needs {self.size}")
        split = self._base + 8 * self.ring_int_cells
        return buf[self._base:split].cast("q"), buf[split:self.size].cast("d")


class SharedInflight(Inflight):
    """One backend's in-flight work summed over every worker's row: what a policy reads.

    Read-only: the owning `SharedInflightTable` writes its own row; `requests`, `tokens` and `queued` are
    computed from the shared cells at each read. `host`: the owner's reader of the host's rings, for a
    worker that follows the engines' progress (`SharedInflightTable.host_estimate` of `name`)."""

    __slots__ = ("_ints", "_floats", "_req", "_tok", "_end", "_qend", "_q", "_p", "_pend", "_b", "_bend",
                 "_host", "_name", "slot")

    def __init__(self, ints: memoryview[int], floats: memoryview[float], layout: SharedLayout, slot: int,
                 host: HostRings | None = None, name: str = "") -> None:
        rows = layout.rows
        self._ints = ints
        self._floats = floats
        self.slot = slot
        self._req = slot * rows
        self._end = self._req + rows
        self._tok = layout.slots * rows + slot * rows
        self._q = slot * rows
        self._qend = self._q + rows
        self._p = layout.slots * rows + slot * rows
        self._pend = self._p + rows
        self._b = self._p + layout.slots * rows
        self._bend = self._b + rows
        self._host = host
        self._name = name

    @property
    def requests(self) -> int:  # type: ignore[override]  # a computed, read-only view of the dataclass field
        return sum(self._ints[self._req:self._end])

    @property
    def tokens(self) -> int:  # type: ignore[override]  # a computed, read-only view of the dataclass field
        start = self._tok
        return sum(self._ints[start:start + self._end - self._req])

    @property
    def queued(self) -> float:
        """Estimated uncached prefill tokens queued on the backend, over every worker: a worker that
        follows the engines' progress reads the host's newest K entries (K: every worker's live requests
        there), as one process holding them all would (`host`, `SharedInflightTable.host_estimate`);
        without KV events (and in the supervisor's view) the sum of each worker's own newest k. (Round 15
        measured the newest K there too: within the noise of a host whose workers each learn only what
        they routed, -1% to +4% TTFT mean, for 2.7x the CPU of a pick.)"""
        if self._host is not None:
            return self._host.estimate(self._name, self.slot)[0]
        return sum(self._floats[self._q:self._qend])

    def backlog(self) -> tuple[float, float]:
        """`queued`, and with progress published (the work ledger's "Progress") the host's backlog bound
        (without: `queued` again). A worker's read (`host`) takes both over the host's newest K entries,
        as one process holding them all would (`SharedInflightTable.host_estimate`). The supervisor's
        view, which has no index, reads the parts each worker published as of its last send or
        completion there: the sum less the largest progress (the progress since the oldest entry counted
        over all of them), or the largest worker's own bound, floored at 0. (Round 14's worker read those
        too: the sum of each worker's newest k, and a bound that left out the others' sends after a
        worker's entry. A --workers 2 host without routing.peer_load lost 10% TTFT mean to one process on
        the busiest Mooncake load: loadtest/results/scaleout.md, Round 15.)"""
        if self._host is not None:
            return self._host.estimate(self._name, self.slot)
        total: float = sum(self._floats[self._q:self._qend])
        if total <= 0.0:
            return total, total
        floats = self._floats
        got = total - max(floats[self._p:self._pend])
        bound = max(floats[self._b:self._bend])
        if bound > got:
            got = bound
        return total, got if got > 0.0 else 0.0


class SharedInflightTable(InflightTable):
    """The in-flight table of one worker (`row`) of several sharing a buffer, or with `row=None` a
    read-only view of all of them (the supervisor's: admin API, drains, metrics).

    The mapping holds a `SharedInflight` for every backend that has a slot (`assign`, from the
    supervisor), so `get`, `[]` and iteration are plain dict operations; their values sum every row.
    `acquire`/`release` write the worker's own row. A backend without a slot (only when the supervisor ran
    out of slots) is counted in this worker alone, like a single process.

    The work ledger's part: `record_queued` keeps this worker's uncached-token estimates per backend and
    publishes, after every change, the estimate for this worker's own live requests into its row, so the
    policy of every worker reads the whole host's queued prefill from `SharedInflight.queued`.
    """

    def __init__(self, buf: memoryview, layout: SharedLayout, row: int | None, ledger_depth: int = 1024) -> None:
        dict.__init__(self)
        if row is not None and not 0 <= row < layout.rows:
            raise ValueError(f"row {row} outside the layout's {layout.rows} rows")
        self.layout = layout
        self.row = row
        self._ints, self._floats = layout.views(buf)
        self._total_at = 2 * layout.slots * layout.rows
        self._tok_off = layout.slots * layout.rows  # tokens[slot][row] - requests[slot][row]
        self._total_cell = self._total_at + (row if row is not None else 0)
        self._slots: dict[str, int] = {}
        # This worker's own requests per backend: name -> (its requests cell (slot * rows + row), or -1
        # when the backend has no slot; own Inflight). A backend's cell is fixed for as long as this worker
        # has requests on it, so every release writes the very cell its acquire wrote, even across a slot
        # map change.
        self._own: dict[str, tuple[int, Inflight]] = {}
        self._local_total = 0
        self._ledger_depth = ledger_depth
        self._ledger: dict[str, RecentWork] = {}
        self._progress: Mapping[str, int] | None = None  # see `follow_progress`
        self._ratio = 1.0  # the ledger's estimated tokens per engine token, as of its last record
        self._p_off = layout.slots * layout.rows  # progress[slot][row] - queued[slot][row], bound - progress
        # The ledger rings (see SharedLayout): this worker's refresh epoch (`tick`) and where its rows start.
        self._rints, self._rfloats = layout.ring_views(buf)
        self._epoch = 0
        self._stamps_at, self._marks_at, self._seqs_at = layout.stamps_at, layout.marks_at, layout.seqs_at
        self._count_at, self._engine_at = layout.counts_at, layout.engine_at
        # The host's rings as one process's entries (`host_estimate`, `host_source`), compiled.
        self._host = HostRings(self._ints, self._rints, self._rfloats, layout.rows, layout.recent,
                               row if row is not None else 0, self._tok_off, self._stamps_at, self._marks_at,
                               self._seqs_at, self._count_at, self._engine_at)
        # cell -> ((its count, its worker's epoch, entries asked, newest stamp and tokens), the entries read):
        # `_ring`'s last answer.
        self._ring_cache: dict[int, tuple[tuple[int, int, int, int, float], list[tuple[int, float]]]] = {}
        # cell -> ((its count, its worker's epoch, newest stamp and tokens), the ring as a MateSource)
        self._source_cache: dict[int, tuple[tuple[int, int, int, float], MateSource]] = {}

    # -- reading

    @property  # summed over the rows, not an attribute
    def total_requests(self) -> int:
        at = self._total_at
        return sum(self._ints[at:at + self.layout.rows]) + self._local_total

    @total_requests.setter
    def total_requests(self, value: int) -> None:
        raise AttributeError("a shared in-flight table's total is the sum of its rows")

    def slots(self) -> dict[str, int]:
        return dict(self._slots)

    # -- the supervisor's slot map

    def assign(self, slots: Mapping[str, int]) -> None:
        """Follow the supervisor's backend name -> slot map (it changes with the backend set)."""
        for name in [n for n in self._slots if n not in slots]:
            del self._slots[name]
            if name not in self._own:
                self.pop(name, None)
                self._ledger.pop(name, None)
        for name, slot in slots.items():
            if not 0 <= slot < self.layout.slots:
                raise ValueError(f"slot {slot} of {name!r} outside the layout's {self.layout.slots} slots")
            if self._slots.get(name) == slot and name in self:
                continue
            if self.row is not None and self._slots.get(name) != slot:
                # A slot new to this name: its ring in this worker's row may hold another backend's entries.
                self._rints[self.layout.rows + slot * self.layout.rows + self.row] = 0
                self._ring_cache.clear()
                self._source_cache.clear()
                self._host.forget()
            self._slots[name] = slot
            held = self._own.get(name)
            if held is None or held[0] == slot * self.layout.rows + (self.row or 0):
                self[name] = self._shared(name, slot)

    def follow_progress(self, progress: Mapping[str, int]) -> None:
        """Publish, next to this worker's queued prefill, the progress since its oldest counted entry as
        `progress` (this worker's `KVIndex.progress`, made after the table) counts it; its reads of the
        host's queued prefill publish its own first."""
        if self.row is None:
            raise RuntimeError("the supervisor's view of the shared in-flight table is read-only")
        self._progress = progress
        self._host.progress = progress
        for name, value in list(self.items()):
            if type(value) is SharedInflight:
                self[name] = self._shared(name, value.slot)

    def _shared(self, name: str, slot: int) -> SharedInflight:
        host = self._host if self._progress is not None else None
        return SharedInflight(self._ints, self._floats, self.layout, slot, host, name)

    # -- this worker's row

    def _writable_row(self) -> int:
        if self.row is None:
            raise RuntimeError("the supervisor's view of the shared in-flight table is read-only")
        return self.row

    def _hold(self, backend: str) -> tuple[int, Inflight]:
        row = self._writable_row()
        slot = self._slots.get(backend, -1)
        own = Inflight()
        if slot < 0 and backend not in self:
            self[backend] = own
        held = self._own[backend] = (slot * self.layout.rows + row if slot >= 0 else -1, own)
        return held

    def acquire(self, backend: str, tokens: int) -> None:
        held = self._own.get(backend)
        if held is None:
            held = self._hold(backend)
        i, own = held
        own.requests += 1
        own.tokens += tokens
        if i < 0:
            self._local_total += 1
            return
        ints = self._ints
        ints[i] = own.requests
        ints[i + self._tok_off] = own.tokens
        ints[self._total_cell] += 1
        recent = self._ledger.get(backend)
        if recent is not None:
            self._publish(backend, i, recent, own)

    def release(self, backend: str, tokens: int) -> None:
        held = self._own[backend]
        i, own = held
        own.requests -= 1
        own.tokens -= tokens
        if i < 0:
            self._local_total -= 1
        else:
            ints = self._ints
            ints[i] = own.requests
            ints[i + self._tok_off] = own.tokens
            ints[self._total_cell] -= 1
            recent = self._ledger.get(backend)
            if recent is not None:
                self._publish(backend, i, recent, own)
        if own.requests <= 0:
            self._unhold(backend, i)

    def _unhold(self, backend: str, cell: int) -> None:
        del self._own[backend]
        slot = self._slots.get(backend)
        if slot is None:  # removed from the fleet while this worker still had work on it
            self.pop(backend, None)
            self._ledger.pop(backend, None)
        elif cell < 0 or cell != slot * self.layout.rows + (self.row or 0):
            self[backend] = self._shared(backend, slot)

    def record_queued(self, backend: str, tokens: float, ratio: float = 1.0) -> None:
        """The work ledger's `record` for this worker: the estimated uncached prompt tokens of a request
        just routed to `backend` (its acquire follows); `ratio`: the ledger's estimated tokens per engine
        token (what its progress, in engine tokens, is converted with)."""
        self._ratio = ratio
        self._host.ratio = ratio
        recent = self._ledger.get(backend)
        if recent is None:
            recent = self._ledger[backend] = RecentWork(self._ledger_depth)
        progress = self._progress
        mark = progress.get(backend, 0) if progress is not None else 0
        recent.append(tokens, mark, tokens / ratio)
        held = self._own.get(backend)
        if held is not None and held[0] >= 0:
            self._publish(backend, held[0], recent, held[1])
        slot = self._slots.get(backend)
        if slot is not None and self.row is not None:  # the ring the host-mates read (`mates_recent`)
            rows, depth = self.layout.rows, self.layout.recent
            cell = slot * rows + self.row
            rints = self._rints
            n = rints[rows + cell]
            at = cell * depth + n % depth
            rints[self._stamps_at + at] = self._epoch
            rints[self._marks_at + at] = mark
            rints[self._seqs_at + at] = self._host.next_seq(slot)
            self._rfloats[at] = tokens
            self._rfloats[self._engine_at + at] = tokens / ratio
            rints[rows + cell] = n + 1  # last: a reader that sees the count sees the entry

    def _publish(self, backend: str, cell: int, recent: RecentWork, own: Inflight) -> None:
        """This worker's part of a backend's queued prefill (and with `progress` the progress since the
        oldest entry it counts) into its cell."""
        self._floats[cell] = recent.estimate(own.requests, own.tokens)
        progress = self._progress
        if progress is not None:
            self._publish_progress_of(cell, recent, own.requests, progress.get(backend, 0))

    def _publish_progress_of(self, cell: int, recent: RecentWork, live: int, now: int) -> None:
        off, ratio = self._p_off, self._ratio
        self._floats[cell + off] = ratio * recent.progress(live, now)
        self._floats[cell + 2 * off] = ratio * recent.bound.backlog(min(live, self._ledger_depth), now)
        self._rints[self._count_at + cell] = now

    @property
    def follows_progress(self) -> bool:
        """Whether this worker follows the engines' progress (`follow_progress`: KV events on)."""
        return self._progress is not None

    def publish_count(self, backend: str) -> None:
        """The engine's count on `backend` in this worker's index, now, into its row (what a host-mate's
        `host_estimate` measures this worker's entries' progress with): called after every batch of the
        backend's events this worker applies (`KVEventSubscriber.on_progress`), so a mate's read is never
        older than the events; its sends and completions there publish it too."""
        progress = self._progress
        slot = self._slots.get(backend)
        if progress is None or slot is None or self.row is None:
            return
        self._rints[self._count_at + slot * self.layout.rows + self.row] = progress.get(backend, 0)

    def host_estimate(self, backend: str, slot: int) -> tuple[float, float]:
        """The host's queued prefill on `backend` (its `slot`) and its backlog bound, as one process
        holding every worker's entries reads them (`WorkLedger.pending` with the engines' progress):
        K = every worker's live requests there; the newest K entries of all the workers' rings by seq,
        their sum, live requests beyond them at the in-flight average; the bound, max over those entries
        j of (the engine tokens sent from j on, less the progress since j), times this worker's ratio, at
        most the sum, plus what the sum counts beyond the entries. An entry's progress is its own
        worker's count now less its mark (a difference within one index: the workers' counts need not
        agree; each publishes its count after every batch of events, `publish_count`). A worker's ring
        keeps its newest `layout.recent` entries of a backend: older ones count at the average. The
        answer is kept until a worker's live requests, entries or tokens there change; a count moving
        alone shifts that worker's part of the bound. For a worker following the engines' progress."""
        if self._progress is None or self.row is None:
            raise RuntimeError("the host's estimate is read by a worker that follows the engines' progress")
        return self._host.estimate(backend, slot)

    def tick(self) -> None:
        """One peer-load refresh has passed (`peer_load.own_load`, with the work ledger's): the epoch the
        ring's entries are stamped with, published for the host-mates' ages."""
        self._epoch += 1
        if self.row is not None:
            self._rints[self.row] = self._epoch

    def mates(self, backend: str) -> tuple[int, int]:
        """The other workers' requests and tokens in flight on `backend`, now (its slot's other rows)."""
        slot = self._slots.get(backend)
        if slot is None or self.row is None:
            return 0, 0
        rows = self.layout.rows
        a = slot * rows
        b = a + self._tok_off
        ints = self._ints
        return (sum(ints[a:a + rows]) - ints[a + self.row], sum(ints[b:b + rows]) - ints[b + self.row])

    def mates_recent(self, backend: str, n: int) -> list[tuple[int, float]]:
        """The other workers' newest ledger entries on `backend`, now, as (age in their refresh epochs,
        tokens), newest first over all of them (at most `n`, and `layout.recent` of each): with their
        counts from `mates`, one moment's view of the host-mates (a published row's entries and counts
        are as old as each other too: counts newer than entries were measured to hurt, scaleout.md 4b)."""
        slot = self._slots.get(backend)
        if slot is None or self.row is None or n <= 0:
            return []
        rows = self.layout.rows
        parts = [self._ring(slot * rows + r, r, n) for r in range(rows) if r != self.row]
        if len(parts) == 1:
            return parts[0]
        return list(islice(heapq.merge(*parts, key=lambda e: e[0]), n))

    def _ring(self, cell: int, row: int, n: int) -> list[tuple[int, float]]:
        """One worker's newest `n` entries on a slot (`cell`), newest first, as (age, tokens); the list is
        shared with later answers (read-only)."""
        rints, depth = self._rints, self.layout.recent
        count = rints[self.layout.rows + cell]
        k = min(n, count, depth)
        if k <= 0:
            return []
        now = rints[row]
        # A mate's entries change only when it records a request there or ticks: read them again only then
        # (the newest entry in the key too: a restarted worker's row counts from 0 again).
        base = cell * depth
        last = (count - 1) % depth
        key = (count, now, k, rints[self._stamps_at + base + last], self._rfloats[base + last])
        cached = self._ring_cache.get(cell)
        if cached is not None and cached[0] == key:
            return cached[1]
        stamps = rints[self._stamps_at + base:self._stamps_at + base + depth].tolist()
        toks = _floats(self._rfloats[base:base + depth])
        end = count % depth  # the ring's oldest slot once full; newest first: end-1 .. 0, then depth-1 .. end
        stamps = (stamps[:end][::-1] + stamps[end:][::-1])[:k]
        toks = (toks[:end][::-1] + toks[end:][::-1])[:k]
        got: list[tuple[int, float]] = [(now - e if now > e else 0, t) for e, t in zip(stamps, toks)]
        self._ring_cache[cell] = (key, got)
        return got

    @property
    def slot_map(self) -> Mapping[str, int]:
        """Backend name -> slot, as last assigned (the table's own dict: read it, do not change it)."""
        return self._slots

    def slot_counts(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per slot, now: every worker's requests and tokens in flight summed, and this worker's own
        (its row; zeros for the supervisor's view). Two reads of the block for every backend at once,
        where `SharedInflight.requests`/`.tokens` and `mates` read one backend each."""
        rows, slots = self.layout.rows, self.layout.slots
        n = rows * slots
        req = self._ints[0:n].tolist()
        tok = self._ints[n:2 * n].tolist()
        if rows == 1:
            host_req, host_tok = req, tok
        elif rows == 2:
            host_req = list(map(add, req[0::2], req[1::2]))
            host_tok = list(map(add, tok[0::2], tok[1::2]))
        else:
            host_req = list(map(sum, zip(*[req[r::rows] for r in range(rows)])))
            host_tok = list(map(sum, zip(*[tok[r::rows] for r in range(rows)])))
        if self.row is None:
            return host_req, host_tok, [0] * slots, [0] * slots
        return host_req, host_tok, req[self.row::rows], tok[self.row::rows]

    def ring_state(self) -> tuple[list[int], list[int]]:
        """Every ring's count (per cell: slot x rows + row) and every worker's epoch, now: two reads of
        the block. A worker's entries on a backend have changed since a pick iff its count there or its
        epoch has (a mate restarting from zero both: within a refresh it cannot reach them again)."""
        rows = self.layout.rows
        return self._rints[rows:rows + rows * self.layout.slots].tolist(), self._rints[0:rows].tolist()

    def host_source(self, backend: str, k: int) -> HostSource | None:
        """Every worker's newest `k` entries of `backend` (a pick takes no more) as one source in the
        order they were sent (see `HostSource`): what a pick with peer load merges with the other hosts'
        by age, the host's own in their exact order and with their exact progress (`WorkLedger._newest`).
        None without a slot. The entries are read and ordered again only when a worker's ring there
        changed; their ages and counts follow the workers' epochs and counts at each call."""
        slot = self._slots.get(backend)
        if self._progress is None:
            raise RuntimeError("the host source is read by a worker that follows the engines' progress")
        if slot is None or self.row is None:
            return None
        return self._host.source(backend, slot, k)

    def mate_sources(self, backend: str) -> tuple[tuple[tuple[int, int, int, float], ...], list[MateSource]]:
        """The other workers' rings of `backend`, now, each as a MateSource (in row order; the same
        entries and ages as `mates_recent`, which merges them), and a key that changes whenever any of
        them does (a record or a tick of that mate: its count, epoch and newest entry), so that a pick
        can keep what it computed from them until then. Each ring is re-read only when it changed."""
        slot = self._slots.get(backend)
        if slot is None or self.row is None:
            return (), []
        rows, depth = self.layout.rows, self.layout.recent
        rints, rfloats = self._rints, self._rfloats
        keys: list[tuple[int, int, int, float]] = []
        out: list[MateSource] = []
        for r in range(rows):
            if r == self.row:
                continue
            cell = slot * rows + r
            count = rints[rows + cell]
            if count <= 0:
                continue
            base = cell * depth
            last = (count - 1) % depth
            now = rints[r]
            key = (count, now, rints[self._stamps_at + base + last], rfloats[base + last])
            keys.append(key)
            cached = self._source_cache.get(cell)
            if cached is not None and cached[0][0] == count and cached[0][2:] == key[2:]:
                # Its entries are the same (a tick moves only their ages: its epoch now).
                src = cached[1]
                out.append(src if src[1] == now else (src[0], now, src[2]))
                continue
            k = min(count, depth)
            stamps = rints[self._stamps_at + base:self._stamps_at + base + depth].tolist()
            toks = _floats(rfloats[base:base + depth])
            end = count % depth
            if count > depth:  # the oldest entry at `end`: oldest first, end .. depth-1, then 0 .. end-1
                stamps = stamps[end:] + stamps[:end]
                toks = toks[end:] + toks[:end]
            else:
                stamps, toks = stamps[:k], toks[:k]
            source: MateSource = (stamps, now, list(accumulate(reversed(toks), initial=0.0)))
            self._source_cache[cell] = (key, source)
            out.append(source)
        return tuple(keys), out

    def own(self, backend: str) -> Inflight | None:
        """This worker's own requests and tokens in flight on `backend` (its row only; None if none): what
        it publishes as its own part of the host's load (proxy/control/peer_load.py `own_load`)."""
        held = self._own.get(backend)
        return None if held is None else held[1]

    def queued_local(self, backend: str) -> float:
        """The queued prefill of a backend counted in this worker only (no slot): the ledger's estimate."""
        held = self._own.get(backend)
        recent = self._ledger.get(backend)
        if held is None or recent is None:
            return 0.0
        return recent.estimate(held[1].requests, held[1].tokens)


def clear_row(buf: memoryview, layout: SharedLayout, row: int) -> None:
    """Zero one worker's row (it died: its requests died with it)."""
    ints, floats = layout.views(buf)
    rows = layout.rows
    for slot in range(layout.slots):
        i = slot * rows + row
        ints[i] = 0
        ints[layout.slots * rows + i] = 0
        floats[i] = 0.0
        floats[layout.slots * rows + i] = 0.0
        floats[2 * layout.slots * rows + i] = 0.0
    ints[2 * layout.slots * rows + row] = 0
    rints, _ = layout.ring_views(buf)
    rints[row] = 0
    for slot in range(layout.slots):
        rints[rows + slot * rows + row] = 0
        rints[layout.counts_at + slot * rows + row] = 0


def slot_is_idle(buf: memoryview, layout: SharedLayout, slot: int) -> bool:
    """No worker has anything in flight or queued in `slot` (it may be given to another backend)."""
    ints, floats = layout.views(buf)
    rows = layout.rows
    a = slot * rows
    b = layout.slots * rows + a
    return not any(ints[a:a + rows]) and not any(ints[b:b + rows]) and not any(floats[a:a + rows])
