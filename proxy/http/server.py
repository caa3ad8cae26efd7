"""The HTTP/1.1 data plane: OpenAI-compatible endpoints in, the chosen backend out, bytes untouched.

Per request: check header size, read the body once (bounded), parse it once for the routing inputs
(`summary_from_openai`), route (`Router.route`), forward the ORIGINAL bytes, and relay the answer. A JSON
answer is read whole and sent in one write; anything else (SSE, chunked) is relayed chunk by chunk as it
arrives, never compressed or buffered, so the first token reaches the client when the backend emits it.

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
import os
from typing import Any, Callable

import aiohttp
from aiohttp import HttpVersion11, web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from proxy.config import Config
from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.control.orca import HEADER as ORCA_HEADER
from proxy.core.decision import NoBackendAvailable, Outcome
from proxy.core.request import RequestError, RequestSummary, summary_from_openai
from proxy.core.snapshot import BackendState
from proxy.dataplane.router import Lease, Overloaded, Router, UnknownModel
from proxy.upstream.failures import classify_upstream_error, client_gone
from proxy.http.errors import error_body, error_response, sse_error_event
from proxy.upstream.headers import upstream_request_head
from proxy.upstream.http1 import Exchange, UpstreamPool
from proxy.metrics import ProxyMetrics
from proxy.dataplane.retry import RetryController, RetryableFailure, run_with_retries

log = logging.getLogger("affinity_proxy.http")

ROUTED_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
RETRY_AFTER_S = "1"
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_ORCA_ASK = ((ORCA_FORMAT_HEADER.encode(), b"TEXT"),)


def _request_ids() -> Callable[[], str]:
    """32 hex digits: a random per-process prefix and a counter. Unique like os.urandom(16).hex(), without a
    getrandom() system call on every request; every process (each --workers worker is a fresh interpreter)
    draws its own prefix when it imports this module."""
    prefix = os.urandom(8).hex()
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter):016x}"


_new_request_id = _request_ids()


class _BodyTooLarge(Exception):
    pass


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


class HttpDataPlane:
    """Owns the listener-facing handler; the upstream session and router are injected by proxy.app."""

    def __init__(
        self, config: Config, router: Router, session: aiohttp.ClientSession, metrics: ProxyMetrics,
        session_header: str | None = None, *, pool: UpstreamPool,
    ) -> None:
        self.config = config
        self.router = router
        self.session = session  # for the proxy's own calls (GET /v1/models); requests go through `pool`
        self.pool = pool
        self.metrics = metrics
        self.counters = metrics.upstream
        self.max_body = config.limits.max_body_bytes
        self.max_headers = config.limits.max_header_bytes
        self.debug_headers = config.debug_headers
        self.session_header = session_header
        # RESILIENCE: set by proxy.resilience; None = one attempt, no retry.
        self.retries: RetryController | None = None
        # Telemetry's ORCA hook (Poller.observe_orca): set by proxy.app when telemetry.orca is on. Upstream
        # requests then ask for `endpoint-load-metrics`, and each response's report refreshes the backend's
        # signals between scrapes.
        self.load_report: Callable[[str, str], None] | None = None

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
        raw_headers = request.raw_headers
        size = sum(map(len, itertools.chain.from_iterable(raw_headers))) + 4 * len(raw_headers)
        if size > self.max_headers:
            self.metrics.error("headers_too_large")
            return error_response(
                431, f"Request headers are {size} bytes; the limit is {self.max_headers}",
                "invalid_request_error", "headers_too_large",
            )
        headers = request.headers
        request_id = headers.get("x-request-id") or _new_request_id()
        path = request.path
        method = request.method
        session_key = headers.get(self.session_header) if self.session_header else None
        try:
            body = await self._read_body(request)
        except _BodyTooLarge:
            self.metrics.error("body_too_large")
            resp = error_response(
                413, f"Request body is larger than the limit of {self.max_body} bytes",
                "invalid_request_error", "body_too_large", headers={"x-request-id": request_id},
            )
            resp.force_close()
            return resp
        if method == "POST" and path in ROUTED_ENDPOINTS:
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                self.metrics.error("invalid_json")
                return error_response(400, f"Request body is not valid JSON: {exc}", "invalid_request_error",
                                      "invalid_json", headers={"x-request-id": request_id})
            try:
                summary = summary_from_openai(path, parsed, session_key=session_key)
            except RequestError as exc:
                self.metrics.error("invalid_request")
                return error_response(400, str(exc), "invalid_request_error", "invalid_value", exc.param,
                                      headers={"x-request-id": request_id})
        elif path == "/v1/models" and method == "GET":
            return await self._models(request_id)
        else:
            summary = RequestSummary(prompt="", endpoint=path, session_key=session_key)
        return await self._proxy(request, method, body, summary, request_id)

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

    async def _proxy(
        self, request: web.BaseRequest, method: str, body: bytes, summary: RequestSummary, request_id: str
    ) -> web.StreamResponse:
        try:
            if self.retries is not None:
                return await run_with_retries(
                    self.retries, self.router, summary,
                    lambda lease: self._exchange(request, method, body, lease, request_id),  # type: ignore[arg-type]
                )
            async with self.router.route(summary) as lease:
                return await self._exchange(request, method, body, lease, request_id)
        except UnknownModel as exc:
            return error_response(404, str(exc), "invalid_request_error", "model_not_found", "model",
                                  headers={"x-request-id": request_id})
        except Overloaded as exc:
            return error_response(exc.status, str(exc), "server_error", "overloaded",
                                  headers={"Retry-After": str(exc.retry_after_s), "x-request-id": request_id})
        except NoBackendAvailable as exc:
            return error_response(503, str(exc) or "No backend is available", "server_error", "no_backend",
                                  headers={"Retry-After": RETRY_AFTER_S, "x-request-id": request_id})

    async def _exchange(
        self, request: web.BaseRequest, method: str, body: bytes, lease: Lease, request_id: str
    ) -> web.StreamResponse:
        backend = lease.backend
        url = backend.spec.url
        load_report = self.load_report
        extra = _ORCA_ASK if load_report is not None and ORCA_FORMAT_HEADER not in request.headers else ()
        head = upstream_request_head(
            method, request.raw_path, self.pool.backend(url).host_header, request.raw_headers, request.remote,
            request.scheme, request_id, len(body), extra,
        )
        self.counters.requests += 1
        up: Exchange | None = None
        try:
            up = await self.pool.request(url, head, body, head_only=method == "HEAD")
            headers = up.headers  # end-to-end fields only; this exchange's own copy
            if load_report is not None:
                report = headers.get(ORCA_HEADER)
                if report is not None:
                    load_report(backend.name, report)
                    if extra:
                        # The proxy asked for this report, not the client: it stops here.
                        headers.popall(ORCA_HEADER)
            headers["x-request-id"] = request_id
            if self.debug_headers:
                headers["x-affinity-backend"] = backend.name
            lease.status = up.status
            if self.retries is not None and self.retries.retry_status(up.status):
                # Held back, not forwarded: if another backend is tried, the client never sees this one.
                held = web.Response(status=up.status, body=await up.read(), headers=headers)
                raise RetryableFailure(Outcome.STATUS_5XX if up.status >= 500 else Outcome.SUCCESS, held, up.status)
            ctype = up.headers.get("Content-Type", "")
            sse = ctype.startswith("text/event-stream")
            if not up.chunked and not sse and (up.content_length is not None or up.complete):
                body = await up.read()
                if method != "HEAD" and up.status >= 200 and up.status not in (204, 304) and \
                        request.version == HttpVersion11:
                    return _RawResponse(up.status, up.reason, headers, body, request.keep_alive)
                return web.Response(status=up.status, reason=up.reason, body=body, headers=headers)
            return await self._relay(request, up, headers, lease, sse)
        except asyncio.CancelledError:
            lease.status = 499
            raise
        except _UPSTREAM_ERRORS as exc:
            # Only reachable before anything was sent to the client (connecting, sending, reading a held or
            # JSON body): once _relay has started answering it handles failures itself.
            return self._failed_before_response(exc, lease, request_id)
        finally:
            if up is not None:
                up.release()

    def _failed_before_response(self, exc: BaseException, lease: Lease, request_id: str) -> web.Response:
        backend = lease.backend
        self.metrics.error("upstream_unreachable")
        lease.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        log.warning("backend %s failed before responding: %r", backend.name, exc)
        failed = error_response(
            lease.status, f"Backend {backend.name} failed: {type(exc).__name__}", "server_error",
            "upstream_timeout" if lease.status == 504 else "upstream_error",
            headers={"x-request-id": request_id},
        )
        lease.outcome = classify_upstream_error(exc)
        if self.retries is not None and lease.outcome is not None:
            raise RetryableFailure(lease.outcome, failed) from exc
        return failed

    async def _relay(
        self, request: web.BaseRequest, up: Exchange, headers: Any, lease: Lease, sse: bool
    ) -> web.StreamResponse:
        """Stream the answer as it arrives. From here on bytes reach the client: never retried."""
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        transport = request.transport
        raw = up.chunked and request.version >= HttpVersion11 and transport is not None
        if raw:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            if raw:
                # The backend's chunks go to the client as they are (complete chunks, straight from the
                # upstream protocol's data_received): no task switch, no de-chunk/re-chunk per event.
                writer = resp._payload_writer
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
        except _UPSTREAM_ERRORS as exc:
            # Headers are gone already: end the stream with an error the client can parse, then close cleanly.
            self.metrics.error("upstream_midstream")
            lease.status = 502
            if not client_gone(request):  # a write to a departed client says nothing about the backend
                lease.outcome = Outcome.STREAM_FAILURE
            log.warning("backend %s failed mid-stream: %r", lease.backend.name, exc)
            if sse:
                await resp.write(sse_error_event(
                    f"The backend {lease.backend.name} failed while streaming: {type(exc).__name__}",
                    "upstream_stream_error",
                ))
            else:
                resp.force_close()
        await resp.write_eof()
        return resp

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
                backend.spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)
            ) as resp:
                if resp.status != 200:
                    return []
                data = json.loads(await resp.read())
        except (*_UPSTREAM_ERRORS, ValueError) as exc:
            log.info("GET /v1/models from %s failed: %r", backend.name, exc)
            return []
        return data.get("data", []) if isinstance(data, dict) and isinstance(data.get("data"), list) else []


__all__ = ["HttpDataPlane", "ROUTED_ENDPOINTS", "error_body"]
