"""The one upstream client session every HTTP request to a backend goes through.

One session (one connector) for the whole process: connections are pooled per backend (aiohttp keys its
pool by host, port and TLS), capped by `upstream.connections_per_backend`, and reused for at most
`upstream.keepalive_s`, which must stay below the backends' own keep-alive (see shared/README.md: reusing a
connection the server is closing fails a POST); aiohttp's cleanup pass closes connections idle longer.

Connection reuse is counted without aiohttp's tracing (which costs several µs per request): the connector
subclass counts the connections it opens, the proxy counts the requests it sends, and the reuse ratio is
derived at scrape time.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from proxy.config import Config
from proxy.metrics import UpstreamCounters


class _CountingConnector(aiohttp.TCPConnector):
    def __init__(self, counters: UpstreamCounters, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._counters = counters

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> ResponseHandler:
        proto = await super()._create_connection(req, traces, timeout)
        self._counters.new_connections += 1
        return proto


def create_session(config: Config, counters: UpstreamCounters) -> aiohttp.ClientSession:
    """The upstream session. Nothing is decompressed, redirected or re-headed: bytes pass as they are."""
    up = config.upstream
    connector = _CountingConnector(
        counters,
        limit=0,  # the per-backend cap is what protects a backend; the total is `limits.max_inflight_total`
        limit_per_host=up.connections_per_backend,
        keepalive_timeout=up.keepalive_s,
        ttl_dns_cache=10,
        enable_cleanup_closed=False,
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=config.timeouts.request_s, connect=config.timeouts.connect_s),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=2**16,
    )
