"""KV-cache events over ZeroMQ, published exactly as vLLM's `--kv-events-config` does.

Matched against vLLM's own source, `vllm/distributed/kv_events.py` (`ZmqEventPublisher`, `EventBatch`,
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and `vllm/config/kv_events.py` (`KVEventsConfig`:
publisher "zmq", endpoint "tcp://*:5557", replay_endpoint, buffer_steps 10_000, hwm 100_000, topic ""), as
of vLLM main in late 2025 (the tagged-map release) and the v0.9-v0.10 releases (positional arrays):

- A PUB socket sends one multipart message per engine step that produced events:
  `[topic (utf-8), sequence (8 bytes, big-endian, from 0), msgpack(EventBatch)]`.
- When (`publish_at=`): "end", as the step's outputs go out (vLLM main collects and publishes a step's
  events in `Scheduler.update_from_output`, after the model ran), or "start", when the step is scheduled
  (earlier vLLM releases published them at the end of `Scheduler.schedule`, before the model ran: a chunk's
  blocks read as cached while it is still being computed).
- Optional replay ROUTER socket: a DEALER sends `[b"", start_seq (8 bytes big-endian)]`; the ROUTER answers
  with one `[b"", seq, payload]` per buffered batch whose seq >= start_seq (from the last `buffer_steps`
  batches), then the end marker `[b"", (-1 as 8 signed big-endian bytes), b""]`. Anything else is ignored
  (vLLM logs "Invalid replay request").
- Encodings (`encoding=`):
  * "array" (vLLM <= 0.10: `msgspec.Struct, array_like=True, tag=True`): EventBatch is
    `[ts, [event, ...], data_parallel_rank]`, an event is `["BlockStored", block_hashes, parent_block_hash,
    token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
    `["AllBlocksCleared"]`.
  * "map" (vLLM main, structs tagged but not array_like): EventBatch is `{"ts", "events",
    "data_parallel_rank"}` and an event `{"type": "BlockStored", "block_hashes": ..., "parent_block_hash",
    "token_ids", "block_size", "lora_id", "medium", "lora_name"}` (fields with defaults - extra_keys,
    group_idx, kv_cache_spec_* - are omitted, as `omit_defaults=True` does when they are None).
  medium is "GPU" (vLLM's MEDIUM_GPU); block hashes are the engine's own 64-bit keys (vLLM sends ints for
  64-bit hashes, bytes for sha256 ones; subscribers handle both).

Token ids come from the simulator's own tokenizer (`sim.tokenizer.token_id`: the ids `/tokenize` returns
and `sim/tokenizer/tokenizer.json` reproduces). The block hashes are the engine's prefix-cache keys
(`sim.kvcache`: xxh3 over the words, seeded by model/adapter), deliberately not what the proxy computes, as
with a real engine whose hash algorithm and seed a router cannot know.

Endpoints: a "*" or 0 port binds a free port (`publisher.endpoint` tells which); in a fleet, server i adds i
to a fixed port, like vLLM does per data-parallel rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import msgpack
import xxhash
import zmq
import zmq.asyncio

from .kvcache import Cleared, PoolEvent, Removed, Stored
from .tokenizer import token_id

Encoding = Literal["array", "map"]
PublishAt = Literal["end", "start"]
PUBLISH_AT: tuple[PublishAt, ...] = ("end", "start")
ENCODINGS: tuple[str, ...] = ("array", "map")
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    """What `--kv-events-*` set (vLLM's KVEventsConfig fields that matter to a subscriber)."""

    endpoint: str = "tcp://127.0.0.1:*"
    topic: str = ""
    replay_endpoint: str | None = None
    encoding: Encoding = "map"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    publish_at: PublishAt = "end"

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.publish_at not in PUBLISH_AT:
            raise ValueError(f"kv events publish_at must be one of {', '.join(PUBLISH_AT)}, got {self.publish_at!r}")
        if self.buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")

    def for_server(self, i: int) -> KVEventsConfig:
        """Server i of a fleet: fixed ports shifted by i, free ports stay free."""
        return KVEventsConfig(_offset(self.endpoint, i), self.topic, _offset(self.replay_endpoint, i) if self.replay_endpoint else None,
                              self.encoding, self.buffer_steps, self.hwm, self.publish_at)


def _offset(endpoint: str, i: int) -> str:
    if i == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port in ("*", "0") else f"{base}:{int(port) + i}"
    return f"{endpoint}_{i}"  # ipc:// or inproc://: one name per server


def _bindable(endpoint: str) -> str:
    base, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port == "0":
        return f"{base}:*"
    return endpoint


def encode_event(event: PoolEvent, encoding: Encoding, block_size: int) -> Any:
    """One pool event as vLLM's msgspec would lay it out (before msgpack)."""
    if isinstance(event, Stored):
        ids = [token_id(w) for w in event.tokens]
        lora_name = event.adapter
        lora_id = _lora_id(event.adapter) if event.adapter else None
        if encoding == "array":
            return ["BlockStored", list(event.keys), event.parent, ids, block_size, lora_id, MEDIUM_GPU, lora_name]
        return {"type": "BlockStored", "block_hashes": list(event.keys), "parent_block_hash": event.parent,
                "token_ids": ids, "block_size": block_size, "lora_id": lora_id, "medium": MEDIUM_GPU,
                "lora_name": lora_name}
    if isinstance(event, Removed):
        if encoding == "array":
            return ["BlockRemoved", list(event.keys), MEDIUM_GPU]
        return {"type": "BlockRemoved", "block_hashes": list(event.keys), "medium": MEDIUM_GPU}
    if isinstance(event, Cleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a pool event: {event!r}")


def _lora_id(adapter: str) -> int:
    # vLLM's lora_int_id is assigned by the server (1-based); a stable small id stands in for it here.
    return 1 + xxhash.xxh32_intdigest(adapter.encode()) % (1 << 20)


def encode_batch(events: Iterable[PoolEvent], ts: float, encoding: Encoding, block_size: int,
                 dp_rank: int = 0) -> bytes:
    body = [encode_event(e, encoding, block_size) for e in events]
    if encoding == "array":
        return msgpack.packb([ts, body, dp_rank], use_bin_type=True)
    return msgpack.packb({"ts": ts, "events": body, "data_parallel_rank": dp_rank}, use_bin_type=True)


class KVEventPublisher:
    """PUB socket + replay ROUTER for one simulated server (asyncio; `publish` never blocks)."""

    def __init__(self, config: KVEventsConfig, *, block_size: int, context: zmq.asyncio.Context | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self.next_seq = 0
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.batches_sent = 0
        self.replays_served = 0
        self.drop_next = 0  # test hook: sequence numbers consumed without sending (a lost message)

    def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(_bindable(self.config.endpoint))
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router = router  # closed by stop() if the bind fails
            router.bind(_bindable(self.config.replay_endpoint))
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def publish(self, events: list[PoolEvent], ts: float | None = None) -> int | None:
        """Send one EventBatch; returns its sequence number (None when there was nothing to send)."""
        if not events or self._pub is None:
            return None
        payload = encode_batch(events, time.time() if ts is None else ts, self.config.encoding, self.block_size)
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return seq
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # past the high-water mark: dropped, as vLLM's PUB does; the replay buffer still has it
        self.batches_sent += 1
        return seq

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                _log.warning("invalid KV-event replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays_served += 1
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", END_SEQ, b""))
