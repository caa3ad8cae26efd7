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
"""

from __future__ import annotations

from collections import deque
from typing import Mapping

from proxy.core.decision import Inflight
from proxy.core.inflight import SharedInflight, SharedInflightTable, newest_sum


class WorkLedger:
    """Per backend, the estimated uncached prompt tokens of the most recent requests routed there."""

    __slots__ = ("_depth", "_entries")

    def __init__(self, depth: int = 1024) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._depth = depth
        self._entries: dict[str, deque[float]] = {}

    def record(self, backend: str, tokens: float, inflight: Mapping[str, Inflight] | None = None) -> None:
        """Remember a request routed to `backend`; `inflight` is the mapping the policy picked with (a
        shared one learns the estimate too)."""
        entries = self._entries.get(backend)
        if entries is None:
            entries = self._entries[backend] = deque(maxlen=self._depth)
        entries.append(tokens)
        if isinstance(inflight, SharedInflightTable) and inflight.row is not None:
            inflight.record_queued(backend, tokens)

    def pending(self, backend: str, inflight: Inflight | None) -> float:
        """Estimated prefill tokens still ahead of a new request on `backend`."""
        if inflight is None:
            return 0.0
        if isinstance(inflight, SharedInflight):
            return inflight.queued
        return newest_sum(self._entries.get(backend), inflight.requests, inflight.tokens)

    def discard(self, backend: str) -> None:
        """Forget a backend removed from the fleet."""
        self._entries.pop(backend, None)

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
