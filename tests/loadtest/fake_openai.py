"""A tiny OpenAI-compatible streaming server for testing the load generator without the simulator.

It streams `max_tokens` one-word chunks, puts a backend name in the debug header, counts prompt words as
prefix-cache queries (and repeats of an earlier prompt's first 16 words as hits), and exports the vLLM-style
series plus a busy-time counter, so the whole run -> report path can be exercised on its own.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


STATE: web.AppKey[dict] = web.AppKey("state", dict)


def make_app(name: str, *, token_delay_s: float = 0.0, fail_every: int = 0) -> web.Application:
    state = {"queries": 0, "hits": 0, "busy": 0.0, "n": 0, "seen": set(), "running": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["n"] += 1
        if fail_every and state["n"] % fail_every == 0:
            return web.json_response({"error": {"message": "injected", "type": "server_error", "param": None, "code": None}}, status=500)
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        words = text.split()
        state["queries"] += len(words)
        key = tuple(words[:16])
        if key in state["seen"]:
            state["hits"] += min(16, len(words))
        state["seen"].add(key)
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-affinity-backend": name})
        await resp.prepare(request)
        state["running"] += 1
        try:
            for i in range(n):
                if token_delay_s:
                    await asyncio.sleep(token_delay_s)
                    state["busy"] += token_delay_s
                chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": 0}}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            state["running"] -= 1
        return resp

    async def metrics(request: web.Request) -> web.Response:
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="m"}} {state["running"]}',
            'vllm:num_requests_waiting{model_name="m"} 0',
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5',
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {state["queries"]}',
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {state["hits"]}',
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0',
            f"gpu_busy_seconds_total {state['busy']}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/metrics", metrics)
    app[STATE] = state
    return app
