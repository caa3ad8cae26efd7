"""The data plane's HTTP/1.1 request parser: `RequestParser` (proxy/wire/http1.py) with the header fields
split and validated by llhttp (the C parser of Node.js and uvicorn, through httptools) instead of Python.

Same interface, events and errors: `LlhttpRequestParser` is a `RequestParser` whose `_head` takes a fast
path for a complete head and hands every other case to the reference `RequestParser._head`, which then
decides (and raises) exactly as before.

- Only the fields move to C. The request line is validated by the reference's own function (and memo);
  the framing fields (Content-Length, Transfer-Encoding, Connection, Expect) go through the reference's
  rules (the same code, so the same 400s for a chunked HTTP/1.0 body or a coding that is not a final
  chunked); the body, chunked or not, trailers, pipelining and `next()`, `feed_eof` are the reference's.
- The fast path runs on a complete head no larger than `max_head` with a valid request line. Anything
  else goes to the reference: an incomplete or too-large head, empty lines before the request line, an
  invalid request line, and every head llhttp refuses. A request llhttp refuses and the reference accepts
  (a byte >= 0x80 in the target, a method llhttp does not know, `Content-Length: 5, 5`, a Content-Length
  of 2^64 or more, `Connection: upgrade` + `Upgrade`) is therefore still accepted, and every error is the
  reference's own, message and order of checks included.
- Where llhttp accepts what the reference refuses, the reference's check runs here: the request line
  (llhttp takes two spaces after the method, HTTP/0.9 and 2.0, PRI), and trailing whitespace of a value,
  which llhttp keeps and the reference strips. The rest of the reference's refusals llhttp makes too, so
  they fall back: bare CR or LF, control characters (NUL, DEL) in a value, obs-fold, whitespace before a
  colon, a name that is not a token, duplicate Content-Length, Content-Length with Transfer-Encoding.
  No smuggling defence is weaker: framing is decided by the reference's rules on the fields, and a field
  list is used only when llhttp and the reference agree it is valid.

tests/wire/test_http1_differential.py runs both parsers on the same byte streams (hypothesis: requests
one or two anomalies away from valid, pipelined, split at random, bytes mutated) and fails on any
difference in events, states or errors; `python -m loadtest.fuzz request_diff` is the same comparison
under atheris.

Measured (feed + next of one request, timeit best of 7, same process): the benchmark's wrk-shaped POST
(3 fields) 3.1 -> 2.6 µs; an OpenAI Python SDK POST (16 fields) 9.4 -> 6.5 µs. llhttp costs ~0.16 µs a
parser and ~0.25 µs a field (the Python callback), the reference ~0.45 µs a field.
"""

from __future__ import annotations

from typing import Any

import httptools

from proxy.wire.http1 import (
    _REQUEST_LINES, ProtocolError, Request, RequestEvent, RequestParser, _request_line, request_framing,
)

__all__ = ["LlhttpRequestParser"]

_LLHTTP_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)
_HttpRequestParser: Any = httptools.HttpRequestParser


class LlhttpRequestParser(RequestParser):
    """`RequestParser` with the header fields split by llhttp; see the module docstring."""

    __slots__ = ("_fields", "_picked", "_size")  # set by _head before llhttp calls on_header

    def on_header(self, name: bytes, value: bytes) -> None:
        """llhttp's callback, once per field (name as sent, value without leading whitespace)."""
        value = value.rstrip(b" \t")  # the same object when there is nothing to strip
        field = (name, value)
        self._fields.append(field)
        n = len(name)
        self._size += n + len(value) + 4
        if n == 14 or n == 17 or n == 10 or n == 6:  # content-length, transfer-encoding, connection, expect
            self._picked.append(field)

    def _head(self, data: bytes, events: list[RequestEvent]) -> list[RequestEvent]:
        end = data.find(b"\r\n\r\n")
        if end <= 0 or end > self.max_head:  # incomplete, too large, or starts with an empty line
            return RequestParser._head(self, data, events)
        line = data[:data.find(b"\r\n")]
        known = _REQUEST_LINES.get(line)
        if known is None:  # not seen yet (or the memo is full): validated as the reference does
            try:
                known = _request_line(line)
            except ProtocolError:  # the reference checks other things first: its own error, its order
                return RequestParser._head(self, data, events)
        fields: list[tuple[bytes, bytes]] = []
        picked: list[tuple[bytes, bytes]] = []
        self._fields = fields
        self._picked = picked
        self._size = 0
        try:
            _HttpRequestParser(self).feed_data(data[:end + 4])
        except _LLHTTP_ERRORS:
            return RequestParser._head(self, data, events)  # llhttp refuses it: the reference decides
        method, target, version = known
        framing, length, keep_alive, expect = request_framing(picked, version)  # the reference's rules
        return self._begin(Request(method, target, version, fields, framing, length, keep_alive, expect, self._size),
                           data, end + 4, events)
