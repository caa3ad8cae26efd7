"""The sans-I/O HTTP/1.1 request parser, fed bytes directly: every framing, every split offset, byte by byte,
pipelined requests, keep-alive rules, the head limit, and malformed input as ProtocolError."""

from __future__ import annotations

from typing import Any, Iterable

import pytest

from proxy.wire.http1 import (
    BODY, CHUNKED, CONTENT_LENGTH, DONE, ERROR, IDLE, NO_BODY, Data, EndOfMessage, Event, HeadTooLarge,
    IncompleteRequest, ProtocolError, Request, RequestParser,
)


def summary(events: Iterable[Event]) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, Request):
            out.append(("request", ev.method, ev.target, ev.http_version, ev.headers, ev.framing,
                        ev.content_length, ev.keep_alive, ev.expect_continue, ev.header_bytes))
        elif isinstance(ev, Data):
            assert ev.data, "no empty body events"
            if out and out[-1][0] == "data":
                out[-1] = ("data", out[-1][1] + ev.data)
            else:
                out.append(("data", ev.data))
        else:
            assert isinstance(ev, EndOfMessage)
            out.append(("end", ev.trailers))
    return out


def splits(wire: bytes) -> Iterable[list[bytes]]:
    yield [wire]
    for i in range(len(wire) + 1):
        yield [wire[:i], wire[i:]]
    yield [wire[i : i + 1] for i in range(len(wire))]


def feed_requests(pieces: Iterable[bytes], **kw: Any) -> list[Any]:
    """Every request in the pieces, answering each (next()) as soon as it is complete."""
    p = RequestParser(**kw)
    out: list[Event] = []
    for piece in pieces:
        events = p.feed(piece)
        while events:
            out += events
            events = p.next() if p.state is DONE else []
    return summary(out)


def assert_split_invariant(wire: bytes, **kw: Any) -> list[Any]:
    results = [feed_requests(pieces, **kw) for pieces in splits(wire)]
    for r in results[1:]:
        assert r == results[0]
    return results[0]


POST = (b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Content-Length: 11\r\n\r\n{\"a\": \"b\"}\n")


def test_content_length_request_at_every_split() -> None:
    out = assert_split_invariant(POST)
    assert out[0][:4] == ("request", "POST", b"/v1/completions?x=1", b"1.1")
    assert out[0][4] == [(b"Host", b"proxy"), (b"Content-Type", b"application/json"), (b"Content-Length", b"11")]
    assert out[0][5:9] == (CONTENT_LENGTH, 11, True, False)
    assert out[1:] == [("data", b'{"a": "b"}\n'), ("end", ())]


def test_one_read_small_post_is_one_step_without_copy() -> None:
    p = RequestParser()
    events = p.feed(POST)
    assert [type(e) for e in events] == [Request, Data, EndOfMessage] and p.state is DONE
    assert p.buffered == 0


def test_chunked_request_with_trailers_at_every_split() -> None:
    wire = (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Sum: 1\r\n\r\n")
    out = assert_split_invariant(wire)
    assert out[0][5] == CHUNKED and out[0][6] is None
    assert out[1:] == [("data", b"hello world"), ("end", ((b"X-Sum", b"1"),))]


def test_pipelined_requests_wait_for_next() -> None:
    wire = POST + b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n" + POST.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)
    out = assert_split_invariant(wire)
    requests = [e for e in out if e[0] == "request"]
    assert [(r[1], r[5], r[7]) for r in requests] == [("POST", CONTENT_LENGTH, True), ("GET", NO_BODY, True),
                                                      ("POST", CONTENT_LENGTH, False)]
    p = RequestParser()
    assert summary(p.feed(wire))[-1] == ("end", ())
    assert p.state is DONE and p.buffered == len(wire) - len(POST)  # the rest waits for the answer
    assert p.feed(b"more") == [] and p.buffered == len(wire) - len(POST) + 4
    with pytest.raises(RuntimeError):
        RequestParser().next()


def test_keep_alive_rules() -> None:
    def ka(head: bytes) -> bool:
        ev = RequestParser().feed(head + b"\r\n")[0]
        assert isinstance(ev, Request)
        return ev.keep_alive

    assert ka(b"GET / HTTP/1.1\r\n")
    assert not ka(b"GET / HTTP/1.1\r\nConnection: close\r\n")
    assert not ka(b"GET / HTTP/1.1\r\nConnection: Upgrade, Close\r\n")
    assert not ka(b"GET / HTTP/1.0\r\n")
    assert ka(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n")


def test_expect_and_header_bytes() -> None:
    ev = RequestParser().feed(b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n")[0]
    assert isinstance(ev, Request) and ev.expect_continue
    assert ev.header_bytes == len(b"Expect") + len(b"100-Continue") + 4 + len(b"Content-Length") + 1 + 4


def test_many_small_headers_are_fine_and_the_total_is_the_limit() -> None:
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n"
    ev = RequestParser().feed(head)[0]
    assert isinstance(ev, Request) and len(ev.headers) == 300
    with pytest.raises(HeadTooLarge):
        RequestParser(max_head=1000).feed(head)
    p = RequestParser(max_head=1000)
    with pytest.raises(HeadTooLarge):  # also when the head never ends
        for i in range(2000):
            p.feed(b"X")
    assert p.state is ERROR
    with pytest.raises(HeadTooLarge):  # every later call raises it again
        p.feed(b"\r\n\r\n")


def test_leading_empty_lines_are_skipped() -> None:
    out = assert_split_invariant(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n")
    assert out[0][1] == "GET"


@pytest.mark.parametrize("wire", [
    b"GET /\r\n\r\n",  # no version
    b"GET / HTTP/2.0\r\n\r\n",
    b"GE(T / HTTP/1.1\r\n\r\n",
    b"GET /a b HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET / HTTP/1.1\r\nName : v\r\n\r\n",  # whitespace before the colon
    b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
    b"GET / HTTP/1.1\r\nA: b\nC: d\r\n\r\n",  # bare LF
    b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
])
def test_malformed_requests_raise_at_every_split(wire: bytes) -> None:
    for pieces in splits(wire):
        p = RequestParser()
        with pytest.raises(ProtocolError) as info:
            for piece in pieces:
                p.feed(piece)
        assert not isinstance(info.value, HeadTooLarge)
        assert p.state is ERROR


def test_eof_between_requests_is_fine_inside_one_is_not() -> None:
    p = RequestParser()
    p.feed_eof()
    p = RequestParser()
    p.feed(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\nabcd")
    assert p.state is BODY and p.started
    with pytest.raises(IncompleteRequest):
        p.feed_eof()
    p = RequestParser()
    p.feed(b"GET / HT")
    assert p.state is IDLE and p.started
    with pytest.raises(IncompleteRequest):
        p.feed_eof()


def test_unknown_methods_pass_as_tokens() -> None:
    ev = RequestParser().feed(b"PROPFIND /x HTTP/1.1\r\n\r\n")[0]
    assert isinstance(ev, Request) and ev.method == "PROPFIND"
