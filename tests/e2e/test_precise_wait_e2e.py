"""Through the real proxy with KV events on (issue 13): a long continuation whose earlier turns this proxy
never tokenised (another replica did, or nobody: they were sent to the engine directly) waits for its own
tokenisation off the event loop and goes to the engine that holds its prefix, not where the learned index
would send it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from sim.fleet import Fleet, start_fleet
from sim.kv_events import KVEventsConfig

from .test_kv_events_e2e import Replica, _cached_on, _direct, _until, _words


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    f = await start_fleet(4, speed=50.0, kv_events=cfg, max_model_len=32768)
    yield f
    await f.stop()


async def test_a_long_continuation_first_seen_here_follows_its_prefix(fleet: Fleet, tmp_path: Path) -> None:
    import asyncio

    log_path = tmp_path / "access.log"
    rep = Replica(fleet, access_log=log_path)
    await rep.start()
    try:
        await asyncio.sleep(0.5)  # SUB sockets connect
        tok = next(iter(rep.matcher.tokenizers.values()))  # type: ignore[attr-defined]
        async with aiohttp.ClientSession() as s:
            for i in (1, 2):
                prefix = _words(500 + i, 7000)
                assert len(prefix) > tok.offload_chars  # too long to tokenise on the event loop
                await _direct(s, fleet, i, prefix)  # behind the proxy's back: it learned nothing
                await _until(lambda: _cached_on(rep, prefix, f"sim-{i}") >= 6900, timeout=20)
                cont = prefix + " " + _words(900 + i, 50)
                backend, cached = await rep.complete(s, cont)
                assert backend == f"sim-{i}"
                assert cached >= 6900  # the engine served the prefix from its cache
        m = rep.matcher
        assert m.deferred == 0 and m.wait_timeouts == 0  # type: ignore[attr-defined]
        assert rep.registry.get_sample_value("affinity_proxy_precise_wait_seconds_count") == 2
        assert rep.registry.get_sample_value("affinity_proxy_precise_wait_timeouts_total") == 0
    finally:
        await rep.stop()
    # The access log says why: the engine holding the most of each continuation by its KV events, and how
    # many of its tokens, beside the reason and the backend.
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert [(x["backend"], x["reason"], x["kv_holder"]) for x in lines] == [
        ("sim-1", "prefix_hit", "sim-1"), ("sim-2", "prefix_hit", "sim-2")]
    assert all(x["kv_cached"] >= 6900 for x in lines), lines
