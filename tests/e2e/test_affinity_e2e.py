"""Issue 4 through the proxy: affinity on the real data plane, to the real simulator, with live telemetry.

- 200 requests over 20 distinct prompts: each prompt on a single backend;
- 20 prompts sharing a 600-word system prompt, 5 sightings each, one at a time: each on one backend, and
  spread over the fleet (issue 13);
- multi-turn chats that extend earlier turns stay on their backend;
- a backend made slow (artificial load, seen by telemetry) sheds its keys and takes them back once it
  recovers.
"""

from __future__ import annotations

import collections
from typing import AsyncIterator

import aiohttp
import pytest

from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.support import until

SYSTEM = "You are a terse assistant for a logistics company. Answer with facts only. " * 10


def proxy_yaml(fleet: Fleet) -> str:
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    return (
        "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\n"
        "health_checks: {enabled: false}\n"
        "telemetry: {interval_ms: 100, timeout_ms: 80}\n"
        "routing: {policy: affinity}\n"
        f"backends:\n{lines}\n"
    )


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, host="127.0.0.1", port=0, speed=8.0)
    yield f
    await f.stop()


@pytest.fixture
async def proxy(fleet: Fleet) -> AsyncIterator[AffinityProxy]:
    p = AffinityProxy(parse_config(proxy_yaml(fleet)))
    await p.start()
    yield p
    await p.stop()


async def ask(s: aiohttp.ClientSession, proxy: AffinityProxy, fleet: Fleet, messages: list[dict]) -> str:
    body = {"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 2, "messages": messages}
    async with s.post(proxy.http_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-affinity-backend"]


def question(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is shipment {i}?"}]


async def test_each_of_20_prompts_stays_on_one_backend(fleet: Fleet, proxy: AffinityProxy) -> None:
    seen: dict[int, set[str]] = collections.defaultdict(set)
    async with aiohttp.ClientSession() as s:
        for n in range(200):
            seen[n % 20].add(await ask(s, proxy, fleet, question(n % 20)))
    assert all(len(b) == 1 for b in seen.values()), seen
    # Sharing the system prompt did not pile them onto one GPU.
    assert len({next(iter(b)) for b in seen.values()}) >= 3


LONG_SYSTEM = " ".join(f"rule{i % 37} applies to every shipment" for i in range(120))  # 600 words


@pytest.mark.parametrize("interleaved", [False, True], ids=["prompt-by-prompt", "interleaved"])
async def test_twenty_prompts_sharing_a_600_word_system_prompt(fleet: Fleet, proxy: AffinityProxy, interleaved: bool) -> None:
    """Issue 13, item 5: sent one at a time to an idle fleet, each prompt's repeats go where its first
    sighting was computed, and the shared system prompt does not pull every new prompt to its holder."""
    order = [i for _ in range(5) for i in range(20)] if interleaved else [i for i in range(20) for _ in range(5)]
    seen: dict[int, list[str]] = collections.defaultdict(list)
    async with aiohttp.ClientSession() as s:
        for i in order:
            messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": f"Where is shipment {i}?"}]
            seen[i].append(await ask(s, proxy, fleet, messages))
    assert all(len(set(b)) == 1 for b in seen.values()), dict(seen)
    assert len({b[0] for b in seen.values()}) >= 3, dict(seen)


async def test_multi_turn_chats_stay_on_their_backend(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with aiohttp.ClientSession() as s:
        homes: dict[int, set[str]] = collections.defaultdict(set)
        for conv in range(8):
            messages = question(1000 + conv)
            for turn in range(4):
                homes[conv].add(await ask(s, proxy, fleet, messages))
                messages = messages + [
                    {"role": "assistant", "content": f"It is in depot {turn}. " * 20},
                    {"role": "user", "content": f"And after step {turn}?"},
                ]
    assert all(len(h) == 1 for h in homes.values()), homes


async def test_slow_backend_sheds_its_keys_and_takes_them_back(fleet: Fleet, proxy: AffinityProxy) -> None:
    def scores() -> dict[str, float | None]:
        return {b.name: b.load_score for b in proxy.store.current.backends}

    await until(lambda: all(v is not None for v in scores().values()), timeout=20, interval=0.05)
    async with aiohttp.ClientSession() as s:
        before = {i: await ask(s, proxy, fleet, question(i)) for i in range(20)}
        slow = collections.Counter(before.values()).most_common(1)[0][0]
        server = next(x for x in fleet.servers if x.name == slow)
        await server.set_faults({"background_requests": 96, "background_prompt_tokens": 2048})

        def slow_is_hot() -> bool:
            sc = scores()
            others = [v for n, v in sc.items() if n != slow and v is not None]
            return sc[slow] is not None and sc[slow] > 1.25 * sum(others) / len(others) + 0.15

        await until(slow_is_hot, timeout=20, interval=0.05)
        during = {i: await ask(s, proxy, fleet, question(i)) for i in range(20)}
        assert slow not in during.values()
        assert all(during[i] == before[i] for i in before if before[i] != slow)

        await server.set_faults({"background_requests": 0})

        def recovered() -> bool:
            sc = scores()
            others = [v for n, v in sc.items() if n != slow and v is not None]
            return sc[slow] is not None and sc[slow] <= max(others) + 0.02

        await until(recovered, timeout=20, interval=0.05)
        after = {i: await ask(s, proxy, fleet, question(i)) for i in range(20)}
    assert after == before
