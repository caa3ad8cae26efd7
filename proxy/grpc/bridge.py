"""Plain HTTP requests that arrive over HTTP/2 on the gRPC listener (e.g. ``httpx`` with ``http2=True``
calling ``/v1/chat/completions``): proxied like the HTTP/1.1 ones.

The request is handled the way `proxy.http.server` handles it, with the same pieces: the body is read
once (bounded by `limits.max_body_bytes`), parsed with `summary_from_openai`, routed through the shared
`Router`, forwarded with the HTTP data plane's header rules over the shared upstream aiohttp session, and the
answer is streamed back chunk by chunk (SSE included) under the client's HTTP/2 flow-control window.
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
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.core.decision import NoBackendAvailable
from proxy.core.request import RequestError, RequestSummary, summary_from_openai
from proxy.dispatch import Overloaded, UnknownModel
from proxy.http.errors import error_body, sse_error_event
from proxy.http.headers import downstream_response_headers, upstream_request_headers
from proxy.http.server import ROUTED_ENDPOINTS

if TYPE_CHECKING:
    from proxy.grpc.listener import RelayContext
    from proxy.grpc.relay import Downstream

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

    async def _error(self, status: int, message: str, type_: str, code: str, param: str | None = None) -> None:
        body = error_body(message, type_, code, param)
        self._send_headers(status, [("content-type", "application/json"),
                                    ("content-length", str(len(body)))], end=False)
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
        regular: CIMultiDict[str] = CIMultiDict()
        for name, value in self.headers:
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                regular.add(name.decode("latin-1"), value.decode("latin-1"))
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
        session = ctx.http_session()
        try:
            async with ctx.router.route(summary) as lease:
                backend = lease.backend
                peer = self.down.transport.get_extra_info("peername") if self.down.transport else None
                up_headers = upstream_request_headers(
                    CIMultiDictProxy(regular), peer[0] if peer else None, scheme,
                    regular.get("x-request-id") or f"h2-{id(self):x}-{self.sid}",
                )
                try:
                    async with session.request(
                        method, URL(backend.spec.url + raw_path, encoded=True),
                        data=bytes(self.body) if self.body else None, headers=up_headers, allow_redirects=False,
                    ) as up:
                        lease.status = up.status
                        headers = downstream_response_headers(up.headers)
                        sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
                        self._send_headers(up.status, headers, end=False)
                        try:
                            while chunk := await up.content.readany():
                                await self._write(chunk)
                        except _UPSTREAM_ERRORS as exc:
                            lease.status = 502
                            if sse:
                                await self._write(sse_error_event(
                                    f"The backend {backend.name} failed while streaming: {type(exc).__name__}",
                                    "upstream_stream_error"))
                                await self._end()
                            else:
                                self.down.conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
                                self.down.mark()
                            return
                        await self._end()
                except asyncio.CancelledError:
                    lease.status = 499
                    raise
                except _UPSTREAM_ERRORS as exc:
                    lease.status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
                    await self._error(lease.status, f"Backend {backend.name} failed: {type(exc).__name__}",
                                      "server_error",
                                      "upstream_timeout" if lease.status == 504 else "upstream_error")
        except UnknownModel as exc:
            await self._error(404, str(exc), "invalid_request_error", "model_not_found", "model")
        except Overloaded as exc:
            await self._error(503, str(exc), "server_error", "overloaded")
        except NoBackendAvailable as exc:
            await self._error(503, str(exc) or "No backend is available", "server_error", "no_backend")
