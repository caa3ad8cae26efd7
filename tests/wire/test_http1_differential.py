"""Differential: the llhttp-backed `LlhttpRequestParser` against the reference `RequestParser` on the same byte
streams (random requests, pipelined, split at random offsets, mutated bytes): the same events, the same
states and buffered counts after every piece, the same errors (type and message)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loadtest.fuzz.differential import observe as run
from proxy.wire.http1 import RequestParser
from proxy.wire.http1_llhttp import LlhttpRequestParser


# Each part of a request is drawn from the usual values mostly and from odd ones sometimes, so most requests
# are valid (and take the llhttp path once the reference has remembered their request line) and the odd
# ones are one or two anomalies away from valid.
METHODS = ([b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS"],
           [b"PROPFIND", b"FOO", b"PRI", b"get", b"G(T", b"CONNECT", b""])
TARGETS = ([b"/", b"/v1/chat/completions", b"/a?b=c&d"],
           [b"*", b"http://h/x", b"/a\xe9", b"/a\tb", b"/a\x01", b"", b"h:443", b"/%zz", b"/a b"])
VERSIONS = ([b"HTTP/1.1", b"HTTP/1.0"], [b"HTTP/0.9", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 ", b"HTTP/1.2", b""])
NAMES = ([b"Host", b"Content-Type", b"Content-Length", b"content-length", b"Transfer-Encoding", b"Connection",
          b"connection", b"Expect", b"X-Session-Id", b"X-Request-Id", b"Accept", b"Upgrade"],
         [b"A b", b"", b"X\x00", b"N\xe9", b"Name ", b" Name", b"X(y", b"X\ty"])
VALUES = ([b"v", b"", b"application/json", b"0", b"5", b"7", b"chunked", b"Chunked", b"gzip, chunked", b"close",
           b"keep-alive", b"Upgrade, close", b"100-continue", b"100-Continue", b"a  b", b"caf\xe9", b"*/*"],
          [b" ", b"5, 5", b"5, 6", b"-1", b"+5", b"05", b"1 2", b"chunked, gzip", b"gzip", b"x \t", b"x ", b"\tx",
           b"a\x00b", b"a\x7fb", b"a\x0bb", b"a\x0cb", b"a\rb", b"a\nb", b"99999999999999999999999", b"upgrade"])
SEPS = ([b" "], [b"  ", b"\t", b""])
COLONS = ([b": ", b":"], [b":  ", b":\t", b" :", b": \t", b""])
EOLS = ([b"\r\n"], [b"\n", b"\r", b"\r\r\n", b" \r\n"])
LEADS = ([b""], [b"\r\n", b"\r\n\r\n", b"\n"])
BODIES = ([b"", b"hello", b"5\r\nhello\r\n0\r\n\r\n"],
          [b"3;x=1\r\nabc\r\n0\r\nT: 1\r\n\r\n", b"zz\r\n", b"2\r\nabc\r\n", b"0\r\n\r\n", b"0\r\nT:\r\n\r\n"])


def pick(draw: Any, choices: tuple[list[bytes], list[bytes]]) -> bytes:
    usual, odd = choices
    return draw(st.sampled_from(odd if draw(st.integers(0, 15)) == 0 else usual))  # type: ignore[no-any-return]


@st.composite
def request(draw: Any) -> bytes:
    line = pick(draw, METHODS) + pick(draw, SEPS) + pick(draw, TARGETS) + b" " + pick(draw, VERSIONS)
    fields = []
    for _ in range(draw(st.integers(0, 6))):
        fields.append(pick(draw, NAMES) + pick(draw, COLONS) + pick(draw, VALUES) + pick(draw, EOLS))
        if draw(st.integers(0, 30)) == 0:
            fields.append(b" folded\r\n")
    return pick(draw, LEADS) + line + b"\r\n" + b"".join(fields) + b"\r\n" + pick(draw, BODIES)


@st.composite
def stream(draw: Any) -> tuple[list[bytes], int, bool]:
    wire = b"".join(draw(st.lists(request(), min_size=1, max_size=3)))
    if draw(st.integers(0, 3)) == 0:  # mutate: flip, insert or delete a few bytes
        data = bytearray(wire)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, max(0, len(data) - 1)))
            op = draw(st.integers(0, 2))
            b = draw(st.sampled_from([0, 9, 10, 13, 32, 58, 0x7F, 0xE9, 65]))
            if op == 0 and data:
                data[i] = b
            elif op == 1:
                data.insert(i, b)
            elif data:
                del data[i]
        wire = bytes(data)
    cuts = sorted(draw(st.lists(st.integers(0, len(wire)), max_size=4)))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]
    return pieces, draw(st.sampled_from([64 * 1024, 64, 30])), draw(st.booleans())


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream())
def test_llhttp_parser_matches_the_reference(case: tuple[list[bytes], int, bool]) -> None:
    pieces, max_head, eof = case
    assert run(LlhttpRequestParser, pieces, max_head, eof) == run(RequestParser, pieces, max_head, eof)


# Heads llhttp and the reference judge differently, each way: what the llhttp parser must do as the reference.
LENIENCY = [
    b"PROPFIND /x HTTP/1.1\r\nHost: h\r\n\r\n",  # a method llhttp does not know: accepted
    b"GET /caf\xe9 HTTP/1.1\r\n\r\n",  # a byte >= 0x80 in the target (llhttp refuses it): accepted
    b"POST / HTTP/1.1\r\nContent-Length: 2, 2\r\n\r\nab",  # one value repeated (RFC 9110 8.6): accepted
    b"POST / HTTP/1.1\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\nab",  # llhttp: duplicate
    b"POST / HTTP/1.1\r\nContent-Length: 18446744073709551616\r\n\r\n",  # llhttp: overflow; waits for it
    b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",  # llhttp stops for the upgrade
    b"CONNECT h:443 HTTP/1.1\r\n\r\n",  # not a path: refused
    b"GET  / HTTP/1.1\r\n\r\n",  # llhttp takes two spaces: refused
    b"GET / HTTP/0.9\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n", b"PRI / HTTP/1.1\r\n\r\n",  # llhttp takes them
    b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # llhttp takes it: refused
    b"GET / HTTP/1.1\r\nA: b \t\r\nB:\t c\r\n\r\n",  # llhttp keeps trailing whitespace: stripped
    b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", b"GET / HTTP/1.1\r\nA : b\r\n\r\n",
    b"GET / HTTP/1.1\r\nA: b\nC: d\r\n\r\n", b"GET / HTTP/1.1\r\nA: b\rc\r\n\r\n",
    b"GET / HTTP/1.1\r\nA: b\x00\r\n\r\n", b"GET / HTTP/1.1\r\nA: \x7f\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"\r\n\r\nGET / HTTP/1.1\r\n\r\n",
]


@pytest.mark.parametrize("wire", LENIENCY)
def test_where_llhttp_judges_differently_the_reference_decides(wire: bytes) -> None:
    for pieces in ([wire], [wire[:len(wire) // 2], wire[len(wire) // 2:]], [wire[i:i + 1] for i in range(len(wire))]):
        for max_head in (64 * 1024, 40):
            assert run(LlhttpRequestParser, pieces, max_head, True) == run(RequestParser, pieces, max_head, True)


def test_the_fast_path_is_taken() -> None:
    """The comparison above means something only if the llhttp path runs (not the fallback every time)."""
    wire = b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    RequestParser().feed(wire)  # the reference remembers the request line
    p = LlhttpRequestParser()
    events = p.feed(wire)
    assert p._fields == events[0].headers  # type: ignore[union-attr]  # set only by the llhttp path
