"""The simulator's KV-cache events: they mirror the prefix cache, and go out on the wire as vLLM's do."""

from __future__ import annotations

import asyncio
import random

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from sim.engine import Engine
from sim.api import SimRequest
from sim.fleet import start_fleet
from sim.kv_events import END_SEQ, KVEventsConfig, encode_batch
from sim.kvcache import Cleared, Removed, Stored, chain_seed, extend_block_keys
from sim.profiles import get_profile
from sim.tokenizer import token_ids
from sim.tokens import VOCAB
from tests.support import until


def _run(engine: Engine, t: float) -> float:
    while (nt := engine.next_step_time()) is not None:
        t = engine.step(nt).end
    return t


def test_events_mirror_the_cached_keys_through_evictions_and_reset() -> None:
    prof = get_profile("llama3-8b-h100").with_overrides(block_size=4, num_gpu_blocks_override=40)
    engine = Engine(prof, seed=1, adapters=("lora-a",), kv_events=True)
    rng = random.Random(5)
    mirror: dict[int, tuple[str, ...]] = {}  # key -> the whole prefix it names, rebuilt from the events
    t = 0.0
    for i in range(60):
        system = [VOCAB[j] for j in range(rng.choice((4, 8, 12)))]
        words = system + [VOCAB[rng.randrange(1024)] for _ in range(rng.randrange(1, 14))]
        engine.add_request(SimRequest(f"r{i}", " ".join(words), max_tokens=rng.randrange(1, 6), ignore_eos=True,
                                      model="lora-a" if i % 7 == 0 else None), t)
        if i % 3 == 2:
            t = _run(engine, t)
        for ev in engine.take_kv_events():
            if isinstance(ev, Stored):
                prefix = mirror[ev.parent] if ev.parent is not None else ()
                for j, key in enumerate(ev.keys):
                    prefix = prefix + ev.tokens[4 * j : 4 * (j + 1)]
                    assert key not in mirror
                    mirror[key] = prefix
            elif isinstance(ev, Removed):
                for key in ev.keys:
                    del mirror[key]
    t = _run(engine, t)
    for ev in engine.take_kv_events():
        if isinstance(ev, Removed):
            for key in ev.keys:
                del mirror[key]
        elif isinstance(ev, Stored):
            prefix = mirror[ev.parent] if ev.parent is not None else ()
            for j, key in enumerate(ev.keys):
                prefix = prefix + ev.tokens[4 * j : 4 * (j + 1)]
                mirror[key] = prefix
    assert engine.pool.evictions > 0
    assert set(mirror) == set(engine.pool._cached)
    # every announced key is the engine's own key of the prefix it names
    for key, prefix in mirror.items():
        keys: list[int] = []
        extend_block_keys(keys, list(prefix), 4, chain_seed(engine.model_name, None))
        keys_lora: list[int] = []
        extend_block_keys(keys_lora, list(prefix), 4, chain_seed(engine.model_name, "lora-a"))
        assert key in (keys[-1], keys_lora[-1])
    assert engine.reset_prefix_cache()
    assert engine.take_kv_events() == [Cleared()] and engine.pool.num_cached == 0


def test_no_events_are_kept_unless_asked() -> None:
    engine = Engine(get_profile("llama3-8b-h100"), seed=0)
    engine.add_request(SimRequest("r", " ".join(VOCAB[:40]), max_tokens=2, ignore_eos=True), 0.0)
    _run(engine, 0.0)
    assert engine.pool.num_cached == 2 and engine.take_kv_events() == []


def test_both_encodings_lay_out_vllm_structs() -> None:
    ev = [Stored((11, 12), None, tuple(VOCAB[:8]), None), Removed((11,)), Cleared()]
    arr = msgpack.unpackb(encode_batch(ev, 1.5, "array", 4))
    assert arr[0] == 1.5 and arr[2] == 0
    assert arr[1][0] == ["BlockStored", [11, 12], None, token_ids(" ".join(VOCAB[:8])), 4, None, "GPU", None]
    assert arr[1][1] == ["BlockRemoved", [11], "GPU"] and arr[1][2] == ["AllBlocksCleared"]
    m = msgpack.unpackb(encode_batch([Stored((7,), 6, tuple(VOCAB[:4]), "sql")], 2.0, "map", 4))
    assert set(m) == {"ts", "events", "data_parallel_rank"}
    e = m["events"][0]
    assert e["type"] == "BlockStored" and e["parent_block_hash"] == 6 and e["lora_name"] == "sql"
    assert isinstance(e["lora_id"], int) and e["block_size"] == 4 and e["medium"] == "GPU"
    with pytest.raises(ValueError):
        KVEventsConfig(encoding="json")  # type: ignore[arg-type]


def test_fleet_endpoints_shift_by_server() -> None:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5600")
    assert cfg.for_server(2).endpoint == "tcp://127.0.0.1:5559"
    assert cfg.for_server(2).replay_endpoint == "tcp://127.0.0.1:5602"
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:*").for_server(3).endpoint == "tcp://127.0.0.1:*"


async def _recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), 5.0)


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_a_request_publishes_its_blocks_and_replay_returns_them(encoding: str) -> None:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv",
                         encoding=encoding)  # type: ignore[arg-type]
    fleet = await start_fleet(1, speed=50.0, kv_events=cfg, profile_overrides={"block_size": 4})
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        pub = fleet.servers[0].backend.kv_publisher
        assert pub is not None and pub.endpoint and pub.replay_endpoint
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        await asyncio.sleep(0.3)  # PUB drops what is sent before the subscription reaches it
        prompt = " ".join(VOCAB[:10])
        async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
            r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200
        topic, seq, payload = await _recv(sub)
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == 0
        batch = msgpack.unpackb(payload)
        events = batch[1] if encoding == "array" else batch["events"]
        first = events[0]
        stored_ids = first[3] if encoding == "array" else first["token_ids"]
        assert stored_ids == token_ids(prompt)[:8]  # two full 4-token blocks of the prompt
        dealer.connect(pub.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            frames = await _recv(dealer)
            assert frames[0] == b""
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                break
            got.append(int.from_bytes(frames[1], "big"))
        assert got[0] == 0 and got == list(range(len(got))) and len(got) == pub.next_seq
        async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
            assert (await h.post("/reset_prefix_cache")).status_code == 200
        while True:
            _, _, payload = await _recv(sub)
            batch = msgpack.unpackb(payload)
            events = batch[1] if encoding == "array" else batch["events"]
            kinds = [e[0] if encoding == "array" else e["type"] for e in events]
            if "AllBlocksCleared" in kinds:
                break
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        await fleet.stop()


def test_cli_flags_publish_events_with_the_chosen_encoding_and_block_size() -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--port", "0", "--servers", "2", "--speed", "100",
         "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
         "--kv-events-topic", "t", "--kv-events-encoding", "array", "--block-size", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        proc.stdout.readline()
        fields = dict(f.split("=", 1) for f in line[2:])
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        sub.connect(fields["kv_events"])
        import time

        time.sleep(0.5)
        httpx.post(line[1] + "/v1/completions", json={"prompt": " ".join(VOCAB[:20]), "max_tokens": 1}, timeout=10)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        batch = msgpack.unpackb(payload)
        assert topic == b"t" and isinstance(batch, list) and batch[1][0][0] == "BlockStored"
        assert batch[1][0][4] == 8 and len(batch[1][0][3]) == 16  # two 8-token blocks of the 20-word prompt
        dealer.connect(fields["kv_replay"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000)
        assert dealer.recv_multipart()[1] == (0).to_bytes(8, "big")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = subprocess.run([sys.executable, "-m", "sim", "--port", "0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=30)
    assert r.returncode == 2 and "needs --kv-events-endpoint" in r.stderr


@pytest.mark.parametrize("publish_at", ["end", "start"])
async def test_a_steps_events_go_out_with_its_outputs_or_when_it_is_scheduled(publish_at: str) -> None:
    """vLLM main publishes a step's events from `update_from_output`, after the model ran ("end", the
    default); earlier releases published them from `schedule` ("start"). Caught while the driver sleeps through
    the step of a long prefill: with "start" its blocks are out already, with "end" not yet."""
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", publish_at=publish_at)  # type: ignore[arg-type]
    assert KVEventsConfig().publish_at == "end" and cfg.for_server(1).publish_at == publish_at
    with pytest.raises(ValueError):
        KVEventsConfig(publish_at="later")  # type: ignore[arg-type]
    fleet = await start_fleet(1, speed=0.5, kv_events=cfg)  # a 4k-token prefill step lasts ~0.5 s of wall time
    try:
        backend = fleet.servers[0].backend
        pub = backend.kv_publisher
        assert pub is not None
        prompt = " ".join(VOCAB[i % len(VOCAB)] for i in range(4096))
        async with httpx.AsyncClient(base_url=fleet.servers[0].url, timeout=30.0) as h:
            answer = asyncio.create_task(h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}))
            await until(lambda: backend.steps >= 1, interval=0.005)  # the first step is computed: its sleep
            during = pub.next_seq
            assert (await answer).status_code == 200
        assert pub.next_seq >= 1  # published by the time its outputs went out, either way
        assert during == (1 if publish_at == "start" else 0)
    finally:
        await fleet.stop()
