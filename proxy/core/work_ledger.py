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
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from operator import itemgetter
from typing import Mapping, Sequence

from proxy.core.decision import Inflight
from proxy.core.inflight import SharedInflight, SharedInflightTable, newest_sum, with_unrecorded

# One published entry of another replica: (age in its refresh epochs, estimated uncached prompt tokens).
RecentEntry = tuple[int, float]
_AGE = itemgetter(0)


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

    __slots__ = ("_depth", "_entries", "_epochs", "_epoch")

    def __init__(self, depth: int = 1024) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._depth = depth
        self._entries: dict[str, deque[float]] = {}
        self._epochs: dict[str, deque[int]] = {}  # the epoch each entry was recorded in (see `tick`)
        self._epoch = 0

    def record(self, backend: str, tokens: float, inflight: Mapping[str, Inflight] | None = None) -> None:
        """Remember a request routed to `backend`; `inflight` is the mapping the policy picked with (a
        shared one learns the estimate too)."""
        entries = self._entries.get(backend)
        if entries is None:
            entries = self._entries[backend] = deque(maxlen=self._depth)
            self._epochs[backend] = deque(maxlen=self._depth)
        entries.append(tokens)
        self._epochs[backend].append(self._epoch)
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
        now = self._epoch
        return tuple((now - e, t) for t, e in zip(islice(reversed(entries), n), reversed(self._epochs[backend])))

    def fleet_pending(self, backend: str, own: Inflight | None, peer_requests: int, peer_tokens: int,
                      peer_recent: Sequence[RecentEntry]) -> float:
        """The fleet's queued prefill on `backend`, as one process holding every entry would estimate it:
        the newest K entries of this process's own and the other replicas' published ones merged by age
        (ties: this process's first), K = this process's live requests + the others'; live requests
        beyond the entries at the per-request average. `peer_recent`: the others' entries, best sorted by
        age (`peer_load.merge_rows` does; otherwise they are sorted here)."""
        live = (own.requests if own is not None else 0) + peer_requests
        if live <= 0:
            return 0.0
        tokens = (own.tokens if own is not None else 0) + peer_tokens
        if any(peer_recent[k][0] > peer_recent[k + 1][0] for k in range(len(peer_recent) - 1)):
            peer_recent = sorted(peer_recent, key=lambda e: e[0])
        entries = self._entries.get(backend)
        mine = zip(reversed(entries), reversed(self._epochs[backend])) if entries is not None else iter(())
        now = self._epoch
        total, known, p, n_peer = 0.0, 0, 0, len(peer_recent)
        nxt = next(mine, None)
        while known < live and (nxt is not None or p < n_peer):
            # The newer of the two heads (own first on a tie): a two-way merge of lists sorted by age.
            if nxt is not None and (p >= n_peer or now - nxt[1] <= peer_recent[p][0]):
                total += nxt[0]
                nxt = next(mine, None)
            else:
                total += peer_recent[p][1]
                p += 1
            known += 1
        return with_unrecorded(total, known, live, tokens)

    def discard(self, backend: str) -> None:
        """Forget a backend removed from the fleet."""
        self._entries.pop(backend, None)
        self._epochs.pop(backend, None)

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
