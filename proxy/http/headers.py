"""Header rewriting between client and backend (RFC 9110 section 7.6.1: hop-by-hop fields stop here)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

# Connection-specific fields, plus the ones the proxy re-computes itself (Host for the backend, framing).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}


def _connection_tokens(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """Fields named in `Connection` are hop-by-hop too, whatever they are called."""
    value = headers.get("Connection")
    if not value:
        return frozenset()
    return frozenset(t.strip().lower() for t in value.split(",") if t.strip())


def upstream_request_headers(
    headers: CIMultiDictProxy[str], peer: str | None, scheme: str, request_id: str
) -> CIMultiDict[str]:
    drop = _REQUEST_DROP | _connection_tokens(headers) if "Connection" in headers else _REQUEST_DROP
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    if peer:
        prior = headers.get("X-Forwarded-For")
        out["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    if "X-Forwarded-Proto" not in headers:
        out["X-Forwarded-Proto"] = scheme
    out["x-request-id"] = request_id
    return out


def downstream_response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    drop = _RESPONSE_DROP | _connection_tokens(headers) if "Connection" in headers else _RESPONSE_DROP
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out
