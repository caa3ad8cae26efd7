"""Header values that change on every call (x-request-id, a rewritten grpc-timeout, trace context) are sent
never indexed and as plain literals; every other field is encoded as hpack does."""

from __future__ import annotations

import hpack

from proxy.grpc.connection import PerCallEncoder, _ProbeSide, per_call

STABLE = [(b":method", b"POST"), (b":path", b"/affinity.v1.Generation/Generate"),
          (b"content-type", b"application/grpc"), (b"user-agent", b"grpc-python/1.0")]


def test_per_call_field_is_a_plain_never_indexed_literal() -> None:
    enc, dec = PerCallEncoder(), hpack.Decoder()
    first = enc.encode([*STABLE, per_call(b"x-request-id", b"0123456789abcdef0123456789abcdef")])
    entries = list(enc.header_table.dynamic_entries)
    assert (b"x-request-id", b"0123456789abcdef0123456789abcdef") not in entries  # never entered the table
    assert b"0123456789abcdef0123456789abcdef" in first  # not Huffman-coded
    decoded = dec.decode(first, raw=True)
    assert [(bytes(n), bytes(v)) for n, v in decoded][-1] == (b"x-request-id", b"0123456789abcdef0123456789abcdef")
    assert not decoded[-1].indexable  # the backend is told never to index it either
    # The next call's id leaves the table as it was; the stable fields are now one index byte each.
    second = enc.encode([*STABLE, per_call(b"x-request-id", b"fedcba9876543210fedcba9876543210")])
    assert list(enc.header_table.dynamic_entries) == entries
    assert len(second) < len(first)
    assert [(bytes(n), bytes(v)) for n, v in dec.decode(second, raw=True)][:len(STABLE)] == STABLE


def test_other_fields_are_huffman_coded_and_indexed_as_before() -> None:
    headers = [*STABLE, (b"x-custom", b"a value that repeats on every call")]
    assert PerCallEncoder().encode(headers) == hpack.Encoder().encode(headers)


def test_both_connection_kinds_use_it() -> None:
    for client_side in (True, False):  # (the probe's side: a compiled H2Side takes no interpreted subclass)
        assert isinstance(_ProbeSide(client_side=client_side).conn.encoder, PerCallEncoder)
