"""The proxy's own in-flight accounting, shared by every data plane of one process.

It is the one piece of shared mutable state in the data path (see ARCHITECTURE.md): the HTTP and gRPC
listeners both count into the same table, so a policy like least-request sees all the work this process
has sent to a backend, whatever protocol carried it. It is a plain `dict[str, Inflight]` subclass because
policies read it on every request (`Mapping[str, Inflight]` is all they need) and a dict lookup is the
cheapest thing Python has.
"""

from __future__ import annotations

from proxy.core.decision import Inflight


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
