"""hpack's per-field debug logging is switched off in the proxy only while nobody asked for DEBUG."""

from __future__ import annotations

import logging

import hpack
import hpack.hpack
import hpack.table
import pytest

from proxy.grpc.connection import quiet_hpack_logging


@pytest.fixture
def hpack_loggers():  # type: ignore[no-untyped-def]
    saved = (hpack.hpack.log, hpack.table.log)
    hpack.hpack.log = logging.getLogger("hpack.hpack")
    hpack.table.log = logging.getLogger("hpack.table")
    yield
    hpack.hpack.log, hpack.table.log = saved
    logging.getLogger("hpack").setLevel(logging.NOTSET)


def _roundtrip() -> list[tuple[bytes, bytes]]:
    headers = [(b":path", b"/affinity.v1.Generation/Generate"), (b"content-type", b"application/grpc"),
               (b"x-bin", b"\x00\xff")]
    encoded = hpack.Encoder().encode(headers)
    return [(bytes(n), bytes(v)) for n, v in hpack.Decoder().decode(encoded, raw=True)]


def test_hpack_logging_is_quieted_when_debug_is_off(hpack_loggers, caplog) -> None:  # type: ignore[no-untyped-def]
    logging.getLogger("hpack").setLevel(logging.INFO)
    assert quiet_hpack_logging()
    assert not isinstance(hpack.hpack.log, logging.Logger)
    with caplog.at_level(logging.DEBUG, logger="hpack"):
        assert _roundtrip()[0] == (b":path", b"/affinity.v1.Generation/Generate")  # still encodes/decodes
    assert not [r for r in caplog.records if r.name.startswith("hpack")]


def test_hpack_keeps_logging_when_debug_is_on(hpack_loggers, caplog) -> None:  # type: ignore[no-untyped-def]
    logging.getLogger("hpack").setLevel(logging.DEBUG)
    assert not quiet_hpack_logging()
    assert isinstance(hpack.hpack.log, logging.Logger)
    with caplog.at_level(logging.DEBUG, logger="hpack"):
        _roundtrip()
    assert [r for r in caplog.records if r.name.startswith("hpack")]
