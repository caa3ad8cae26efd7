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
not record (another worker's, or from before a restart) count at the data plane's own per-request
average. Pure and bounded: no clock, at most `depth` entries per backend.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from proxy.core.decision import Inflight


class WorkLedger:
    """Per backend, the estimated uncached prompt tokens of the most recent requests routed there."""

    __slots__ = ("_depth", "_entries")

    def __init__(self, depth: int = 1024) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._depth = depth
        self._entries: dict[str, deque[float]] = {}

    def record(self, backend: str, tokens: float) -> None:
        entries = self._entries.get(backend)
        if entries is None:
            entries = self._entries[backend] = deque(maxlen=self._depth)
        entries.append(tokens)

    def pending(self, backend: str, inflight: Inflight | None) -> float:
        """Estimated prefill tokens still ahead of a new request on `backend`."""
        if inflight is None or inflight.requests <= 0:
            return 0.0
        live = inflight.requests
        entries = self._entries.get(backend)
        known = 0 if entries is None else min(live, len(entries))
        total = sum(islice(reversed(entries), known)) if known else 0.0  # type: ignore[arg-type]
        if live > known:
            per_request = inflight.tokens / inflight.requests if inflight.tokens > 0 else (total / known if known else 0.0)
            total += (live - known) * per_request
        return total

    def discard(self, backend: str) -> None:
        """Forget a backend removed from the fleet."""
        self._entries.pop(backend, None)

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
