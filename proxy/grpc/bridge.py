"""Plain HTTP requests that arrive over HTTP/2 on the gRPC listener (e.g. ``httpx`` with ``http2=True``
calling ``/v1/chat/completions``): proxied like the HTTP/1.1 ones.

The request is handled the way `proxy.http.server` handles it, with the same pieces: the body is read
once (bounded by `limits.max_body_bytes`), parsed with `summary_from_openai`, routed through the shared
`Router`, and sent over the HTTP data plane's own relay pool (proxy/upstream/http1.py) with its header rules, so
it gets what an HTTP/1.1 request gets: ORCA load reports asked for and folded into the routing signals
(telemetry.orca), and retries on another backend before the first byte (the shared `retries:` policy and
budget). The answer goes back whole (JSON) or piece by piece as it arrives (SSE) under the client's
HTTP/2 flow-control window.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import TYPE_CHECKING

import aiohttp
import h2.errors
import h2.exceptions
from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.control.orca import HEADER as ORCA_HEADER
from proxy.core.decision import NoBackendAvailable, Outcome
from proxy.core.request import RequestError, RequestSummary, summary_from_openai
from proxy.dataplane.router import Lease, Overloaded, UnknownModel
from proxy.http.errors import error_body, sse_error_event
from proxy.upstream.headers import upstream_request_head
from proxy.upstream.failures import classify_upstream_error
from proxy.http.server import RETRY_AFTER_S, ROUTED_ENDPOINTS
from proxy.dataplane.retry import RetryableFailure, run_with_retries

if TYPE_CHECKING:
    from proxy.grpc.listener import RelayContext
    from proxy.grpc.call import Downstream
    from proxy.http.server import HttpDataPlane

log = logging.getLogger(__name__)

_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_LOW_WATER = 64 * 1024  # a writer waits while more than this is queued for the client


class HttpBridgeCall:
    """One non-gRPC HTTP/2 request stream on the gRPC listener."""

    def __init__(self, ctx: "RelayContext", down: "Downstream", sid: int,
                 headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.ctx = ctx
        self.down = down
        self.sid = sid
        self.headers = headers
        self.body = bytearray()
        self.too_large = False
        self.body_done = asyncio.Event()
        if ended:
            self.body_done.set()
        self.to_down: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.closed = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    # ----------------------------------------------------------------------------- connection events

    def client_data(self, data: bytes, flow_len: int) -> None:
        if len(self.body) + len(data) > self.ctx.max_body_bytes:
            self.too_large = True
        elif not self.too_large:
            self.body += data
        self.down.ack(flow_len, self.sid)

    def client_end(self) -> None:
        self.body_done.set()

    def client_reset(self) -> None:
        self.closed = True
        self.task.cancel()

    def flush_down(self) -> None:
        conn = self.down.conn
        sid = self.sid
        try:
            while self.to_down and not self.down.paused:
                window = conn.local_flow_control_window(sid)
                if window <= 0:
                    break
                data = self.to_down[0]
                n = min(len(data), window, conn.max_outbound_frame_size)
                if n < len(data):
                    self.to_down[0] = data[n:]
                    data = data[:n]
                else:
                    self.to_down.popleft()
                conn.send_data(sid, data)
                self.queued -= n
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.client_reset()
        if self.to_down and not self.closed:
            self.down.blocked[self] = None
        self.down.mark()
        if self.queued <= _LOW_WATER:
            self.drained.set()

    # ---------------------------------------------------------------------------------------- writes

    def _send_headers(self, status: int, headers: CIMultiDict[str] | list[tuple[str, str]], end: bool) -> None:
        items = headers.items() if isinstance(headers, CIMultiDict) else headers
        out = [(b":status", str(status).encode())]
        out.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in items)
        self.down.conn.send_headers(self.sid, out, end_stream=end)
        self.down.mark()

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        self.to_down.append(data)
        self.queued += len(data)
        self.flush_down()
        while self.queued > _LOW_WATER and not self.closed:
            self.drained.clear()
            await self.drained.wait()

    async def _end(self) -> None:
        while self.queued and not self.closed:
            self.drained.clear()
            self.flush_down()
            if self.queued:
                await self.drained.wait()
        if not self.closed:
            self.down.conn.end_stream(self.sid)
            self.down.mark()

    async def _error(self, status: int, message: str, type_: str, code: str, param: str | None = None,
                     retry_after: str | None = None) -> None:
        body = error_body(message, type_, code, param)
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        if retry_after is not None:
            headers.append(("retry-after", retry_after))
        self._send_headers(status, headers, end=False)
        await self._write(body)
        await self._end()

    # ---------------------------------------------------------------------------------------- request

    async def _run(self) -> None:
        try:
            await self._handle()
        except asyncio.CancelledError:
            pass
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        except Exception:
            log.exception("HTTP/2 bridge request failed")
            try:
                self.down.conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
                self.down.mark()
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                pass
        finally:
            self.down.others.pop(self.sid, None)

    async def _handle(self) -> None:
        pseudo: dict[bytes, bytes] = {}
        raw: list[tuple[bytes, bytes]] = []
        cookies: list[bytes] = []
        for name, value in self.headers:
            if name.startswith(b":"):
                pseudo[name] = value
            elif name == b"cookie":
                cookies.append(value)  # HTTP/2 may split the cookie field; HTTP/1.1 wants it whole
            else:
                raw.append((name, value))
        if cookies:
            raw.append((b"cookie", b"; ".join(cookies)))
        regular: CIMultiDict[str] = CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in raw)
        method = pseudo.get(b":method", b"GET").decode("ascii", "replace")
        raw_path = pseudo.get(b":path", b"/").decode("latin-1")
        path = raw_path.split("?", 1)[0]
        scheme = pseudo.get(b":scheme", b"http").decode("ascii", "replace")
        await self.body_done.wait()
        ctx = self.ctx
        if self.too_large:
            await self._error(413, f"Request body is larger than the limit of {ctx.max_body_bytes} bytes",
                              "invalid_request_error", "body_too_large")
            return
        session_key = regular.get(ctx.http_session_header) if ctx.http_session_header else None
        if method == "POST" and path in ROUTED_ENDPOINTS:
            try:
                parsed = json.loads(self.body)
            except ValueError as exc:
                await self._error(400, f"Request body is not valid JSON: {exc}", "invalid_request_error",
                                  "invalid_json")
                return
            try:
                summary = summary_from_openai(path, parsed, session_key=session_key)
            except RequestError as exc:
                await self._error(400, str(exc), "invalid_request_error", "invalid_value", exc.param)
                return
        else:
            summary = RequestSummary(prompt="", endpoint=path, session_key=session_key)
        plane = ctx.http_plane()
        if plane is None:
            await self._error(503, "The HTTP data plane is not running", "server_error", "no_backend")
            return
        request_id = regular.get("x-request-id") or f"h2-{id(self):x}-{self.sid}"
        peer = self.down.transport.get_extra_info("peername") if self.down.transport else None
        request = _Request(method, raw_path, scheme, tuple(raw), peer[0] if peer else None, request_id,
                           bytes(self.body), ORCA_FORMAT_HEADER in regular)
        try:
            if plane.retries is not None:
                failed = await run_with_retries(plane.retries, ctx.router, summary,
                                                lambda lease: self._exchange(plane, request, lease))  # type: ignore[arg-type]
            else:
                async with ctx.router.route(summary) as lease:
                    failed = await self._exchange(plane, request, lease)
        except UnknownModel as exc:
            await self._error(404, str(exc), "invalid_request_error", "model_not_found", "model")
            return
        except Overloaded as exc:
            await self._error(exc.status, str(exc), "server_error", "overloaded",
                              retry_after=str(exc.retry_after_s))
            return
        except NoBackendAvailable as exc:
            await self._error(503, str(exc) or "No backend is available", "server_error", "no_backend",
                              retry_after=RETRY_AFTER_S)
            return
        if failed is not None:  # an answer held back for a retry that did not happen, or an upstream error
            status, headers, body = failed
            await self._respond(status, headers, body)

    async def _exchange(self, plane: "HttpDataPlane", req: "_Request", lease: Lease) -> "_Held | None":
        """One attempt through the HTTP data plane's relay pool, as `HttpDataPlane._exchange` does it:
        ORCA asked for and folded in, failures before the first byte raised as `RetryableFailure` for the
        shared retry policy. Returns None once the answer went to the client, else the answer to send."""
        backend = lease.backend
        url = backend.spec.url
        pool = plane.pool
        load_report = plane.load_report
        extra = _ORCA_ASK if load_report is not None and not req.asked_orca else ()
        head = upstream_request_head(req.method, req.raw_path, pool.backend(url).host_header, req.raw_headers,
                                     req.peer, req.scheme, req.request_id, len(req.body), extra)
        plane.counters.requests += 1
        try:
            up = await pool.request(url, head, req.body, head_only=req.method == "HEAD")
        except asyncio.CancelledError:
            lease.status = 499
            raise
        except _UPSTREAM_ERRORS as exc:
            return self._failed_before_response(plane, exc, lease, req)
        try:
            headers = up.headers
            if load_report is not None:
                report = headers.get(ORCA_HEADER)
                if report is not None:
                    load_report(backend.name, report)
                    if extra:  # the proxy asked for it, not the client
                        headers.popall(ORCA_HEADER)
            headers["x-request-id"] = req.request_id
            if plane.debug_headers:
                headers["x-affinity-backend"] = backend.name
            lease.status = up.status
            if plane.retries is not None and plane.retries.retry_status(up.status):
                held = (up.status, headers, await up.read())
                raise RetryableFailure(Outcome.STATUS_5XX if up.status >= 500 else Outcome.SUCCESS, held, up.status)
            sse = headers.get("Content-Type", "").startswith("text/event-stream")
            if not up.chunked and not sse and (up.content_length is not None or up.complete):
                body = await up.read()
                # A HEAD answer has no body but keeps the length a GET would have had.
                length = _declared_length(up.raw_headers) if req.method == "HEAD" else None
                await self._respond(up.status, headers, body, length)
                return None
            # Streamed: from the first byte on, never retried.
            self._send_headers(up.status, headers, end=False)
            try:
                async for piece in up.stream():
                    await self._write(piece)
            except _UPSTREAM_ERRORS as exc:
                lease.status = 502
                if not self.closed:
                    lease.outcome = Outcome.STREAM_FAILURE
                log.warning("backend %s failed mid-stream (HTTP/2 bridge): %r", backend.name, exc)
                if sse:
                    await self._write(sse_error_event(
                        f"The backend {backend.name} failed while streaming: {type(exc).__name__}",
                        "upstream_stream_error"))
                    await self._end()
                else:
                    self.down.conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
                    self.down.mark()
                return None
            await self._end()
            return None
        except asyncio.CancelledError:
            lease.status = 499
            raise
        except _UPSTREAM_ERRORS as exc:
            return self._failed_before_response(plane, exc, lease, req)
        finally:
            up.release()

    def _failed_before_response(self, plane: "HttpDataPlane", exc: BaseException, lease: Lease,
                                req: "_Request") -> "_Held":
        backend = lease.backend
        plane.metrics.error("upstream_unreachable")
        lease.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        log.warning("backend %s failed before responding (HTTP/2 bridge): %r", backend.name, exc)
        code = "upstream_timeout" if lease.status == 504 else "upstream_error"
        failed = (lease.status, _json_headers(req.request_id),
                  error_body(f"Backend {backend.name} failed: {type(exc).__name__}", "server_error", code))
        lease.outcome = classify_upstream_error(exc)
        if plane.retries is not None and lease.outcome is not None:
            raise RetryableFailure(lease.outcome, failed) from exc
        return failed

    async def _respond(self, status: int, headers: CIMultiDict[str], body: bytes, length: int | None = None) -> None:
        if length is not None or status not in (204, 304):
            headers["content-length"] = str(len(body) if length is None else length)
        self._send_headers(status, headers, end=not body)
        if body:
            await self._write(body)
            await self._end()


_ORCA_ASK = ((ORCA_FORMAT_HEADER.encode(), b"TEXT"),)
_Held = tuple[int, CIMultiDict[str], bytes]  # status, headers, body of an answer not yet sent


class _Request:
    """What every attempt of one bridged request needs, parsed once."""

    __slots__ = ("method", "raw_path", "scheme", "raw_headers", "peer", "request_id", "body", "asked_orca")

    def __init__(self, method: str, raw_path: str, scheme: str, raw_headers: tuple[tuple[bytes, bytes], ...],
                 peer: str | None, request_id: str, body: bytes, asked_orca: bool) -> None:
        self.method = method
        self.raw_path = raw_path
        self.scheme = scheme
        self.raw_headers = raw_headers
        self.peer = peer
        self.request_id = request_id
        self.body = body
        self.asked_orca = asked_orca


def _declared_length(raw_headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in raw_headers:
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


def _json_headers(request_id: str) -> CIMultiDict[str]:
    return CIMultiDict([("content-type", "application/json"), ("x-request-id", request_id)])
