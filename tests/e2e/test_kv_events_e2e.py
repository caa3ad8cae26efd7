"""Precise routing through the proxy against the simulator with KV events on.

- a prompt computed on a backend (sent there directly, so no proxy learned it) has its continuation routed
  to that backend by two independent proxy replicas, in both of vLLM's event encodings, and the engine
  reports the prefix as cached;
- the same through `affinity-proxy run --workers 2`: continuations landing on either worker process;
- a gap in a backend's sequence triggers a replay that restores the index;
- a backend whose events never arrive is stale: the proxy routes it by the learned index;
- a live request's prompt leaves the queued-prefill estimate once its engine's events show it computed
  (routing.affinity.running_weight below 1), while it is still decoding.
"""

from __future__ import annotations

import asyncio
import random
import socket
from typing import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.request import RequestSummary
from sim.fleet import Fleet, start_fleet
from sim.kv_events import KVEventsConfig
from sim.tokenizer import LOADTEST_WORDS, TOKENIZER_DIR, token_ids

QUIET = "sim-3"  # its events go nowhere the proxy listens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(LOADTEST_WORDS) for _ in range(n))


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


class Replica:
    """One proxy replica: its own index, subscriber, tokenizer and learned state."""

    def __init__(self, fleet: Fleet, access_log: Path | None = None, affinity: str = "", kv_events: str = "") -> None:
        model = fleet.servers[0].backend.engine.model_name
        self.model = model
        lines = []
        kv = []
        for s in fleet.servers:
            lines.append(f"  - {{name: {s.name}, url: '{s.url}', models: ['{model}']}}")
            pub = s.backend.kv_publisher
            assert pub is not None and pub.endpoint and pub.replay_endpoint
            endpoint = f"tcp://127.0.0.1:{_free_port()}" if s.name == QUIET else pub.endpoint
            replay = "" if s.name == QUIET else f", replay_endpoint: '{pub.replay_endpoint}'"
            kv.append(f"      {s.name}: {{endpoint: '{endpoint}'{replay}}}")
        yaml = (
            "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\nhealth_checks: {enabled: false}\n"
            f"routing: {{policy: affinity{', affinity: {' + affinity + '}' if affinity else ''}}}\n"
            f"backends:\n{chr(10).join(lines)}\n"
            f"telemetry:\n  interval_ms: 100\n  timeout_ms: 80\n  kv_events:\n    stale_after_s: 0\n{kv_events}"
            f"    tokenizers: {{'{model}': '{TOKENIZER_DIR}'}}\n    backends:\n{chr(10).join(kv)}\n"
        )
        if access_log is not None:
            yaml += f"logging: {{format: json, access_log: {{path: '{access_log}', flush_interval_s: 0}}}}\n"
        # The real wiring: AffinityProxy builds the index, the policy's precise lookup and the subscriber
        # (a data-plane service) from telemetry.kv_events.
        self.proxy = AffinityProxy(parse_config(yaml))
        assert self.proxy.precise is not None
        self.index = self.proxy.precise.index
        self.matcher = self.proxy.precise.matcher
        self.registry = self.proxy.metrics.registry

    async def start(self) -> None:
        await self.proxy.start()

    async def stop(self) -> None:
        await self.proxy.stop()

    async def complete(self, s: aiohttp.ClientSession, prompt: str) -> tuple[str, int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        async with s.post(self.proxy.http_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
            return resp.headers["x-affinity-backend"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _direct(s: aiohttp.ClientSession, fleet: Fleet, i: int, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 1}
    async with s.post(fleet.servers[i].url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def _computed_behind_the_proxy(s: aiohttp.ClientSession, fleet: Fleet, backends: int, each: int,
                                     seed: int, step: int = 100) -> dict[tuple[int, int], str]:
    """`each` prompts of 320 words (20 blocks of 16 tokens) computed directly on each of the first
    `backends` backends, behind every proxy's back: (backend i, j) -> prompt, seeded seed + step * i + j."""
    prompts = {}
    for i in range(backends):
        for j in range(each):
            prompts[(i, j)] = p = _words(seed + step * i + j, 320)
            await _direct(s, fleet, i, p)
    return prompts


async def _continuations_reach_holders(port: int, model: str, prompts: dict[tuple[int, int], str],
                                       names: list[str], workers: list[int], seed: int) -> None:
    """Through a real `run --workers N` on `port`: four continuations of each prompt (i, j), each on a
    fresh connection (the kernel spreads them over the workers), go to backend `names[i]`, which computed
    its prefix, with its cached tokens; and every worker served some of them."""
    import json

    from tests.deploy.procs import owner_of_connection, post_json

    served_by: set[int] = set()
    for (i, j), p in prompts.items():
        for n in range(4):
            owner: list[int | None] = []
            reply = await post_json(
                port, "/v1/completions",
                {"model": model, "prompt": p + " " + _words(seed + n + 10 * j + 100 * i, 20), "max_tokens": 1},
                lambda r: owner.append(owner_of_connection(r.local_port, port, workers)),
            )
            assert reply.status == 200, reply.body
            assert reply.headers["x-affinity-backend"] == names[i], (i, j, n, owner)
            assert json.loads(reply.body)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 304
            if owner[0] is not None:
                served_by.add(owner[0])
    assert served_by == set(workers)


@pytest.fixture(params=["array", "map"])
async def fleet(request) -> AsyncIterator[Fleet]:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", encoding=request.param)
    f = await start_fleet(4, speed=20.0, kv_events=cfg)
    yield f
    await f.stop()


@pytest.fixture
async def array_fleet() -> AsyncIterator[Fleet]:
    """The same fleet in one encoding, for tests whose subject is not the events' wire format."""
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", encoding="array")
    f = await start_fleet(4, speed=20.0, kv_events=cfg)
    yield f
    await f.stop()


@pytest.fixture
async def replicas(fleet: Fleet) -> AsyncIterator[list[Replica]]:
    reps = [Replica(fleet), Replica(fleet)]
    for r in reps:
        await r.start()
    await asyncio.sleep(0.5)  # SUB sockets connect; what they miss meanwhile comes back by replay
    yield reps
    for r in reps:
        await r.stop()


def _cached_on(rep: Replica, prompt: str, backend: str) -> int:
    return rep.index.match(token_ids(prompt), rep.model).get(backend, 0)


async def test_continuations_follow_the_engine_that_holds_the_prefix(fleet: Fleet, replicas: list[Replica]) -> None:
    async with aiohttp.ClientSession() as s:
        prompts = await _computed_behind_the_proxy(s, fleet, 3, 2, seed=0)  # the publishing backends
        for rep in replicas:
            await _until(lambda: all(_cached_on(rep, p, f"sim-{i}") >= 304 for (i, _), p in prompts.items()))
        for (i, j), p in prompts.items():
            for n, rep in enumerate(replicas):
                cont = p + " " + _words(7 + n + 10 * j + 100 * i, 40)
                backend, cached = await rep.complete(s, cont)
                assert backend == f"sim-{i}", (i, j, n)
                assert cached >= 304  # the engine really served the prefix from its cache
    for rep in replicas:
        assert rep.index.is_fresh("sim-0") and not rep.index.is_fresh(QUIET)
        assert rep.registry.get_sample_value("affinity_proxy_kv_index_blocks", {"backend": "sim-0"}) > 0


async def test_a_pick_applies_the_events_that_arrived_before_it(array_fleet: Fleet) -> None:
    """telemetry.kv_events.drain_interval_ms: events are not applied as they arrive but by the router, just
    before each pick (and by a timer, here a minute away). Prompts computed behind the proxy's back are
    unknown to its index until a continuation is routed, and that pick already sends it to their holder."""
    rep = Replica(array_fleet, kv_events="    drain_interval_ms: 60000\n")
    await rep.start()
    try:
        await asyncio.sleep(0.5)  # SUB sockets connect
        async with aiohttp.ClientSession() as s:
            prompts = await _computed_behind_the_proxy(s, array_fleet, 3, 2, seed=300)
            await asyncio.sleep(0.3)  # the engines' batches reach the SUB sockets
            assert all(_cached_on(rep, p, f"sim-{i}") == 0 for (i, _), p in prompts.items())  # not applied
            for (i, j), p in prompts.items():
                backend, cached = await rep.complete(s, p + " " + _words(9 + 10 * j + 100 * i, 40))
                assert backend == f"sim-{i}", (i, j)
                assert cached >= 304
    finally:
        await rep.stop()


async def test_a_gap_is_replayed_and_the_index_restored(fleet: Fleet, replicas: list[Replica]) -> None:
    rep = replicas[0]
    pub = fleet.servers[1].backend.kv_publisher
    assert pub is not None
    async with aiohttp.ClientSession() as s:
        await _direct(s, fleet, 1, _words(1, 64))
        await _until(lambda: rep.index.is_fresh("sim-1"))
        lost = _words(2, 320)
        pub.drop_next = 1  # the PUB socket loses this batch; the replay buffer keeps it
        await _direct(s, fleet, 1, lost)
        await _direct(s, fleet, 1, _words(3, 64))  # the next batch shows the gap
        await _until(lambda: _cached_on(rep, lost, "sim-1") >= 304)
    assert rep.registry.get_sample_value("affinity_proxy_kv_event_gaps_total", {"backend": "sim-1"}) == 1
    assert rep.registry.get_sample_value("affinity_proxy_kv_event_replays_total",
                                         {"backend": "sim-1", "outcome": "complete"}) >= 1


async def test_a_backend_without_events_is_routed_by_the_learned_index(fleet: Fleet, replicas: list[Replica]) -> None:
    rep = replicas[0]
    async with aiohttp.ClientSession() as s:
        await _direct(s, fleet, 0, _words(5, 64))  # a publishing backend is fresh: the lookup answers
        await _until(lambda: rep.index.is_fresh("sim-0"))
        for seed in range(200):
            p = _words(1000 + seed, 64)
            backend, _ = await rep.complete(s, p)
            if backend == QUIET:
                break
        else:
            raise AssertionError("no prompt hashed to the quiet backend")
        assert rep.index.state(QUIET) == "stale"
        answer = rep.matcher(RequestSummary(prompt=p, model=rep.model, endpoint="/v1/completions"))
        assert answer is not None and QUIET not in answer.cached  # stale: no answer for it, not "empty"
        for _ in range(3):  # repeats: the learned index keeps it where it was computed
            backend, cached = await rep.complete(s, p)
            assert backend == QUIET and cached > 0


def _workers_config(tmp_path: Path, fleet: Fleet) -> tuple[str, Path]:
    """The model and a config file for `affinity-proxy run --workers N` over `fleet`, every backend's
    events subscribed (with their replay endpoints)."""
    model = fleet.servers[0].backend.engine.model_name
    lines, kv = [], []
    for s in fleet.servers:
        pub = s.backend.kv_publisher
        assert pub is not None
        lines.append(f"  - {{name: {s.name}, url: '{s.url}', models: ['{model}']}}")
        kv.append(f"      {s.name}: {{endpoint: '{pub.endpoint}', replay_endpoint: '{pub.replay_endpoint}'}}")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "health_checks: {enabled: false}\nrouting: {policy: affinity}\n"
        f"backends:\n{chr(10).join(lines)}\n"
        f"telemetry:\n  kv_events:\n    tokenizers: {{'{model}': '{TOKENIZER_DIR}'}}\n    backends:\n{chr(10).join(kv)}\n"
    )
    return model, cfg


async def test_every_worker_of_a_multiprocess_proxy_routes_by_the_events(tmp_path, fleet: Fleet) -> None:
    """`affinity-proxy run --workers 2`: each worker subscribes and holds the index, so a continuation that
    the kernel hands to either worker goes to the engine that computed its prefix."""
    from tests.deploy.procs import AFFINITY_PROXY, start_proxy

    model, cfg = _workers_config(tmp_path, fleet)
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        async with aiohttp.ClientSession() as s:
            prompts = await _computed_behind_the_proxy(s, fleet, 4, 3, seed=500, step=10)
        await asyncio.sleep(1.5)  # the workers' subscriptions have seen the events (or replayed them)
        await _continuations_reach_holders(proxy.port, model, prompts, [f"sim-{i}" for i in range(4)], workers, 9000)
    finally:
        await proxy.terminate()


async def test_killing_and_restarting_a_backend_clears_its_index(fleet: Fleet, replicas: list[Replica]) -> None:
    from sim.backend import SimBackend
    from sim.fleet import SimServer

    rep = replicas[0]
    old = fleet.servers[2]
    pub = old.backend.kv_publisher
    assert pub is not None and pub.endpoint and pub.replay_endpoint
    async with aiohttp.ClientSession() as s:
        held = _words(77, 320)
        await _direct(s, fleet, 2, held)
        await _until(lambda: _cached_on(rep, held, "sim-2") >= 304)
        await old.stop()  # killed ...
        cfg = KVEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, encoding=pub.config.encoding)
        new = None
        for _ in range(100):  # ... and started again on the same ports (freed asynchronously)
            backend = SimBackend(old.backend.profile, name="sim-2", seed=2, kv_events=cfg)
            candidate = SimServer(backend, host=old.host, port=old.port, grpc_port=None, flavor=old.flavor, fleet=fleet)
            try:
                await candidate.start()
                new = candidate
                break
            except Exception:
                await candidate.stop()
                await asyncio.sleep(0.05)
        assert new is not None
        fleet.servers[2] = new
        for n in range(50):  # the subscriber reconnects by itself; the restart shows as a sequence reset
            if rep.registry.get_sample_value("affinity_proxy_kv_event_restarts_total", {"backend": "sim-2"}):
                break
            await _direct(s, fleet, 2, _words(3000 + n, 40))
            await asyncio.sleep(0.1)
        await _until(lambda: rep.index.is_fresh("sim-2"))
    assert rep.registry.get_sample_value("affinity_proxy_kv_event_restarts_total", {"backend": "sim-2"}) == 1
    assert _cached_on(rep, held, "sim-2") == 0  # the old engine's blocks are gone from the index
    assert rep.index.num_blocks("sim-2") > 0  # and the new engine's are there


async def test_a_chats_next_turn_follows_the_engine_that_served_its_first(fleet: Fleet, replicas: list[Replica]) -> None:
    rep = replicas[1]
    system = {"role": "system", "content": _words(41, 200)}
    async with aiohttp.ClientSession() as s:
        homes = {}
        for i in range(3):
            first = [system, {"role": "user", "content": _words(50 + i, 200)}]
            async with s.post(fleet.servers[i].url + "/v1/chat/completions",
                              json={"messages": first, "max_tokens": 3, "ignore_eos": True}) as resp:
                assert resp.status == 200
                reply = (await resp.json())["choices"][0]["message"]["content"]
            homes[i] = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": _words(60 + i, 30)}]
        await _until(lambda: all(rep.index.num_blocks(f"sim-{i}") >= 25 for i in range(3)))
        for i, messages in homes.items():
            body = {"model": rep.model, "messages": messages, "max_tokens": 1}
            async with s.post(rep.proxy.http_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-affinity-backend"] == f"sim-{i}"
                assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400


async def test_a_decoding_requests_prompt_leaves_the_queued_prefill_once_its_blocks_are_stored() -> None:
    """The work ledger counts a routed prompt's uncached tokens as queued prefill for as long as the
    request is live. Once the engine's events show its blocks stored, the backlog bound no longer does:
    a streamed request still decoding counts in full at running_weight 1 and not at all at 0, each
    read through the proxy's own ledger, index and in-flight table."""
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    fleet = await start_fleet(2, speed=1.0, kv_events=cfg)  # real time: 2,000 tokens decode for seconds
    rep = Replica(fleet, affinity="running_weight: 0.0")
    await rep.start()
    try:
        await asyncio.sleep(0.5)
        prompt = _words(77, 640)
        body = {"model": rep.model, "prompt": prompt, "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as s:
            for i in range(2):  # each engine publishes: its index is fresh, so the precise lookup answers
                await _direct(s, fleet, i, _words(90 + i, 64))
            await _until(lambda: rep.index.is_fresh("sim-0") and rep.index.is_fresh("sim-1"))
            async with s.post(rep.proxy.http_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                backend = resp.headers["x-affinity-backend"]
                await resp.content.readline()  # the first token: its prefill is done
                await _until(lambda: rep.index.progress.get(backend, 0) >= 624)  # its 39 full blocks
                work = rep.proxy._work
                assert work is not None
                live = rep.proxy.inflight.get(backend)
                assert live is not None and live.requests == 1
                full = work.pending(backend, live)
                assert full >= 600  # the newest-k sum: the whole prompt (estimated from its bytes)
                # The bound, in the engine's tokens (`ratio`: the prompt's own estimate over its count): all
                # of it computed but the prompt's partial last block, stored once decode fills it.
                assert 1.0 < work.ratio and work.pending(backend, live, 0.0) < 16 * work.ratio
                half = work.pending(backend, live, 0.5)
                assert half == pytest.approx((full + work.pending(backend, live, 0.0)) / 2)
                resp.close()
    finally:
        await rep.stop()
        await fleet.stop()


def _chunk_counts(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("affinity_proxy_tokenizer_chunks_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


async def test_the_workers_of_a_host_tokenise_a_prompt_once_between_them(tmp_path, array_fleet: Fleet) -> None:
    """`run --workers 2`: a prompt one worker tokenised is found by the other in the host's shared chunk
    block, so the host tokenises each of its chunks once, whichever worker each sighting reaches (the
    merged /metrics: affinity_proxy_tokenizer_chunks_total by source)."""
    from tests.deploy.procs import AFFINITY_PROXY, owner_of_connection, post_json, start_proxy

    fleet = array_fleet
    model, cfg = _workers_config(tmp_path, fleet)
    prompt = _words(77, 1500)  # ~10k characters: a few 2 KB chunks, tokenised inline (under offload_chars)
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        async with aiohttp.ClientSession() as s:
            await _direct(s, fleet, 0, _words(78, 300))  # another prompt: every worker's index has seen events
        await asyncio.sleep(1.5)  # (a lookup with no event yet is skipped: nothing to match against)
        served: list[int | None] = []
        for _ in range(40):  # fresh connections until both workers have routed the prompt
            owner: list[int | None] = []
            reply = await post_json(proxy.port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1},
                                    lambda r: owner.append(owner_of_connection(r.local_port, proxy.port, workers)))
            assert reply.status == 200, reply.body
            served += owner
            if set(served) == set(workers):
                break
        assert set(served) == set(workers), served
        async with aiohttp.ClientSession() as s, s.get(proxy.admin + "/metrics") as resp:
            counts = _chunk_counts(await resp.text())
        # The first sighting tokenised every chunk; the first one on the other worker copied them all from
        # the host's block (then read them from its own cache); none was tokenised twice.
        assert counts["tokenized"] >= 4, counts
        assert counts["host_cache"] == counts["tokenized"], counts
        assert counts["own_cache"] >= counts["host_cache"], counts
    finally:
        await proxy.terminate()
