"""The sans-I/O HTTP/1.1 response parser, fed bytes directly: every framing, every split offset, byte by byte,
1xx before the final answer, trailers, keep-alive rules, and malformed input as ProtocolError."""

from __future__ import annotations

from typing import Any, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire.http1 import (
    AWAIT_HEAD, BODY, CHUNKED, CONTENT_LENGTH, DONE, ERROR, NO_BODY, UNTIL_CLOSE, Data, EndOfMessage, Event,
    IncompleteResponse, Informational, ProtocolError, RawChunks, Response, ResponseParser,
)


def summary(events: Iterable[Event]) -> list[Any]:
    """Events as comparable values; adjacent Data (or RawChunks) merged, since a split may cut a body."""
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, Informational):
            out.append(("info", ev.status, ev.reason, ev.http_version, ev.headers))
        elif isinstance(ev, Response):
            out.append(("response", ev.status, ev.reason, ev.http_version, ev.headers, ev.framing,
                        ev.content_length, ev.keep_alive, ev.connection))
        elif isinstance(ev, (Data, RawChunks)):
            kind = "data" if isinstance(ev, Data) else "raw"
            assert ev.data, "no empty body events"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + ev.data)
            else:
                out.append((kind, ev.data))
        else:
            assert isinstance(ev, EndOfMessage)
            out.append(("end", ev.trailers))
    return out


def feed_all(pieces: Iterable[bytes], *, head_request: bool = False, raw: bool = False,
             eof: bool = False) -> tuple[list[Event], ResponseParser]:
    p = ResponseParser(head_request)
    p.raw_chunks = raw
    events: list[Event] = []
    for piece in pieces:
        events += p.feed(piece)
    if eof:
        events += p.feed_eof()
    return events, p


def splits(wire: bytes) -> Iterable[list[bytes]]:
    """The same bytes in one read, cut in two at every offset, and one byte at a time."""
    yield [wire]
    for i in range(len(wire) + 1):
        yield [wire[:i], wire[i:]]
    yield [wire[i : i + 1] for i in range(len(wire))]


def assert_split_invariant(wire: bytes, **kw: Any) -> list[Any]:
    whole = summary(feed_all([wire], **kw)[0])
    for pieces in splits(wire):
        events, _ = feed_all(pieces, **kw)
        assert summary(events) == whole, [len(p) for p in pieces]
    return whole


JSON = b'{"id":"cmpl-1","object":"text_completion","choices":[{"text":"hello","index":0}]}'
CL_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nX-Id: 7\r\n\r\n%s"
               % (len(JSON), JSON))
CHUNKS = [b"data: a\n\n", b"data: bb\n\n", b"x" * 300]
EXTENSIONS = [b"", b';ext=1;q="v"', b" ;x"]
RAW_CHUNKS = b"".join(b"%x%s\r\n%s\r\n" % (len(c), e, c) for c, e in zip(CHUNKS, EXTENSIONS))
CHUNKED_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + RAW_CHUNKS + b"0\r\nX-Trailer: t\r\nX-Other:  two words \r\n\r\n")


# ---------------------------------------------------------------------------------------------- framings


def test_content_length_at_every_split() -> None:
    whole = assert_split_invariant(CL_RESPONSE)
    assert whole == [
        ("response", 200, b"OK", b"1.1",
         [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(JSON)), (b"X-Id", b"7")],
         CONTENT_LENGTH, len(JSON), True, frozenset()),
        ("data", JSON),
        ("end", ()),
    ]


def test_content_length_in_one_read_is_passed_through_without_copying_the_body() -> None:
    p = ResponseParser()
    head = CL_RESPONSE[: -len(JSON)]
    assert len(p.feed(head)) == 1
    body_events = p.feed(JSON)
    assert body_events[0].data is JSON  # type: ignore[union-attr]
    assert p.state is DONE and p.reusable


def test_chunked_with_extensions_and_trailers_at_every_split() -> None:
    whole = assert_split_invariant(CHUNKED_RESPONSE)
    assert whole[1:] == [("data", b"".join(CHUNKS)), ("end", ((b"X-Trailer", b"t"), (b"X-Other", b"two words")))]
    assert whole[0][5] == CHUNKED and whole[0][6] is None and whole[0][7] is True
    # Whole chunks only, in either mode: the pieces themselves do not depend on how the bytes were split.
    for pieces in splits(CHUNKED_RESPONSE):
        events, p = feed_all(pieces)
        assert [e.data for e in events if isinstance(e, Data)] == CHUNKS
        assert p.state is DONE and p.reusable


def test_raw_chunks_are_the_framed_bytes_at_every_split() -> None:
    whole = assert_split_invariant(CHUNKED_RESPONSE, raw=True)
    assert whole[1] == ("raw", RAW_CHUNKS)  # size lines and extensions as sent; never the last chunk
    assert whole[2][0] == "end"
    for pieces in splits(CHUNKED_RESPONSE):
        events, _ = feed_all(pieces, raw=True)
        raws = [e.data for e in events if isinstance(e, RawChunks)]
        assert b"".join(raws) == RAW_CHUNKS
        assert all(r.endswith(b"\r\n") for r in raws)  # never a torn chunk


def test_one_read_of_complete_chunks_is_passed_on_as_it_is() -> None:
    p = ResponseParser()
    p.raw_chunks = True
    p.feed(CHUNKED_RESPONSE[: CHUNKED_RESPONSE.index(RAW_CHUNKS)])
    events = p.feed(RAW_CHUNKS)
    assert len(events) == 1 and events[0].data is RAW_CHUNKS  # type: ignore[union-attr]


@pytest.mark.parametrize("switch_at", range(0, len(CHUNKED_RESPONSE) + 1, 7))
def test_switching_to_raw_chunks_between_reads_loses_and_repeats_nothing(switch_at: int) -> None:
    p = ResponseParser()
    before = p.feed(CHUNKED_RESPONSE[:switch_at])
    p.raw_chunks = True
    after = p.feed(CHUNKED_RESPONSE[switch_at:])
    assert not any(isinstance(e, RawChunks) for e in before)
    decoded = [e.data for e in before + after if isinstance(e, Data)]
    raw = b"".join(e.data for e in after if isinstance(e, RawChunks))
    assert RAW_CHUNKS.endswith(raw)  # framed as sent, complete chunks, the rest of the body
    # What was decoded before the switch plus what came framed after it is every chunk exactly once.
    rest, _ = feed_all([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + raw + b"0\r\n\r\n"])
    assert decoded + [e.data for e in rest if isinstance(e, Data)] == CHUNKS
    assert isinstance((before + after)[-1], EndOfMessage)


def test_interim_1xx_answers_are_reported_then_skipped_at_every_split() -> None:
    wire = (b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" + CL_RESPONSE)
    whole = assert_split_invariant(wire)
    assert whole[0] == ("info", 100, b"Continue", b"1.1", [])
    assert whole[1] == ("info", 103, b"Early Hints", b"1.1", [(b"Link", b"</style.css>; rel=preload")])
    assert whole[2][:2] == ("response", 200) and whole[3] == ("data", JSON)


@pytest.mark.parametrize("wire", [
    b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it, until the end",
    b"HTTP/1.1 200 OK\r\n\r\nall of it, until the end",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nall of it, until the end",  # not chunked last
])
def test_body_until_close_at_every_split(wire: bytes) -> None:
    whole = summary(feed_all([wire], eof=True)[0])
    assert whole[0][5] == UNTIL_CLOSE and whole[0][7] is False
    assert whole[1:] == [("data", b"all of it, until the end"), ("end", ())]
    for pieces in splits(wire):
        events, p = feed_all(pieces)
        assert p.state is BODY and not any(isinstance(e, EndOfMessage) for e in events)
        assert summary(events + p.feed_eof()) == whole
        assert p.state is DONE and not p.reusable  # the close delimited it


@pytest.mark.parametrize(("status", "head_request"), [(200, True), (204, False), (304, False), (204, True)])
def test_no_body_for_head_204_304_whatever_the_headers_say(status: int, head_request: bool) -> None:
    for framing in (b"Content-Length: 1234\r\n", b"Transfer-Encoding: chunked\r\n", b""):
        wire = b"HTTP/1.1 %d X\r\n%s\r\n" % (status, framing)
        whole = assert_split_invariant(wire, head_request=head_request)
        assert whole[0][5] == NO_BODY and whole[0][6] is None and whole[0][7] is True
        assert whole[1:] == [("end", ())]
        events, p = feed_all([wire], head_request=head_request)
        assert p.reusable


def test_zero_content_length_ends_with_the_head() -> None:
    events, p = feed_all([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    assert summary(events)[1:] == [("end", ())] and p.reusable
    assert events[0].content_length == 0  # type: ignore[union-attr]


def test_until_close_with_nothing_in_the_body() -> None:
    events, p = feed_all([b"HTTP/1.1 200 OK\r\n\r\n"], eof=True)
    assert summary(events)[1:] == [("end", ())]


def test_switching_protocols_is_final_and_read_until_close() -> None:
    events, p = feed_all([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nother"])
    r = events[0]
    assert isinstance(r, Response) and r.framing == UNTIL_CLOSE and not r.keep_alive
    assert summary(events[1:]) == [("data", b"other")]


# ---------------------------------------------------------------------------------------------- keep-alive


@pytest.mark.parametrize(("head", "keep_alive", "tokens"), [
    (b"HTTP/1.1 200 OK\r\n", True, frozenset()),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n", False, {b"close"}),
    (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, X-Secret\r\n", True, {b"keep-alive", b"x-secret"}),
    (b"HTTP/1.1 200 OK\r\nConnection: x-a\r\nconnection: CLOSE\r\n", False, {b"x-a", b"close"}),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\n", False, {b"close", b"keep-alive"}),
    (b"HTTP/1.0 200 OK\r\n", False, frozenset()),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n", True, {b"keep-alive"}),
])
def test_keep_alive_rules(head: bytes, keep_alive: bool, tokens: set[bytes]) -> None:
    events, p = feed_all([head + b"Content-Length: 2\r\n\r\n{}"])
    r = events[0]
    assert isinstance(r, Response) and r.keep_alive is keep_alive and r.connection == tokens
    assert p.state is DONE and p.reusable is keep_alive


def test_chunked_and_content_length_both_present_chunked_wins_and_the_connection_closes() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    events, p = feed_all([wire])
    r = events[0]
    assert isinstance(r, Response) and r.framing == CHUNKED and r.content_length is None and not r.keep_alive
    assert summary(events[1:]) == [("data", b"hello"), ("end", ())]


def test_bytes_after_the_end_make_the_connection_not_reusable() -> None:
    events, p = feed_all([CL_RESPONSE + b"HTTP/1.1 200 OK"])
    assert p.state is DONE and not p.reusable
    _, p2 = feed_all([CL_RESPONSE, b"x"])
    assert not p2.reusable
    assert p2.feed_eof() == []  # a close after a complete response is fine


def test_repeated_identical_content_length_is_one_value() -> None:
    events, _ = feed_all([b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\n{}"])
    assert summary(events)[1:] == [("data", b"{}"), ("end", ())]


def test_folded_lines_and_space_before_colon_are_normalised() -> None:
    events, _ = feed_all([b"HTTP/1.1 200 OK\r\nX-Long: one\r\n  two\r\n\tthree\r\nX-Sp : v\r\n"
                          b"Content-Length: 0\r\n\r\n"])
    r = events[0]
    assert isinstance(r, Response)
    assert r.headers == [(b"X-Long", b"one two three"), (b"X-Sp", b"v"), (b"Content-Length", b"0")]


def test_reason_phrase_may_be_empty() -> None:
    for line in (b"HTTP/1.1 200", b"HTTP/1.1 200 "):
        events, _ = feed_all([line + b"\r\nContent-Length: 0\r\n\r\n"])
        r = events[0]
        assert isinstance(r, Response) and r.status == 200 and r.reason == b""


# ---------------------------------------------------------------------------------------------- errors


def assert_protocol_error(wire: bytes, match: str, **kw: Any) -> None:
    """Malformed at every split: the error comes (at the latest by the last byte) and then sticks."""
    for pieces in splits(wire):
        p = ResponseParser(**kw)
        with pytest.raises(ProtocolError, match=match):
            for piece in pieces:
                p.feed(piece)
        assert p.state is ERROR
        with pytest.raises(ProtocolError, match=match):
            p.feed(b"more")
        with pytest.raises(ProtocolError, match=match):
            p.feed_eof()


@pytest.mark.parametrize("status_line", [
    b"HTTP/2 200 OK", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1 abc OK", b"HTTP/1.1 200OK",
    b"HTTP/1.1  200 OK", b"http/1.1 200 OK", b"ICY 200 OK", b"", b"HTTP/1.1 099 Low", b"SSH-2.0-OpenSSH_9.6",
])
def test_bad_status_line(status_line: bytes) -> None:
    assert_protocol_error(status_line + b"\r\nContent-Length: 0\r\n\r\n", "status line")


@pytest.mark.parametrize("size_line", [b"zz", b"-1", b"0x5", b"1_0", b"+5", b"5 5", b"\x005", b"1234567890abcdef0"])
def test_bad_chunk_size(size_line: bytes) -> None:
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\nhello\r\n0\r\n\r\n"
    assert_protocol_error(wire, "chunk size")


def test_empty_chunk_size_line_is_a_protocol_error() -> None:
    """The two former parsers disagreed here: the relay pool's failed on an empty chunk-size line, the
    scrape client's read it as `0` (the last chunk) and returned the body so far as complete.

    Decided: a ProtocolError. RFC 9112 section 7.1 defines `chunk-size = 1*HEXDIG`, at least one digit, so an
    empty line where a size belongs is not a last chunk but malformed framing; taking it as the end would
    silently truncate the body and leave the rest of the stream to be read as the next response (the
    desynchronisation request smuggling is made of). Both callers now get the same answer (see
    tests/http/test_pool.py and tests/control/test_httpget.py for each of them end to end).
    """
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n\r\n5\r\nworld\r\n0\r\n\r\n"
    assert_protocol_error(wire, "chunk size")
    p = ResponseParser()
    with pytest.raises(ProtocolError) as info:
        p.feed(wire)
    # What came before the bad line is kept on the error, for a consumer that wants to deliver it first.
    assert summary(info.value.events)[1:] == [("data", b"hello")]


@pytest.mark.parametrize(("wire", "match"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", "CRLF"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\n: empty name\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\n folded first: v\r\n\r\n", "folded"),
    (b"HTTP/1.1 200 OK\r\nX: a\nInjected: b\r\n\r\n", "bare CR or LF"),
    (b"HTTP/1.1 200 OK\r\nX: a\rInjected: b\r\n\r\n", "bare CR or LF"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nT: a\nb\r\n\r\n", "bare CR or LF"),
])
def test_malformed_inputs(wire: bytes, match: str) -> None:
    assert_protocol_error(wire, match)


def test_oversize_head_is_a_clear_error() -> None:
    big = b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"f" * 300 + b"\r\n"
    with pytest.raises(ProtocolError, match="response head larger than 256 bytes"):
        ResponseParser(max_head=256).feed(big + b"\r\n")  # complete but too large
    p = ResponseParser(max_head=256)
    with pytest.raises(ProtocolError, match="response head larger than 256 bytes"):
        for i in range(len(big)):  # never complete: caught once it passes the limit, not at the end
            p.feed(big[i : i + 1])
    assert p.state is ERROR
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert feed_all([ok])[1].state is DONE  # the default limit lets a normal head through


def test_oversize_chunk_and_trailers() -> None:
    p = ResponseParser(max_chunk=1000, max_head=100)
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(ProtocolError, match="larger than 1000"):
        p.feed(b"1000\r\npartial")
    p = ResponseParser(max_head=100)
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n")
    with pytest.raises(ProtocolError, match="trailer section larger"):
        p.feed(b"T: " + b"t" * 200)
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(ProtocolError, match="chunk size line too long"):
        p.feed(b"5;" + b"e" * 5000)


@pytest.mark.parametrize(("wire", "where"), [
    (b"", "head"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "head"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "body"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", "body"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nT: v\r\n", "body"),
])
def test_close_before_the_end_is_an_incomplete_response(wire: bytes, where: str) -> None:
    p = ResponseParser()
    p.feed(wire)
    with pytest.raises(IncompleteResponse, match=where):
        p.feed_eof()
    assert p.state is ERROR


def test_states_are_named() -> None:
    p = ResponseParser()
    assert p.state is AWAIT_HEAD
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{")
    assert p.state is BODY and not p.reusable
    p.feed(b"}")
    assert p.state is DONE and p.response is not None and p.response.status == 200


# ---------------------------------------------------------------------------------------------- properties


@st.composite
def chunked_wire(draw: st.DrawFn) -> tuple[bytes, list[bytes], bytes, list[int]]:
    chunks = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=8))
    framed = b""
    for c in chunks:
        ext = draw(st.sampled_from([b"", b";a=1", b" ;b"]))
        hexsize = draw(st.sampled_from([b"%x", b"%X", b"%04x"])) % len(c)
        framed += hexsize + ext + b"\r\n" + c + b"\r\n"
    trailer = draw(st.sampled_from([b"", b"X-T: 1\r\n", b"A: b\r\nC: d\r\n"]))
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n" + trailer + b"\r\n"
    cuts = sorted(draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    return wire, chunks, framed, cuts


def cut(wire: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(wire)]
    return [wire[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(chunked_wire())
def test_chunked_any_chunks_any_splits(case: tuple[bytes, list[bytes], bytes, list[int]]) -> None:
    wire, chunks, framed, cuts = case
    events, p = feed_all(cut(wire, cuts))
    assert [e.data for e in events if isinstance(e, Data)] == chunks
    assert isinstance(events[-1], EndOfMessage) and p.reusable
    raw_events, _ = feed_all(cut(wire, cuts), raw=True)
    assert b"".join(e.data for e in raw_events if isinstance(e, RawChunks)) == framed


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.integers(0, 400), max_size=6), st.booleans())
def test_content_length_any_body_any_splits(body: bytes, cuts: list[int], pipelined_1xx: bool) -> None:
    wire = (b"HTTP/1.1 100 Continue\r\n\r\n" if pipelined_1xx else b"") + \
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    events, p = feed_all(cut(wire, sorted(c for c in cuts if c <= len(wire))))
    assert b"".join(e.data for e in events if isinstance(e, Data)) == body
    assert isinstance(events[-1], EndOfMessage) and p.reusable
    assert sum(isinstance(e, Informational) for e in events) == int(pipelined_1xx)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_garbage_never_escapes_as_another_exception(data: bytes, cuts: list[int]) -> None:
    p = ResponseParser(max_head=128)
    try:
        for piece in cut(data, sorted(c for c in cuts if c <= len(data))):
            p.feed(piece)
        p.feed_eof()
    except ProtocolError:
        assert p.state is ERROR
