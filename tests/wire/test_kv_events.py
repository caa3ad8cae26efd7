"""The KV-event decoder, fed bytes: both vLLM encodings, replay frames, and garbage that must not crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from proxy.core.kv_index import AllBlocksCleared, BlockRemoved, BlockStored
from proxy.wire.kv_events import (
    END_SEQ,
    KVEventDecodeError,
    decode_message,
    decode_payload,
    decode_replay,
    encode_replay_request,
)
from sim.kv_events import encode_batch
from sim.kvcache import Cleared, Removed, Stored
from sim.tokenizer import token_ids
from sim.tokens import VOCAB

SIM_EVENTS = [Stored((11, 12), None, tuple(VOCAB[:8]), None), Stored((13,), 12, tuple(VOCAB[8:12]), "sql"),
              Removed((11,)), Cleared()]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_both_encodings_decode_to_the_same_events(encoding: str) -> None:
    payload = encode_batch(SIM_EVENTS, 3.25, encoding, 4)  # type: ignore[arg-type]
    batch = decode_message([b"topic", (7).to_bytes(8, "big"), payload])
    assert batch.seq == 7 and batch.topic == b"topic" and batch.ts == 3.25 and batch.data_parallel_rank == 0
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.block_hashes == (11, 12) and a.parent_block_hash is None
    assert list(a.token_ids) == token_ids(" ".join(VOCAB[:8])) and a.block_size == 4 and a.medium == "GPU"
    assert isinstance(b, BlockStored) and b.parent_block_hash == 12 and b.lora_name == "sql" and b.lora_id
    assert c == BlockRemoved((11,), "GPU") and d == AllBlocksCleared()


def test_older_and_newer_layouts() -> None:
    # vLLM 0.9: no medium, no lora_name, no data_parallel_rank; sha256 hashes as bytes
    old = msgpack.packb([1.0, [["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None], ["BlockRemoved", [b"\x01" * 32]]]])
    batch = decode_payload(old)
    assert batch.data_parallel_rank is None
    assert batch.events[0] == BlockStored((b"\x01" * 32,), None, (1, 2), 2)
    assert batch.events[1] == BlockRemoved((b"\x01" * 32,))
    # newest main: extra fields, another cache group, a future event type
    new = msgpack.packb({"ts": 2, "events": [
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1], "block_size": 1,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": None, "token_ids": [1], "block_size": 1,
         "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU", "group_idx": 1},
        {"type": "SomethingNew", "x": 1},
    ]})
    batch = decode_payload(new)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored"] and batch.unknown == 1
    assert batch.events[0].extra_keys is None  # [None]: nothing extra
    salted = msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, [["salt"]]]]])
    assert decode_payload(salted).events[0].extra_keys == (["salt"],)


def test_a_positional_batch_of_tagged_map_events_decodes() -> None:
    """Some releases made EventBatch array_like while the events were already tagged maps."""
    mixed = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}], 2])
    batch = decode_payload(mixed)
    assert batch.events == (BlockRemoved((9,), "GPU"),) and batch.data_parallel_rank == 2


def test_replay_frames_and_end_marker() -> None:
    assert encode_replay_request(5) == [b"", (5).to_bytes(8, "big")]
    with pytest.raises(ValueError):
        encode_replay_request(-1)
    payload = encode_batch([Cleared()], 1.0, "map", 4)
    got = decode_replay([b"", (3).to_bytes(8, "big"), payload])
    assert got is not None and got.seq == 3 and got.events == (AllBlocksCleared(),)
    assert decode_replay([(3).to_bytes(8, "big"), payload]) == got  # delimiter already stripped
    assert decode_replay([b"", END_SEQ, b""]) is None
    with pytest.raises(KVEventDecodeError):
        decode_replay([b"", END_SEQ, b"x"])
    with pytest.raises(KVEventDecodeError):
        decode_replay([b"", b"\x00", payload])


@pytest.mark.parametrize("bad", [
    [b"t", b"\x00" * 7, b"\x90"],            # short sequence frame
    [b"t", b"\x00" * 8],                     # missing payload
    [b"t", b"\x00" * 8, b"\xc1"],            # msgpack's never-used byte
    [b"t", b"\x00" * 8, msgpack.packb(3)],
    [b"t", b"\x00" * 8, msgpack.packb([1.0])],
    [b"t", b"\x00" * 8, msgpack.packb(["x", []])],
    [b"t", b"\x00" * 8, msgpack.packb({"ts": 1})],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]])],  # 3 ids, 1 block
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, -2], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1.5], None, [1, 2], 2, None]]])],
    # checked in C (msgspec): no bool, no string (not even one that reads as base64 bytes), no id >= 2^63
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [True], None, [1, 2], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", ["aGk="], None, [1, 2], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, True], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 1 << 63], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, "2"], 2, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockRemoved", [b"x", False], None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None]]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockRemoved"}]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [{"type": 3}]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [7]])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [[]]])],
    [b"t", b"\x00" * 8, msgpack.packb([True, []])],
    [b"t", b"\x00" * 8, msgpack.packb([1.0, [], "rank"])],
])
def test_malformed_messages_raise_a_clear_error(bad: list[bytes]) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_message(bad)


def test_every_truncation_of_a_real_payload_is_an_error_not_a_crash() -> None:
    payload = encode_batch(SIM_EVENTS, 3.25, "array", 4)
    for cut in range(len(payload)):
        with pytest.raises(KVEventDecodeError):
            decode_payload(payload[:cut])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_anything_but_decode_errors(data: bytes) -> None:
    try:
        decode_message([b"", data[:8].ljust(8, b"\x00"), data[8:]])
    except KVEventDecodeError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
                  st.text(max_size=12), st.binary(max_size=12),
                  st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "ts", "events"]))
_tree = st.recursive(_leaf, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(
    st.one_of(st.sampled_from(["type", "ts", "events", "block_hashes", "token_ids", "block_size",
                               "parent_block_hash", "group_idx", "medium"]), st.text(max_size=4)), kids, max_size=6),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_tree)
def test_well_formed_msgpack_of_the_wrong_shape_is_a_decode_error(obj: object) -> None:
    try:
        batch = decode_payload(msgpack.packb(obj, use_bin_type=True))
    except KVEventDecodeError:
        return
    for ev in batch.events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))
