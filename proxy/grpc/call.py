"""The frame-level gRPC relay: one client HTTP/2 stream <-> one backend HTTP/2 stream, bytes unchanged.

Life of a call (`Call`):

1. HOLD: the client's HEADERS are kept until its first gRPC message is complete (or the method has no
   extractor, or END_STREAM, or `first_message_timeout_s`). Held bytes are acknowledged to the client as
   they arrive, bounded by `max_routing_message_bytes`.
2. ROUTE: the extractor for the method reads routing inputs off a copy of the message (decompressed for
   routing when ``grpc-encoding`` says so) into a `RequestSummary`; a `Lease` of the shared router
   (proxy/dataplane/router.py) picks a backend with a gRPC address and holds its in-flight slot, exactly
   as for HTTP: one token formula, one duration (from the HEADERS), one outcome rule.
3. RELAY: request headers go to the backend (``grpc-timeout`` reduced by the time already spent, an
   ``x-request-id`` added when the client sent none, as for HTTP), then
   every DATA frame in order, each direction under the receiver's flow-control window. Data received
   from one side is acknowledged (WINDOW_UPDATE) only once it has been handed to the other side, so a
   slow reader holds back its writer through HTTP/2 flow control and the proxy buffers at most one
   window per stream.
4. END: trailers (or END_STREAM) from the backend end the client stream; a reset on either side resets
   the other; a backend reset or crash gives the client ``UNAVAILABLE`` with a message. If the backend
   connection fails before any response byte (the first response HEADERS or DATA to the client), the
   call goes to another backend as the shared retry policy allows (`retries:`, proxy/dataplane/retry.py
   `Attempts`; its request bytes are kept for that, up to `replay_buffer_bytes`). Each attempt's lease
   is finished on its own, so a retried call is accounted to every backend it touched.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, Awaitable

import h2.errors
import h2.exceptions

from proxy.core.decision import NoBackendAvailable, Outcome
from proxy.core.request import RequestSummary
from proxy.dataplane.request_ids import new_request_id
from proxy.dataplane.retry import Attempts, RetryableFailure
from proxy.dataplane.router import Lease, Overloaded, UnknownModel
from proxy.grpc.connection import per_call
from proxy.grpc.context import CLIENT_CHOSEN, RelayContext, http_status_for
from proxy.grpc.extractors import Extractor
from proxy.grpc.streams import ClientConnection
from proxy.grpc.upstream import BackendPool, Upstream
from proxy.observability.lifecycle import strip_trace_headers
from proxy.observability.record import GRPC
from proxy.wire import grpc as wire
from proxy.wire.grpc import (CANCELLED, DEADLINE_EXCEEDED, INTERNAL, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE,
                             UNKNOWN, grpc_message, status_of)

log = logging.getLogger(__name__)

NO_BACKEND_PUSHBACK_S = 1  # as the HTTP data plane's Retry-After when no backend is available

_HOLD, _WAIT_CONN, _RELAY, _DONE = 0, 1, 2, 3
_CANCEL = h2.errors.ErrorCodes.CANCEL
_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM


class Call:
    """One relayed gRPC call (one stream on each side). See the module docstring for its life."""

    __slots__ = (
        "ctx", "down", "sid", "headers", "path", "ext", "started", "timeout", "encoding", "state",
        "held", "client_ended", "client_trailers", "up", "uid", "pool", "backend", "lease",
        "to_up", "up_sent_end", "to_down", "down_trailers", "down_end", "response_started",
        "headers_sent", "replay", "replay_bytes", "attempts", "retry_reason", "timer", "route_key", "summary",
        "grpc_status", "failure", "admission", "deadline", "holding", "request_id", "obs", "touched_at",
    )

    def __init__(self, ctx: RelayContext, down: ClientConnection, holding: list["Call"], sid: int,
                 headers: list[tuple[bytes, bytes]],
                 path: str, ext: Extractor | None) -> None:
        self.ctx = ctx
        self.down = down
        self.holding = holding  # the connection's calls that started holding during its current read
        self.sid = sid
        self.headers = headers
        self.path = path
        self.ext = ext  # None: a local service (health, admin), not routed
        self.started = time.monotonic()  # the HEADERS are in: deadline and request duration count from here
        self.touched_at = self.started  # the client's last DATA on this stream (set by the connection)
        self.timeout: float | None = None
        self.encoding = b"identity"
        self.route_key: str | None = None
        request_id: bytes | None = None
        at = -1
        for i, (name, value) in enumerate(headers):
            if name == b"grpc-timeout":
                self.timeout = wire.parse_timeout(value)
            elif name == b"grpc-encoding":
                self.encoding = value
            elif name == b"x-request-id":
                request_id = value
                at = i
        # The id differs on every call: it goes to the backend never indexed (connection.PerCallEncoder).
        if request_id is None:
            # As for HTTP: the backend gets an x-request-id, from the one id source of every protocol.
            request_id = new_request_id().encode("ascii")
            self.headers = [*headers, per_call(b"x-request-id", request_id)]
        else:
            self.headers = [*headers]
            self.headers[at] = per_call(b"x-request-id", request_id)
        self.request_id = request_id.decode("latin-1")
        self.state = _HOLD
        self.held = bytearray()
        self.client_ended = False
        self.client_trailers: list[tuple[bytes, bytes]] | None = None
        self.up: Upstream | None = None
        self.uid = 0
        self.pool: BackendPool | None = None
        self.backend: str | None = None  # the backend of the current attempt
        self.lease: Lease | None = None  # the current attempt's in-flight slot (proxy/dataplane/router.py)
        # [bytes, unacknowledged flow-controlled length] per queued DATA chunk.
        self.to_up: collections.deque[list[Any]] = collections.deque()
        self.up_sent_end = False
        self.to_down: collections.deque[list[Any]] = collections.deque()
        self.down_trailers: list[tuple[bytes, bytes]] | None = None
        self.down_end = False
        self.response_started = False
        self.headers_sent = False
        self.replay: list[bytes] | None = [] if ctx.options.retry_on_connect_failure else None
        self.replay_bytes = 0
        self.attempts: Attempts | None = None  # the shared retry bookkeeping, from the first pick on
        self.retry_reason: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.summary: RequestSummary | None = None
        self.grpc_status = UNKNOWN
        self.failure: Outcome | None = None  # how the backend failed this call, for outlier detection
        self.admission: asyncio.Task[None] | None = None  # waiting in the overload queue
        self.deadline: asyncio.TimerHandle | None = None  # the client's grpc-timeout, enforced here too
        # This call's access-log record and trace (proxy/observability/lifecycle.py); None: off, or a local service.
        observability = ctx.observability
        self.obs = None if observability is None or ext is None else observability.begin(
            self.request_id, GRPC, "POST", path, down.peer(), lambda name: _header(headers, name), self.started)

    # ------------------------------------------------------------------------------ client -> proxy

    def client_data(self, data: bytes, flow_len: int, ended: bool = False) -> None:
        if self.obs is not None:
            self.obs.record.bytes_in += len(data)
        if ended:
            # Known before routing, so the message and END_STREAM leave in one DATA frame.
            self.client_ended = True
        if self.state == _HOLD:
            self.held += data
            self.down.ack(flow_len, self.sid)
            self._maybe_route()
        elif self.state == _DONE:
            self.down.ack(flow_len, self.sid)
        else:
            # Flushed by the connection once per read (see `up_data`).
            self.to_up.append([data, flow_len])

    def client_end(self) -> None:
        self.client_ended = True
        if self.state == _HOLD:
            self._route()
        elif self.state == _RELAY:
            self.flush_up()

    def client_trailers_received(self, trailers: list[tuple[bytes, bytes]]) -> None:
        self.client_trailers = trailers
        self.client_end()

    def client_reset(self) -> None:
        """The client cancelled (RST_STREAM) or went away: cancel the backend stream too."""
        if self.state == _DONE:
            return
        if self.up is not None:
            self.up.reset(self.uid, _CANCEL)
        elif self.pool is not None:
            self.pool.cancel_wait(self)
        self.grpc_status = CANCELLED
        self._finish(remove_down=True)

    def _deadline_expired(self) -> None:
        self.deadline = None
        if self.state == _DONE:
            return
        where = {_HOLD: "waiting for the first message", _WAIT_CONN: "before the call reached a backend",
                 _RELAY: f"on backend {self.backend}" if self.backend else "in the proxy"}[self.state]
        self.fail(DEADLINE_EXCEEDED, f"deadline exceeded ({self.timeout:g} s) {where}")

    def first_message_timeout(self) -> None:
        self.timer = None
        if self.state == _HOLD:
            try:
                self._route()
            except Exception as exc:  # a timer callback: nobody above would end the call
                self.internal_error(exc)

    def _maybe_route(self) -> None:
        held = self.held
        if len(held) < wire.GRPC_PREFIX:
            return
        length = wire.message_length(held)
        assert length is not None
        if len(held) >= wire.GRPC_PREFIX + length or length > self.ctx.options.max_routing_message_bytes:
            self._route()

    # ------------------------------------------------------------------------------------- routing

    def start(self, end_stream: bool) -> None:
        """Called once the request HEADERS are in."""
        if end_stream:
            self.client_ended = True
        if self.timeout is not None:
            # The deadline runs from the HEADERS: holding the first message, waiting in the overload queue
            # or for a connection, retries and the relay itself all count, and a backend that ignores the
            # grpc-timeout it was passed is stopped here.
            self.deadline = asyncio.get_running_loop().call_later(self.timeout, self._deadline_expired)
        if self.ext is None or not self.ext.needs_message or end_stream:
            self._route()
        else:
            # The first message usually arrives in the same read as the headers; the timer is only
            # armed (by the connection, after this read) for calls still holding.
            self.holding.append(self)

    def arm_timer(self) -> None:
        if self.state == _HOLD and self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(
                self.ctx.options.first_message_timeout_s, self.first_message_timeout)

    def _route(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        ctx = self.ctx
        if self.held:
            self.to_up.appendleft([bytes(self.held), 0])  # acknowledged while held
            self.held = bytearray()
        if self.ext is None:
            self._use_pool(ctx.local_pool)
            return
        if self.timeout is not None and time.monotonic() - self.started >= self.timeout:
            self.fail(DEADLINE_EXCEEDED, "deadline exceeded before the call was routed")
            return
        payload = None
        if self.ext.needs_message and self.to_up:
            held_view = self.to_up[0][0]
            msg = wire.first_message(held_view)
            if msg is not None:
                compressed, payload = msg
                if compressed:
                    payload = wire.decompress(payload, self.encoding.decode("ascii", "replace"),
                                              ctx.options.max_routing_message_bytes)
                    if payload is not None:
                        ctx.decompressed_for_routing += 1
        key_header = ctx.registry.route_key_header(self.ext)
        if key_header is not None and self.route_key is None:
            for name, value in self.headers:
                if name == key_header:
                    self.route_key = value.decode("utf-8", "replace")
                    break
        summary = ctx.registry.summarize(self.path, self.ext, payload, self.route_key, ctx.router.adapter_names())
        if ctx.router.aliases and summary.model is not None and payload is not None:
            summary = self._alias(summary, payload)
        if self.obs is not None:
            self.obs.summarised(summary)
        self._pick(summary)

    def _alias(self, summary: RequestSummary, payload: bytes) -> RequestSummary:
        """YAML `models` aliases, as on HTTP: the first message is forwarded naming the served model (or the
        fallback), uncompressed (a message's own flag says so), and routed on that name."""
        router = self.ctx.router
        assert summary.model is not None and self.ext is not None
        served = router.resolve_model(summary.model)
        if served == summary.model:
            return summary
        message = self.ctx.registry.with_model(self.ext, payload, served)
        if message is None:
            return summary
        held = self.to_up[0][0]
        rest = held[wire.GRPC_PREFIX + (wire.message_length(held) or 0):]
        self.to_up[0][0] = b"\0" + len(message).to_bytes(4, "big") + message + rest
        adapter = served if served in router.adapter_names() else None
        return dataclasses.replace(summary, model=served, adapter=adapter)

    def _pick(self, summary: RequestSummary) -> None:
        ctx = self.ctx
        if self.attempts is None:
            self.attempts = Attempts(ctx.retries)  # first attempt: counts toward the shared retry budget
        self.summary = summary
        ctx.prune_pools()
        lease = ctx.router.route(summary, self.attempts.exclude, received_at=self.started, grpc=True)
        ready = lease.prepare()
        if ready is not None:  # e.g. a long prompt's tokenisation for the precise lookup (bounded)
            self.state = _WAIT_CONN
            self.admission = asyncio.get_running_loop().create_task(self._prepared(lease, ready))
            return
        self._try(lease)

    async def _prepared(self, lease: Lease, ready: Awaitable[None]) -> None:
        await ready
        self.admission = None
        if self.state == _DONE:
            return  # the client left while it waited: nothing was picked or held
        try:
            self._try(lease)
        except Exception as exc:
            self.internal_error(exc)

    def _try(self, lease: Lease) -> None:
        ctx = self.ctx
        try:
            lease.try_pick()
        except Overloaded as overloaded:
            queue = ctx.router.queue
            if queue is not None and queue.enabled:
                # overload.action: queue -- wait (bounded) for capacity like an HTTP request would.
                self.state = _WAIT_CONN
                self.admission = asyncio.get_running_loop().create_task(self._admit(lease, overloaded))
                return
            self._no_backend(overloaded)
            return
        except NoBackendAvailable as none:
            self._no_backend(none)
            return
        self._picked(lease)

    async def _admit(self, lease: Lease, first: Overloaded) -> None:
        try:
            await lease.wait_in_queue(first)
        except NoBackendAvailable as err:
            self.admission = None
            self._no_backend(err)
            return
        self.admission = None
        if self.state == _DONE:
            lease.finish()  # status 499: the client left while it waited
        else:
            try:
                self._picked(lease)
            except Exception as exc:
                self.internal_error(exc)

    def _no_backend(self, err: NoBackendAvailable) -> None:
        if self.retry_reason is not None:
            # A retry found no other backend: the client hears why the first attempt failed.
            if self.attempts is not None:
                self.attempts.no_backend_left()
            self.fail(UNAVAILABLE, self.retry_reason)
            return
        if isinstance(err, UnknownModel):  # no backend serves that model (HTTP: 404): not worth a retry
            self.fail(NOT_FOUND, str(err))
            return
        # Saturation answered as 429 over HTTP (overload.reject_status) is RESOURCE_EXHAUSTED here: the
        # client should back off; everything else (503) is UNAVAILABLE. Both carry grpc-retry-pushback-ms,
        # gRPC's Retry-After: a client with a retry policy waits that long before its next attempt (the
        # HTTP data plane's Retry-After values: overload.retry_after_s, or 1 s when no backend is up).
        if isinstance(err, Overloaded):
            code = RESOURCE_EXHAUSTED if err.status == 429 else UNAVAILABLE
            pushback_s = float(err.retry_after_s)
        else:
            code, pushback_s = UNAVAILABLE, float(NO_BACKEND_PUSHBACK_S)
        self.fail(code, f"no backend available: {err}" if str(err) else "no backend available",
                  ((b"grpc-retry-pushback-ms", str(int(pushback_s * 1000)).encode()),))

    def _picked(self, lease: Lease) -> None:
        self.lease = lease
        backend = lease.backend
        self.backend = backend.name
        address = backend.spec.grpc_address
        assert address is not None  # the router picks only backends with one for gRPC leases
        if self.obs is not None:
            trace_headers = self.obs.picked(lease, f"http://{address}")
            if trace_headers:  # tracing on: the upstream span's context replaces the client's
                self.headers = [*strip_trace_headers(self.headers), *(per_call(n, v) for n, v in trace_headers)]
        self._use_pool(self.ctx.pools.get(backend.name, address))

    def _use_pool(self, pool: BackendPool) -> None:
        self.pool = pool
        up = pool.take()
        if up is None:
            self.state = _WAIT_CONN
            pool.wait(self)
        else:
            self.attach(up)

    def attach(self, up: Upstream) -> None:
        """Open the backend stream on `up` and start relaying."""
        if self.state == _DONE:
            return
        headers = self.headers
        if self.timeout is not None:
            left = self.timeout - (time.monotonic() - self.started)
            if left <= 0:
                self.fail(DEADLINE_EXCEEDED, "deadline exceeded before the call reached a backend")
                return
            timeout = per_call(b"grpc-timeout", wire.format_timeout(left))  # the time left: new each call
            headers = [timeout if h[0] == b"grpc-timeout" else h for h in headers]
        try:
            self.uid = up.open_stream(self, headers)
        except (h2.exceptions.ProtocolError, h2.exceptions.TooManyStreamsError) as err:
            self.up_lost(f"cannot open a stream to backend {self.backend}: {err}", refused=True)
            return
        self.up = up
        self.state = _RELAY
        self.flush_up()

    def connect_failed(self, reason: str) -> None:
        """The pool could not open a connection for this waiting call."""
        if self.state == _DONE:
            return
        self.pool = None
        self.failure = Outcome.CONNECT_FAILURE
        try:
            self._retry_or_fail(reason)  # may route again
        except Exception as exc:
            self.internal_error(exc)

    # ------------------------------------------------------------------------------ proxy -> backend

    def flush_up(self) -> None:
        up = self.up
        if up is None or self.state != _RELAY:
            return
        if up.paused:
            up.blocked[self] = None
            return
        conn = up.conn
        uid = self.uid
        to_up = self.to_up
        down = self.down
        try:
            while to_up:
                window = conn.local_flow_control_window(uid)
                if window <= 0:
                    break
                chunk, ack = take(to_up, min(window, conn.max_outbound_frame_size))
                end = not to_up and self.client_ended and self.client_trailers is None
                conn.send_data(uid, chunk, end_stream=end)
                if self.replay is not None and not self.response_started:
                    self.replay_bytes += len(chunk)
                    if self.replay_bytes > self.ctx.options.replay_buffer_bytes:
                        self.replay = None
                    else:
                        self.replay.append(chunk)
                if ack:
                    down.ack(ack, self.sid)
                if end:
                    self.up_sent_end = True
            if to_up:
                up.blocked[self] = None
            elif self.client_ended and not self.up_sent_end:
                if self.client_trailers is not None:
                    conn.send_headers(uid, self.client_trailers, end_stream=True)
                else:
                    conn.end_stream(uid)
                self.up_sent_end = True
        except h2.exceptions.StreamClosedError:
            # The backend already closed its side; what is left for it is moot.
            self.up_sent_end = True
            for item in to_up:
                if item[1]:
                    down.ack(item[1], self.sid)
            to_up.clear()
        up.mark()

    # ------------------------------------------------------------------------------ backend -> proxy

    def up_headers(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        if self.obs is not None:
            self.obs.first_byte()
        self.response_started = True
        self.replay = None
        if ended:
            self.grpc_status = status_of(headers)
        down = self.down
        try:
            down.conn.send_headers(self.sid, headers, end_stream=ended)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._backend_side_done()
            return
        self.headers_sent = True
        down.mark()
        if ended:
            self._finish(remove_down=True)

    def up_data(self, data: bytes, flow_len: int) -> None:
        """Queue response bytes; the connection flushes every touched call once per read, so the DATA
        frames of one read (often one gRPC message each) leave as few, larger frames."""
        self.response_started = True
        self.replay = None
        if self.state == _DONE:
            if self.up is not None:
                self.up.conn.acknowledge_received_data(flow_len, self.uid)
            return
        if self.obs is not None:
            self.obs.record.bytes_out += len(data)
        self.to_down.append([data, flow_len])

    def up_trailers(self, trailers: list[tuple[bytes, bytes]]) -> None:
        self.grpc_status = status_of(trailers)
        self.down_trailers = trailers
        self.down_end = True
        self.flush_down()

    def up_ended(self) -> None:
        # END_STREAM with trailers was handled by up_trailers; a bare END_STREAM after DATA means the
        # backend ended without trailers (not valid gRPC, but pass it on as it is).
        if not self.down_end:
            self.down_end = True
            self.flush_down()

    def up_reset(self, code: int) -> None:
        if self.state == _DONE:
            return
        if code == _REFUSED and not self.response_started:
            self.up_lost(f"backend {self.backend} refused the stream", refused=True)
            return
        self._detach_up()
        self.failure = Outcome.STREAM_FAILURE if self.response_started else Outcome.RESET
        self.fail(UNAVAILABLE, f"backend {self.backend} reset the stream (HTTP/2 error {int(code)})")

    def up_lost(self, reason: str, refused: bool) -> None:
        """The backend connection died (or refused the stream) under this call."""
        if self.state == _DONE:
            return
        self._detach_up()
        if not self.response_started:
            self.failure = Outcome.RESET
            self._retry_or_fail(reason)
        else:
            self.failure = Outcome.STREAM_FAILURE
            self.fail(UNAVAILABLE, reason)

    def _detach_up(self) -> None:
        if self.up is not None:
            self.up.release(self.uid)
            self.up = None

    def _retry_or_fail(self, reason: str) -> None:
        """The attempt failed before any response byte: route the call again, excluding the backends
        tried, if the shared retry policy (`retries:` -- failure kinds, attempts, budget) allows it."""
        ctx = self.ctx
        lease = self.lease
        if (self.ext is None or self.replay is None or not ctx.options.retry_on_connect_failure
                or lease is None or self.attempts is None):
            self.fail(UNAVAILABLE, reason)
            return
        outcome = self.failure or Outcome.RESET
        delay = self.attempts.retry(RetryableFailure(outcome, None), lease.tried)
        if delay is None:
            self.fail(UNAVAILABLE, reason)
            return
        # The failed attempt ends here and is accounted to its backend, as an HTTP attempt is: the status
        # the client would have got (UNAVAILABLE) and the failure for outlier detection.
        lease.status = http_status_for(UNAVAILABLE)
        lease.outcome = outcome
        lease.finish()
        if self.obs is not None:
            self.obs.attempt_failed(grpc_status=UNAVAILABLE, error=outcome.value)
        self.lease = None
        ctx.router.metrics.error("grpc_retry")
        summary = self.summary
        assert summary is not None
        self.failure = None
        self.backend = None
        # Sent bytes go again, ahead of what was still queued; they were acknowledged already.
        for chunk in reversed(self.replay):
            self.to_up.appendleft([chunk, 0])
        self.replay = []
        self.replay_bytes = 0
        self.up_sent_end = False
        self.state = _WAIT_CONN
        ctx.retried += 1
        self.retry_reason = reason
        log.info("retrying call %s (request %s) on another backend: %s", self.path, self.request_id, reason)
        if delay > 0:
            self.timer = asyncio.get_running_loop().call_later(delay, self._retry_now)
        else:
            self._pick(summary)

    def _retry_now(self) -> None:
        self.timer = None
        if self.state != _DONE and self.summary is not None:
            try:
                self._pick(self.summary)
            except Exception as exc:
                self.internal_error(exc)

    def flush_down(self) -> None:
        down = self.down
        if self.state == _DONE:
            return
        if down.paused:
            down.blocked[self] = None
            return
        conn = down.conn
        sid = self.sid
        to_down = self.to_down
        up = self.up
        ended = False
        try:
            while to_down:
                window = conn.local_flow_control_window(sid)
                if window <= 0:
                    break
                chunk, ack = take(to_down, min(window, conn.max_outbound_frame_size))
                end = not to_down and self.down_end and self.down_trailers is None
                conn.send_data(sid, chunk, end_stream=end)
                ended = end
                if ack and up is not None:
                    up.conn.acknowledge_received_data(ack, self.uid)
                    up.mark()
            if to_down:
                down.blocked[self] = None
            elif self.down_end:
                if self.down_trailers is not None:
                    conn.send_headers(sid, self.down_trailers, end_stream=True)
                elif not ended:
                    conn.end_stream(sid)
                down.mark()
                self._finish(remove_down=True)
                return
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._backend_side_done()
            return
        down.mark()

    def _backend_side_done(self) -> None:
        """The client stream is gone while the backend still talks: stop the backend stream."""
        if self.up is not None:
            self.up.reset(self.uid, _CANCEL)
            self.up = None
        self._finish(remove_down=True)

    # ---------------------------------------------------------------------------------------- ending

    def fail(self, code: int, message: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """End the client stream with a gRPC status (trailers-only when nothing was sent yet); `extra`
        trailers go with it."""
        if self.state == _DONE:
            return
        if self.pool is not None and self.up is None:
            self.pool.cancel_wait(self)
        if self.up is not None:
            self.up.reset(self.uid, _CANCEL)
            self.up = None
        self.grpc_status = code
        status = [(b"grpc-status", str(code).encode()), (b"grpc-message", grpc_message(message)), *extra]
        down = self.down
        try:
            if not self.headers_sent:
                down.conn.send_headers(self.sid, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                                  *status], end_stream=True)
                self.headers_sent = True
                self.to_down.clear()
            else:
                # Deliver what the backend already sent, then the status.
                self.down_trailers = status
                self.down_end = True
                self.flush_down()
                if self.state != _DONE and self.to_down:
                    return  # flush_down finishes the call once the client has taken the data
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        down.mark()
        self._finish(remove_down=True)

    def internal_error(self, exc: BaseException) -> None:
        """A fault in the proxy while handling this call (a bug, a routing policy that raised): the call
        ends with INTERNAL and one log line; its connection, the other calls and the process go on."""
        log.error("internal error in call %s (request %s): %s: %s", self.path, self.request_id,
                  type(exc).__name__, exc)
        if self.state == _DONE:
            return
        try:
            self.fail(INTERNAL, f"internal proxy error: {type(exc).__name__}")
            return
        except Exception:  # the call's own state is broken: take it apart by hand, each step on its own
            pass
        self.state = _DONE
        for timer in (self.timer, self.deadline):
            if timer is not None:
                timer.cancel()
        self.timer = self.deadline = None
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.status = http_status_for(INTERNAL)
            try:
                lease.finish()
            except Exception:
                log.error("could not account call %s (request %s)", self.path, self.request_id)
        if self.up is not None:
            try:
                self.up.reset(self.uid, _CANCEL)
            except Exception:
                pass
            self.up = None
        self.down.calls.pop(self.sid, None)
        try:
            self.down.conn.reset_stream(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        except Exception:
            pass
        self.down.mark()

    def _finish(self, remove_down: bool) -> None:
        if self.state == _DONE:
            return
        self.state = _DONE
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.admission is not None:
            self.admission.cancel()
            self.admission = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        lease = self.lease
        if lease is not None:
            # One accounting for every protocol (Lease.finish): the HTTP equivalent of the grpc-status,
            # how the backend failed the call if it did, and whether the ending was the client's choice.
            self.lease = None
            code = self.grpc_status
            lease.status = http_status_for(code)
            lease.outcome = self.failure
            lease.client_chosen = code in CLIENT_CHOSEN
            lease.finish()
            self.backend = None
        if self.up is not None:
            self.up.blocked.pop(self, None)
            self.up.release(self.uid)
            self.up = None
        self.down.blocked.pop(self, None)
        if self.obs is not None:
            self.obs.finish(200, self.grpc_status, None if self.failure is None else self.failure.value)
        if remove_down:
            self.down.calls.pop(self.sid, None)
            # Anything the client sent that was never forwarded still counts against its windows.
            for item in self.to_up:
                if item[1]:
                    self.down.ack(item[1], self.sid)
            self.to_up.clear()


def _header(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    key = name.encode()
    for n, v in headers:
        if n == key:
            return v.decode("latin-1")
    return None


def take(queue: collections.deque[list[Any]], limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes from the front of a [bytes, unacknowledged length] queue, joined into one
    chunk, and how many flow-controlled bytes handing it on releases. A chunk cut short keeps its
    unacknowledged rest (padding included) with the bytes left behind."""
    item = queue[0]
    data = item[0]
    size = len(data)
    if size >= limit:
        if size == limit:
            queue.popleft()
            return data, item[1]
        item[0] = data[limit:]
        ack = min(limit, item[1])
        item[1] -= ack
        return data[:limit], ack
    queue.popleft()
    ack = item[1]
    if not queue:
        return data, ack
    parts = [data]
    while queue:
        item = queue[0]
        data = item[0]
        room = limit - size
        if len(data) <= room:
            parts.append(data)
            size += len(data)
            ack += item[1]
            queue.popleft()
        else:
            if room > 0:
                parts.append(data[:room])
                item[0] = data[room:]
                part = min(room, item[1])
                item[1] -= part
                ack += part
            break
    return b"".join(parts), ack
