"""The two upstream clients of a proxy process, built from the same `upstream:` and `timeouts:` config.

- `create_pool`: the data plane's relay pool (proxy/upstream/http1.py). Every proxied request goes through it;
  it counts requests and new connections, from which the exported connection reuse ratio is derived.
- `create_session`: an aiohttp ClientSession for the proxy's own, infrequent calls (GET /v1/models
  fan-out, health checks that want one). Same limits and keep-alive rules: idle
  connections are reused for at most `upstream.keepalive_s`, below the backends' own keep-alive (see
  shared/README.md: reusing a connection the server is closing fails a POST), then closed.
"""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp
from aiohttp.client_reqrep import ClientRequest

from typing import Callable

from proxy.config import Config
from proxy.tls import BackendTlsConfig, ClientTls, url_origin
from proxy.upstream.http1 import UpstreamPool
from proxy.metrics import UpstreamCounters


def backend_tls(config: Callable[[], Config]) -> ClientTls:
    """The TLS of every backend, looked up in the configuration in force (`config()`: a reload changes it)
    by base URL or gRPC address; contexts are built once per backend section (proxy/tls.py `ClientTls`)."""
    seen: list[tuple[Config, dict[str, BackendTlsConfig | None]]] = []

    def settings(key: str) -> BackendTlsConfig | None:
        current = config()
        if not seen or seen[0][0] is not current:
            table: dict[str, BackendTlsConfig | None] = {}
            for b in current.backends:
                table[url_origin(b.url)] = b.tls
                if b.metrics_url is not None:
                    table.setdefault(url_origin(b.metrics_url), b.tls)
                if b.grpc is not None:
                    table[b.grpc] = b.tls
            seen[:] = [(current, table)]
        return seen[0][1].get(key)

    return ClientTls(settings)


class _BackendTlsConnector(aiohttp.TCPConnector):
    """aiohttp's connector with each https:// backend's own context (CA bundle, client certificate).

    aiohttp picks the context of a connection in `_get_ssl_context`, a private hook, so overriding it is
    the one place that changes; a request that brings its own `ssl=` keeps it. A backend's
    `tls.server_name` becomes the request's `server_hostname` (SNI and the name verified), which aiohttp
    reads right after choosing the context.
    """

    def __init__(self, tls: ClientTls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend_tls = tls

    def _get_ssl_context(self, req: ClientRequest) -> ssl.SSLContext | None:
        if req.is_ssl() and not isinstance(req.ssl, ssl.SSLContext) and req.ssl is True:
            found = self._backend_tls.for_url(str(req.url.origin()))
            if found is not None:
                if found[1] is not None and req.server_hostname is None:
                    req.server_hostname = found[1]
                return found[0]
        return super()._get_ssl_context(req)


def create_session(config: Config, tls: ClientTls | None = None) -> aiohttp.ClientSession:
    """Nothing is decompressed, redirected or re-headed: bytes pass as they are. `tls`: the contexts of
    https:// backends (`backend_tls`)."""
    up = config.upstream
    connector = _BackendTlsConnector(
        tls if tls is not None else ClientTls(lambda key: None),
        limit=0,  # the per-backend cap is what protects a backend
        limit_per_host=up.connections_per_backend,
        keepalive_timeout=up.keepalive_s,
        ttl_dns_cache=10,
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=config.timeouts.request_s, connect=config.timeouts.connect_s),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        read_bufsize=2**16,
    )


def create_pool(config: Config, counters: UpstreamCounters, tls: ClientTls | None = None) -> UpstreamPool:
    """`tls`: the contexts of https:// backends (`backend_tls`); without it https:// is verified against the
    system CAs."""
    return UpstreamPool(
        counters,
        connections_per_backend=config.upstream.connections_per_backend,
        keepalive_s=config.upstream.keepalive_s,
        connect_timeout_s=config.timeouts.connect_s,
        request_timeout_s=config.timeouts.request_s,
        tls=(tls if tls is not None else ClientTls(lambda key: None)).for_url,
    )
