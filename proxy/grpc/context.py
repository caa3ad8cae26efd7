"""What every connection and call on the gRPC listener shares, and how a grpc-status counts as HTTP.

`RelayContext` is built once per listener start with everything the calls use passed in: the options,
the shared `Router` (same policy, in-flight table, metrics and overload rules as HTTP), the process-wide
`RetryController`, the extractor registry, the write `Flusher`, the backend pools and the pool of the
proxy's own local services, and the OpenAI pipeline for plain HTTP/2 requests (proxy/grpc/bridge.py).
"""

from __future__ import annotations

from typing import Any

from proxy.dataplane.openai import OpenAIPipeline
from proxy.dataplane.retry import RetryController
from proxy.dataplane.router import Router
from proxy.grpc.connection import Flusher
from proxy.grpc.extractors import ExtractorRegistry
from proxy.grpc.grpc_config import GrpcOptions
from proxy.grpc.local import LOCAL_PREFIXES
from proxy.grpc.upstream import BackendPool, Pools
from proxy.observability.lifecycle import Observability
from proxy.wire.grpc import CANCELLED, DEADLINE_EXCEEDED

LOCAL_BACKEND = "<proxy>"


class RelayContext:
    """Everything calls on the listener share: options, extractors, router, retries, pools, counters."""

    def __init__(self, *, options: GrpcOptions, router: Router, retries: RetryController,
                 registry: ExtractorRegistry, flusher: Flusher, pools: Pools, local_pool: BackendPool,
                 openai: OpenAIPipeline[None]) -> None:
        self.options = options
        self.router = router
        self.retries = retries  # the process-wide retry policy and budget, shared with HTTP
        self.registry = registry
        self.flusher = flusher
        self.pools = pools
        self.local_pool = local_pool
        self.local_prefixes = LOCAL_PREFIXES
        self.openai = openai  # plain HTTP/2 requests on this listener (proxy/grpc/bridge.py)
        # Access log, hot-spot windows and traces of relayed calls (the pipeline's own); None when all are off.
        self.observability: Observability | None = openai.observability
        self.downstreams: set[Any] = set()  # the open client connections (proxy/grpc/downstream.py)
        self.retried = 0  # calls sent to another backend after a connection failure
        self.decompressed_for_routing = 0  # compressed first messages inflated (a copy) to be routed
        self._pools_version = -1

    def prune_pools(self) -> None:
        """Once per snapshot version: close the pools of backends no longer in the snapshot."""
        snapshot = self.router.store.current
        if snapshot.version != self._pools_version:
            self._pools_version = snapshot.version
            self.pools.prune(lambda name: name in snapshot)


# grpc-status -> the HTTP status recorded in the shared request metrics (as grpc-gateway maps them).
# Endings the client chose, which say nothing about the backend: CANCELLED (the client left) and
# DEADLINE_EXCEEDED (the client's own grpc-timeout ran out, enforced here or by the backend). Counting a
# deadline as a backend failure would let one client with tight deadlines eject every backend in turn;
# a backend that is really slow or hung is caught by the active health checks (adaptive timeout).
CLIENT_CHOSEN = frozenset({CANCELLED, DEADLINE_EXCEEDED})

_HTTP_FOR_GRPC = {0: 200, 1: 499, 2: 500, 3: 400, 4: 504, 5: 404, 6: 409, 7: 403, 8: 429, 9: 400, 10: 409,
                  11: 400, 12: 501, 13: 500, 14: 503, 15: 500, 16: 401}


def http_status_for(grpc_status: int) -> int:
    return _HTTP_FOR_GRPC.get(grpc_status, 500)


__all__ = ["CLIENT_CHOSEN", "LOCAL_BACKEND", "RelayContext", "http_status_for"]
