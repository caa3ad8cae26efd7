"""A tiny, scriptable OpenAI-ish backend for pure-proxy behaviour (the e2e tests use the real simulator).

It records what reached it (raw body bytes, headers, path) and whether a handler was cancelled, so tests
can observe from the backend's side what the proxy did. Its /health answer is scriptable too (ok, 503 or
stalled), for the health checks' tests.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    method: str
    path_qs: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes


@dataclass
class FakeBackend:
    name: str = "fake"
    url: str = ""
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    stream_started: asyncio.Event = field(default_factory=asyncio.Event)
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    # Behaviour knobs, set by tests.
    events: int = 3
    event_delay: float = 0.0
    die_after_events: int | None = None  # abort the TCP connection after this many SSE events
    hang_stream: bool = False  # after the first event, wait forever (until cancelled)
    status: int = 200
    pad: int = 0  # extra bytes of content per SSE event (for back-pressure tests)
    written: int = 0  # SSE events written so far
    response_headers: dict[str, str] = field(default_factory=dict)  # added to every completion answer
    # GET /health: "ok" answers like any other path (recorded in `seen`), "fail" answers 503; `health_stall_s`
    # delays either answer. `health_calls` counts them all.
    health: str = "ok"
    health_stall_s: float = 0.0
    health_calls: int = 0
    _runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1:`port` (a free one by default; a given one to come back where it was)."""
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)  # the telemetry poller's scrapes: not counted in `seen`
        app.router.add_get("/health", self.health_check)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health_check(self, request: web.Request) -> web.StreamResponse:
        self.health_calls += 1
        if self.health_stall_s:
            await asyncio.sleep(self.health_stall_s)
        if self.health == "fail":
            return web.Response(status=503, text="no")
        return await self.handle(request)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=404, text="no metrics here")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(request.method, request.raw_path, dict(request.headers),
                 [(k.decode(), v.decode()) for k, v in request.raw_headers], body)
        )
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": self.name} for m in self.models]})
        if request.path not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            return web.json_response({"path": request.raw_path, "backend": self.name}, status=self.status)
        payload: Any = json.loads(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "backend says no", "type": "server_error",
                                                "param": None, "code": None}}, status=self.status)
        chat = request.path == "/v1/chat/completions"
        if not payload.get("stream"):
            if chat:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": f"hello from {self.name}"}}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "finish_reason": "stop", "text": f"hello from {self.name}", "logprobs": None}
                obj = "text_completion"
            return web.json_response({
                "id": "cmpl-1", "object": obj, "created": 0, "model": payload.get("model", "fake-model"),
                "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}},
                headers=self.response_headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self.response_headers})
        await resp.prepare(request)
        self.stream_started.set()
        try:
            for i in range(self.events):
                if self.die_after_events is not None and i == self.die_after_events:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                delta = {"content": f"t{i} " + "p" * self.pad} if chat else None
                chunk = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": 0, "model": payload.get("model", "fake-model"),
                         "choices": [{"index": 0, "delta": delta, "finish_reason": None} if chat
                                     else {"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.written += 1
                if self.hang_stream:
                    await asyncio.Event().wait()
                if self.event_delay:
                    await asyncio.sleep(self.event_delay)
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp
