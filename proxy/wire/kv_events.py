"""vLLM KV-cache events, sans-I/O: ZeroMQ multipart frames in, typed events (`proxy.core.kv_index`) out.

What vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) sends, and `sim/kv_events.py` reproduces:

- PUB messages: `[topic, seq, payload]`: seq is an 8-byte big-endian unsigned counter from 0 per publisher
  process (a restart starts at 0 again), payload is msgpack of an `EventBatch`.
- Replay: a DEALER sends `[b"", start_seq(8 bytes)]` to the ROUTER (`encode_replay_request`); each answer
  arrives as `[b"", seq, payload]` and the last one is the end marker `[b"", -1 (8 signed bytes), b""]`
  (`decode_replay`). Some clients strip the empty delimiter; both forms are accepted.
- Two encodings of the payload, both accepted at every level (vLLM changed them separately):
  * positional (vLLM <= 0.10, `array_like=True`): batch `[ts, events, data_parallel_rank?]`, events
    `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, lora_name?,
    extra_keys?, group_idx?, ...]`, `["BlockRemoved", block_hashes, medium?, group_idx?]`,
    `["AllBlocksCleared"]`;
  * tagged maps (vLLM main): batch `{"ts", "events", "data_parallel_rank"?}`, events `{"type":
    "BlockStored", "block_hashes": ..., ...}` with the same field names; unknown keys are ignored.
  Block hashes are ints (64-bit hash algorithms) or bytes (sha256); both are kept as they are.
  `extra_keys` (per block: multimodal ids, cache salt, LoRA name) is passed on when some entry is not nil.

Events of other KV-cache groups than the first (`group_idx` > 0: the sliding-window layers of a hybrid
model) are dropped: their blocks do not decide prefix reuse of the full-attention layers. Event types this
decoder does not know are skipped and counted (`EventBatch.unknown`), so a newer engine does not break the
stream. Anything malformed raises `KVEventDecodeError` (a ValueError) with what was wrong; nothing else
escapes, whatever the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Sequence

import msgpack
import msgspec

from proxy.core.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "END_SEQ",
    "EventBatch",
    "KVEventDecodeError",
    "decode_message",
    "decode_payload",
    "decode_replay",
    "encode_replay_request",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_PAYLOAD = 64 * 1024 * 1024  # one step's events; anything bigger is not a vLLM batch


class KVEventDecodeError(ValueError):
    """The frames are not a vLLM KV-event message."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    topic: bytes = b""
    unknown: int = 0  # events of a type this decoder does not know (skipped)


def encode_replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to the replay ROUTER to get every buffered batch from `start_seq` on."""
    if not 0 <= start_seq < 1 << 64:
        raise ValueError(f"start_seq out of range: {start_seq}")
    return [b"", start_seq.to_bytes(8, "big")]


def _seq(frame: bytes) -> int:
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {_len(frame)}")
    return int.from_bytes(frame, "big")


def _len(frame: object) -> str:
    try:
        return f"{len(frame)} bytes"  # type: ignore[arg-type]  # any sized frame; the except handles the rest
    except TypeError:
        return type(frame).__name__


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """A PUB message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return decode_payload(bytes(payload), seq=_seq(seq), topic=bytes(topic))


def decode_replay(frames: Sequence[bytes]) -> EventBatch | None:
    """One replay answer (`[b"", seq, payload]` or `[seq, payload]`); None for the end marker."""
    if len(frames) == 3 and len(frames[0]) == 0:
        frames = frames[1:]
    if len(frames) != 2:
        raise KVEventDecodeError(f"a replay answer has 2 frames (seq, payload) after the delimiter, got {len(frames)}")
    seq, payload = frames
    if bytes(seq) == END_SEQ:
        if len(payload):
            raise KVEventDecodeError("replay end marker with a non-empty payload")
        return None
    return decode_payload(bytes(payload), seq=_seq(seq))


def decode_payload(payload: bytes, *, seq: int = 0, topic: bytes = b"") -> EventBatch:
    if len(payload) > MAX_PAYLOAD:
        raise KVEventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, StackError, ValueError...)
        raise KVEventDecodeError(f"payload is not msgpack: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise KVEventDecodeError(f"positional EventBatch needs [ts, events, ...], got {len(obj)} items")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise KVEventDecodeError("EventBatch map needs 'ts' and 'events'")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"EventBatch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventDecodeError(f"EventBatch.ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"EventBatch.events must be an array, got {type(events).__name__}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KVEventDecodeError(f"EventBatch.data_parallel_rank must be an integer, got {type(rank).__name__}")
    out: list[KVEvent] = []
    unknown = 0
    for i, raw in enumerate(events):
        try:
            ev = _event(raw)
        except KVEventDecodeError as exc:
            raise KVEventDecodeError(f"events[{i}]: {exc}") from None
        if ev is None:
            unknown += 1
        elif not isinstance(ev, _Skip):
            out.append(ev)
    return EventBatch(seq, float(ts), tuple(out), rank, topic, unknown)


class _Skip:
    """An event of another KV-cache group: valid, but not ours to index."""


_SKIP = _Skip()
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
           "extra_keys", "group_idx")
_REMOVED = ("block_hashes", "medium", "group_idx")


def _fields(raw: Any, names: tuple[str, ...], required: int) -> dict[str, Any]:
    if isinstance(raw, list):
        values = raw[1:]
        if len(values) < required:
            raise KVEventDecodeError(f"{raw[0]} needs at least {required} fields, got {len(values)}")
        return dict(zip(names, values))
    missing = [n for n in names[:required] if n not in raw]
    if missing:
        raise KVEventDecodeError(f"{raw.get('type')} lacks {', '.join(missing)}")
    return {n: raw[n] for n in names if n in raw}


def _hash(h: Any, what: str) -> int | bytes:
    if isinstance(h, bool) or not isinstance(h, (int, bytes)):
        raise KVEventDecodeError(f"{what} must be an integer or bytes, got {type(h).__name__}")
    return h


# What an event's arrays must hold, checked in C by msgspec.convert (a Python test per item was a third of
# the decoding's CPU: a prefill chunk's event carries thousands of token ids). Neither accepts a bool, a
# float or a string.
_INT_HASHES = list[int]
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]]


def _hashes(v: Any) -> tuple[int | bytes, ...]:
    if not isinstance(v, list):
        raise KVEventDecodeError(f"block_hashes must be an array, got {type(v).__name__}")
    try:
        return tuple(msgspec.convert(v, _INT_HASHES))  # 64-bit hash algorithms: integers, checked in C
    except msgspec.ValidationError:
        # sha256 hashes are bytes (msgspec would also take a base64 string as bytes: not an engine's hash)
        return tuple(_hash(h, "a block hash") for h in v)


def _token_ids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise KVEventDecodeError(f"token_ids must be an array, got {type(v).__name__}")
    try:
        return tuple(msgspec.convert(v, _TOKEN_IDS))
    except msgspec.ValidationError as exc:
        raise KVEventDecodeError(f"token_ids must be non-negative 64-bit integers: {exc}") from None


def _opt(v: Any, kind: type, what: str) -> Any:
    if v is None:
        return None
    if not isinstance(v, kind) or isinstance(v, bool):
        raise KVEventDecodeError(f"{what} must be {kind.__name__} or nil, got {type(v).__name__}")
    return v


def _event(raw: Any) -> KVEvent | _Skip | None:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KVEventDecodeError("a positional event starts with its type name")
        kind = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KVEventDecodeError("a tagged event needs a string 'type'")
        kind = tag
    else:
        raise KVEventDecodeError(f"an event must be an array or a map, got {type(raw).__name__}")
    if kind == "BlockStored":
        f = _fields(raw, _STORED, 4)
        if _opt(f.get("group_idx"), int, "group_idx"):
            return _SKIP
        hashes = _hashes(f["block_hashes"])
        parent = f["parent_block_hash"]
        if parent is not None:
            parent = _hash(parent, "parent_block_hash")
        ids = _token_ids(f["token_ids"])
        size = f["block_size"]
        if type(size) is not int or size < 1:
            raise KVEventDecodeError(f"block_size must be a positive integer, got {size!r}")
        if len(ids) != len(hashes) * size:
            raise KVEventDecodeError(f"{len(ids)} token ids for {len(hashes)} blocks of {size} tokens")
        extra = f.get("extra_keys")
        if extra is not None and not isinstance(extra, list):
            raise KVEventDecodeError(f"extra_keys must be an array or nil, got {type(extra).__name__}")
        return BlockStored(hashes, parent, ids, size, _opt(f.get("lora_id"), int, "lora_id"),
                           _opt(f.get("medium"), str, "medium"), _opt(f.get("lora_name"), str, "lora_name"),
                           tuple(extra) if extra and any(e is not None for e in extra) else None)
    if kind == "BlockRemoved":
        f = _fields(raw, _REMOVED, 1)
        if _opt(f.get("group_idx"), int, "group_idx"):
            return _SKIP
        return BlockRemoved(_hashes(f["block_hashes"]), _opt(f.get("medium"), str, "medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
