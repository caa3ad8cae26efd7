"""Two proxy replicas in front of the simulator, sharing their live load through one redis-server
(routing.peer_load): requests replica A holds in flight on a backend are in replica B's routing inputs,
and B's decisions change accordingly; a third replica without the component (the control) sends the same
prompts to that busy backend, so this fails without the component.

A is configured with only one backend (sim-1), so every request it holds in flight is on that backend:
which backend is busy is then known without computing any hash.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from sim.tokenizer import LOADTEST_WORDS
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401  # the fixture
from tests.support.wait import until

BUSY = "sim-1"
HELD = 4  # long requests A keeps in flight on BUSY: above the request bound of a 4-backend fleet


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(LOADTEST_WORDS) for _ in range(n))


def _proxy(fleet: Fleet, names: list[str], redis_url: str | None, replica_id: str) -> AffinityProxy:
    model = fleet.servers[0].backend.engine.model_name
    lines = [f"  - {{name: {s.name}, url: '{s.url}', models: ['{model}']}}" for s in fleet.servers if s.name in names]
    peer = f"  peer_load: {{redis_url: '{redis_url}', refresh_ms: 20, replica_id: {replica_id}}}\n" if redis_url else ""
    yaml = ("listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\nhealth_checks: {enabled: false}\n"
            "telemetry: {enabled: false}\n"
            f"routing:\n  policy: affinity\n{peer}"
            f"backends:\n{chr(10).join(lines)}\n")
    return AffinityProxy(parse_config(yaml))


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, speed=1.0)
    yield f
    await f.stop()


async def _complete(s: aiohttp.ClientSession, proxy: AffinityProxy, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    async with s.post(proxy.http_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-affinity-backend"]


async def test_load_held_by_one_replica_moves_the_other_replicas_decisions(
        fleet: Fleet, redis_server: RedisServer) -> None:
    names = [s.name for s in fleet.servers]
    model = fleet.servers[0].backend.engine.model_name
    a = _proxy(fleet, [BUSY], redis_server.url, "replica-a")
    b = _proxy(fleet, names, redis_server.url, "replica-b")
    control = _proxy(fleet, names, None, "control")  # the same as B without routing.peer_load
    assert control.peer_load is not None and not control.peer_load.config.enabled
    prompts = [f"question {i}: " + _words(i, 150) for i in range(16)]
    async with AsyncExitStack() as stack:
        for p in (a, b, control):
            await p.start()
            stack.push_async_callback(p.stop)
        s = await stack.enter_async_context(aiohttp.ClientSession())
        assert b.peer_load is not None
        # Both replicas publish: B sees A's row (all zeros while A is idle).
        assert await until(lambda: (b.peer_load.peers() or {}).get(BUSY, ())[:3] == (0, 0, 0.0), timeout=10)
        # A holds HELD long streams on BUSY (only the first chunk read: they stay in flight).
        streams = []
        for i in range(HELD):
            body = {"model": model, "prompt": f"long job {i}: " + _words(100 + i, 400), "max_tokens": 4000,
                    "stream": True}
            resp = await s.post(a.http_url + "/v1/completions", json=body)
            stack.push_async_callback(resp.release)
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-affinity-backend"] == BUSY
            await resp.content.readline()
            streams.append(resp)
        assert a.inflight[BUSY].requests == HELD
        # B's routing inputs now hold A's requests on BUSY (and nothing of its own).
        view = await until(lambda: (v := b.peer_load.peers()) and v.get(BUSY, (0,))[0] == HELD and v, timeout=10)
        assert view[BUSY][1] > 0 and view[BUSY][2] > 0  # tokens and queued prefill travel too
        assert len(view[BUSY][3]) == HELD  # and A's newest ledger entries, one per request it holds
        assert set(view) == {BUSY}  # A knows only BUSY
        assert b.inflight.get(BUSY) is None or b.inflight[BUSY].requests == 0
        # The control replica, blind to A, sends the prompts whose hash home is BUSY there ...
        to_busy = [p for p in prompts if await _complete(s, control, model, p) == BUSY]
        assert to_busy, "no prompt of the set hashes to the busy backend: pick another set"
        # ... and B, which sees A's load, sends none of them (nor any other prompt) to BUSY.
        placed = {p: await _complete(s, b, model, p) for p in prompts}
        assert BUSY not in placed.values(), placed
        # A's streams end: its load leaves B's view, and B's next fresh prompt for BUSY goes home again.
        for resp in streams:
            resp.close()
        assert await until(lambda: (b.peer_load.peers() or {}).get(BUSY, (1,))[0] == 0, timeout=10)
        later = [f"later {p}" for p in prompts]
        homes = [p for p in later if await _complete(s, control, model, p) == BUSY]
        assert homes
        assert [await _complete(s, b, model, p) for p in homes] == [BUSY] * len(homes)


async def test_each_worker_of_one_proxy_publishes_its_own_part_of_the_host(tmp_path, redis_server: RedisServer) -> None:
    """`run --workers 2` with routing.peer_load and the affinity policy: each worker publishes its own
    row, `<hostname>:<supervisor pid>/<worker index>`, holding its own requests and its own newest
    ledger entries (a --workers host's entries reach the fleet-wide merge), so another replica sums the
    host's load once over the two rows and merges every worker's entries."""
    import socket

    import redis.asyncio as aioredis

    from proxy.control.peer_load import merge_rows, parse_row
    from tests.deploy.procs import AFFINITY_PROXY, start_proxy
    from tests.deploy.test_workers_shared_load import _connection_to, _open_stream
    from tests.support import FakeBackend

    fakes = [FakeBackend(f"gpu-{i}") for i in range(2)]
    for f in fakes:
        f.hang_stream = True
        await f.start()
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in fakes)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "telemetry: {enabled: false}\ntimeouts: {drain_s: 2}\n"
        f"routing:\n  policy: affinity\n  peer_load: {{redis_url: '{redis_server.url}', refresh_ms: 20, key_prefix: w}}\n"
        f"backends:\n{lines}\n")
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    client = aioredis.from_url(redis_server.url)
    held = []
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        for i in range(4):
            reader, writer = await _connection_to(proxy, workers[i % 2])
            held.append(writer)
            await _open_stream(reader, writer, proxy.port, f"prompt {i} " + "words " * (40 + i))
        host = f"{socket.gethostname()}:{proxy.pid}"
        worker_rows = [f"w:replica:{host}/0", f"w:replica:{host}/1"]

        async def rows() -> list[bytes] | None:
            keys = sorted(k.decode() for k in await client.keys("w:replica:*"))
            if keys != worker_rows:
                return None
            raw = [await client.get(k) or b"{}" for k in worker_rows]
            parsed = [parse_row(r) or {} for r in raw]  # packed rows (round 5b)
            # Each worker: its own 2 streams and its own 2 newest ledger entries (over both backends).
            if [sum(v[0] for v in row.values()) for row in parsed] != [2, 2]:
                return None
            if [sum(len(v[3]) for v in row.values()) for row in parsed] != [2, 2]:
                return None
            return raw

        raw = await until(rows, timeout=20)
        # Another replica's view of the host: its 4 requests once, and its 4 entries.
        view = merge_rows(raw)
        assert sum(v[0] for v in view.values()) == 4
        assert sum(len(v[3]) for v in view.values()) == 4  # type: ignore[misc]  # rows with entries
    finally:
        for writer in held:
            writer.close()
        await client.aclose()
        assert await proxy.terminate() == 0
        for f in fakes:
            await f.stop()
