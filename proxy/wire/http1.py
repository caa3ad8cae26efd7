"""HTTP/1.1 response parsing, sans-I/O: bytes in, events out (RFC 9112).

One `ResponseParser` reads one response (plus any interim 1xx answers before it) from the bytes a
connection delivers, however they are split: `feed(data)` returns the events those bytes complete, and
`feed_eof()` says the connection ended. No sockets, futures, clock or asyncio: the relay pool
(proxy/upstream/http1.py) and the control plane's scrape client (proxy/control/httpget.py) drive it from
their protocols' `data_received` and `connection_lost`, and its tests feed it bytes directly.

Events, in order: zero or more `Informational` (100 Continue, 103 Early Hints: reported, then skipped), one
`Response` (status line, the raw header list, and the framing the body will have), body events, and one
`EndOfMessage` (with the trailers of a chunked body). Body events are `Data` (decoded body bytes) or, for a
chunked body once `raw_chunks` is set, `RawChunks`: the bytes of one or more complete chunks exactly as
the server framed them (size line, data, CRLF), so a relay can forward them to a chunked downstream
without de-chunking and re-chunking. In either mode a chunked body is delivered as whole chunks only (a
partial chunk is held until it completes), so a server dying mid-chunk never tears one, and the mode can be
switched between any two `feed` calls.

States are named (`AWAIT_HEAD`, `BODY`, `DONE`, `ERROR`); in `BODY` the reader is chosen from `_READERS` by
the framing the head decided (RFC 9112 section 6.3): no body for a HEAD request and 204/304, chunked when
the final transfer coding is chunked, Content-Length, else until the connection closes.

After the end, `reusable` says whether the connection may carry the next exchange: the response allowed
keep-alive (HTTP/1.1 unless `Connection: close`, HTTP/1.0 only with `keep-alive`, never a body delimited
by the close) and no byte came after its end.

Cost matters: this runs for every proxied request and every streamed chunk. No per-byte Python loops:
the common cases touch the input with a handful of `bytes.find`/slice calls; a whole Content-Length
response arriving in one read is done in one step without copying the buffer first; a read holding only
complete chunks is passed on as it is (no copy, no re-framing); status lines and chunk-size lines, which
repeat, are validated once and remembered in bounded memos (pure functions of the line, so no state leaks
between parsers). Measured against the two parsers it replaced: tests/wire/bench_http1.py.
"""

from __future__ import annotations

import re
from typing import Callable, Union

__all__ = [
    "AWAIT_HEAD", "BODY", "CHUNKED", "CONTENT_LENGTH", "DONE", "ERROR", "NO_BODY", "UNTIL_CLOSE",
    "Data", "EndOfMessage", "Event", "IncompleteResponse", "Informational", "ProtocolError", "RawChunks",
    "Response", "ResponseParser",
]

MAX_HEAD = 64 * 1024  # bytes of status line + headers (and of a trailer section) a parser accepts by default
MAX_CHUNK = 16 * 1024 * 1024  # one chunk is held whole until complete: the most a parser buffers for it
_MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions

# Framings a response body can have.
NO_BODY = "no-body"
CONTENT_LENGTH = "content-length"
CHUNKED = "chunked"
UNTIL_CLOSE = "until-close"

# Parser states.
AWAIT_HEAD = "await-head"  # reading a status line and headers (again after each 1xx)
BODY = "body"  # reading the body with the reader its framing chose
DONE = "done"  # the response is complete; bytes after it make the connection not reusable
ERROR = "error"  # a ProtocolError was raised; every later call raises it again

_HEXDIGITS = b"0123456789abcdefABCDEF"
_NO_TRAILERS: tuple[tuple[bytes, bytes], ...] = ()
_NO_TOKENS: frozenset[bytes] = frozenset()


class ProtocolError(Exception):
    """The bytes are not an HTTP/1.1 response this parser accepts (or it is larger than its limits).

    `events` holds what the bytes before the offending ones completed (e.g. the chunks before a bad chunk
    size), for a consumer that wants to deliver them before failing.
    """

    def __init__(self, message: str, events: list[Event] | None = None) -> None:
        super().__init__(message)
        self.events: list[Event] = events if events is not None else []


class IncompleteResponse(ProtocolError):
    """The connection ended before the response was complete."""


class Informational:
    """An interim 1xx answer (100 Continue, 103 Early Hints...); the final response follows."""

    __slots__ = ("status", "reason", "http_version", "headers")

    def __init__(self, status: int, reason: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.reason = reason
        self.http_version = http_version  # b"1.1" or b"1.0"
        self.headers = headers

    def __repr__(self) -> str:
        return f"Informational({self.status}, {self.reason!r})"


class Response:
    """The final response's head.

    `headers` is every field as received: (name as sent, value without surrounding whitespace), in order.
    `framing` is one of NO_BODY, CONTENT_LENGTH, CHUNKED, UNTIL_CLOSE; `content_length` is set only when
    the body is framed by it. `keep_alive` says whether the connection may carry another exchange after
    this one (HTTP/1.1 unless `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`; never for a
    body delimited by the close). `connection` is the lower-cased tokens of the Connection field(s): the
    fields they name are hop-by-hop.
    """

    __slots__ = ("status", "reason", "http_version", "headers", "framing", "content_length", "keep_alive",
                 "connection")

    def __init__(self, status: int, reason: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]],
                 framing: str, content_length: int | None, keep_alive: bool, connection: frozenset[bytes]) -> None:
        self.status = status
        self.reason = reason
        self.http_version = http_version
        self.headers = headers
        self.framing = framing
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.connection = connection

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.reason!r}, framing={self.framing!r}, keep_alive={self.keep_alive})"


class Data:
    """Decoded body bytes (chunk framing removed)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Data({self.data!r})"


class RawChunks:
    """One or more complete chunks as the server framed them (size line, data, CRLF each); never the last
    chunk (`0` line) nor trailers. Only when the parser's `raw_chunks` is set."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"RawChunks({self.data!r})"


class EndOfMessage:
    """The response is complete; `trailers` are the fields after a chunked body (else empty)."""

    __slots__ = ("trailers",)

    def __init__(self, trailers: tuple[tuple[bytes, bytes], ...] = _NO_TRAILERS) -> None:
        self.trailers = trailers

    def __repr__(self) -> str:
        return f"EndOfMessage({self.trailers!r})"


_END = EndOfMessage()  # shared: the common end carries no trailers and is immutable

Event = Union[Informational, Response, Data, RawChunks, EndOfMessage]
_Reader = Callable[["ResponseParser", bytes, int, list[Event]], list[Event]]

_CHUNK_SIZES: dict[bytes, int] = {}  # a memo of chunk-size lines: a stream repeats a few sizes
_CHUNK_SIZES_MAX = 4096


def _chunk_size(line: bytes) -> int:
    """`chunk-size [ chunk-ext ]` -> the size. RFC 9112 7.1: chunk-size = 1*HEXDIG, so an empty size (or
    one with a sign, `0x`, `_` or spaces inside, all of which int() would take) is an error. Valid lines
    are remembered (a pure function of the line), so the usual chunk costs one dict lookup here."""
    semi = line.find(b";")
    digits = (line[:semi] if semi >= 0 else line).rstrip(b" \t")  # BWS before a chunk-ext
    if not digits or len(digits) > 15 or digits.strip(_HEXDIGITS):
        raise ProtocolError(f"malformed chunk size line {line[:40]!r}")
    size = int(digits, 16)
    if len(_CHUNK_SIZES) < _CHUNK_SIZES_MAX:
        _CHUNK_SIZES[line] = size
    return size


def _content_length(value: bytes) -> int:
    if value.isdigit():
        return int(value)
    # RFC 9110 8.6: a list of identical values (from a field repeated by an intermediary) is one value.
    values = {v.strip() for v in value.split(b",")}
    if len(values) == 1:
        only = values.pop()
        if only.isdigit():
            return int(only)
    raise ProtocolError(f"malformed Content-Length {value[:40]!r}")


_FRAMING_NAME_LENGTHS = frozenset((len(b"connection"), len(b"content-length"), len(b"transfer-encoding")))


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Header (or trailer) lines -> [(name, value)], normalising what RFC 9112 5.1/5.2 tell a recipient to:
    a folded line joins the previous value, whitespace before the colon goes. The head parser's fast loop
    falls back to this on any line it does not find plain."""
    fields: list[tuple[bytes, bytes]] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            if not fields:
                raise ProtocolError("folded line before any header field")
            name, value = fields[-1]
            fields[-1] = (name, (value + b" " + line.strip()).strip())
            continue
        name, colon, value = line.partition(b":")
        name = name.rstrip(b" \t")
        if not colon or not name:
            raise ProtocolError(f"malformed header line {line[:80]!r}")
        fields.append((name, value.strip()))
    return fields


_STATUS_LINES: dict[bytes, tuple[int, bytes, bytes]] = {}  # a memo: a backend sends a few distinct ones
_STATUS_LINES_MAX = 256


def _status_line(line: bytes) -> tuple[int, bytes, bytes]:
    """`HTTP/1.x SP 3DIGIT SP reason` -> (status, reason, b"1.1" or b"1.0"); remembered once validated."""
    version, _, rest = line.partition(b" ")
    code = rest[:3]
    if (version != b"HTTP/1.1" and version != b"HTTP/1.0") or len(code) != 3 or not code.isdigit() \
            or (len(rest) > 3 and rest[3] != 32) or code[0] == 48:
        raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
    parsed = (int(code), rest[4:], version[5:])
    if len(_STATUS_LINES) < _STATUS_LINES_MAX:
        _STATUS_LINES[line] = parsed
    return parsed


def _bare_cr_or_lf(block: bytes, lines: list[bytes]) -> bool:
    """After splitting at CRLF, any CR or LF left is a bare one (each CRLF removed one of each)."""
    return len(block) - len(block.translate(None, b"\r\n")) != 2 * (len(lines) - 1)


class ResponseParser:
    """Parses one HTTP/1.1 response; see the module docstring. `head_request`: the request was HEAD, so
    the response has no body whatever its headers say."""

    __slots__ = ("state", "raw_chunks", "response", "reusable", "max_head", "max_chunk", "_head_request", "_reader",
                 "_remaining", "_held", "_held_len", "_need", "_head_buf", "_error")

    def __init__(self, head_request: bool = False, *, max_head: int = MAX_HEAD, max_chunk: int = MAX_CHUNK) -> None:
        self.state = AWAIT_HEAD
        self.raw_chunks = False  # chunked bodies as RawChunks (framed) instead of Data (decoded)
        self.response: Response | None = None
        # The response is complete, the connection may be kept alive, and nothing came after the end.
        self.reusable = False
        self.max_head = max_head
        self.max_chunk = max_chunk
        self._head_request = head_request
        self._reader: _Reader | None = None
        self._remaining = 0  # content-length: body bytes still to come
        self._held: list[bytes] = []  # body bytes kept until `_need` of them are there (a partial chunk)
        self._held_len = 0
        self._need = 0
        self._head_buf: bytearray | None = None  # a head that did not arrive in one read
        self._error: ProtocolError | None = None

    # ------------------------------------------------------------------------------------------ public

    def feed(self, data: bytes) -> list[Event]:
        """The events that `data` (the next bytes from the connection) completes."""
        events: list[Event] = []
        state = self.state
        if not data and state is not ERROR:
            return events
        try:
            if state is BODY:
                if self._held_len:
                    total = self._held_len + len(data)
                    self._held.append(data)
                    if total < self._need:
                        self._held_len = total
                        return events
                    data = b"".join(self._held)
                    self._held = []
                    self._held_len = 0
                return self._reader(self, data, 0, events)  # type: ignore[misc]  # set with state BODY
            if state is AWAIT_HEAD:
                hb = self._head_buf
                if hb:
                    scan = len(hb) - 3
                    hb += data
                    if hb.find(b"\r\n\r\n", scan if scan > 0 else 0) < 0:
                        if len(hb) > self.max_head:
                            raise ProtocolError(f"response head larger than {self.max_head} bytes")
                        return events
                    data = bytes(hb)
                    self._head_buf = None
                return self._read_head(data, 0, events)
        except ProtocolError as exc:
            exc.events = events
            raise self._fail(exc) from None
        if state is DONE:
            self.reusable = False  # the server is out of step with the requests
            return events
        assert self._error is not None
        raise self._error

    def feed_eof(self) -> list[Event]:
        """The connection ended: the events that completes (the end of an until-close body), or
        IncompleteResponse when the response was not complete."""
        state = self.state
        if state is DONE:
            return []
        if state is BODY and self._reader is ResponseParser._read_until_close:
            self.state = DONE  # not reusable: the close delimited the body
            return [_END]
        if state is ERROR:
            assert self._error is not None
            raise self._error
        where = "the response head" if state is AWAIT_HEAD else "the response body"
        raise self._fail(IncompleteResponse(f"connection closed in the middle of {where}"))

    # ------------------------------------------------------------------------------------------ readers

    def _fail(self, exc: ProtocolError) -> ProtocolError:
        self.state = ERROR
        self._error = exc
        self._held = []
        self._head_buf = None
        return exc

    def _hold(self, data: bytes, pos: int, need: int) -> None:
        """Keep data[pos:] until at least `need` bytes (counted from pos) are there."""
        self._held = [data[pos:] if pos else data]
        self._held_len = len(data) - pos
        self._need = need

    def _read_head(self, data: bytes, pos: int, events: list[Event]) -> list[Event]:
        while True:
            end = data.find(b"\r\n\r\n", pos)
            if end < 0:
                if len(data) - pos > self.max_head:
                    raise ProtocolError(f"response head larger than {self.max_head} bytes")
                if pos < len(data):
                    self._head_buf = bytearray(data[pos:] if pos else data)
                return events
            if end - pos > self.max_head:
                raise ProtocolError(f"response head larger than {self.max_head} bytes")
            head = data[pos:end]
            pos = end + 4
            lines = head.split(b"\r\n")
            # Any CR or LF left after splitting at CRLF is a bare one (each CRLF removed one of each).
            if len(head) - len(head.translate(None, b"\r\n")) != 2 * len(lines) - 2:
                raise ProtocolError("bare CR or LF in the response head")
            status_line = lines[0]
            known = _STATUS_LINES.get(status_line)
            if known is None:
                known = _status_line(status_line)
            status, reason, version = known
            if 100 <= status < 200 and status != 101:
                events.append(Informational(status, reason, version, _fields(lines[1:])))
                continue  # the final answer follows
            break

        # The final response's fields, with the framing ones picked out on the way.
        keep_alive = version == b"1.1"
        length: int | None = None
        transfer: bytes | None = None
        tokens: frozenset[bytes] = _NO_TOKENS
        fields: list[tuple[bytes, bytes]] = []
        picked: list[tuple[bytes, bytes]] = []  # the fields whose name has the length of a framing one
        append = fields.append
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            # bytes.strip returns the object itself when there is nothing to strip: whitespace around a
            # name (a folded line, a space before the colon) or no colon at all takes the slow path.
            if not colon or not name or name.strip() is not name:
                fields = _fields(lines[1:])
                picked = [f for f in fields if len(f[0]) in _FRAMING_NAME_LENGTHS]
                break
            field = (name, value.strip())
            append(field)
            if len(name) in _FRAMING_NAME_LENGTHS:  # connection, content-length, transfer-encoding
                picked.append(field)
        for name, value in picked:
            lname = name.lower()
            if lname == b"content-length":
                n = int(value) if value.isdigit() else _content_length(value)
                if length is not None and n != length:
                    raise ProtocolError("conflicting Content-Length fields")
                length = n
            elif lname == b"transfer-encoding":
                transfer = value.lower()  # the last field's last coding is the final one
            elif lname == b"connection":
                found = frozenset(t.strip() for t in value.lower().split(b","))
                tokens = tokens | found if tokens else found
                if b"close" in found:
                    keep_alive = False
                elif b"keep-alive" in found and version == b"1.0":
                    keep_alive = True
        if b"close" in tokens:
            keep_alive = False

        # RFC 9112 6.3, in its order.
        if self._head_request or status == 204 or status == 304:
            framing = NO_BODY
            length = None
        elif status == 101:  # the bytes after it are another protocol: relay them until the close
            framing = UNTIL_CLOSE
            keep_alive = False
            length = None
        elif transfer is not None:
            if transfer.rsplit(b",", 1)[-1].strip() == b"chunked":
                framing = CHUNKED
                if length is not None:  # both: chunked wins, and the connection is not to be trusted after
                    keep_alive = False
            else:
                framing = UNTIL_CLOSE
                keep_alive = False
            length = None
        elif length is not None:
            framing = CONTENT_LENGTH
        else:
            framing = UNTIL_CLOSE
            keep_alive = False
        response = Response(status, reason, version, fields, framing, length, keep_alive, tokens)
        self.response = response
        events.append(response)
        if framing is CONTENT_LENGTH:
            end = pos + length  # type: ignore[operator]  # not None: framing says so
            if end <= len(data):  # the whole body is here (the usual JSON answer): done in one step
                if length:
                    events.append(Data(data[pos:end]))
                self.state = DONE
                self.reusable = keep_alive and end == len(data)
                events.append(_END)
                return events
        elif framing is NO_BODY:
            return self._done(data, pos, events, _END)
        self.state = BODY
        reader = self._reader = _READERS[framing]
        if framing is CONTENT_LENGTH:
            self._remaining = length  # type: ignore[assignment]  # not None: framing says so
        if pos < len(data):
            return reader(self, data, pos, events)
        return events

    def _read_length(self, data: bytes, pos: int, events: list[Event]) -> list[Event]:
        n = len(data) - pos
        remaining = self._remaining
        if n < remaining:
            self._remaining = remaining - n
            events.append(Data(data[pos:] if pos else data))
            return events
        end = pos + remaining
        events.append(Data(data if not pos and end == len(data) else data[pos:end]))
        self._remaining = 0
        return self._done(data, end, events, _END)

    def _read_until_close(self, data: bytes, pos: int, events: list[Event]) -> list[Event]:
        if pos < len(data):
            events.append(Data(data[pos:] if pos else data))
        return events

    def _read_chunked(self, data: bytes, pos: int, events: list[Event]) -> list[Event]:
        """Whole chunks from data[pos:]; a partial one is held for the next read."""
        n = len(data)
        start = pos  # the run of complete raw chunks not yet reported
        raw = self.raw_chunks
        while pos < n:
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _MAX_CHUNK_LINE:
                    raise ProtocolError("chunk size line too long")
                self._hold(data, pos, n - pos + 1)
                break
            line = data[pos:eol]
            size = _CHUNK_SIZES.get(line)
            if size is None:
                size = _chunk_size(line)
            if not size:  # the last chunk: trailers follow
                if raw and pos > start:
                    events.append(RawChunks(data[start:pos]))
                self._reader = ResponseParser._read_trailers
                return self._read_trailers(data, eol + 2, events)
            chunk_end = eol + 4 + size
            if chunk_end > n:
                if size > self.max_chunk:
                    raise ProtocolError(f"chunk of {size} bytes is larger than {self.max_chunk}")
                self._hold(data, pos, chunk_end - pos)
                break
            if data[chunk_end - 2] != 13 or data[chunk_end - 1] != 10:  # CR LF; indexing is the cheapest test
                raise ProtocolError("chunk data not followed by CRLF")
            if not raw:
                events.append(Data(data[eol + 2 : chunk_end - 2]))
            pos = chunk_end
        if raw and pos > start:
            events.append(RawChunks(data if not start and pos == n else data[start:pos]))
        return events

    def _read_trailers(self, data: bytes, pos: int, events: list[Event]) -> list[Event]:
        """After the last chunk: trailer fields, then an empty line."""
        if data.startswith(b"\r\n", pos):
            return self._done(data, pos + 2, events, _END)
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            if len(data) - pos > self.max_head:
                raise ProtocolError(f"trailer section larger than {self.max_head} bytes")
            self._hold(data, pos, len(data) - pos + 1)
            return events
        block = data[pos:end]
        lines = block.split(b"\r\n")
        if _bare_cr_or_lf(block, lines):
            raise ProtocolError("bare CR or LF in the trailer section")
        return self._done(data, end + 4, events, EndOfMessage(tuple(_fields(lines))))

    def _done(self, data: bytes, pos: int, events: list[Event], end: EndOfMessage) -> list[Event]:
        self.state = DONE
        self._reader = None
        self.reusable = pos == len(data) and self.response is not None and self.response.keep_alive
        events.append(end)
        return events


_READERS: dict[str, _Reader] = {
    CONTENT_LENGTH: ResponseParser._read_length,
    CHUNKED: ResponseParser._read_chunked,
    UNTIL_CLOSE: ResponseParser._read_until_close,
}


# ================================================================================================ requests
#
# The server side: `RequestParser` reads the requests a client sends on one connection, one at a time,
# however the bytes are split. Events for one request, in order: one `Request` (the head and the framing
# its body has), `Data` pieces of the decoded body, one `EndOfMessage` (with the trailers of a chunked body).
# Then the parser stops in DONE and keeps whatever came after (a pipelined next request) until the server
# has answered and calls `next()`. Stricter than the response parser where RFC 9112 tells a server to be
# (request smuggling): whitespace before a colon, folded lines, both Content-Length and Transfer-Encoding,
# a transfer coding other than a final chunked are all errors (400). A head larger than `max_head` raises
# `HeadTooLarge` (431).
#
# The data plane runs `LlhttpRequestParser` (proxy/wire/http1_llhttp.py): this parser with the header fields
# split by llhttp; it falls back to `_head` here for anything unusual, and this one stays the reference its
# differential test (tests/wire/test_http1_differential.py) compares it with.

IDLE = "idle"  # between requests: nothing of the next one has arrived (a request parser state)

_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_CTL = bytes(range(33)) + b"\x7f"  # not allowed in a request target (nor a space)
_TCHAR_BYTES = bytes(sorted(_TCHAR))  # `name.translate(None, _TCHAR_BYTES)` is empty for a token
# RFC 9110 5.5: a CTL other than HTAB (NUL included) is invalid in a field value; a proxy must not pass it on.
_FIELD_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_METHODS: dict[bytes, str] = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")}


class HeadTooLarge(ProtocolError):
    """The request's head is larger than the parser's `max_head` (answered 431)."""


class IncompleteRequest(ProtocolError):
    """The connection ended in the middle of a request."""


class Request:
    """A request's head. `headers`: every field as received (name as sent, value stripped), in order.
    `framing`: NO_BODY, CONTENT_LENGTH or CHUNKED; `content_length` only with CONTENT_LENGTH.
    `header_bytes`: the fields' size as the limit counts it (name + value + 4 per field).
    `keep_alive`: the client lets the connection carry another request after this one."""

    __slots__ = ("method", "target", "http_version", "headers", "framing", "content_length", "keep_alive",
                 "expect_continue", "header_bytes")

    def __init__(self, method: str, target: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]],
                 framing: str, content_length: int | None, keep_alive: bool, expect_continue: bool,
                 header_bytes: int) -> None:
        self.method = method
        self.target = target
        self.http_version = http_version
        self.headers = headers
        self.framing = framing
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.header_bytes = header_bytes

    def __repr__(self) -> str:
        return f"Request({self.method} {self.target!r}, framing={self.framing!r}, keep_alive={self.keep_alive})"


# A memo of valid request lines: clients of an LLM API send a handful (POST /v1/chat/completions HTTP/1.1),
# and the line is the request's one field validated byte by byte. Only short valid lines are kept (a pure
# function of the line, so no state leaks between connections), at most _REQUEST_LINES_MAX of them.
_REQUEST_LINES: dict[bytes, tuple[str, bytes, bytes]] = {}
_REQUEST_LINES_MAX = 1024
_REQUEST_LINE_MEMO_BYTES = 256


def _request_line(line: bytes) -> tuple[str, bytes, bytes]:
    parsed = _parse_request_line(line)
    if len(line) <= _REQUEST_LINE_MEMO_BYTES and len(_REQUEST_LINES) < _REQUEST_LINES_MAX:
        _REQUEST_LINES[line] = parsed
    return parsed


def _parse_request_line(line: bytes) -> tuple[str, bytes, bytes]:
    method, sp, rest = line.partition(b" ")
    target, sp2, version = rest.partition(b" ")
    if not sp or not sp2 or not method or not target or b" " in version:
        raise ProtocolError(f"malformed request line {line[:80]!r}")
    if version != b"HTTP/1.1" and version != b"HTTP/1.0":
        raise ProtocolError(f"unsupported HTTP version {version[:20]!r}")
    name = _METHODS.get(method)
    if name is None:
        if not all(c in _TCHAR for c in method):
            raise ProtocolError(f"malformed method {method[:20]!r}")
        if method == b"PRI":  # RFC 9113 11.1: the HTTP/2 preface's method, never a client's; not passed on
            raise ProtocolError("PRI is the HTTP/2 connection preface, not an HTTP/1.1 request")
        name = method.decode("ascii")
    if len(target.translate(None, _CTL)) != len(target):
        raise ProtocolError("control character in the request target")
    if target[:1] != b"/" and b"://" not in target[:16] and (target != b"*" or name != "OPTIONS"):
        raise ProtocolError(f"request target {target[:40]!r} is not a path or an absolute URL")  # RFC 9112 3.2
    return name, target, version[5:]


RequestEvent = Union[Request, Data, EndOfMessage]


def request_framing(picked: list[tuple[bytes, bytes]], version: bytes) -> tuple[str, int | None, bool, bool]:
    """RFC 9112 6: a request's framing from its fields that may set it (`picked`: Content-Length,
    Transfer-Encoding, Connection and Expect, in order; others are ignored) and its version: (framing,
    content length or None, keep-alive, Expect: 100-continue). Raises ProtocolError for what a request
    must not do (conflicting lengths, a length and a coding, a coding that does not end in chunked, a chunked
    HTTP/1.0 body). The one copy of these rules, for `RequestParser` and `LlhttpRequestParser`."""
    keep_alive = version == b"1.1"
    length: int | None = None
    transfer: bytes | None = None
    expect = False
    for name, value in picked:
        lname = name.lower()
        if lname == b"content-length":
            v = int(value) if value.isdigit() else _content_length(value)
            if length is not None and v != length:
                raise ProtocolError("conflicting Content-Length fields")
            length = v
        elif lname == b"transfer-encoding":
            transfer = value.lower() if transfer is None else transfer + b", " + value.lower()
        elif lname == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens and version == b"1.0":
                keep_alive = True
        elif lname == b"expect":
            expect = value.lower() == b"100-continue"
    if transfer is not None:
        if length is not None:
            raise ProtocolError("both Content-Length and Transfer-Encoding")
        if transfer.rsplit(b",", 1)[-1].strip() != b"chunked" or version == b"1.0":
            raise ProtocolError(f"unsupported Transfer-Encoding {transfer[:40]!r}")
        return CHUNKED, None, keep_alive, expect
    if length:
        return CONTENT_LENGTH, length, keep_alive, expect
    return NO_BODY, None, keep_alive, expect


class RequestParser:
    """Parses the requests of one client connection; see the block comment above."""

    __slots__ = ("state", "request", "max_head", "max_chunk", "_buf", "_remaining", "_chunked_stage", "_error")

    def __init__(self, *, max_head: int = MAX_HEAD, max_chunk: int = MAX_CHUNK) -> None:
        self.state = IDLE
        self.request: Request | None = None
        self.max_head = max_head
        self.max_chunk = max_chunk
        self._buf = b""  # bytes received and not consumed yet (a partial head or chunk, a pipelined request)
        self._remaining = 0  # content-length: body bytes still to come
        self._chunked_stage = 0  # 0: size line next, 1: trailers next
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held and not parsed yet (in DONE: what the client pipelined after this request)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[RequestEvent]:
        """The events that `data` completes (none past the end of the current request)."""
        state = self.state
        if state is ERROR:
            assert self._error is not None
            raise self._error
        if state is DONE:
            self._buf += data  # pipelined: parsed after next()
            return []
        if self._buf:
            data = self._buf + data
            self._buf = b""
        elif not data:
            return []
        events: list[RequestEvent] = []
        try:
            if state is BODY:
                return self._body(data, 0, events)
            return self._head(data, events)
        except ProtocolError as exc:  # what the bytes before completed belongs to the request that failed
            self.state = ERROR
            self._error = exc
            self._buf = b""
            raise

    def next(self) -> list[RequestEvent]:
        """The current request was answered: start on the next one (with what was pipelined)."""
        if self.state is not DONE:
            raise RuntimeError("next() before the end of the current request")
        self.state = IDLE
        self.request = None
        data, self._buf = self._buf, b""
        return self.feed(data)

    def feed_eof(self) -> None:
        """The client closed its side: fine between requests, IncompleteRequest inside one."""
        if self.state is ERROR:
            assert self._error is not None
            raise self._error
        if self.state is BODY or (self.state is IDLE and self._buf):
            where = "body" if self.state is BODY else "head"
            self.state = ERROR
            self._error = IncompleteRequest(f"connection closed in the middle of the request {where}")
            raise self._error

    @property
    def started(self) -> bool:
        """Some bytes of a request not yet complete are here (its head is being read, or its body)."""
        return self.state is BODY or (self.state is IDLE and bool(self._buf))

    # ---------------------------------------------------------------------------------------- head

    def _head(self, data: bytes, events: list[RequestEvent]) -> list[RequestEvent]:
        start = 0
        while data.startswith(b"\r\n", start):  # RFC 9112 2.2: ignore empty lines before a request line
            start += 2
        end = data.find(b"\r\n\r\n", start)
        if end < 0:
            if len(data) - start > self.max_head:
                raise HeadTooLarge(f"request head larger than {self.max_head} bytes")
            self._buf = data[start:] if start else data
            return events
        if end - start > self.max_head:
            raise HeadTooLarge(f"request head larger than {self.max_head} bytes")
        head = data[start:end]
        lines = head.split(b"\r\n")
        if len(head) - len(head.translate(None, b"\r\n")) != 2 * len(lines) - 2:
            raise ProtocolError("bare CR or LF in the request head")
        line = lines[0]
        known = _REQUEST_LINES.get(line)
        method, target, version = known if known is not None else _request_line(line)
        if _FIELD_CTL.search(head, len(line)):
            raise ProtocolError("control character in a header field")
        fields: list[tuple[bytes, bytes]] = []
        append = fields.append
        picked: list[tuple[bytes, bytes]] = []  # the fields that may set the framing
        size = 0
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name.translate(None, _TCHAR_BYTES):  # RFC 9110 5.1: a name is a token
                if line[:1] in (b" ", b"\t"):
                    raise ProtocolError("folded header line in a request")
                raise ProtocolError(f"malformed header line {line[:80]!r}")
            value = value.strip()
            field = (name, value)
            append(field)
            n = len(name)
            size += n + len(value) + 4
            if n == 14 or n == 17 or n == 10 or n == 6:  # content-length, transfer-encoding, connection, expect
                picked.append(field)
        framing, length, keep_alive, expect = request_framing(picked, version)
        return self._begin(Request(method, target, version, fields, framing, length, keep_alive, expect, size),
                           data, end + 4, events)

    def _begin(self, request: Request, data: bytes, pos: int, events: list[RequestEvent]) -> list[RequestEvent]:
        """The head is parsed (the body starts at data[pos]): report it and read what of the body is here."""
        self.request = request
        events.append(request)
        framing = request.framing
        length = request.content_length
        if framing is NO_BODY:
            return self._done(data, pos, events, _END)
        if framing is CONTENT_LENGTH:
            stop = pos + length  # type: ignore[operator]  # set with CONTENT_LENGTH
            if stop <= len(data):  # the usual small POST: head and body in one read
                events.append(Data(data[pos:stop] if pos or stop != len(data) else data))
                return self._done(data, stop, events, _END)
            self._remaining = length  # type: ignore[assignment]  # set with CONTENT_LENGTH
        else:
            self._chunked_stage = 0
        self.state = BODY
        if pos < len(data):
            return self._body(data, pos, events)
        return events

    # ---------------------------------------------------------------------------------------- body

    def _body(self, data: bytes, pos: int, events: list[RequestEvent]) -> list[RequestEvent]:
        request = self.request
        assert request is not None
        if request.framing is CONTENT_LENGTH:
            n = len(data) - pos
            remaining = self._remaining
            if n < remaining:
                self._remaining = remaining - n
                if n:
                    events.append(Data(data[pos:] if pos else data))
                return events
            stop = pos + remaining
            self._remaining = 0
            events.append(Data(data[pos:stop]))
            return self._done(data, stop, events, _END)
        n = len(data)
        while pos < n:
            if self._chunked_stage == 1:  # after the last chunk: trailers, then an empty line
                if data.startswith(b"\r\n", pos):
                    return self._done(data, pos + 2, events, _END)
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > self.max_head:
                        raise HeadTooLarge(f"trailer section larger than {self.max_head} bytes")
                    break
                block = data[pos:end]
                lines = block.split(b"\r\n")
                if _bare_cr_or_lf(block, lines):
                    raise ProtocolError("bare CR or LF in the trailer section")
                return self._done(data, end + 4, events, EndOfMessage(tuple(_fields(lines))))
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _MAX_CHUNK_LINE:
                    raise ProtocolError("chunk size line too long")
                break
            line = data[pos:eol]
            size = _CHUNK_SIZES.get(line)
            if size is None:
                size = _chunk_size(line)
            if not size:
                self._chunked_stage = 1
                pos = eol + 2
                continue
            if size > self.max_chunk:
                raise ProtocolError(f"chunk of {size} bytes is larger than {self.max_chunk}")
            chunk_end = eol + 4 + size
            if chunk_end > n:
                break
            if data[chunk_end - 2] != 13 or data[chunk_end - 1] != 10:
                raise ProtocolError("chunk data not followed by CRLF")
            events.append(Data(data[eol + 2 : chunk_end - 2]))
            pos = chunk_end
        self._buf = data[pos:] if pos < n else b""
        return events

    def _done(self, data: bytes, pos: int, events: list[RequestEvent], end: EndOfMessage) -> list[RequestEvent]:
        self.state = DONE
        self._buf = data[pos:] if pos < len(data) else b""
        events.append(end)
        return events


__all__ += ["HeadTooLarge", "IDLE", "IncompleteRequest", "Request", "RequestEvent", "RequestParser"]
