"""The DATA fast path must be indistinguishable from plain h2: same bytes per stream, same ends, same
inbound windows, however the byte stream is cut into reads."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.grpc.connection import FastData, h2_config
from tests.grpc.rawh2 import server_side


def _client_bytes(plan: list[tuple[int, bytes, bool]], padded: set[int],
                  updates: dict[int, tuple[int, int]] | None = None) -> bytes:
    """`updates`: after plan item i, a WINDOW_UPDATE (stream id, 0 = the connection; increment)."""
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    for sid in (1, 3, 5):
        client.send_headers(sid, [(b":method", b"POST"), (b":path", b"/a.B/C"), (b":scheme", b"http"),
                                  (b":authority", b"x"), (b"content-type", b"application/grpc")])
    ended: set[int] = set()
    for i, (sid, data, end) in enumerate(plan):
        if sid in ended:
            continue
        client.send_data(sid, data, end_stream=end, pad_length=3 if i in padded else None)
        if end:
            ended.add(sid)
        if updates and i in updates:
            wsid, inc = updates[i]
            client.increment_flow_control_window(inc, stream_id=wsid or None)
    return client.data_to_send()


def _run(side_fast: bool, wire: bytes, cuts: list[int], known: bool = True) -> tuple[dict[int, bytes], set[int], list[int]]:
    """`known`: the streams are relayed calls from the start; else none is (a stream whose HEADERS are in
    the same read still takes the fast path)."""
    side = server_side()
    side.fast = side_fast
    side.calls = {1: None, 3: None, 5: None} if known else {}  # type: ignore[dict-item]
    got: dict[int, bytes] = {1: b"", 3: b"", 5: b""}
    ended: set[int] = set()
    start = 0
    for cut in sorted(set(cuts)) + [len(wire)]:
        if cut <= start:
            continue
        for ev in side.receive(wire[start:cut]):
            if isinstance(ev, (FastData, h2.events.DataReceived)):
                got[ev.stream_id] += ev.data
                side.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                ended.add(ev.stream_id)
        start = cut
    windows = [side.conn.inbound_flow_control_window, side.conn.outbound_flow_control_window]
    windows += [side.conn.streams[s].inbound_flow_control_window for s in (1, 3, 5) if s in side.conn.streams]
    windows += [side.conn.streams[s].outbound_flow_control_window for s in (1, 3, 5) if s in side.conn.streams]
    return got, ended, windows


@settings(max_examples=80, deadline=None)
@given(
    plan=st.lists(st.tuples(st.sampled_from([1, 3, 5]), st.binary(max_size=3000), st.booleans()), max_size=25),
    padded=st.sets(st.integers(0, 24), max_size=5),
    cuts=st.lists(st.integers(0, 90_000), max_size=12),
    known=st.booleans(),
    updates=st.dictionaries(st.integers(0, 24), st.tuples(st.sampled_from([0, 1, 3, 5]), st.integers(1, 2**20)),
                            max_size=6),
)
def test_fast_path_matches_plain_h2(plan: list[tuple[int, bytes, bool]], padded: set[int], cuts: list[int],
                                    known: bool, updates: dict[int, tuple[int, int]]) -> None:
    wire = _client_bytes(plan, padded, updates)
    cuts = [c % (len(wire) + 1) for c in cuts]
    assert _run(True, wire, cuts, known) == _run(False, wire, cuts, known)


def test_data_in_the_read_of_its_headers_takes_the_fast_path() -> None:
    """A unary request: HEADERS, then one DATA frame in the same read, before the stream is a known call."""
    from proxy.grpc.connection import _FAST_PATH

    wire = _client_bytes([(1, b"\x00\x00\x00\x00\x02hi", False), (3, b"\x00\x00\x00\x00\x01x", True)], set())
    side = server_side()
    events = side.receive(wire)
    data = [ev for ev in events if isinstance(ev, (FastData, h2.events.DataReceived))]
    assert [(ev.stream_id, ev.data) for ev in data] == [(1, b"\x00\x00\x00\x00\x02hi"), (3, b"\x00\x00\x00\x00\x01x")]
    if _FAST_PATH:
        assert isinstance(data[0], FastData)  # not ending its stream: the fast path's own event
    assert 3 in {ev.stream_id for ev in events if isinstance(ev, h2.events.StreamEnded)}


def test_h2_config_keeps_headers_as_bytes() -> None:
    assert h2_config(client_side=False).header_encoding is None


def _window_update(sid: int, increment: int) -> bytes:
    return b"\x00\x00\x04\x08\x00" + sid.to_bytes(4, "big") + increment.to_bytes(4, "big")


def test_window_updates_take_the_fast_path_and_invalid_ones_stay_h2s() -> None:
    import h2.exceptions
    import pytest

    from proxy.grpc.connection import _FAST_PATH, FastWindow

    wire = _client_bytes([(1, b"x", False)], set())
    side = server_side()
    side.receive(wire)
    before = side.conn.outbound_flow_control_window, side.conn.streams[1].outbound_flow_control_window
    events = side.receive(_window_update(0, 1000) + _window_update(1, 500))
    assert [(ev.stream_id, ev.delta) for ev in events] == [(0, 1000), (1, 500)]
    if _FAST_PATH:
        assert isinstance(events[0], FastWindow)
    assert (side.conn.outbound_flow_control_window, side.conn.streams[1].outbound_flow_control_window) == (
        before[0] + 1000, before[1] + 500)
    # A zero increment and one that overflows the connection window are protocol errors, as in plain h2.
    with pytest.raises(h2.exceptions.ProtocolError):
        side.receive(_window_update(0, 0))
    side = server_side()
    side.receive(wire)
    with pytest.raises(h2.exceptions.FlowControlError):
        side.receive(_window_update(0, 2**31 - 1))
