"""The two upstream clients of a proxy process, built from the same `upstream:` and `timeouts:` config.

- `create_pool`: the data plane's relay pool (proxy/upstream/http1.py). Every proxied request goes through it;
  it counts requests and new connections, from which the exported connection reuse ratio is derived.
- `create_session`: an aiohttp ClientSession for the proxy's own, infrequent calls (GET /v1/models
  fan-out, health checks that want one). Same limits and keep-alive rules: idle
  connections are reused for at most `upstream.keepalive_s`, below the backends' own keep-alive (see
  shared/README.md: reusing a connection the server is closing fails a POST), then closed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import ssl
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.client_reqrep import ClientRequest

from typing import Callable

from proxy.config import Config
from proxy.tls import DEFAULT_BACKEND_TLS, BackendTlsConfig, ClientTls, url_origin
from proxy.upstream.http1 import UpstreamPool
from proxy.metrics import UpstreamCounters


def backend_tls(config: Callable[[], Config]) -> ClientTls:
    """The TLS of every backend, looked up in the configuration in force (`config()`: a reload changes it)
    by URL origin or gRPC address; contexts are built once per backend section (proxy/tls.py `ClientTls`).

    With discovery on, a backend found through DNS has its pod's address in its URL, which no config entry
    names: it gets the section of the one configured backend with a DNS name, the same scheme and the same
    port, with that DNS name as its `server_name` unless the section sets one (a headless Service's pods
    present the Service's certificate, not one per pod address).
    """
    seen: list[tuple[Config, dict[str, BackendTlsConfig | None], dict[tuple[str, str], list[BackendTlsConfig]]]] = []

    def tables() -> tuple[dict[str, BackendTlsConfig | None], dict[tuple[str, str], list[BackendTlsConfig]]]:
        current = config()
        if not seen or seen[0][0] is not current:
            table: dict[str, BackendTlsConfig | None] = {}
            by_port: dict[tuple[str, str], list[BackendTlsConfig]] = {}
            for b in current.backends:
                table[url_origin(b.url)] = b.tls
                if b.metrics_url is not None:
                    table.setdefault(url_origin(b.metrics_url), b.tls)
                if b.grpc is not None:
                    table[b.grpc] = b.tls
                if current.discovery.enabled:
                    for address in (b.url, b.grpc):
                        found = _dns_name(address) if address is not None else None
                        if found is not None:
                            tls = b.tls or DEFAULT_BACKEND_TLS
                            by_port.setdefault(found[1], []).append(
                                tls if tls.server_name else dataclasses.replace(tls, server_name=found[0]))
            seen[:] = [(current, table, by_port)]
        return seen[0][1], seen[0][2]

    def settings(key: str) -> BackendTlsConfig | None:
        table, by_port = tables()
        if key in table:
            return table[key]
        parsed = _scheme_port(key)
        candidates = by_port.get(parsed) if parsed is not None else None
        return candidates[0] if candidates and len(candidates) == 1 else None

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


def _scheme_port(address: str) -> tuple[str, str] | None:
    """(scheme, port) of an http(s) URL or a grpcs:// address; None without an explicit port and scheme."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return None
    netloc = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = netloc.rpartition(":")
    if not host or not port.isdigit():
        port = {"https": "443", "http": "80"}.get(scheme, "")
    return (scheme, port) if port else None


def _dns_name(address: str) -> tuple[str, tuple[str, str]] | None:
    """(host, (scheme, port)) of an https:// URL or grpcs:// address whose host is a DNS name, else None."""
    parsed = _scheme_port(address)
    if parsed is None or parsed[0] not in ("https", "grpcs"):
        return None
    host = urlsplit(address.replace("grpcs://", "https://", 1)).hostname
    if not host:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host, parsed
    return None


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
