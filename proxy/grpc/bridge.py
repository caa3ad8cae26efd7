"""Plain HTTP requests that arrive over HTTP/2 on the gRPC listener (e.g. ``httpx`` with ``http2=True``
calling ``/v1/chat/completions``): proxied like the HTTP/1.1 ones, by the same OpenAI pipeline.

This is the pipeline's HTTP/2 adapter (proxy/dataplane/openai.py has the request's life: the body bounded
by `limits.max_body_bytes` and parsed once, routed through the shared `Router`, sent over the relay pool
with its header rules, ORCA reports asked for and folded in, retries on another backend before the first
byte, OpenAI-shaped errors). Here: the h2 stream is read into an `InboundRequest`, and the answer goes
back whole (JSON) or piece by piece as it arrives (SSE) under the client's HTTP/2 flow-control window.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import h2.errors
import h2.exceptions
from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.dataplane.openai import Answer, InboundRequest, OpenAIPipeline
from proxy.observability.record import H2
from proxy.dataplane.request_ids import new_request_id
from proxy.grpc.streams import ClientConnection
from proxy.upstream.http1 import Exchange

log = logging.getLogger(__name__)

_LOW_WATER = 64 * 1024  # a writer waits while more than this is queued for the client


class HttpBridgeCall:
    """One non-gRPC HTTP/2 request stream on the gRPC listener."""

    def __init__(self, pipeline: OpenAIPipeline[None], down: ClientConnection, sid: int,
                 headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.received_at = time.monotonic()  # the request's HEADERS are in: its duration counts from here
        self.pipeline = pipeline
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
        if len(self.body) + len(data) > self.pipeline.max_body_bytes:
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
        scheme = pseudo.get(b":scheme", b"http").decode("ascii", "replace")
        request_id = regular.get("x-request-id") or new_request_id()
        pipeline = self.pipeline
        await self.body_done.wait()
        if self.too_large:
            await self.send(pipeline.too_large(request_id))
            return
        session_header = pipeline.session_header
        peer = self.down.peer()
        req = InboundRequest(
            method, raw_path, raw_path.split("?", 1)[0], scheme, tuple(raw), peer, request_id, bytes(self.body),
            asked_orca=ORCA_FORMAT_HEADER in regular,
            session_key=regular.get(session_header) if session_header else None,
            received_at=self.received_at, protocol=H2,
        )
        await pipeline.handle(req, self)

    # ------------------------------------------------------------------------ the pipeline's Responder

    async def send(self, answer: Answer) -> None:
        headers = answer.headers
        body = answer.body
        length = answer.head_length
        if length is not None or answer.status not in (204, 304):
            headers["content-length"] = str(len(body) if length is None else length)
        self._send_headers(answer.status, headers, end=not body)
        if body:
            await self._write(body)
            await self._end()

    async def start(self, up: Exchange, headers: CIMultiDict[str]) -> None:
        self._send_headers(up.status, headers, end=False)

    async def relay(self, up: Exchange) -> None:
        async for piece in up.stream():
            await self._write(piece)

    async def write(self, data: bytes) -> None:
        await self._write(data)

    async def end(self) -> None:
        await self._end()

    async def abort(self) -> None:
        if not self.closed:
            self.down.conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            self.down.mark()

    def gone(self) -> bool:
        return self.closed
