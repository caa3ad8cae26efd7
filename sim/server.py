"""The simulated server's HTTP side (aiohttp): OpenAI API, metrics, health, peer-router endpoints, faults.

Shapes follow vLLM's OpenAI server (SSE chunks, the final usage chunk, error JSON, `endpoint-load-metrics`)
and, where peer routers ask a worker about itself, SGLang's (`/server_info`, `/model_info`, `/get_load`).
Everything generation-related goes through `SimBackend.generate`, so the gRPC port of the same server
(grpc.py) sees the same queue, cache and faults.

Fault endpoints (not part of any real engine; every response carries `x-sim-backend: <name>`):
  GET  /sim/faults            current switches (JSON)
  POST /sim/faults            partial update, e.g. {"fail_rate": 0.5}, {"stall_ms": 300},
                              {"refuse_connections": true, "refuse_ms": 1000}; `?server=NAME` addresses
                              another server of the same fleet (useful while this one refuses)
  GET  /sim/stats             engine counters and gauges (JSON)

Runtime LoRA API (vLLM's, enabled there by VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter
{"lora_name", "lora_path"} registers an adapter after LORA_REGISTER_S engine seconds, refused (400) beyond
the profile's `max_loras` slots; POST /v1/unload_lora_adapter {"lora_name"} removes one (404 if unknown).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from . import metrics as sim_metrics
from .api import (ConnectionDropped, InvalidRequest, SimError, SimRequest, TokenChunk, Usage, count_tokens, render_anthropic,
                  render_chat, render_responses)
from .backend import SimBackend
from .engine import Engine
from .tokenizer import TOKENIZER_DIR, token_ids, token_str

SIM_HEADER = "x-sim-backend"
ORCA_REQUEST_HEADER = "endpoint-load-metrics-format"
ORCA_RESPONSE_HEADER = "endpoint-load-metrics"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
RESPONSES_STORED_MAX = 10_000  # stored Responses API responses kept per server (the oldest go first)
LORA_REGISTER_S = 0.5  # reading an adapter's weights from disk into host memory (engine seconds)

_dumps = json.dumps


def error_body(message: str, type_: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: SimError) -> web.Response:
    return web.json_response(error_body(err.message, err.type, err.status, err.param, err.code), status=err.status)


class ResponseNotFound(SimError):
    """A `previous_response_id` this server did not store (vLLM's answer, status and type included)."""

    status = 404
    type = "invalid_request_error"


def _bad(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param)


def _usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class _Parsed:
    __slots__ = ("req", "stream", "include_usage", "model", "default_max_tokens", "chat")

    def __init__(self, req: SimRequest, stream: bool, include_usage: bool, model: str, default_max: int | None, chat: bool) -> None:
        self.req = req
        self.stream = stream
        self.include_usage = include_usage
        self.model = model
        self.default_max_tokens = default_max
        self.chat = chat


class SimHttpApp:
    """Routes and handlers of one simulated server. `lookup` finds sibling servers for `?server=`;
    `on_faults_change` lets the owner act on switches that live outside HTTP (listeners, gRPC health)."""

    def __init__(
        self,
        backend: SimBackend,
        *,
        flavor: str = "vllm",
        on_faults_change: Callable[[], Awaitable[None]] | None = None,
        lookup: Callable[[str], "SimHttpApp | None"] | None = None,
    ) -> None:
        if flavor not in sim_metrics.FLAVORS:
            raise ValueError(f"unknown metrics flavor {flavor!r}; known: {', '.join(sim_metrics.FLAVORS)}")
        self.backend = backend
        self.flavor = flavor
        self.on_faults_change = on_faults_change
        self.lookup = lookup
        self._ids = itertools.count(1)
        self._stored: dict[str, str] = {}  # Responses API: response id -> its conversation (prompt + answer)
        self._refuse_timer: asyncio.TimerHandle | None = None
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        self.app.on_response_prepare.append(self._tag)
        r = self.app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_load", self.get_load)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/v1/embeddings", self.embeddings)
        r.add_post("/pooling", self.pooling)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/v1/messages", self.anthropic_messages)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, self.rerank)
        for path in ("/score", "/v1/score"):
            r.add_post(path, self.score)
        r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/v1/completions/render", self.render_completions)
        r.add_post("/v1/chat/completions/render", self.render_chat_completions)
        r.add_get("/sim/faults", self.get_faults)
        r.add_post("/sim/faults", self.post_faults)
        r.add_get("/sim/stats", self.stats)

    # ---- plumbing ------------------------------------------------------------------------------------
    async def _tag(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SIM_HEADER] = self.backend.name

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if not request.path.startswith("/sim/"):
            if self.backend.faults.refuse_connections:
                # The listener is closed; a request on a connection that was already open gets a reset.
                if request.transport is not None:
                    request.transport.abort()
                raise asyncio.CancelledError()
            await self.backend.wait_stall()
        try:
            return await handler(request)
        except SimError as err:
            return error_response(err)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self.backend.name}-{next(self._ids)}"

    def _orca(self, request: web.Request) -> dict[str, str]:
        fmt = request.headers.get(ORCA_REQUEST_HEADER)
        if not fmt:
            return {}
        e = self.backend.engine
        named = (
            ("kv_cache_usage_perc", float(e.kv_usage)),
            ("num_requests_waiting", float(e.num_waiting)),
            ("num_requests_running", float(e.num_running)),
        )
        if fmt.lower() == "json":
            return {ORCA_RESPONSE_HEADER: "JSON " + _dumps({"named_metrics": dict(named)})}
        if fmt.lower() == "text":
            return {ORCA_RESPONSE_HEADER: "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named)}
        return {}

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _bad("The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise _bad("The request body must be a JSON object.")
        return body

    def _parse_common(self, body: dict[str, Any], prompt: str, chat: bool, request: web.Request) -> _Parsed:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("'stream' must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = bool(opts.get("include_usage", False))
        max_tokens: int | None = None
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(f"'{key}' must be an integer", key)
            if value < 1:
                raise _bad(f"'{key}' must be at least 1, got {value}.", key)
            max_tokens = value
            break
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise _bad("'temperature' must be a non-negative number", "temperature")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
        n = body.get("n", 1)
        if n != 1:
            raise _bad("The simulator generates one choice per request ('n' must be 1).", "n")
        rid = request.headers.get("x-request-id") or self._new_id("chatcmpl" if chat else "cmpl")
        req = SimRequest(rid, prompt, max_tokens, float(temperature), model, ignore_eos)
        return _Parsed(
            req,
            stream,
            include_usage,
            model or self.backend.engine.model_name,
            None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
            chat,
        )

    @staticmethod
    def _completion_prompt(body: dict[str, Any]) -> str:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return " ".join(f"t{t}" for t in prompt)
            else:
                raise _bad("The simulator takes one prompt per request: a string or a list of token ids.", "prompt")
            if isinstance(prompt, list):
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    raise _bad("'prompt' token ids must be integers", "prompt")
                return " ".join(f"t{t}" for t in prompt)
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string or a list of token ids", "prompt")
        return prompt

    @staticmethod
    def _chat_prompt(body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        prompt = render_chat(messages)
        if messages[-1].get("role") != "assistant":
            prompt += "assistant\n"  # the generation prompt a chat template adds
        return prompt

    # ---- OpenAI API ----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        parsed = self._parse_common(body, self._completion_prompt(body), False, request)
        return await self._serve(request, parsed)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        parsed = self._parse_common(body, self._chat_prompt(body), True, request)
        return await self._serve(request, parsed)

    async def _serve(self, request: web.Request, p: _Parsed) -> web.StreamResponse:
        agen = self.backend.generate(p.req, default_max_tokens=p.default_max_tokens)
        try:
            first = await agen.__anext__()  # errors before the first token become JSON errors
        except StopAsyncIteration:  # pragma: no cover - generate always yields at least one chunk
            raise SimError("the engine produced no output") from None
        except BaseException:
            await agen.aclose()
            raise
        try:
            if p.stream:
                return await self._stream(request, p, first, agen)
            return await self._whole(request, p, first, agen)
        except ConnectionDropped:
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError() from None
        finally:
            await agen.aclose()

    async def _whole(self, request: web.Request, p: _Parsed, first: TokenChunk, agen: AsyncIterator[TokenChunk]) -> web.Response:
        parts = [first.text]
        last = first
        if first.finish_reason is None:
            async for chunk in agen:
                parts.append(chunk.text)
                last = chunk
        text = "".join(parts)
        usage = last.usage
        assert usage is not None
        created = int(time.time())
        if p.chat:
            out: dict[str, Any] = {
                "id": p.req.request_id,
                "object": "chat.completion",
                "created": created,
                "model": p.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "tool_calls": []},
                        "logprobs": None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": None,
                    }
                ],
                "usage": _usage_json(usage),
            }
        else:
            out = {
                "id": p.req.request_id,
                "object": "text_completion",
                "created": created,
                "model": p.model,
                "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason, "stop_reason": None}
                ],
                "usage": _usage_json(usage),
            }
        return web.Response(
            body=_dumps(out).encode(), content_type="application/json", headers=self._orca(request)
        )

    async def _stream(self, request: web.Request, p: _Parsed, first: TokenChunk, agen: AsyncIterator[TokenChunk]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._orca(request)})
        await resp.prepare(request)
        rid = p.req.request_id
        created = int(time.time())
        model = p.model
        # Fixed parts of every chunk, pre-serialised: only text and finish_reason change.
        if p.chat:
            head = f'data: {{"id":{_dumps(rid)},"object":"chat.completion.chunk","created":{created},"model":{_dumps(model)},"choices":[{{"index":0,"delta":'
            await resp.write(
                (head + '{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n').encode()
            )
        else:
            head = f'data: {{"id":{_dumps(rid)},"object":"text_completion","created":{created},"model":{_dumps(model)},"choices":[{{"index":0,'
        usage: Usage | None = None
        chunk: TokenChunk | None = first
        while chunk is not None:
            reason = "null" if chunk.finish_reason is None else _dumps(chunk.finish_reason)
            if p.chat:
                line = f'{head}{{"content":{_dumps(chunk.text)}}},"logprobs":null,"finish_reason":{reason}}}]}}\n\n'
            else:
                line = f'{head}"text":{_dumps(chunk.text)},"logprobs":null,"finish_reason":{reason},"stop_reason":null}}]}}\n\n'
            await resp.write(line.encode())
            if chunk.finish_reason is not None:
                usage = chunk.usage
                break
            chunk = await anext(agen, None)
        if p.include_usage and usage is not None:
            obj = "chat.completion.chunk" if p.chat else "text_completion"
            tail = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage_json(usage)}
            await resp.write(b"data: " + _dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_listing(self.backend.engine, self.backend.profile.model.max_model_len,
                                                int(time.time())))

    # ---- runtime LoRA adapters -------------------------------------------------------------------------
    def _lora_name(self, body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise _bad("'lora_name' must be a non-empty string", "lora_name")
        return name

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        name = self._lora_name(body)
        e = self.backend.engine
        if name in e.known_adapters:
            raise _bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if len(e.known_adapters) >= e.profile.max_loras:
            e.register_adapter(name)  # raises: every slot taken, refused before the load delay
        await asyncio.sleep(LORA_REGISTER_S / self.backend.speed)
        e.register_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        name = self._lora_name(body)
        self.backend.engine.unregister_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- the other generation and pooling APIs -------------------------------------------------------
    def _plain_request(self, body: dict[str, Any], prompt: str, prefix: str, request: web.Request,
                       max_key: str) -> SimRequest:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        max_tokens = body.get(max_key)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise _bad(f"'{max_key}' must be a positive integer", max_key)
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise _bad("'temperature' must be a non-negative number", "temperature")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("'stream' must be a boolean", "stream")
        rid = request.headers.get("x-request-id") or self._new_id(prefix)
        return SimRequest(rid, prompt, max_tokens, float(temperature), model)

    async def _chunks(self, req: SimRequest) -> AsyncIterator[TokenChunk]:
        """The engine's chunks for `req`; errors before the first chunk raise here (become JSON errors)."""
        agen = self.backend.generate(req)
        try:
            first = await agen.__anext__()
        except BaseException:
            await agen.aclose()
            raise

        async def rest() -> AsyncIterator[TokenChunk]:
            try:
                yield first
                if first.finish_reason is None:
                    async for chunk in agen:
                        yield chunk
            finally:
                await agen.aclose()

        return rest()

    async def _prefill_only(self, body: dict[str, Any], text: str, request: web.Request) -> Usage:
        """Pooling requests (embeddings, score, rerank) run their prompt through the engine's prefill (and
        its prefix cache) with a one-token generation, as a pooling model's forward pass."""
        req = self._plain_request({"model": body.get("model")}, text, "pool", request, "max_tokens")
        req = SimRequest(req.request_id, text, 1, 1.0, req.model)
        usage: Usage | None = None
        async for chunk in await self._chunks(req):
            usage = chunk.usage or usage
        assert usage is not None
        return usage

    @staticmethod
    def _vector(text: str, dims: int = 8) -> list[float]:
        import hashlib
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        return [round((b - 127.5) / 127.5, 6) for b in digest[:dims]]

    @staticmethod
    def _relevance(a: str, b: str) -> float:
        wa, wb = set(a.lower().split()), set(b.lower().split())
        return round(len(wa & wb) / max(1, len(wa | wb)), 6)

    @staticmethod
    def _texts(value: Any, name: str) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return list(value)
        raise _bad(f"'{name}' must be a string or a non-empty list of strings", name)

    def _model(self, body: dict[str, Any]) -> str:
        return body.get("model") or self.backend.engine.model_name

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if "input" not in body:
            raise _bad("'input' is required", "input")
        inputs = self._texts(body["input"], "input")
        usage = await self._prefill_only(body, "\n".join(inputs), request)
        data = [{"object": "embedding", "index": i, "embedding": self._vector(t)} for i, t in enumerate(inputs)]
        return web.json_response({"object": "list", "data": data, "model": self._model(body),
                                  "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}})

    async def pooling(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if "messages" in body:
            texts = [self._chat_prompt(body)]
        elif "input" in body:
            texts = self._texts(body["input"], "input")
        else:
            raise _bad("'input' or 'messages' is required", "input")
        usage = await self._prefill_only(body, "\n".join(texts), request)
        return web.json_response({"id": self._new_id("pool"), "object": "list", "created": int(time.time()),
                                  "model": self._model(body),
                                  "data": [{"index": i, "object": "pooling", "data": self._vector(t)} for i, t in enumerate(texts)],
                                  "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}})

    async def score(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        a = self._texts(body.get("text_1"), "text_1")
        b = self._texts(body.get("text_2"), "text_2")
        if len(a) == 1:
            a = a * len(b)
        if len(a) != len(b):
            raise _bad("'text_1' must have one text or as many as 'text_2'", "text_1")
        usage = await self._prefill_only(body, "\n".join(x + "\n" + y for x, y in zip(a, b)), request)
        return web.json_response({"id": self._new_id("score"), "object": "list", "created": int(time.time()),
                                  "model": self._model(body),
                                  "data": [{"index": i, "object": "score", "score": self._relevance(x, y)}
                                           for i, (x, y) in enumerate(zip(a, b))],
                                  "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}})

    async def rerank(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        query = body.get("query")
        if not isinstance(query, str):
            raise _bad("'query' must be a string", "query")
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise _bad("'documents' must be a non-empty list", "documents")
        texts = [d if isinstance(d, str) else str(d.get("text", "")) if isinstance(d, dict) else "" for d in docs]
        usage = await self._prefill_only(body, query + "\n" + "\n".join(texts), request)
        results = sorted(({"index": i, "document": {"text": t}, "relevance_score": self._relevance(query, t)}
                          for i, t in enumerate(texts)), key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return web.json_response({"id": self._new_id("rerank"), "model": self._model(body),
                                  "usage": {"total_tokens": usage.prompt_tokens}, "results": results})

    # Responses API (OpenAI): one message output item with one output_text part.
    # Stored responses (`store`, true by default) live in this server's memory, as in vLLM: a request whose
    # `previous_response_id` this server did not produce gets vLLM's 404; a known one continues that
    # conversation (its prompt and answer come first).
    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        history = ""
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str):
                raise _bad("'previous_response_id' must be a string", "previous_response_id")
            stored = self._stored.get(prev)
            if stored is None:
                raise ResponseNotFound(f"Response with id '{prev}' not found.", "response_id")
            history = stored
        store = body.get("store", True) is not False
        turn = render_responses(body)
        if not turn.strip():
            raise _bad("'input' is required", "input")
        prompt = history + turn
        req = self._plain_request(body, prompt + "assistant\n", "resp", request, "max_output_tokens")
        chunks = await self._chunks(req)
        model = self._model(body)
        rid = "resp_" + req.request_id.replace("-", "")
        mid = "msg_" + req.request_id.replace("-", "")
        created = int(time.time())

        def response(status: str, text: str | None, usage: Usage | None, reason: str | None) -> dict[str, Any]:
            content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            return {
                "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": [] if text is None else [{"type": "message", "id": mid, "status": "completed",
                                                   "role": "assistant", "content": content}],
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
                "parallel_tool_calls": True, "temperature": req.temperature, "tool_choice": "auto",
                "tools": body.get("tools") or [], "top_p": 1.0,
                "max_output_tokens": body.get("max_output_tokens"),
                "previous_response_id": body.get("previous_response_id"),
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": None if usage is None else {
                    "input_tokens": usage.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                    "output_tokens": usage.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": usage.total_tokens,
                },
            }

        if not body.get("stream"):
            parts: list[str] = []
            last: TokenChunk | None = None
            async for chunk in chunks:
                parts.append(chunk.text)
                last = chunk
            assert last is not None
            status = "incomplete" if last.finish_reason == "length" and body.get("max_output_tokens") else "completed"
            if store:
                self._store_response(rid, req.prompt + "".join(parts) + "\n")
            return web.json_response(response(status, "".join(parts), last.usage, last.finish_reason),
                                     headers=self._orca(request))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._orca(request)})
        await resp.prepare(request)
        seq = itertools.count()

        async def event(kind: str, data: dict[str, Any]) -> None:
            data = {"type": kind, "sequence_number": next(seq), **data}
            await resp.write(f"event: {kind}\ndata: {_dumps(data)}\n\n".encode())

        await event("response.created", {"response": response("in_progress", None, None, None)})
        await event("response.in_progress", {"response": response("in_progress", None, None, None)})
        item = {"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []}
        await event("response.output_item.added", {"output_index": 0, "item": item})
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        await event("response.content_part.added", {**where, "part": {"type": "output_text", "text": "", "annotations": []}})
        parts = []
        last = None
        try:
            async for chunk in chunks:
                parts.append(chunk.text)
                last = chunk
                await event("response.output_text.delta", {**where, "delta": chunk.text, "logprobs": []})
        except ConnectionDropped:
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError() from None
        assert last is not None
        text = "".join(parts)
        await event("response.output_text.done", {**where, "text": text, "logprobs": []})
        done_part = {"type": "output_text", "text": text, "annotations": []}
        await event("response.content_part.done", {**where, "part": done_part})
        await event("response.output_item.done", {"output_index": 0, "item": {**item, "status": "completed", "content": [done_part]}})
        status = "incomplete" if last.finish_reason == "length" and body.get("max_output_tokens") else "completed"
        if store:
            self._store_response(rid, req.prompt + text + "\n")
        await event(f"response.{status}", {"response": response(status, text, last.usage, last.finish_reason)})
        await resp.write_eof()
        return resp

    def _store_response(self, rid: str, conversation: str) -> None:
        stored = self._stored
        stored[rid] = conversation
        if len(stored) > RESPONSES_STORED_MAX:
            del stored[next(iter(stored))]

    # Anthropic Messages API (as vLLM and SGLang serve it at /v1/messages).
    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        if not isinstance(body.get("max_tokens"), int):
            raise _bad("'max_tokens' is required", "max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        req = self._plain_request(body, render_anthropic(body) + "assistant\n", "msg", request, "max_tokens")
        chunks = await self._chunks(req)
        mid = "msg_" + req.request_id.replace("-", "")
        model = self._model(body)
        input_tokens = count_tokens(req.prompt)

        def stop(reason: str | None) -> str:
            return "max_tokens" if reason == "length" else "end_turn"

        if not body.get("stream"):
            parts: list[str] = []
            last: TokenChunk | None = None
            async for chunk in chunks:
                parts.append(chunk.text)
                last = chunk
            assert last is not None and last.usage is not None
            return web.json_response({
                "id": mid, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": "".join(parts)}],
                "stop_reason": stop(last.finish_reason), "stop_sequence": None,
                "usage": {"input_tokens": last.usage.prompt_tokens, "output_tokens": last.usage.completion_tokens,
                          "cache_read_input_tokens": last.usage.cached_tokens, "cache_creation_input_tokens": 0},
            }, headers=self._orca(request))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self._orca(request)})
        await resp.prepare(request)

        async def event(kind: str, data: dict[str, Any]) -> None:
            await resp.write(f"event: {kind}\ndata: {_dumps({'type': kind, **data})}\n\n".encode())

        await event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1}}})
        await event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        await event("ping", {})
        last = None
        try:
            async for chunk in chunks:
                last = chunk
                await event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": chunk.text}})
        except ConnectionDropped:
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError() from None
        assert last is not None and last.usage is not None
        await event("content_block_stop", {"index": 0})
        await event("message_delta", {"delta": {"stop_reason": stop(last.finish_reason), "stop_sequence": None},
                                      "usage": {"output_tokens": last.usage.completion_tokens}})
        await event("message_stop", {})
        await resp.write_eof()
        return resp

    # ---- health and metrics --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.backend.faults.health_fail or self.backend.stopped:
            return web.json_response(error_body("unhealthy (injected)", "ServiceUnavailableError", 503), status=503)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        faults = self.backend.faults
        if faults.metrics_delay_ms > 0:
            await asyncio.sleep(faults.metrics_delay_ms / 1000.0)
        if faults.metrics_absent:
            return web.Response(status=404, text="404: Not Found")
        text = sim_metrics.render(self.backend, self.flavor)
        return web.Response(body=text.encode(), headers={"Content-Type": sim_metrics.CONTENT_TYPE})

    # ---- what peer routers ask a worker --------------------------------------------------------------
    async def server_info(self, request: web.Request) -> web.Response:
        b, e, p = self.backend, self.backend.engine, self.backend.profile
        return web.json_response(
            {
                "model_path": str(TOKENIZER_DIR),
                "tokenizer_path": str(TOKENIZER_DIR),
                "served_model_name": e.model_name,
                "tp_size": p.tp,
                "dp_size": 1,
                "page_size": p.block_size,
                "context_length": p.model.max_model_len,
                "max_total_num_tokens": e.pool.num_blocks * p.block_size,
                "max_running_requests": p.max_num_seqs,
                "chunked_prefill_size": p.max_num_batched_tokens,
                "disable_radix_cache": False,
                "is_embedding": False,
                "skip_tokenizer_init": False,
                "version": "sim",
                "internal_states": [{"last_gen_throughput": b.tokens_per_second(), "load": e.num_running + e.num_waiting}],
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": str(TOKENIZER_DIR),
                "tokenizer_path": str(TOKENIZER_DIR),
                "served_model_name": self.backend.engine.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        e = self.backend.engine
        return web.json_response(
            [{"dp_rank": 0, "num_reqs": e.num_running + e.num_waiting, "num_waiting_reqs": e.num_waiting, "num_tokens": e.num_tokens_in_use}]
        )

    def _render_text(self, body: dict[str, Any]) -> tuple[str, bool]:
        if "messages" in body:
            return self._chat_prompt(body), True
        return self._completion_prompt(body), False

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        text, _ = self._render_text(body)
        ids = token_ids(text)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.backend.profile.model.max_model_len,
            "tokens": ids,
            "token_strs": text.split() if body.get("return_token_strs") else None,
        }
        return web.json_response(out)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: 200 when the cache was dropped (AllBlocksCleared is published),
        409 while requests hold blocks (vLLM answers 200 but logs that it failed; a status a test can read)."""
        if self.backend.reset_prefix_cache():
            return web.Response(status=200)
        return web.json_response({"error": "requests are running; the prefix cache was not reset"}, status=409)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _bad("'tokens' must be a list of integers", "tokens")
        return web.json_response({"prompt": " ".join(token_str(t) for t in tokens)})

    def _rendered(self, body: dict[str, Any], prefix: str, text: str) -> dict[str, Any]:
        sampling: dict[str, Any] = {}
        for key in ("max_tokens", "max_completion_tokens", "temperature", "ignore_eos"):
            if key in body:
                sampling["max_tokens" if key == "max_completion_tokens" else key] = body[key]
        return {
            "request_id": self._new_id(prefix),
            "token_ids": token_ids(text),
            "sampling_params": sampling,
            "model": body.get("model") or self.backend.engine.model_name,
        }

    async def render_completions(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        return web.json_response([self._rendered(body, "cmpl", self._completion_prompt(body))])

    async def render_chat_completions(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        return web.json_response(self._rendered(body, "chatcmpl", self._chat_prompt(body)))

    # ---- fault control -------------------------------------------------------------------------------
    async def get_faults(self, request: web.Request) -> web.Response:
        target = self._target(request)
        return web.json_response(target.backend.faults.to_json())

    async def post_faults(self, request: web.Request) -> web.Response:
        target = self._target(request)
        body = await self._json_body(request)
        try:
            await target.apply_faults(body)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return web.json_response(target.backend.faults.to_json())

    def _target(self, request: web.Request) -> SimHttpApp:
        name = request.query.get("server")
        if not name or name == self.backend.name:
            return self
        other = self.lookup(name) if self.lookup is not None else None
        if other is None:
            raise _bad(f"no simulated server named {name!r} in this fleet", "server")
        return other

    async def apply_faults(self, changes: dict[str, Any]) -> None:
        """Apply a fault update (same keys as POST /sim/faults) and act on the ones that need acting."""
        b = self.backend
        before_bg = (b.faults.background_requests, b.faults.background_prompt_tokens, b.faults.background_max_tokens)
        b.faults.update(changes)
        if "stall_ms" in changes:
            b.stall(b.faults.stall_ms)
        if (b.faults.background_requests, b.faults.background_prompt_tokens, b.faults.background_max_tokens) != before_bg:
            b.sync_background()
        refuse_ms = b.faults.refuse_ms
        b.faults.refuse_ms = 0.0
        if self._refuse_timer is not None and ("refuse_connections" in changes or refuse_ms):
            self._refuse_timer.cancel()
            self._refuse_timer = None
        if refuse_ms and b.faults.refuse_connections:
            loop = asyncio.get_running_loop()
            self._refuse_timer = loop.call_later(refuse_ms / 1000.0, self._end_refuse)
        if self.on_faults_change is not None:
            # After this response is on its way: closing the listener first would cut our own reply.
            hook = self.on_faults_change
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(hook()))

    def _end_refuse(self) -> None:
        self._refuse_timer = None
        asyncio.ensure_future(self.apply_faults({"refuse_connections": False}))

    async def stats(self, request: web.Request) -> web.Response:
        b, e = self.backend, self.backend.engine
        st = e.stats
        return web.json_response(
            {
                "name": b.name,
                "profile": b.profile.name,
                "speed": b.speed,
                "now": b.now(),
                "running": e.num_running,
                "waiting": e.num_waiting,
                "kv_usage": e.kv_usage,
                "num_gpu_blocks": e.pool.num_blocks,
                "num_cached_blocks": e.pool.num_cached,
                "evictions": e.pool.evictions,
                "prefix_queries_tokens": st.prefix_queries_tokens,
                "prefix_hits_tokens": st.prefix_hits_tokens,
                "prompt_tokens": st.prompt_tokens,
                "generation_tokens": st.generation_tokens,
                "preemptions": st.num_preemptions,
                "lora_loads": st.lora_loads,
                "loaded_adapters": list(e.loaded_adapters),
                "requests_added": st.requests_added,
                "requests_aborted": st.requests_aborted,
                "requests_failed": b.requests_failed,
                "requests_dropped": b.requests_dropped,
                "busy_seconds": b.busy_seconds(),
                "ttft_count": st.ttft.count,
                "ttft_sum": st.ttft.sum,
            }
        )


def models_listing(e: Engine, max_model_len: int, created: int) -> dict[str, Any]:
    """vLLM's /v1/models answer: the base model, then every registered LoRA adapter with the base as its
    `parent` (what the proxy's adapter discovery reads; the offline replay serves the same page)."""
    base = {
        "id": e.model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": e.model_name,
        "parent": None,
        "max_model_len": max_model_len,
    }
    data: list[dict[str, Any]] = [base]
    loaded = set(e.loaded_adapters)
    for name in e.known_adapters:
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": e.model_name,
                "loaded": name in loaded,
            }
        )
    return {"object": "list", "data": data}
