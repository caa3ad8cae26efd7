"""The frames a bridged plain HTTP/2 request is answered with: a whole answer's last DATA frame ends the
stream (no empty closing frame), an answer larger than the client's window arrives whole as the client
opens it, and the client connection's header coding (stateless response fields, remembered request
blocks) decodes to exactly what hpack's own coders give."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h2.errors
import h2.events
import h2.settings
import hpack
import pytest

from proxy.grpc.connection import RepeatDecoder, ResponseEncoder, per_call
from sim.fleet import Fleet
from tests.grpc.conftest import fleet_entries, proxy_address
from tests.grpc.rawh2 import RawClient


def _request(client: RawClient, fleet: Fleet, text: str) -> int:
    body = json.dumps({"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 40, "ignore_eos": True,
                       "messages": [{"role": "user", "content": text}]}).encode()
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/chat/completions"),
                                   (b":authority", b"proxy"), (b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())])
    client.conn.send_data(sid, body, end_stream=True)
    client.flush()
    return sid


async def _answer(client: RawClient, sid: int) -> tuple[dict[bytes, bytes], list[Any]]:
    await client.wait_for(lambda ev: isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid)
    head = next(ev for ev in client.events if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid)
    data = [ev for ev in client.events if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid]
    return dict(head.headers), data


@pytest.mark.timeout(60)  # the event loop itself would spin if the end of an answer waited wrongly
async def test_whole_answer_ends_with_its_last_data_frame_and_fills_a_small_window(fleet: Fleet, make_proxy) -> None:
    proxy = await make_proxy(fleet_entries(fleet)[:1])
    client = await RawClient.connect(proxy_address(proxy))
    try:
        sid = _request(client, fleet, "one")
        head, data = await _answer(client, sid)
        assert head[b":status"] == b"200" and head[b"x-request-id"]
        body = b"".join(ev.data for ev in data)
        assert int(head[b"content-length"]) == len(body)
        assert json.loads(body)["usage"]["completion_tokens"] == 40
        # One DATA frame: the body, carrying END_STREAM itself.
        assert len(data) == 1 and data[0].stream_ended is not None

        # A client window far smaller than the answer: the answer comes in window-sized frames as the
        # client acknowledges each (RawClient does), the last one ending the stream.
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64})
        client.flush()
        await client.wait_for(lambda ev: isinstance(ev, h2.events.SettingsAcknowledged))
        sid = _request(client, fleet, "two")
        head, data = await _answer(client, sid)
        body = b"".join(ev.data for ev in data)
        assert int(head[b"content-length"]) == len(body) > 64 * 4
        assert json.loads(body)["usage"]["completion_tokens"] == 40
        assert all(0 < len(ev.data) <= 64 for ev in data) and data[-1].stream_ended is not None
    finally:
        client.close()


def test_response_fields_are_static_indexes_or_unindexed_literals() -> None:
    enc, dec = ResponseEncoder(), hpack.Decoder()
    headers = [(b":status", b"200"), (b"server", b"fake-backend"), (b"content-type", b"application/json"),
               per_call(b"x-request-id", b"0123456789abcdef0123456789abcdef"), (b"content-length", b"258"),
               (b"x-custom", b"abc")]
    for _ in range(3):
        block = enc.encode(headers)
        assert [(bytes(n), bytes(v)) for n, v in dec.decode(block, raw=True)] == headers
        # Nothing entered either side's dynamic table: the next block means the same on its own.
        assert not enc.header_table.dynamic_entries and not dec.header_table.dynamic_entries
    assert block[:1] == b"\x88"  # :status 200 from the static table
    assert b"0123456789abcdef0123456789abcdef" in block  # the per-call id: a plain literal...
    assert not dec.decode(block, raw=True)[3].indexable  # ...marked never-indexed
    assert block == ResponseEncoder().encode(headers)  # a field's bytes depend on nothing else
    for value in (b"", b"a" * 126, b"b" * 127, b"c" * 300):  # never-indexed value lengths around the prefix
        for name in (b"x-request-id", b"content-length"):  # a literal name, a static-table one
            fields = dec.decode(enc.encode([(b":status", b"200"), per_call(name, value)]), raw=True)
            assert fields == [(b":status", b"200"), (name, value)] and not fields[1].indexable
    # A smaller table asked for by the client's SETTINGS is still signalled before the next block.
    enc.header_table_size = 0
    resized = enc.encode(headers)
    assert resized[:1] == b"\x20" and resized[1:] == block
    assert [(bytes(n), bytes(v)) for n, v in dec.decode(resized, raw=True)] == headers


def test_repeated_request_blocks_decode_as_hpack_decodes_them() -> None:
    # An indexing encoder (python clients, grpcio) and an nghttp2-like one (path and length not indexed).
    indexing, mixed = hpack.Encoder(), hpack.Encoder()
    mine_a, mine_b, plain_a, plain_b = RepeatDecoder(), RepeatDecoder(), hpack.Decoder(), hpack.Decoder()
    base = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"proxy"), (b"user-agent", b"t/1")]
    for i in range(40):
        extra = [(b"x-n", str(i % 3).encode()), (b"x-new", str(i).encode())] if i % 5 == 4 else []
        req = [*base, (b":path", b"/v1/completions"), (b"content-length", b"280"), *extra]
        block = indexing.encode(req)
        assert mine_a.decode(block, raw=True) == plain_a.decode(block, raw=True)
        req_mixed = [*base, hpack.NeverIndexedHeaderTuple(b":path", b"/v1/completions"),
                     hpack.NeverIndexedHeaderTuple(b"content-length", str(200 + i % 2).encode()), *extra]
        block = mixed.encode(req_mixed)
        got, expected = mine_b.decode(block, raw=True), plain_b.decode(block, raw=True)
        assert got == expected == req_mixed
        assert [h.indexable for h in got] == [h.indexable for h in expected]
    assert mine_b._blocks  # noqa: SLF001  # the repeats were remembered (and checked above against hpack)

    # The same bytes after the table changed mean something else: index 62 is the newest entry.
    enc, mine, plain = hpack.Encoder(), RepeatDecoder(), hpack.Decoder()
    for value in (b"one", b"two"):
        block = enc.encode([(b"x-a", value)])
        assert mine.decode(block, raw=True) == plain.decode(block, raw=True)
        assert mine.decode(b"\xbe", raw=True) == plain.decode(b"\xbe", raw=True) == [(b"x-a", value)]

    # A limit lowered after a block was remembered is applied to it again.
    mine.max_header_list_size = 10
    with pytest.raises(hpack.OversizedHeaderListError):
        mine.decode(b"\xbe", raw=True)


@pytest.mark.parametrize("sent", [b"12345", b"x" * 20])
async def test_a_body_not_matching_its_content_length_is_a_protocol_error(fleet: Fleet, make_proxy,
                                                                         sent: bytes) -> None:
    """The request's only DATA frame comes in the read of its HEADERS (the fast path); a declared length
    that the body does not match still ends the connection with GOAWAY PROTOCOL_ERROR, as h2 answers it."""
    proxy = await make_proxy(fleet_entries(fleet)[:1])
    client = await RawClient.connect(proxy_address(proxy))
    try:
        client.conn.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"),
                                     (b":authority", b"proxy"), (b"content-length", b"10")])
        client.conn.send_data(1, sent, end_stream=True)
        client.flush()
        ev = await client.wait_for(lambda ev: isinstance(ev, h2.events.ConnectionTerminated))
        assert ev.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
        await asyncio.wait_for(client.lost.wait(), 10)
    finally:
        client.close()
