"""Every parsed endpoint routes on its content, through the proxy to the simulator, with real clients.

For each endpoint of proxy/core/request.py's SUMMARISERS table: 20 distinct prompts spread over the fleet,
and each prompt stays on one backend over 5 sightings. Requests with no content are placed by load.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Awaitable, Callable

import anthropic
import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from proxy.core.request import SUMMARISERS
from proxy.dataplane.openai import ROUTED_ENDPOINTS
from sim.fleet import Fleet
from tests.routing.conftest import decisions, model_of

Send = Callable[[int], Awaitable[str]]  # prompt number -> the backend that answered


def _words(i: int) -> str:
    return f"prompt number {i} about topic {i * 7919 % 1000} with some words"


def _openai(proxy: AffinityProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0)


async def _spread_and_stick(send: Send, backends: int) -> None:
    homes: dict[int, set[str]] = {}
    for _ in range(5):
        for i in range(20):
            homes.setdefault(i, set()).add(await send(i))
    assert all(len(h) == 1 for h in homes.values()), homes
    load = Counter(next(iter(h)) for h in homes.values())
    assert len(load) >= backends - 1 and max(load.values()) <= 10, load


async def test_the_routed_endpoints_are_the_summariser_table() -> None:
    assert ROUTED_ENDPOINTS == frozenset(SUMMARISERS)


async def test_chat_completions(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with _openai(proxy) as c:
        async def send(i: int) -> str:
            raw = await c.chat.completions.with_raw_response.create(
                model=model_of(fleet), max_tokens=2,
                messages=[{"role": "system", "content": "you are helpful"}, {"role": "user", "content": _words(i)}])
            return raw.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


async def test_completions(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with _openai(proxy) as c:
        async def send(i: int) -> str:
            raw = await c.completions.with_raw_response.create(model=model_of(fleet), max_tokens=2, prompt=_words(i))
            return raw.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


async def test_embeddings(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with _openai(proxy) as c:
        async def send(i: int) -> str:
            raw = await c.embeddings.with_raw_response.create(model=model_of(fleet), input=_words(i))
            assert len(raw.parse().data[0].embedding) == 8
            return raw.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


@pytest.mark.parametrize("stream", [False, True])
async def test_responses(fleet: Fleet, proxy: AffinityProxy, stream: bool) -> None:
    async with _openai(proxy) as c:
        async def send(i: int) -> str:
            kwargs: dict[str, Any] = dict(model=model_of(fleet), max_output_tokens=3, instructions="be brief",
                                          input=[{"role": "user", "content": [{"type": "input_text", "text": _words(i)}]}])
            if not stream:
                raw = await c.responses.with_raw_response.create(**kwargs)
                assert raw.parse().output_text
                return raw.headers["x-affinity-backend"]
            async with c.responses.with_streaming_response.create(stream=True, **kwargs) as resp:
                events = [e async for e in await resp.parse()]
                assert events[-1].type in ("response.completed", "response.incomplete")
                assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
                return resp.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages(fleet: Fleet, proxy: AffinityProxy, stream: bool) -> None:
    async with anthropic.AsyncAnthropic(base_url=proxy.http_url, api_key="k", max_retries=0) as c:
        async def send(i: int) -> str:
            kwargs: dict[str, Any] = dict(model=model_of(fleet), max_tokens=3, system="be brief",
                                          messages=[{"role": "user", "content": _words(i)}])
            if not stream:
                raw = await c.messages.with_raw_response.create(**kwargs)
                msg = await raw.parse()
                assert msg.content[0].text and msg.stop_reason == "max_tokens"
                return raw.headers["x-affinity-backend"]
            async with c.messages.with_streaming_response.create(stream=True, **kwargs) as resp:
                events = [e async for e in await resp.parse()]
                assert [e.type for e in events][-1] == "message_stop"
                assert "".join(e.delta.text for e in events if e.type == "content_block_delta")
                return resp.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


VLLM_BODIES: dict[str, Callable[[int], dict[str, Any]]] = {
    "/v1/rerank": lambda i: {"query": _words(i), "documents": ["a cat", "a dog", {"text": "a bird"}]},
    "/score": lambda i: {"text_1": _words(i), "text_2": ["first text", "second text"]},
    "/tokenize": lambda i: {"prompt": _words(i)},
    "/pooling": lambda i: {"messages": [{"role": "user", "content": _words(i)}]},
}


@pytest.mark.parametrize("path", sorted(VLLM_BODIES))
async def test_vllm_pooling_and_utility_endpoints(fleet: Fleet, proxy: AffinityProxy, path: str) -> None:
    async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
        async def send(i: int) -> str:
            resp = await c.post(path, json={"model": model_of(fleet), **VLLM_BODIES[path](i)})
            assert resp.status_code == 200, resp.text
            return resp.headers["x-affinity-backend"]
        await _spread_and_stick(send, len(fleet.servers))


async def test_requests_with_no_content_are_placed_by_load(fleet: Fleet, proxy: AffinityProxy) -> None:
    for path in ("/get_load", "/detokenize"):
        seen: Counter[str] = Counter()
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
            for _ in range(20):
                if path == "/get_load":
                    resp = await c.get(path)
                else:
                    resp = await c.post(path, json={"tokens": [1, 2, 3]})
                assert resp.status_code == 200, resp.text
                seen[resp.headers["x-affinity-backend"]] += 1
        even = 20 / len(fleet.servers)
        assert len(seen) == len(fleet.servers), seen
        assert all(0.7 * even <= n <= 1.3 * even for n in seen.values()), (path, seen)


async def test_requests_differing_only_in_an_image_are_not_exact_repeats(fleet: Fleet, proxy: AffinityProxy) -> None:
    def body(url: str) -> dict[str, Any]:
        return {"model": model_of(fleet), "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]}]}

    async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
        for url in ("https://example.com/cat.png", "https://example.com/dog.png"):
            resp = await c.post("/v1/chat/completions", json=body(url))
            assert resp.status_code == 200, resp.text
        assert (await decisions(proxy))["exact_hit"] == 0
        resp = await c.post("/v1/chat/completions", json=body("https://example.com/dog.png"))
        assert resp.status_code == 200
        assert (await decisions(proxy))["exact_hit"] == 1  # the same image again is a repeat


async def test_a_bad_body_gets_the_error_shape_of_its_api(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with anthropic.AsyncAnthropic(base_url=proxy.http_url, api_key="k", max_retries=0) as c:
        with pytest.raises(anthropic.BadRequestError) as err:
            await c.messages.create(model=model_of(fleet), max_tokens=3, messages=[])
    assert err.value.body["type"] == "error" and "'messages'" in err.value.body["error"]["message"]
    async with _openai(proxy) as oc:
        with pytest.raises(openai.BadRequestError) as oerr:
            await oc.responses.create(model=model_of(fleet), input=3)  # type: ignore[arg-type]  # a bad body on purpose
    assert oerr.value.body["param"] == "input"
