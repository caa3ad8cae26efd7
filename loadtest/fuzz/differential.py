"""What a client request parser shows of a byte stream, as comparable data: the one driver of the
differential between the data path's `LlhttpRequestParser` (proxy/wire/http1_llhttp.py) and the reference
`RequestParser` (proxy/wire/http1.py), used by the fuzz target `request_diff` (loadtest/fuzz/targets.py) and
by tests/wire/test_http1_differential.py. No atheris here: the tests import it without the fuzzer."""

from __future__ import annotations

from typing import Any

from proxy.wire.http1 import DONE, Data, EndOfMessage, ProtocolError, Request, RequestEvent, RequestParser


def event_of(ev: RequestEvent) -> Any:
    """One event as plain data (every field a client's request sets)."""
    if isinstance(ev, Request):
        return ("request", ev.method, ev.target, ev.http_version, ev.headers, ev.framing, ev.content_length,
                ev.keep_alive, ev.expect_continue, ev.header_bytes)
    if isinstance(ev, Data):
        return ("data", ev.data)
    assert isinstance(ev, EndOfMessage)
    return ("end", ev.trailers)


def observe(cls: type[RequestParser], pieces: list[bytes], max_head: int, eof: bool) -> list[Any]:
    """Everything observable, in order, when `pieces` arrive one read each (then the end of the stream if
    `eof`): the events (answered requests go on with `next()`), the state, buffered bytes and `started`
    after each piece, and an error with the state after it (and that a failed parser raises it again)."""
    p = cls(max_head=max_head, max_chunk=4096)
    out: list[Any] = []
    try:
        for piece in pieces:
            events = p.feed(piece)
            while True:
                out += [event_of(e) for e in events]
                if p.state is not DONE or not events:
                    break
                events = p.next()
            out.append((p.state, p.buffered, p.started))
        if eof:
            p.feed_eof()
            out.append(("eof", p.state))
    except ProtocolError as exc:
        out.append(("error", type(exc).__name__, str(exc), p.state))
        try:  # a failed parser raises the same error again
            p.feed(b"x")
        except ProtocolError as again:
            out.append(("again", again is exc))
    return out
