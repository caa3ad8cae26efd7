"""The HTTP/1.1 data plane: an asyncio protocol on the sans-I/O request parser, driving the OpenAI pipeline.

Per connection one `HttpConnection` (an `asyncio.Protocol`): the bytes go to `LlhttpRequestParser`
(proxy/wire/http1_llhttp.py: the reference `RequestParser` of proxy/wire/http1.py, with the header fields split
by llhttp); a complete request (head and body, bounded) becomes an `InboundRequest` for the
shared OpenAI pipeline (proxy/dataplane/openai.py), which routes it, forwards the ORIGINAL bytes and maps
failures to OpenAI-shaped errors; the connection itself is the pipeline's `Responder` and writes the answer.

Why not aiohttp's server here (it stays for the admin listener, the control-plane client and the simulator):
its request and response objects, header multidicts, payload streams and writer cost more CPU per request
than the rest of the proxy's work on it, and added latency at low load (issue 19; loadtest/bench_peers.py).
What this module does instead, per request:
- one parse of the head (no header multidict: the raw fields go to the backend as they came, and the three
  the proxy reads itself are picked out in one pass);
- the body of the usual small POST arrives with its head and is a slice of that read (no copy, no stream);
- a JSON answer is one `transport.write` of head + body; a stream's chunks go from the backend's
  `data_received` straight to this transport (no de-chunk/re-chunk, no task switch per event);
- one task per request (the pipeline awaits the backend), none per connection; no timer per request:
  one sweep per listener checks the connections' deadlines.

Client timeouts (issue 18), from `timeouts:`: a head must be complete within `client_header_s` of its first
byte (of the connection, for the first request), a body may pause at most `client_body_idle_s` between
bytes and take at most `client_body_s` in all, an idle keep-alive connection is closed after
`client_keepalive_s`. A head or body timeout is answered 408 (OpenAI-shaped) and the connection closed; an
idle one is just closed. `limits.max_connections_per_client` caps the open connections of one client
address (429 and close beyond it). Header size: the total (`limits.max_header_bytes`) is the rule, whatever
the number of fields (431 beyond it).

A client that goes away cancels its request's task at once, which exits the upstream exchange and closes
the upstream connection, so the backend sees the cancellation and stops generating. Writes to a slow
client pause the relay (and the backend's socket) through `pause_writing`/`resume_writing`.

For the listener module (proxy/listen.py) and a one-port dispatcher: `HttpDataPlane.listen(sock)` serves a
bound listening socket; `HttpDataPlane.protocol()` is the protocol factory, so an already accepted
transport can be handed over with `p = plane.protocol(); p.connection_made(transport); p.data_received(first)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import aiohttp
from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.core.snapshot import BackendState
from proxy.dataplane.openai import UPSTREAM_ERRORS, Answer, InboundRequest, OpenAIPipeline, error_answer
from proxy.dataplane.request_ids import new_request_id
from proxy.listen import ProtocolFactory, sniffing
from proxy.metrics import ProxyMetrics
from proxy.upstream.http1 import Exchange
from proxy.wire.http1 import BODY, DONE, ERROR, Data, EndOfMessage, HeadTooLarge, ProtocolError, Request
from proxy.wire.http1_llhttp import LlhttpRequestParser

log = logging.getLogger("affinity_proxy.http")

_REQUEST_LINE_ALLOWANCE = 8192  # the head limit is the fields' limit plus this much for the request line
_PIPELINE_HIGH_WATER = 256 * 1024  # stop reading while this much of a pipelined next request is buffered
_LINGER_S = 2.0  # after an error answer with close: how long unread input is still drained (no RST)
_ORCA_NAME = ORCA_FORMAT_HEADER.lower().encode()
_ORCA_LEN = len(_ORCA_NAME)

# A memo of request targets -> (raw path, path): clients of an LLM API send a handful of them. A pure function
# of the target, so nothing leaks between connections; short targets only, at most _TARGETS_MAX of them.
_TARGETS: dict[bytes, tuple[str, str]] = {}
_TARGETS_MAX = 1024
_TARGET_MEMO_BYTES = 256


def _paths(target: bytes) -> tuple[str, str]:
    """The target as forwarded (origin form; an absolute form's authority removed) and the path the proxy
    routes on (no query, percent-decoded)."""
    raw_path = target.decode("utf-8", "surrogateescape")
    path = raw_path
    if target[:1] != b"/" and b"://" in target[:16]:  # absolute form: the path is what follows the authority
        rest = raw_path.split("://", 1)[1]
        slash = rest.find("/")
        path = raw_path = rest[slash:] if slash >= 0 else "/"
    q = path.find("?")
    if q >= 0:
        path = path[:q]
    if "%" in path:
        path = unquote(path)
    known = (raw_path, path)
    if len(target) <= _TARGET_MEMO_BYTES and len(_TARGETS) < _TARGETS_MAX:
        _TARGETS[target] = known
    return known

# Connection phases: which deadline applies.
_IDLE, _HEAD, _BODY, _BUSY, _LINGER = range(5)


class ClientLimits:
    """The client-side limits of the HTTP/1.1 listener (from `limits:` and `timeouts:`)."""

    __slots__ = ("max_header_bytes", "header_s", "body_idle_s", "body_s", "keepalive_s", "max_per_client")

    def __init__(self, *, max_header_bytes: int, header_s: float = 10.0, body_idle_s: float = 30.0,
                 body_s: float = 300.0, keepalive_s: float = 75.0, max_per_client: int | None = None) -> None:
        self.max_header_bytes = max_header_bytes
        self.header_s = header_s
        self.body_idle_s = body_idle_s
        self.body_s = body_s
        self.keepalive_s = keepalive_s
        self.max_per_client = max_per_client


_DATE: list[Any] = [0, ""]


def _date() -> str:
    """The Date field line, made once a second."""
    now = int(time.time())
    if now != _DATE[0]:
        _DATE[0] = now
        _DATE[1] = f"Date: {formatdate(now, usegmt=True)}\r\n"
    return str(_DATE[1])


_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _head(status: int, reason: str, headers: CIMultiDict[str]) -> list[str]:
    """The status line and the answer's fields, as str pieces (encoded once, as aiohttp's writer does)."""
    parts = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, '')}\r\n"]
    parts += [f"{name}: {value}\r\n" for name, value in headers.items()]
    return parts


class HttpConnection(asyncio.Protocol):
    """One client connection; also the OpenAI pipeline's Responder for the request it is answering."""

    def __init__(self, plane: HttpDataPlane) -> None:
        self.plane = plane
        self.loop = plane.loop
        self.limits = plane.limits
        self.transport: asyncio.Transport | None = None
        self.parser = LlhttpRequestParser(max_head=self.limits.max_header_bytes + _REQUEST_LINE_ALLOWANCE)
        self.peer: str | None = None
        self.request: Request | None = None
        self.received_at = 0.0
        self.body: list[bytes] = []
        self.body_len = 0
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True
        self.closing = False  # close after the current response (drain, an error answer)
        self.phase = _IDLE
        self.deadline = 0.0
        self.body_deadline = 0.0
        # Responder state of the current request.
        self.sent = False  # bytes of the answer reached the transport
        self.chunked = False  # the streamed answer is chunked by us (HTTP/1.1)
        self.head_method = False
        self.http10 = False
        # Write flow control (pause_writing / resume_writing from the transport).
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.read_paused = False

    # ------------------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        plane = self.plane
        if not plane.admit(self):
            self._error(429, "Too many connections from this address", "rate_limit_error",
                        "too_many_connections")
            return
        self.phase = _HEAD  # the first request's head is due within header_s of the connection
        self.deadline = self.loop.time() + self.limits.header_s

    def connection_lost(self, exc: Exception | None) -> None:
        self.plane.forget(self)
        self.closing = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))
            waiter.exception()  # retrieved: nobody awaiting it is fine
        self.drain_waiter = None
        self.phase = _LINGER
        self.deadline = 0.0
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self.drain_waiter = None

    def data_received(self, data: bytes) -> None:
        if self.phase == _LINGER:
            return  # an error answer went out: input is drained, not parsed
        if self.task is not None:  # answering: what comes now is a pipelined next request
            self.parser.feed(data)
            if self.parser.buffered > _PIPELINE_HIGH_WATER and not self.read_paused and self.transport:
                self.read_paused = True
                self.transport.pause_reading()
            return
        try:
            events = self.parser.feed(data)
        except ProtocolError as exc:
            self._bad_request(exc)
            return
        if events:
            self._on_events(events)
        elif self.phase == _IDLE:  # the first bytes of the next request: its head is due
            self.phase = _HEAD
            self.deadline = self.loop.time() + self.limits.header_s
        elif self.phase == _BODY:
            self._body_progress()

    def eof_received(self) -> bool | None:
        return None  # the client is gone: close (and cancel what it asked for), as aiohttp's server did

    # ------------------------------------------------------------------------------ requests

    def _on_events(self, events: list[Any]) -> None:
        n = len(events)
        if n <= 3 and type(events[0]) is Request and type(events[-1]) is EndOfMessage:
            # The usual case: a whole request in one read (head, the body if any, the end).
            if not self._begin(events[0]):
                return
            if n == 3:
                data = events[1].data
                if len(data) > self.plane.max_body:
                    self._reject(self.plane.pipeline.too_large(self._request_id()))
                    return
                self._dispatch(data)
            else:
                self._dispatch(b"")
            return
        for ev in events:
            kind = type(ev)
            if kind is Data:
                self.body.append(ev.data)
                self.body_len += len(ev.data)
                if self.body_len > self.plane.max_body:
                    self._reject(self.plane.pipeline.too_large(self._request_id()))
                    return
            elif kind is Request:
                if not self._begin(ev):
                    return
            elif kind is EndOfMessage:
                body = self.body
                self.body = []
                self._dispatch(body[0] if len(body) == 1 else b"".join(body))
                return
        if self.phase == _BODY:
            self._body_progress()

    def _begin(self, request: Request) -> bool:
        self.received_at = time.monotonic()  # the head is in: the request's duration counts from here
        self.request = request
        self.body = []
        self.body_len = 0
        self.sent = False
        self.head_method = request.method == "HEAD"
        self.http10 = request.http_version == b"1.0"
        self.keep_alive = request.keep_alive
        plane = self.plane
        limit = self.limits.max_header_bytes
        if request.header_bytes > limit:
            plane.metrics.error("headers_too_large")
            self._reject(error_answer(
                431, f"Request headers are {request.header_bytes} bytes; the limit is {limit}",
                "invalid_request_error", "headers_too_large", request_id=self._request_id(), close=True))
            return False
        length = request.content_length
        if length is not None and length > plane.max_body:
            self._reject(plane.pipeline.too_large(self._request_id()))
            return False
        if request.expect_continue and self.parser.state is not DONE and self.transport is not None:
            # curl sends this for bodies over 1 KiB and waits a second for the go-ahead.
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.parser.state is not DONE:
            now = self.loop.time()
            self.phase = _BODY
            self.body_deadline = now + self.limits.body_s
            self.deadline = min(now + self.limits.body_idle_s, self.body_deadline)
        return True

    def _body_progress(self) -> None:
        self.deadline = min(self.loop.time() + self.limits.body_idle_s, self.body_deadline)

    def _request_id(self) -> str:
        request = self.request
        if request is not None:
            for name, value in request.headers:
                if len(name) == 12 and name.lower() == b"x-request-id" and value:
                    return value.decode("latin-1")
        return new_request_id()

    def _dispatch(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        self.phase = _BUSY
        self.deadline = 0.0
        plane = self.plane
        request_id = None
        asked_orca = False
        session_key = None
        session_name = plane.session_name
        for name, value in request.headers:
            n = len(name)
            if n == 12 and request_id is None and name.lower() == b"x-request-id":
                request_id = value.decode("latin-1") or None
            elif n == _ORCA_LEN and name.lower() == _ORCA_NAME:
                asked_orca = True
            elif session_name is not None and n == len(session_name) and session_name == name.lower() \
                    and session_key is None:
                session_key = value.decode("latin-1")
        target = request.target
        known = _TARGETS.get(target)
        if known is None:
            known = _paths(target)
        raw_path, path = known
        req = InboundRequest(
            request.method, raw_path, path, "http", tuple(request.headers), self.peer,
            request_id or new_request_id(), body,
            asked_orca=asked_orca, session_key=session_key, received_at=self.received_at,
        )
        self.task = self.loop.create_task(self._run(req))

    async def _run(self, req: InboundRequest) -> None:
        try:
            if req.path == "/v1/models" and req.method == "GET":
                await self.send(await self.plane.models(req.request_id))
            else:
                await self.plane.pipeline.handle(req, self)
        except asyncio.CancelledError:
            return  # the client went away (or the drain deadline passed): nothing more to write
        except ConnectionError:
            self.keep_alive = False  # the client went away while its answer was being written
        except Exception as exc:  # noqa: BLE001  # one request's fault ends that request, not the connection's server
            if not self.sent and not self.gone():
                log.error("error handling request", exc_info=exc)
                await self.send(error_answer(500, "Internal proxy error", "server_error", "internal_error",
                                             request_id=req.request_id, close=True))
            else:
                log.error("error while answering a request", exc_info=exc)
                self.keep_alive = False
        finally:
            self.task = None
        self._next()

    def _next(self) -> None:
        """The answer is out: go on with the next request (pipelined or to come), or close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self.keep_alive or self.closing:
            self._close()
            return
        self.request = None
        self.phase = _IDLE
        self.deadline = self.loop.time() + self.limits.keepalive_s
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        try:
            events = self.parser.next()
        except ProtocolError as exc:
            self._bad_request(exc)
            return
        if events:
            self._on_events(events)
        elif self.parser.started:
            self.phase = _HEAD
            self.deadline = self.loop.time() + self.limits.header_s

    # ------------------------------------------------------------------------------ errors, closing

    def _bad_request(self, exc: ProtocolError) -> None:
        if self.task is not None or self.sent:
            self._close()
            return
        if isinstance(exc, HeadTooLarge):
            self.plane.metrics.error("headers_too_large")
            answer = error_answer(431, "Request header fields too large", "invalid_request_error",
                                  "headers_too_large", request_id=new_request_id(), close=True)
        else:
            answer = error_answer(400, f"Malformed HTTP request: {exc}", "invalid_request_error", "bad_request",
                                  request_id=new_request_id(), close=True)
        self.head_method = False
        self._reject(answer)

    def _error(self, status: int, message: str, type_: str, code: str) -> None:
        self._reject(error_answer(status, message, type_, code, request_id=new_request_id(), close=True))

    def _reject(self, answer: Answer) -> None:
        """An answer of the proxy's own before the request was complete; the connection closes after it."""
        self.keep_alive = False
        self._write_answer(answer)
        self._close()

    def timed_out(self) -> None:
        phase = self.phase
        if phase == _LINGER:
            if self.transport is not None:
                self.transport.abort()
            return
        if phase == _IDLE:
            self._close()
            return
        what = "headers" if phase == _HEAD else "body"
        self.plane.metrics.error(f"client_{what}_timeout")
        self._error(408, f"The request {what} did not arrive in time", "invalid_request_error",
                    f"request_{what}_timeout")

    def _close(self) -> None:
        """Close after what was written; unread input is drained for a moment so that the answer is read
        (closing with unread bytes would reset the connection and could destroy the answer in flight)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.phase = _LINGER
        self.keep_alive = False
        parser = self.parser
        if (parser.state is BODY or parser.state is ERROR or parser.buffered) and transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:
                transport.close()
                return
            self.deadline = self.loop.time() + _LINGER_S
            if self.read_paused:
                self.read_paused = False
                transport.resume_reading()
        else:
            transport.close()

    def shut(self) -> None:
        """Drain: close now if idle, else after the current answer."""
        self.closing = True
        if self.task is None and self.phase in (_IDLE, _HEAD):
            self._close()

    # ------------------------------------------------------------------------------ Responder

    def _write_answer(self, answer: Answer) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if answer.close or self.closing:
            self.keep_alive = False
        status = answer.status
        headers = answer.headers
        body = answer.body
        parts = [f"HTTP/1.1 {status} {answer.reason or _REASONS.get(status, '')}\r\n"]
        parts += [f"{name}: {value}\r\n" for name, value in headers.items()]
        if "Date" not in headers:
            parts.append(_date())
        no_body = status < 200 or status == 204 or status == 304
        if not no_body:
            if body and "Content-Type" not in headers:
                parts.append("Content-Type: application/octet-stream\r\n")
            length = answer.head_length if self.head_method and answer.head_length is not None else len(body)
            parts.append(f"Content-Length: {length}\r\n")
        if not self.keep_alive:
            parts.append("Connection: close\r\n\r\n")
        elif self.http10:
            parts.append("Connection: keep-alive\r\n\r\n")
        else:
            parts.append("\r\n")
        head = "".join(parts).encode("utf-8", "surrogateescape")
        self.sent = True
        transport.write(head + body if body and not no_body and not self.head_method else head)

    async def send(self, answer: Answer) -> None:
        self._write_answer(answer)

    async def start(self, up: Exchange, headers: CIMultiDict[str]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if self.closing:
            self.keep_alive = False
        parts = _head(up.status, up.reason, headers)
        if "Date" not in headers:
            parts.append(_date())
        if self.http10:
            self.chunked = False
            self.keep_alive = False  # the close ends the body
        else:
            self.chunked = True
            parts.append("Transfer-Encoding: chunked\r\n")
        parts.append("Connection: close\r\n\r\n" if not self.keep_alive else "\r\n")
        self.sent = True
        transport.write("".join(parts).encode("utf-8", "surrogateescape"))

    async def relay(self, up: Exchange) -> None:
        transport = self.transport
        if up.chunked and self.chunked and transport is not None:
            # The backend's chunks go to the client as they are (complete chunks, straight from the
            # upstream protocol's data_received): no task switch, no de-chunk/re-chunk per event.
            up.relay_chunks(transport)
            while not up.complete:
                await up.wait_relay()
                if up.paused:
                    await self._drain()
                    up.resume()
        else:
            async for piece in up.stream():
                await self.write(piece)

    async def _drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        if not self.write_paused:
            return
        waiter = self.drain_waiter
        if waiter is None:
            waiter = self.drain_waiter = self.loop.create_future()
        await waiter

    async def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if not data:
            return
        transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        if self.write_paused:
            await self._drain()

    async def end(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            self.keep_alive = False
            return  # the client left before the end: nothing to finish
        if self.chunked:
            transport.write(b"0\r\n\r\n")
        if self.write_paused:
            await self._drain()

    async def abort(self) -> None:
        # No last chunk: the client sees a body that ended without its end, i.e. a failure.
        self.keep_alive = False
        transport = self.transport
        if transport is not None:
            transport.close()

    def gone(self) -> bool:
        transport = self.transport
        return transport is None or transport.is_closing()


class HttpListener:
    """A serving HTTP/1.1 listener: its addresses, and `cleanup()` to drain and stop it."""

    def __init__(self, plane: HttpDataPlane, server: asyncio.Server, drain_s: float) -> None:
        self.plane = plane
        self.server = server
        self.drain_s = drain_s
        # asyncio declares `sockets` a tuple; uvloop's is a list, which compiled code would refuse (proxy/native).
        sockets: Any = getattr(server, "sockets")
        self.addresses = [s.getsockname() for s in sockets]

    async def cleanup(self) -> None:
        self.server.close()
        await self.plane.drain(self.drain_s)


class HttpDataPlane:
    """The HTTP/1.1 listener's shared state: the pipeline, limits, the open connections and their deadlines."""

    def __init__(
        self, pipeline: OpenAIPipeline[None], session: aiohttp.ClientSession, metrics: ProxyMetrics,
        *, max_header_bytes: int, connect_timeout_s: float, limits: ClientLimits | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.router = pipeline.router
        self.session = session  # for the proxy's own calls (GET /v1/models); requests go through the pool
        self.metrics = metrics
        self.max_body = pipeline.max_body_bytes
        self.limits = limits if limits is not None else ClientLimits(max_header_bytes=max_header_bytes)
        session_header = pipeline.session_header
        self.session_name = session_header.lower().encode("latin-1") if session_header else None
        self.connect_timeout_s = connect_timeout_s
        self.connections: set[HttpConnection] = set()
        self.per_client: dict[str | None, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._stopped = False
        lim = self.limits
        self._tick = min(1.0, max(0.02, min(lim.header_s, lim.body_idle_s, lim.keepalive_s) / 4))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def protocol(self) -> HttpConnection:
        """The protocol factory (asyncio `create_server`, or a dispatcher handing over accepted transports)."""
        return HttpConnection(self)

    async def listen(
        self, sock: Any, *, drain_s: float, backlog: int = 4096, h2: ProtocolFactory | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> HttpListener:
        """Serve HTTP/1.1 on a bound, listening socket (proxy/listen.py); with `h2` (the HTTP/2 side's
        protocol factory) the same port also serves HTTP/2 (ALPN h2, or the h2c preface sniffed), and with
        `ssl_context` it speaks TLS."""
        server = await self.loop.create_server(
            sniffing(self.protocol, h2, self.limits.header_s), sock=sock, ssl=ssl_context, backlog=backlog
        )
        return HttpListener(self, server, drain_s)

    # ------------------------------------------------------------------------------ connections

    def admit(self, conn: HttpConnection) -> bool:
        self.connections.add(conn)
        cap = self.limits.max_per_client
        if cap is not None:
            n = self.per_client.get(conn.peer, 0)
            self.per_client[conn.peer] = n + 1
            if n >= cap:
                return False
        if self._sweep is None and not self._stopped:
            self._sweep = self.loop.call_later(self._tick, self._check_deadlines)
        return True

    def forget(self, conn: HttpConnection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            if self.limits.max_per_client is not None:
                n = self.per_client.get(conn.peer, 1) - 1
                if n > 0:
                    self.per_client[conn.peer] = n
                else:
                    self.per_client.pop(conn.peer, None)

    def _check_deadlines(self) -> None:
        now = self.loop.time()
        for conn in [c for c in self.connections if 0.0 < c.deadline <= now]:
            conn.deadline = 0.0
            conn.timed_out()
        self._sweep = self.loop.call_later(self._tick, self._check_deadlines) if self.connections else None

    async def drain(self, timeout: float) -> None:
        """Stop: idle connections close now, busy ones after their answer; at `timeout` the rest is cut."""
        self._stopped = True
        for conn in list(self.connections):
            conn.shut()
        deadline = time.monotonic() + timeout
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # ------------------------------------------------------------------------------ models

    async def models(self, request_id: str) -> Answer:
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
        headers: CIMultiDict[str] = CIMultiDict([("Content-Type", "application/json"), ("x-request-id", request_id)])
        body = json.dumps({"object": "list", "data": list(models.values())}).encode()
        return Answer(200, "OK", headers, body)

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


__all__ = ["ClientLimits", "HttpConnection", "HttpDataPlane", "HttpListener"]
