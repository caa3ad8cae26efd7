"""Just enough of the protobuf and gRPC wire formats to route a call without decoding it.

The proxy never decodes and re-encodes a message: it forwards the client's bytes unchanged. To route, it
reads a few fields straight off the first message's wire bytes (varints, length-delimited strings, fixed32
floats), which needs no generated classes, works for any message layout described by field numbers, and
costs a few microseconds where a full ``ParseFromString`` of a long prompt costs far more.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Iterator
from urllib.parse import quote

# Wire types (protobuf encoding spec).
VARINT = 0
FIXED64 = 1
LEN = 2
START_GROUP = 3
END_GROUP = 4
FIXED32 = 5

GRPC_PREFIX = 5  # 1 byte compressed flag + 4 bytes big-endian length

# gRPC status codes the proxy itself answers with (grpc/status.h).
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14


def grpc_message(text: str) -> bytes:
    """grpc-message is percent-encoded UTF-8 (the spec allows printable ASCII except '%' unencoded)."""
    return quote(text, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


def status_of(headers: list[tuple[bytes, bytes]]) -> int:
    """The grpc-status of a trailers (or trailers-only) block; UNKNOWN when missing or not a number."""
    for name, value in headers:
        if name == b"grpc-status":
            return int(value) if value.isdigit() else UNKNOWN
    return UNKNOWN


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message (or gRPC frame)."""


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint too long")


def iter_fields(buf: bytes | memoryview) -> Iterator[tuple[int, int, object]]:
    """Yield (field number, wire type, value) for every field of one message, in wire order.

    LEN values are memoryview slices (no copy); VARINT values are ints; FIXED32/FIXED64 are the raw 4/8
    bytes (the caller knows whether a float, a double or an integer is meant).
    """
    mv = memoryview(buf)
    pos = 0
    end = len(mv)
    while pos < end:
        key, pos = read_varint(mv, pos)
        number, wtype = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wtype == VARINT:
            value, pos = read_varint(mv, pos)
            yield number, wtype, value
        elif wtype == LEN:
            n, pos = read_varint(mv, pos)
            if pos + n > end:
                raise WireError("length-delimited field runs past the message")
            yield number, wtype, mv[pos : pos + n]
            pos += n
        elif wtype == FIXED32:
            if pos + 4 > end:
                raise WireError("truncated fixed32")
            yield number, wtype, mv[pos : pos + 4]
            pos += 4
        elif wtype == FIXED64:
            if pos + 8 > end:
                raise WireError("truncated fixed64")
            yield number, wtype, mv[pos : pos + 8]
            pos += 8
        elif wtype == START_GROUP:
            pos = _skip_group(mv, pos, number)
        else:
            raise WireError(f"unexpected wire type {wtype}")


def _skip_group(mv: memoryview, pos: int, number: int) -> int:
    """Groups are deprecated but legal; skip one (nested groups included) to keep reading its siblings."""
    end = len(mv)
    while pos < end:
        key, pos = read_varint(mv, pos)
        n, wtype = key >> 3, key & 7
        if wtype == END_GROUP:
            if n != number:
                raise WireError("mismatched end-group")
            return pos
        if wtype == VARINT:
            _, pos = read_varint(mv, pos)
        elif wtype == LEN:
            length, pos = read_varint(mv, pos)
            pos += length
        elif wtype == FIXED32:
            pos += 4
        elif wtype == FIXED64:
            pos += 8
        elif wtype == START_GROUP:
            pos = _skip_group(mv, pos, n)
        else:
            raise WireError(f"unexpected wire type {wtype}")
    raise WireError("unterminated group")


def as_text(value: object) -> str:
    if isinstance(value, memoryview):
        return bytes(value).decode("utf-8", "replace")
    raise WireError("expected a length-delimited field")


def as_int(wtype: int, value: object) -> int:
    """An integer field of any encoding (varint int32/int64/uint32/uint64, fixed32/64)."""
    if wtype == VARINT:
        assert isinstance(value, int)
        if value >= 1 << 63:  # negative int64/int32 are sign-extended to 10-byte varints
            value -= 1 << 64
        return value
    if wtype == FIXED32 and isinstance(value, memoryview):
        return int(struct.unpack("<i", value)[0])
    if wtype == FIXED64 and isinstance(value, memoryview):
        return int(struct.unpack("<q", value)[0])
    raise WireError("expected an integer field")


def as_float(wtype: int, value: object) -> float:
    """A float (fixed32), double (fixed64) or integer field read as a number."""
    if wtype == FIXED32 and isinstance(value, memoryview):
        return float(struct.unpack("<f", value)[0])
    if wtype == FIXED64 and isinstance(value, memoryview):
        return float(struct.unpack("<d", value)[0])
    if wtype == VARINT:
        return float(as_int(wtype, value))
    raise WireError("expected a numeric field")


def packed_or_single(wtype: int, value: object, scalar_wtype: int) -> list[tuple[int, object]]:
    """Repeated scalars arrive packed (one LEN field) or one field per element; normalise to elements."""
    if wtype != LEN or scalar_wtype == LEN:
        return [(wtype, value)]
    assert isinstance(value, memoryview)
    out: list[tuple[int, object]] = []
    pos = 0
    if scalar_wtype == VARINT:
        while pos < len(value):
            v, pos = read_varint(value, pos)
            out.append((VARINT, v))
    else:
        size = 4 if scalar_wtype == FIXED32 else 8
        if len(value) % size:
            raise WireError("packed fixed-width field has a partial element")
        out = [(scalar_wtype, value[i : i + size]) for i in range(0, len(value), size)]
    return out


# ---------------------------------------------------------------------------------------------- gRPC


def first_message(buf: bytes | bytearray) -> tuple[bool, bytes] | None:
    """The first length-prefixed gRPC message in `buf` as (compressed flag, payload), or None if not all
    of it has arrived yet."""
    if len(buf) < GRPC_PREFIX:
        return None
    flag = buf[0]
    (length,) = struct.unpack_from(">I", buf, 1)
    if len(buf) < GRPC_PREFIX + length:
        return None
    return bool(flag & 1), bytes(buf[GRPC_PREFIX : GRPC_PREFIX + length])


def message_length(buf: bytes | bytearray) -> int | None:
    """The declared payload length of the first message, once its 5-byte prefix has arrived."""
    if len(buf) < GRPC_PREFIX:
        return None
    return int(struct.unpack_from(">I", buf, 1)[0])


def decompress(payload: bytes, encoding: str, limit: int) -> bytes | None:
    """Decompress a copy of a compressed message for routing; None when the codec is unknown or the
    result would exceed `limit` bytes (a decompression bomb must not cost memory just to be routed)."""
    if encoding == "gzip":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        d = zlib.decompressobj()
    else:
        return None
    try:
        out = d.decompress(payload, limit + 1)
    except zlib.error:
        return None
    if len(out) > limit:
        return None
    return out


def compress_gzip(payload: bytes) -> bytes:
    return gzip.compress(payload)


# ----------------------------------------------------------------------------------------- grpc-timeout

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (``TimeoutValue TimeoutUnit``, at most 8 digits) in seconds; None if malformed."""
    if len(value) < 2 or len(value) > 9:
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit():
        return None
    return int(digits) * unit


def format_timeout(seconds: float) -> bytes:
    """The shortest-unit encoding that fits 8 digits, rounded up so a deadline never shrinks to zero."""
    if seconds <= 0:
        return b"1n"
    for suffix, scale in ((b"n", 1e9), (b"u", 1e6), (b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = -int(-seconds * scale // 1)  # ceil
        if value < 100_000_000:
            return str(max(value, 1)).encode() + suffix
    return b"99999999H"
