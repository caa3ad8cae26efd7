"""The simulated server over real HTTP: the openai client, SSE shapes, peer-router endpoints, metrics."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.fleet import Fleet, start_fleet
from sim.metrics import FLAVORS
from sim.tokenizer import TOKENIZER_DIR, tokenizer_files
from tests.support import until

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, speed=200.0, adapters=["sql-lora"])
    try:
        yield f
    finally:
        await f.stop()


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


async def test_async_openai_completion_and_chat(fleet: Fleet) -> None:
    url = fleet.servers[0].url
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
    r = await client.completions.create(model=MODEL, prompt=words("p", 30), max_tokens=7, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text.split()) == 7
    assert r.usage is not None and r.usage.prompt_tokens == 30 and r.usage.completion_tokens == 7
    c = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5, extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant"
    assert len((c.choices[0].message.content or "").split()) == 5
    assert c.usage is not None and c.usage.prompt_tokens == 4  # "user hello there assistant"
    await client.close()


async def test_async_openai_streaming_with_usage(fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.servers[0].url + "/v1", api_key="sim", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a b c"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    comp = await client.completions.create(model=MODEL, prompt="x y z", max_tokens=3, stream=True, extra_body={"ignore_eos": True})
    parts = [c async for c in comp]
    assert len(parts) == 3 and parts[-1].choices[0].finish_reason == "length"
    await client.close()


async def test_sync_openai_client_streaming_and_not(fleet: Fleet) -> None:
    url = fleet.servers[1].url

    def call() -> tuple[str, str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
        whole = client.completions.create(model=MODEL, prompt="one two three", max_tokens=4, extra_body={"ignore_eos": True})
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(model=MODEL, prompt="one two three", max_tokens=4, stream=True, extra_body={"ignore_eos": True})
        )
        client.close()
        return whole.choices[0].text, streamed

    whole, streamed = await asyncio.to_thread(call)
    assert whole == streamed and len(whole.split()) == 4  # same request, same deterministic text


async def test_completions_default_to_16_tokens_and_errors_are_openai_shaped(fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.servers[0].url + "/v1", api_key="sim", max_retries=0)
    r = await client.completions.create(model=MODEL, prompt="a", extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="a")
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt=words("x", 8190), max_tokens=10)
    assert "maximum context length" in str(err.value)
    await client.close()
    async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
        bad = await h.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400
        body = bad.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        bad = await h.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        bad = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": "many"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


async def test_models_lists_base_and_adapters(fleet: Fleet) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.servers[0].url + "/v1", api_key="sim", max_retries=0)
    ids = [m.id async for m in client.models.list()]
    assert ids == [MODEL, "sql-lora"]
    r = await client.completions.create(model="sql-lora", prompt="q", max_tokens=2)
    assert r.model == "sql-lora"
    async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
        data = (await h.get("/v1/models")).json()["data"]
    assert data[1]["parent"] == MODEL and data[1]["loaded"] is True
    await client.close()


async def test_shared_prefix_hits_show_in_usage_and_metrics(fleet: Fleet) -> None:
    server = fleet.servers[0]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sim", max_retries=0)
    doc = words("doc", 320)
    cached = []
    for q in range(3):
        r = await client.completions.create(model=MODEL, prompt=f"{doc} question{q}", max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 320, 320]
    other = fleet.servers[1]
    r = await client.completions.create(model=MODEL, prompt=f"{doc} question9", max_tokens=2)
    async with httpx.AsyncClient() as h:
        text = (await h.get(server.url + "/metrics")).text
        other_text = (await h.get(other.url + "/metrics")).text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["vllm:prefix_cache_hits_total"] == 320 * 3
    assert values["vllm:prefix_cache_queries_total"] == 321 * 4
    other_values = {s.name: s.value for fam in text_string_to_metric_families(other_text) for s in fam.samples}
    assert other_values["vllm:prefix_cache_hits_total"] == 0  # servers do not share a cache
    await client.close()


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_metrics_parse_with_prometheus_client(flavor: str) -> None:
    fleet = await start_fleet(1, flavor=flavor, speed=200.0, faults={"background_requests": 2})
    try:
        url = fleet.servers[0].url
        async with httpx.AsyncClient() as h:
            await h.post(url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
            resp = await h.get(url + "/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
        samples = {s.name for f in fams.values() for s in f.samples}
        expected = {
            "vllm": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                     "vllm:time_to_first_token_seconds_bucket", "vllm:lora_requests_info", "vllm:cache_config_info"],
            "sglang": ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"],
            "tgi": ["tgi_queue_size", "tgi_batch_current_size"],
            "triton": ["nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"],
        }[flavor]
        common = ["gpu_memory_used_bytes", "gpu_memory_total_bytes", "cuda_kernel_queue_length",
                  "kvcache_tokens_per_second", "gpu_busy_seconds_total"]
        for name in expected + common:
            assert name in samples, name
        values = {s.name: s for f in fams.values() for s in f.samples}
        assert values["gpu_memory_used_bytes"].value < values["gpu_memory_total_bytes"].value
        assert values["gpu_busy_seconds_total"].value > 0
        if flavor == "vllm":
            info = values["vllm:cache_config_info"].labels
            assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) == fleet.servers[0].backend.engine.pool.num_blocks
            assert values["vllm:num_requests_running"].value == 2  # the background load
    finally:
        await fleet.stop()


async def test_orca_load_header_when_asked(fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
        plain = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert "endpoint-load-metrics" not in plain.headers
        assert plain.headers["x-sim-backend"] == "sim-0"
        text = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"endpoint-load-metrics-format": "TEXT"})
        assert text.headers["endpoint-load-metrics"].startswith("TEXT named_metrics.kv_cache_usage_perc=")
        js = await h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "stream": True}, headers={"endpoint-load-metrics-format": "JSON"})
        header = js.headers["endpoint-load-metrics"]
        assert header.startswith("JSON ")
        assert set(json.loads(header[5:])["named_metrics"]) == {"kv_cache_usage_perc", "num_requests_waiting", "num_requests_running"}


async def test_peer_router_endpoints(fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            info = (await h.get(path)).json()
            assert info["tokenizer_path"] == str(TOKENIZER_DIR)
        load = (await h.get("/get_load")).json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        tok = (await h.post("/tokenize", json={"model": MODEL, "prompt": "user hello hello"})).json()
        assert tok["count"] == 3 and tok["tokens"][1] == tok["tokens"][2] != tok["tokens"][0]
        chat_tok = (await h.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})).json()
        render = (await h.post("/v1/chat/completions/render", json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})).json()
        assert render["token_ids"] == chat_tok["tokens"]
        comp = (await h.post("/v1/completions/render", json={"model": MODEL, "prompt": "user hello hello", "max_tokens": 3})).json()
        assert comp[0]["token_ids"] == tok["tokens"] and comp[0]["sampling_params"]["max_tokens"] == 3
        detok = (await h.post("/detokenize", json={"tokens": tok["tokens"][:1]})).json()
        assert detok["prompt"] == "user"


def test_shipped_tokenizer_folder_matches_the_vocabulary() -> None:
    for name, value in tokenizer_files("sim", 8192).items():
        assert json.loads((TOKENIZER_DIR / name).read_text()) == value
    model = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["model"]
    assert model["type"] == "WordLevel" and len(model["vocab"]) > 1000


async def test_client_disconnect_aborts_the_request_in_the_engine() -> None:
    fleet = await start_fleet(1, speed=1.0)
    try:
        backend = fleet.servers[0].backend
        async with httpx.AsyncClient(base_url=fleet.servers[0].url) as h:
            async with h.stream("POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
                lines = r.aiter_lines()
                got = 0
                async for line in lines:
                    if line.startswith("data: "):
                        got += 1
                        if got == 2:
                            break
        await until(lambda: backend.engine.stats.requests_aborted, timeout=5, message="the engine aborts the request")
        assert backend.engine.stats.requests_aborted == 1
        assert backend.engine.num_running == 0 and backend.engine.kv_usage == 0
    finally:
        await fleet.stop()


async def test_ttft_grows_with_queueing_over_http() -> None:
    """Eight long prompts at once queue behind the 8k-token step budget; one alone does not."""
    fleet = await start_fleet(1, speed=1.0)
    try:
        server = fleet.servers[0]
        stats = server.backend.engine.stats
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as h:
            await h.post("/v1/completions", json={"prompt": words("solo", 4000), "max_tokens": 1})
            alone = stats.ttft.sum
            await asyncio.gather(*(h.post("/v1/completions", json={"prompt": words(f"q{i}_", 4000), "max_tokens": 1}) for i in range(8)))
        queued_mean = (stats.ttft.sum - alone) / 8
        assert stats.ttft.count == 9
        assert queued_mean > 2 * alone
    finally:
        await fleet.stop()
