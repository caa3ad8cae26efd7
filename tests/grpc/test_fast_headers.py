"""A client's new-stream HEADERS frame handed to h2 by the receive fast path: the same events as plain h2,
and every protocol error the same error with the same GOAWAY."""

from __future__ import annotations

from typing import Any

import h2.connection
import h2.errors
import h2.exceptions
import h2.settings
import pytest

from proxy.grpc.connection import _FAST_HEADERS, h2_config
from tests.grpc.rawh2 import server_side


def _frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def _preface() -> bytes:
    client = h2.connection.H2Connection(config=h2_config(client_side=True))
    client.initiate_connection()
    return client.data_to_send()


# A request block: :method POST, :scheme http, :path /, :authority x (static indexes and one literal).
_BLOCK = b"\x83\x86\x84\x01\x01x"


def _outcome(fast: bool, wire: bytes, max_streams: int = 100) -> tuple[Any, ...]:
    side = server_side()
    side.fast = fast
    side.init_settings(max_streams, 65535, 65535)
    side.conn.local_settings.acknowledge()
    side.conn.data_to_send()
    handed = []  # what went through h2's own receive_data (its frame buffer)
    plain_receive = side.conn.receive_data
    side.conn.receive_data = lambda data: handed.append(len(data)) or plain_receive(data)  # type: ignore[method-assign]
    try:
        events = side.receive(wire)
        error: tuple[Any, ...] = ()
    except h2.exceptions.ProtocolError as exc:
        events = []
        error = (type(exc), exc.error_code)
    shapes = [(type(ev).__name__, getattr(ev, "stream_id", None), getattr(ev, "headers", None)) for ev in events]
    _outcome.handed = sum(handed)  # type: ignore[attr-defined]  # read by the test right after the call
    return shapes, error, side.conn.data_to_send(), side.conn.highest_inbound_stream_id


@pytest.mark.parametrize("case", [
    "request", "ends_with_headers", "bad_hpack", "too_many_streams", "even_stream", "lower_stream",
    "priority", "padded", "continuation",
])
def test_fast_headers_match_plain_h2(case: str) -> None:
    wire = _preface()
    max_streams = 100
    if case == "request":
        wire += _frame(1, 0x4, 1, _BLOCK) + _frame(0, 0x1, 1, b"hi") + _frame(1, 0x4, 3, _BLOCK)
    elif case == "ends_with_headers":
        wire += _frame(1, 0x5, 1, _BLOCK)
    elif case == "bad_hpack":
        wire += _frame(1, 0x4, 1, b"\x80")  # index 0: a decoding error
    elif case == "too_many_streams":
        max_streams = 1
        wire += _frame(1, 0x4, 1, _BLOCK) + _frame(1, 0x4, 3, _BLOCK)
    elif case == "even_stream":
        wire += _frame(1, 0x4, 2, _BLOCK)
    elif case == "lower_stream":
        wire += _frame(1, 0x4, 5, _BLOCK) + _frame(1, 0x4, 3, _BLOCK)
    elif case == "priority":
        wire += _frame(1, 0x24, 1, b"\x00\x00\x00\x00\x0f" + _BLOCK)
    elif case == "padded":
        wire += _frame(1, 0x0C, 1, b"\x02" + _BLOCK + b"\x00\x00")
    elif case == "continuation":
        wire += _frame(1, 0x0, 1, _BLOCK[:3]) + _frame(9, 0x4, 1, _BLOCK[3:])
    fast = _outcome(True, wire, max_streams)
    fast_handed = _outcome.handed  # type: ignore[attr-defined]
    assert fast == _outcome(False, wire, max_streams)
    if case in ("request", "ends_with_headers", "bad_hpack", "too_many_streams"):  # the HEADERS skipped h2's buffer
        assert fast_handed == len(_preface())
    if case == "request":
        assert [(s[0], s[1]) for s in fast[0] if s[1]] == [
            ("RequestReceived", 1), ("DataReceived", 1), ("StreamEnded", 1), ("RequestReceived", 3)]
    if case in ("bad_hpack", "too_many_streams", "even_stream", "lower_stream"):
        assert fast[1] and 7 in _frame_types(fast[2])  # a protocol error, and a GOAWAY to send


def _frame_types(data: bytes) -> list[int]:
    types, pos = [], 0
    while pos + 9 <= len(data):
        types.append(data[pos + 3])
        pos += 9 + int.from_bytes(data[pos:pos + 3], "big")
    return types


def test_the_fast_path_is_in_use() -> None:
    assert _FAST_HEADERS  # this h2 passed the probe: the cases above compared the fast path, not h2 twice
