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


_REQUEST_DROP_BYTES = frozenset(n.encode() for n in _REQUEST_DROP) | {b"x-request-id", b"x-forwarded-for"}
_REQUEST_DROP_LENGTHS = frozenset(len(n) for n in _REQUEST_DROP_BYTES)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_METHOD_LINES = {m: f"{m} ".encode() for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")}


def upstream_request_head(
    method: str,
    raw_path: str,
    host: bytes,
    raw_headers: tuple[tuple[bytes, bytes], ...],
    peer: str | None,
    scheme: str,
    request_id: str,
    body_length: int,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> bytes:
    """The serialised request head for the backend, built from the client's raw header bytes.

    Same rules as `upstream_request_headers` (hop-by-hop and Connection-named fields dropped, Host for the
    backend, X-Forwarded-For appended, X-Forwarded-Proto added unless present, x-request-id set), without
    decoding and re-encoding every header: the bytes the client sent are the bytes the backend gets.
    """
    parts = [_METHOD_LINES.get(method) or f"{method} ".encode(), raw_path.encode("utf-8", "surrogateescape"),
             b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    drop = _REQUEST_DROP_BYTES
    lengths = _REQUEST_DROP_LENGTHS
    for name, value in raw_headers:
        if len(name) == 10 and name.lower() == b"connection":
            tokens = frozenset(t.strip().lower() for t in value.split(b",") if t.strip())
            drop = drop | tokens
            lengths = lengths | {len(t) for t in tokens}
            break
    prior_xff: bytes | None = None
    has_proto = False
    for name, value in raw_headers:
        n = len(name)
        # Only a name as long as a dropped one or X-Forwarded-Proto needs lowering (most do not).
        if n in lengths or n == 17:
            lname = name.lower()
            if lname in drop:
                if lname == b"x-forwarded-for":
                    prior_xff = value if prior_xff is None else prior_xff + b", " + value
                continue
            if lname == b"x-forwarded-proto":
                has_proto = True
        parts += (name, b": ", value, b"\r\n")
    if peer:
        parts += (b"X-Forwarded-For: ", (prior_xff + b", " if prior_xff else b""), peer.encode(), b"\r\n")
    elif prior_xff:
        parts += (b"X-Forwarded-For: ", prior_xff, b"\r\n")
    if not has_proto:
        parts += (b"X-Forwarded-Proto: ", scheme.encode(), b"\r\n")
    parts += (b"x-request-id: ", request_id.encode("utf-8", "surrogateescape"), b"\r\n")
    for name, value in extra:
        parts += (name, b": ", value, b"\r\n")
    if body_length or method in _BODY_METHODS:
        parts += (b"Content-Length: ", str(body_length).encode(), b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)
