"""The HTTP/1.1 data plane: the aiohttp adapter of the OpenAI pipeline (proxy/dataplane/openai.py).

Per request: check header size, read the body once (bounded), and hand it to the pipeline, which parses
it once for the routing inputs, routes, forwards the ORIGINAL bytes and maps failures to OpenAI-shaped
errors. This module only writes the answers: a JSON answer is sent in one write (`_RawResponse`);
anything else (SSE, chunked) is relayed chunk by chunk as it arrives, never compressed or buffered, so the
first token reaches the client when the backend emits it.

Why aiohttp's low-level `web.Server` and not `web.Application`: there is one handler, so the router,
middlewares and signals of an Application are pure per-request overhead. `handler_cancellation=True` makes a
client disconnect cancel the handler at once, which exits the upstream `async with` and closes the upstream
connection, so the backend sees the cancellation and stops generating.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.core.snapshot import BackendState
from proxy.dataplane.errors import error_body
from proxy.dataplane.openai import UPSTREAM_ERRORS, Answer, InboundRequest, OpenAIPipeline
from proxy.dataplane.request_ids import new_request_id
from proxy.metrics import ProxyMetrics
from proxy.upstream.failures import client_gone
from proxy.upstream.http1 import Exchange

log = logging.getLogger("affinity_proxy.http")


class _BodyTooLarge(Exception):
    pass


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-shaped error as an aiohttp response (for answers aiohttp itself makes: 431, 500...)."""
    return web.Response(
        status=status,
        body=error_body(message, type_, code, param),
        content_type="application/json",
        headers=headers,
    )


class _JsonErrorRequestHandler(RequestHandler):
    """aiohttp answers malformed HTTP itself; make those answers OpenAI-shaped too (431 for big headers)."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)):
            resp = error_response(431, "Request header fields too large", "invalid_request_error", "headers_too_large")
        elif status == 500:
            log.error("error handling request", exc_info=exc)
            resp = error_response(500, "Internal proxy error", "server_error", "internal_error")
        else:
            resp = error_response(status, f"Malformed HTTP request: {message or exc}", "invalid_request_error",
                                  "bad_request")
        resp.force_close()
        return resp


class _RawResponse:
    """A complete HTTP/1.1 answer serialised once and sent in one `transport.write`.

    Why not `web.Response`: for the common non-streaming answer (status, the backend's end-to-end headers,
    a body of known length) aiohttp's response object, its header preparation and its StreamWriter cost
    more CPU than the rest of the proxy's work on the request (loadtest/bench_proxy.py, concurrency 1).
    aiohttp's request handler only needs `prepare`, `write_eof` and `keep_alive` from what a handler
    returns. HEAD, 1xx/204/304 and HTTP/1.0 answers keep using `web.Response`.
    """

    __slots__ = ("status", "reason", "headers", "body", "keep_alive", "prepared", "_sent")

    def __init__(self, status: int, reason: str, headers: Any, body: bytes, keep_alive: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.prepared = False
        self._sent = False

    async def prepare(self, request: web.BaseRequest) -> None:
        if self._sent:
            return
        self._sent = self.prepared = True
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        headers = self.headers
        body = self.body
        lines = [f"HTTP/1.1 {self.status} {self.reason}\r\n"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n")
        if "Date" not in headers:
            lines.append(f"Date: {rfc822_formatted_time()}\r\n")
        if body and "Content-Type" not in headers:
            lines.append("Content-Type: application/octet-stream\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n")
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")  # as aiohttp's own writer does
        transport.write(head + body if body else head)
        request.writer.output_size += len(head) + len(body)  # tells aiohttp's error handler bytes went out

    async def write_eof(self, data: bytes = b"") -> None:
        return None


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class _AiohttpResponder:
    """How the OpenAI pipeline (proxy/dataplane/openai.py) answers on an aiohttp request."""

    __slots__ = ("request", "resp", "raw")

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.raw = False

    async def send(self, answer: Answer) -> web.StreamResponse:
        request = self.request
        if answer.close:
            resp = web.Response(status=answer.status, reason=answer.reason, body=answer.body, headers=answer.headers)
            resp.force_close()
            return resp
        if request.method != "HEAD" and answer.status >= 200 and answer.status not in (204, 304) and \
                request.version == HttpVersion11:
            # Duck-typed: aiohttp's handler needs only prepare, write_eof and keep_alive (see _RawResponse).
            return _RawResponse(  # type: ignore[return-value]  # duck-typed StreamResponse, see the line above
                answer.status, answer.reason, answer.headers, answer.body, request.keep_alive)
        return web.Response(status=answer.status, reason=answer.reason, body=answer.body, headers=answer.headers)

    async def start(self, up: Exchange, headers: CIMultiDict[str]) -> None:
        request = self.request
        resp = self.resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        self.raw = up.chunked and request.version >= HttpVersion11 and request.transport is not None
        if self.raw:
            resp.enable_chunked_encoding()
        await resp.prepare(request)

    async def relay(self, up: Exchange) -> None:
        resp = self.resp
        assert resp is not None
        if self.raw:
            # The backend's chunks go to the client as they are (complete chunks, straight from the
            # upstream protocol's data_received): no task switch, no de-chunk/re-chunk per event.
            writer = resp._payload_writer
            transport = self.request.transport
            assert writer is not None and transport is not None
            writer.send_headers()
            up.relay_chunks(transport)
            while not up.complete:
                await up.wait_relay()
                if up.paused:
                    await writer.drain()
                    up.resume()
        else:
            async for piece in up.stream():
                await resp.write(piece)

    async def write(self, data: bytes) -> None:
        assert self.resp is not None
        await self.resp.write(data)

    async def end(self) -> web.StreamResponse:
        assert self.resp is not None
        await self.resp.write_eof()
        return self.resp

    async def abort(self) -> web.StreamResponse:
        assert self.resp is not None
        self.resp.force_close()
        return await self.end()

    def gone(self) -> bool:
        return client_gone(self.request)


class HttpDataPlane:
    """The aiohttp adapter: reads the request, hands it to the shared OpenAI pipeline, writes the answer."""

    def __init__(
        self, pipeline: OpenAIPipeline[web.StreamResponse], session: aiohttp.ClientSession, metrics: ProxyMetrics,
        *, max_header_bytes: int, connect_timeout_s: float,
    ) -> None:
        self.pipeline = pipeline
        self.router = pipeline.router
        self.session = session  # for the proxy's own calls (GET /v1/models); requests go through the pool
        self.metrics = metrics
        self.max_body = pipeline.max_body_bytes
        self.max_headers = max_header_bytes
        self.session_header = pipeline.session_header
        self.connect_timeout_s = connect_timeout_s

    def make_server(self) -> web.Server:
        # aiohttp's own per-line limits sit above ours so that our total check answers a clean 431 first;
        # only a single monster line hits aiohttp's parser (also answered 431 by _JsonErrorRequestHandler).
        field_limit = max(8190, self.max_headers + 1024)
        return _Server(
            self.handle,
            handler_cancellation=True,
            access_log=None,
            max_line_size=field_limit,
            max_field_size=field_limit,
            auto_decompress=False,
        )

    # ------------------------------------------------------------------------------------------ handler

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        received_at = time.monotonic()  # the head is in: the request's duration counts from here
        if request.version < HttpVersion10:
            # A request line without a version (HTTP/0.9): aiohttp would echo "HTTP/0.9 200 OK" and headers,
            # which no client parses. Refused, in HTTP/1.1 (found by loadtest/fuzz http1).
            self.metrics.error("bad_request")
            return _RawResponse(  # type: ignore[return-value]  # duck-typed StreamResponse (see _RawResponse)
                505, "HTTP Version Not Supported", CIMultiDict([("Content-Type", "application/json")]),
                error_body("HTTP/0.9 is not supported; send HTTP/1.0 or later", "invalid_request_error",
                           "http_version_not_supported"), keep_alive=False)
        raw_headers = request.raw_headers
        size = sum(map(len, itertools.chain.from_iterable(raw_headers))) + 4 * len(raw_headers)
        if size > self.max_headers:
            self.metrics.error("headers_too_large")
            return error_response(
                431, f"Request headers are {size} bytes; the limit is {self.max_headers}",
                "invalid_request_error", "headers_too_large",
            )
        headers = request.headers
        request_id = headers.get("x-request-id") or new_request_id()
        path = request.path
        method = request.method
        responder = _AiohttpResponder(request)
        try:
            body = await self._read_body(request)
        except _BodyTooLarge:
            return await responder.send(self.pipeline.too_large(request_id))
        if path == "/v1/models" and method == "GET":
            return await self._models(request_id)
        req = InboundRequest(
            method, request.raw_path, path, request.scheme, raw_headers, request.remote, request_id, body,
            asked_orca=ORCA_FORMAT_HEADER in headers,
            session_key=headers.get(self.session_header) if self.session_header else None,
            received_at=received_at,
        )
        return await self.pipeline.handle(req, responder)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        length = request.content_length
        if length is not None and length > self.max_body:
            raise _BodyTooLarge
        if request.body_exists and request.headers.get("Expect", "").lower() == "100-continue":
            # curl sends this for bodies over 1 KiB and waits a second for the go-ahead; the low-level
            # server (no Application router) does not answer it by itself.
            transport = request.transport
            if transport is not None:
                transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if length is not None:
            if not length:
                return b""
            content = request.content
            if content.is_eof():  # the usual case: the whole body came with the head, nothing to wait for
                body = content.read_nowait()
                if len(body) == length:
                    return body
                raise asyncio.IncompleteReadError(body, length)  # as readexactly would
            return await content.readexactly(length)
        if not request.body_exists:
            return b""
        buf = bytearray()
        while chunk := await request.content.readany():
            buf += chunk
            if len(buf) > self.max_body:
                raise _BodyTooLarge
        return bytes(buf)

    # ------------------------------------------------------------------------------------------ models

    async def _models(self, request_id: str) -> web.Response:
        """Union of the models of routable backends: configured lists, else what each backend reports."""
        snapshot = self.router.store.current
        models: dict[str, dict[str, Any]] = {}
        ask: list[BackendState] = []
        for b in snapshot.routable():
            if b.spec.models:
                for m in b.spec.models:
                    models.setdefault(m, {"id": m, "object": "model", "created": 0, "owned_by": b.name})
            else:
                ask.append(b)
        answers = await asyncio.gather(*(self._backend_models(b) for b in ask))
        for entries in answers:
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    models.setdefault(entry["id"], entry)
        return web.Response(
            body=json.dumps({"object": "list", "data": list(models.values())}).encode(),
            content_type="application/json",
            headers={"x-request-id": request_id},
        )

    async def _backend_models(self, backend: BackendState) -> list[Any]:
        try:
            async with self.session.get(
                backend.spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.connect_timeout_s)
            ) as resp:
                if resp.status != 200:
                    return []
                data = json.loads(await resp.read())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            log.info("GET /v1/models from %s failed: %r", backend.name, exc)
            return []
        return data.get("data", []) if isinstance(data, dict) and isinstance(data.get("data"), list) else []


__all__ = ["HttpDataPlane", "error_response"]
