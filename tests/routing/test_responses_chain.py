"""Responses API chains: each turn's `previous_response_id` names a response stored in one engine's memory
(as vLLM does), so the proxy sends the turn to the backend that produced it, learned from the answers it
relayed (JSON `id`, or the stream's `response.created` event)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from sim.fleet import Fleet
from tests.routing.conftest import ProxyFactory, model_of


async def _turn(c: openai.AsyncOpenAI, model: str, text: str, prev: str | None, stream: bool) -> tuple[str, str]:
    """One turn through the proxy: (response id, backend that answered)."""
    kwargs: dict[str, Any] = dict(model=model, max_output_tokens=3, input=text)
    if prev is not None:
        kwargs["previous_response_id"] = prev
    if not stream:
        raw = await c.responses.with_raw_response.create(**kwargs)
        resp = raw.parse()
        assert resp.output_text and resp.previous_response_id == prev
        return resp.id, raw.headers["x-affinity-backend"]
    async with c.responses.with_streaming_response.create(stream=True, **kwargs) as streamed:
        events = [e async for e in await streamed.parse()]
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        return events[-1].response.id, streamed.headers["x-affinity-backend"]


@pytest.mark.parametrize("stream", [False, True])
async def test_every_turn_of_a_chain_reaches_the_backend_that_stored_the_previous_response(
        fleet: Fleet, make_proxy: ProxyFactory, stream: bool) -> None:
    proxy = await make_proxy()
    model = model_of(fleet)
    used: set[str] = set()
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        for chain in range(6):
            prev, home = await _turn(c, model, f"chain {chain} opening question about topic {chain * 37}", None, stream)
            used.add(home)
            for turn in range(1, 5):
                rid, backend = await _turn(c, model, f"follow-up {turn} of chain {chain}", prev, stream)
                assert backend == home, (chain, turn)
                prev = rid
    assert len(used) >= 2  # the chains themselves still spread (each opening is routed on its content)
    assert len(proxy.openai.response_homes) == 6 * 5


async def test_streamed_and_json_turns_mix_in_one_chain(fleet: Fleet, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    model = model_of(fleet)
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        prev, home = await _turn(c, model, "a mixed chain begins here", None, True)
        for turn, stream in enumerate((False, True, False, True)):
            prev, backend = await _turn(c, model, f"mixed turn {turn}", prev, stream)
            assert backend == home


async def test_a_previous_response_on_a_backend_that_is_down_gets_the_engines_own_404(
        fleet: Fleet, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    model = model_of(fleet)
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        prev, home = await _turn(c, model, "a chain whose home goes away", None, False)
        async with httpx.AsyncClient(timeout=10) as admin:
            assert (await admin.post(f"{proxy.admin_url}/admin/backends/{home}/drain")).status_code == 200
        with pytest.raises(openai.NotFoundError) as info:
            await c.responses.with_raw_response.create(model=model, max_output_tokens=3, input="next",
                                                       previous_response_id=prev)
        assert f"Response with id '{prev}' not found." in str(info.value)
        assert info.value.response.headers["x-affinity-backend"] != home


async def test_the_simulator_keeps_responses_per_server_and_404s_unknown_ids(fleet: Fleet) -> None:
    a, b = fleet.servers[0], fleet.servers[1]
    async with httpx.AsyncClient(timeout=10) as c:
        first = (await c.post(a.url + "/v1/responses", json={"model": model_of(fleet), "input": "hello",
                                                             "max_output_tokens": 2})).json()
        ok = await c.post(a.url + "/v1/responses", json={"model": model_of(fleet), "input": "more",
                                                         "previous_response_id": first["id"], "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["previous_response_id"] == first["id"]
        assert ok.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]  # the history came first
        elsewhere = await c.post(b.url + "/v1/responses", json={"model": model_of(fleet), "input": "more",
                                                                "previous_response_id": first["id"]})
        assert elsewhere.status_code == 404
        assert elsewhere.json()["error"] == {"message": f"Response with id '{first['id']}' not found.",
                                             "type": "invalid_request_error", "param": "response_id", "code": None}
        unstored = (await c.post(a.url + "/v1/responses", json={"model": model_of(fleet), "input": "x", "store": False,
                                                                "max_output_tokens": 2})).json()
        gone = await c.post(a.url + "/v1/responses", json={"model": model_of(fleet), "input": "y",
                                                           "previous_response_id": unstored["id"]})
        assert gone.status_code == 404
