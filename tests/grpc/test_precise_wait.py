"""gRPC goes through the same Router hook (issue 13): a long Generate prompt whose prefix an engine holds
(placed there behind the proxy's back) waits for its tokenisation and follows its prefix."""

from __future__ import annotations

import asyncio
import random
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from sim.kv_events import KVEventsConfig
from sim.tokenizer import LOADTEST_WORDS, TOKENIZER_DIR, token_ids
from tests.grpc import stubs
from tests.grpc.conftest import proxy_address


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    f = await start_fleet(4, grpc_port=0, speed=50.0, kv_events=cfg, max_model_len=32768)
    yield f
    await f.stop()


async def test_a_long_grpc_prompt_waits_for_its_tokenisation_and_follows_its_prefix(fleet: Fleet, channel_to) -> None:  # type: ignore[no-untyped-def]
    model = fleet.servers[0].backend.engine.model_name
    lines, kv = [], []
    for s in fleet.servers:
        pub = s.backend.kv_publisher
        assert pub is not None
        lines.append(f"  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}', models: ['{model}']}}")
        kv.append(f"      {s.name}: {{endpoint: '{pub.endpoint}', replay_endpoint: '{pub.replay_endpoint}'}}")
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\nhealth_checks: {enabled: false}\n"
        "routing: {policy: affinity}\n"
        f"backends:\n{chr(10).join(lines)}\n"
        "telemetry:\n  interval_ms: 100\n  timeout_ms: 80\n  kv_events:\n    stale_after_s: 0\n"
        f"    tokenizers: {{'{model}': '{TOKENIZER_DIR}'}}\n    backends:\n{chr(10).join(kv)}\n"
    ))
    await proxy.start()
    try:
        assert proxy.precise is not None
        index, matcher = proxy.precise.index, proxy.precise.matcher
        await asyncio.sleep(0.5)  # SUB sockets connect
        rng = random.Random(77)
        prefix = " ".join(rng.choice(LOADTEST_WORDS) for _ in range(7000))
        async with aiohttp.ClientSession() as s:
            async with s.post(fleet.servers[3].url + "/v1/completions", json={"prompt": prefix, "max_tokens": 1}) as r:
                assert r.status == 200
        ids = token_ids(prefix)
        for _ in range(1000):
            if index.match(ids, model).get("sim-3", 0) >= 6900:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the prefix never reached the index")
        generate = stubs.generate(channel_to(proxy_address(proxy)))
        cont = prefix + " " + " ".join(rng.choice(LOADTEST_WORDS) for _ in range(40))
        resp = await generate(gen.GenerateRequest(model=model, prompt=cont, max_tokens=1))
        assert resp.backend == "sim-3"
        assert matcher.deferred == 0 and sum(matcher.wait_counts) == 1  # type: ignore[attr-defined]
    finally:
        await proxy.stop()
