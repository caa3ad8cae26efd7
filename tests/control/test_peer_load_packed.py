"""Packed rows (routing.peer_load, issue 13 round 5b): a row as this version publishes it is binary
(proxy/control/peer_load.py PACKED_MAGIC), read into columns with a few C calls; the JSON rows of the
previous version are still read, a previous version skips a packed row without an error, and while any
replica publishes JSON a replica publishes JSON too (a rolling upgrade sees every replica both ways)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import msgspec
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.control.peer_load import (PACKED_MAGIC, PEER_RECENT_MAX, PeerLoadExchange, encode_row, encode_row_packed,
                                     merge_rows, parse_packed, parse_row)
from proxy.core.routing_config import PeerLoadConfig
from proxy.core.work_ledger import WorkLedger
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401  # the fixture
from tests.support.wait import until

LOAD = {"a": (2, 200, 60.5, ((0, 30.25), (1, 7.0), (1, 131072.75))), "b": (0, 0, 0.0, ()),
        "c": (1, 10, 5.0), "é/ü": (3, 30, 0.1, ((2, 0.1),))}


def test_a_packed_row_reads_as_its_json_row() -> None:
    raw = encode_row_packed(LOAD)  # type: ignore[arg-type]  # rows with and without entries
    assert raw[:4] == PACKED_MAGIC
    assert parse_row(raw) == parse_row(encode_row(LOAD)) == {  # type: ignore[arg-type]  # as above
        "a": (2, 200, 60.5, [(0, 30.25), (1, 7.0), (1, 131072.75)]), "b": (0, 0, 0.0, []), "c": (1, 10, 5.0),
        "é/ü": (3, 30, 0.1, [(2, 0.1)])}
    # float32 where every token is one exactly (smaller), float64 otherwise (0.1): the same values
    exact = {"a": (1, 1, 1.0, ((0, 0.25), (3, 7.5)))}
    assert len(encode_row_packed(exact)) < len(encode_row_packed({"a": (1, 1, 1.0, ((0, 0.1), (3, 7.5)))}))
    assert parse_row(encode_row_packed(exact)) == {"a": (1, 1, 1.0, [(0, 0.25), (3, 7.5)])}
    # Merged with JSON rows (a replica of the previous version), as the JSON rows alone merge.
    other = {"a": (1, 5, 2.0, ((1, 3.0), (4, 1.0))), "c": (0, 0, 0.0, ((0, 9.0),))}
    packed = merge_rows([encode_row_packed(LOAD), encode_row(other)])  # type: ignore[arg-type]  # as above
    assert packed == merge_rows([encode_row(LOAD), encode_row(other)])  # type: ignore[arg-type]  # as above
    assert packed["a"] == (3, 205, 62.5, ((0, 30.25), (1, 7.0), (1, 131072.75), (1, 3.0), (4, 1.0)))
    assert packed["c"] == (1, 10, 5.0)  # one row without entries: the sums only


def test_a_previous_version_skips_a_packed_row_without_an_error() -> None:
    """Round 5's parse_row: msgspec's JSON decoder, then json.loads, each error caught (a row it cannot
    read is dropped). A packed row's first byte is not UTF-8: both raise what it catches."""
    raw = encode_row_packed(LOAD)  # type: ignore[arg-type]  # as above
    decoder = msgspec.json.Decoder(dict[str, tuple[int, int, float, list[tuple[int, float]]]])
    for decode in (decoder.decode, msgspec.json.decode):
        try:
            decode(raw)
            raise AssertionError("decoded")
        except msgspec.DecodeError:
            pass
    try:
        json.loads(raw)
        raise AssertionError("decoded")
    except ValueError:  # UnicodeDecodeError is one
        pass


def test_a_malformed_packed_row_is_dropped_whole_and_never_raises() -> None:
    raw = encode_row_packed(LOAD)  # type: ignore[arg-type]  # as above
    assert parse_packed(raw[:-1]) is None and parse_packed(raw + b"\0") is None
    assert parse_packed(encode_row_packed({"a": (-1, 0, 0.0, ())})) is None
    assert parse_packed(encode_row_packed({"a": (1, 0, float("nan"), ())})) is None
    assert parse_packed(encode_row_packed({"a": (1, 0, 0.0, ((0, float("inf")),))})) is None
    assert parse_packed(encode_row_packed({"a": (1, 0, 0.0, ((0, -1.0),))})) is None
    assert parse_packed(encode_row_packed({"a": (1, 0, 0.0, ((0, 1.0),) * (PEER_RECENT_MAX + 1))})) is None
    rng = random.Random(3)
    for _ in range(300):  # truncated or bit-flipped: None or a well-formed load, never an exception
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        got = parse_row(bytes(b[:rng.randrange(len(b) + 1)]) if rng.random() < 0.3 else bytes(b))
        assert got is None or isinstance(got, dict)
    # Ages out of order (no publisher of this version writes them; not checked): an estimate, no error.
    merged = merge_rows([encode_row_packed({"a": (1, 1, 1.0, ((3, 1.0), (1, 2.0), (1, 4.0), (0, 8.0)))})])
    led = WorkLedger()
    for k in range(6):
        assert 0.0 <= led.fleet_pending("a", None, k, 0, merged["a"][3]) < math.inf  # type: ignore[misc]  # the 4-tuple


async def test_a_replica_publishes_json_while_a_previous_version_does(redis_server: RedisServer) -> None:
    cfg = PeerLoadConfig(redis_url=redis_server.url, refresh_ms=20, key_prefix=f"test:{redis_server.port}",
                         replica_id="new")
    load = {"gpu-0": (1, 100, 50.0, ((0, 50.0),))}
    ex = PeerLoadExchange(cfg, lambda: load, registry=CollectorRegistry())  # type: ignore[arg-type, return-value]  # a row with entries
    client = aioredis.from_url(redis_server.url)
    key = f"{cfg.key_prefix}:replica:new"
    await ex.start()
    try:
        assert await until(lambda: ex.peers() is not None, timeout=5)
        assert (await client.get(key))[:4] == PACKED_MAGIC
        # A replica of the previous version joins: its JSON row is read, and the next rows are JSON.
        await client.set(f"{cfg.key_prefix}:replica:old", encode_row({"gpu-0": (2, 20, 9.0, ((1, 9.0),))}), px=60000)
        await client.sadd(f"{cfg.key_prefix}:replicas", "old")
        assert await until(lambda: (ex.peers() or {}).get("gpu-0") == (2, 20, 9.0, ((1, 9.0),)), timeout=5)
        got = await client.get(key)
        for _ in range(50):
            if got[:1] == b"{":
                break
            await asyncio.sleep(0.02)
            got = await client.get(key)
        assert json.loads(got) == {"gpu-0": [1, 100, 50.0, [[0, 50.0]]]}
        await client.delete(f"{cfg.key_prefix}:replica:old")  # it is upgraded (or gone): packed again
        for _ in range(100):
            got = await client.get(key)
            if got[:4] == PACKED_MAGIC:
                break
            await asyncio.sleep(0.02)
        assert got[:4] == PACKED_MAGIC
    finally:
        await ex.stop()
        await client.aclose()
