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

import h2.errors
import h2.exceptions
from multidict import CIMultiDict

from proxy.control.orca import FORMAT_HEADER as ORCA_FORMAT_HEADER
from proxy.dataplane.openai import Answer, InboundRequest, OpenAIPipeline
from proxy.observability.record import H2
from proxy.dataplane.request_ids import new_request_id
from proxy.grpc.connection import per_call
from proxy.grpc.streams import ClientConnection
from proxy.upstream.http1 import Exchange

log = logging.getLogger(__name__)

_LOW_WATER = 64 * 1024  # a writer waits while more than this is queued for the client


_STATUS = {code: str(code).encode() for code in range(100, 600)}
_NAMES: dict[str, bytes] = {}  # response header name -> its HTTP/2 (lower-case) bytes
_NAMES_MAX = 1024
_REQUEST_ID = b"x-request-id"
_ORCA_ASK = ORCA_FORMAT_HEADER.lower().encode("latin-1")


class HttpBridgeCall:
    """One non-gRPC HTTP/2 request stream on the gRPC listener.

    The request's task starts once its body is complete (usually in the read that brought its HEADERS:
    a small POST's HEADERS and its one DATA frame arrive together), so a request waits on nothing before
    the pipeline sees it. A whole answer leaves as HEADERS plus DATA frames, the last of them carrying
    END_STREAM (no empty closing frame), written with the other frames of that loop turn.
    """

    __slots__ = ("received_at", "pipeline", "down", "sid", "headers", "body", "too_large", "body_complete",
                 "to_down", "queued", "drained", "closed", "end_pending", "ended", "task")

    def __init__(self, pipeline: OpenAIPipeline[None], down: ClientConnection, sid: int,
                 headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.received_at = down.now  # the request's HEADERS are in (this read): its duration counts from here
        self.pipeline = pipeline
        self.down = down
        self.sid = sid
        self.headers = headers
        self.body = bytearray()
        self.too_large = False
        self.body_complete = False
        self.to_down: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.drained = asyncio.Event()  # set by flush_down once the queue is at most _LOW_WATER
        self.drained.set()
        self.closed = False
        self.end_pending = False  # the last queued bytes end the stream
        self.ended = False  # END_STREAM went to h2
        self.task: asyncio.Task[None] | None = None
        if ended:
            self.client_end()

    # ----------------------------------------------------------------------------- connection events

    def client_data(self, data: bytes, flow_len: int, ended: bool = False) -> None:
        if len(self.body) + len(data) > self.pipeline.max_body_bytes:
            self.too_large = True
        elif not self.too_large:
            self.body += data
        self.down.ack(flow_len, self.sid)

    def client_end(self) -> None:
        if self.body_complete or self.closed:
            return
        self.body_complete = True
        self.task = asyncio.get_running_loop().create_task(self._run())

    def client_reset(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()

    def flush_down(self) -> None:
        down = self.down
        conn = down.conn
        sid = self.sid
        to_down = self.to_down
        try:
            while to_down and not down.paused:
                window = conn.local_flow_control_window(sid)
                if window <= 0:
                    break
                data = to_down[0]
                n = min(len(data), window, conn.max_outbound_frame_size)
                if n < len(data):
                    to_down[0] = data[n:]
                    data = data[:n]
                else:
                    to_down.popleft()
                last = self.end_pending and not to_down
                conn.send_data(sid, data, end_stream=last)
                self.queued -= n
                if last:
                    self.ended = True
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.client_reset()
        if to_down and not self.closed:
            down.blocked[self] = None
        down.mark()
        if self.queued <= _LOW_WATER:
            self.drained.set()

    # ---------------------------------------------------------------------------------------- writes

    def _send_headers(self, status: int, headers: CIMultiDict[str] | list[tuple[str, str]], end: bool) -> None:
        self.down.conn.send_headers(self.sid, self._head(status, headers), end_stream=end)
        if end:
            self.ended = True
        self.down.mark()

    @staticmethod
    def _head(status: int, headers: CIMultiDict[str] | list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
        names = _NAMES
        out: list[tuple[bytes, bytes]] = [(b":status", _STATUS.get(status) or str(status).encode())]
        for k, v in headers.items() if isinstance(headers, CIMultiDict) else headers:
            name = names.get(k)
            if name is None:
                name = k.lower().encode("latin-1")
                if len(names) < _NAMES_MAX:
                    names[k] = name
            if name == _REQUEST_ID:  # new on every response: a plain never-indexed literal, not cached
                out.append(per_call(name, v.encode("latin-1")))
            else:
                out.append((name, v.encode("latin-1")))
        return out

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        self.to_down.append(data)
        self.queued += len(data)
        self.flush_down()
        while self.queued > _LOW_WATER and not self.closed:
            self.drained.clear()
            await self.drained.wait()

    async def _end(self, data: bytes = b"") -> None:
        """End the stream after what is queued, and `data`: the last DATA frame carries END_STREAM (an
        empty one when everything went out already)."""
        if self.closed or self.ended:
            return
        if data:
            self.to_down.append(data)
            self.queued += len(data)
        if not self.to_down:
            self.down.conn.end_stream(self.sid)
            self.ended = True
            self.down.mark()
            return
        self.end_pending = True
        self.flush_down()
        # Each flush_down (a window opened, the transport drained) wakes this to look again.
        while not self.ended and not self.closed:
            self.drained.clear()
            await self.drained.wait()

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
        pipeline = self.pipeline
        session_header = pipeline.session_header
        session_name = session_header.lower().encode("latin-1") if session_header else None
        method = b"GET"
        raw_path_b = b"/"
        scheme_b = b"http"
        raw: list[tuple[bytes, bytes]] = []
        cookies: list[bytes] = []
        request_id: str | None = None
        session_key: str | None = None
        asked_orca = False
        for name, value in self.headers:
            if name[:1] == b":":
                if name == b":method":
                    method = value
                elif name == b":path":
                    raw_path_b = value
                elif name == b":scheme":
                    scheme_b = value
                continue
            if name == b"cookie":
                cookies.append(value)  # HTTP/2 may split the cookie field; HTTP/1.1 wants it whole
                continue
            raw.append((name, value))
            low = name.lower()  # HTTP/2 names are lower-case; matched as HTTP/1.1 matches them all the same
            if low == _REQUEST_ID:
                if request_id is None:
                    request_id = value.decode("latin-1")
            elif low == _ORCA_ASK:
                asked_orca = True
            elif low == session_name and session_key is None:
                session_key = value.decode("latin-1")
        if cookies:
            raw.append((b"cookie", b"; ".join(cookies)))
            if session_name == b"cookie":
                session_key = b"; ".join(cookies).decode("latin-1")
        raw_path = raw_path_b.decode("latin-1")
        if not request_id:
            request_id = new_request_id()
        if self.too_large:
            await self.send(pipeline.too_large(request_id))
            return
        req = InboundRequest(
            method.decode("ascii", "replace"), raw_path, raw_path.split("?", 1)[0],
            scheme_b.decode("ascii", "replace"), tuple(raw), self.down.peer(), request_id, bytes(self.body),
            asked_orca=asked_orca, session_key=session_key, received_at=self.received_at, protocol=H2,
        )
        await pipeline.handle(req, self)

    # ------------------------------------------------------------------------ the pipeline's Responder

    async def send(self, answer: Answer) -> None:
        headers = answer.headers
        body = answer.body
        length = answer.head_length
        if length is not None or answer.status not in (204, 304):
            headers["content-length"] = str(len(body) if length is None else length)
        if self.closed or self.ended:
            return
        head = self._head(answer.status, headers)
        if answer.status >= 200 and not self.to_down and self.down.send_whole(self.sid, head, body):
            self.ended = True  # HEADERS and the body's one DATA frame (END_STREAM) in h2's buffer
            self.down.mark()
            return
        self.down.conn.send_headers(self.sid, head, end_stream=not body)
        self.down.mark()
        if not body:
            self.ended = True
            return
        await self._end(body)

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
