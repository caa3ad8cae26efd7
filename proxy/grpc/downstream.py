"""One client HTTP/2 connection on the gRPC listener: h2 events in, dispatched to the stream they belong to.

gRPC requests (content-type application/grpc...) become relayed `Call`s (proxy/grpc/call.py); any other
request is a plain HTTP/2 request for the OpenAI pipeline (`HttpBridgeCall`, proxy/grpc/bridge.py). Each
h2 event class maps to one method in one table, as grpclib's EventsProcessor does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import h2.errors
import h2.events
import h2.exceptions
import hyperframe.frame

from proxy.grpc.bridge import HttpBridgeCall
from proxy.grpc.call import Call
from proxy.grpc.connection import FastData, FastWindow, H2Side, RepeatDecoder, ResponseEncoder
from proxy.grpc.context import RelayContext
from proxy.wire.grpc import CANCELLED, UNAVAILABLE

log = logging.getLogger(__name__)

_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
_INTERNAL = h2.errors.ErrorCodes.INTERNAL_ERROR
_CANCEL = h2.errors.ErrorCodes.CANCEL
_MAX_SWEEP_S = 5.0  # idle connections and streams are looked at least this often (when those timeouts are on)


class Downstream(H2Side):
    """One client HTTP/2 connection on the gRPC listener."""

    def __init__(self, ctx: RelayContext) -> None:
        super().__init__(ctx.flusher, client_side=False)
        # Nothing was encoded or decoded yet: the same state as h2's own coders.
        self.conn.encoder = ResponseEncoder()
        decoder = RepeatDecoder()
        decoder.max_header_list_size = self.conn.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.conn.decoder.max_allowed_table_size
        self.conn.decoder = decoder
        self.ctx = ctx
        self.calls: dict[int, Call] = {}
        self.others: dict[int, HttpBridgeCall] = {}  # non-gRPC requests (HTTP bridge), by stream id
        self.holding: list[Call] = []  # calls that started holding during the current read
        self.draining = False
        self._touched: dict[Call, None] = {}  # calls given client data during the current read
        # Client timeouts (grpc.client_*_timeout_s): when the client last sent anything, whether its preface
        # (SETTINGS) is in, when each plain HTTP/2 request last got body bytes, and the one timer that
        # checks them.
        self.now = time.monotonic()
        self.last_read = self.now
        self.prefaced = False
        self._peer: tuple[str | None] | None = None
        self._bridge_touched: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {
            FastData: self._on_data,
            h2.events.DataReceived: self._on_data,
            h2.events.RequestReceived: self._on_request,
            h2.events.StreamEnded: self._on_ended,
            h2.events.WindowUpdated: self._on_window,
            FastWindow: self._on_window,
            h2.events.StreamReset: self._on_reset,
            h2.events.TrailersReceived: self._on_trailers,
            h2.events.RemoteSettingsChanged: self._on_settings,
            h2.events.ConnectionTerminated: self._on_terminated,
        }

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        opts = self.ctx.options
        self.init_settings(opts.max_concurrent_streams, opts.stream_window_bytes, opts.connection_window_bytes)
        self.ctx.downstreams.add(self)
        self.mark()
        self._timer = asyncio.get_running_loop().call_later(opts.client_preface_timeout_s, self._preface_check)

    # ------------------------------------------------------------------------------------ client timeouts

    def _preface_check(self) -> None:
        if self.closed:
            return
        if not self.prefaced:
            log.info("client %s sent no HTTP/2 preface within %g s: closing", self.peer(),
                     self.ctx.options.client_preface_timeout_s)
            if self.transport is not None:
                self.transport.close()
            return
        self._arm_sweep()

    def _arm_sweep(self) -> None:
        opts = self.ctx.options
        limits = [t for t in (opts.client_idle_timeout_s, opts.client_stream_idle_timeout_s) if t > 0]
        if not limits or self.closed:
            self._timer = None
            return
        self._timer = asyncio.get_running_loop().call_later(min(min(limits) / 4, _MAX_SWEEP_S), self._sweep)

    def _sweep(self) -> None:
        """Idle connection and silent streams (see GrpcOptions.client_*_timeout_s)."""
        if self.closed:
            return
        opts = self.ctx.options
        now = time.monotonic()
        stream_idle = opts.client_stream_idle_timeout_s
        if stream_idle > 0:
            for call in [c for c in self.calls.values()
                         if not c.client_ended and not c.response_started and now - c.touched_at > stream_idle]:
                call.fail(CANCELLED, f"the client sent nothing on this stream for {stream_idle:g} s")
            for sid in [s for s, t in self._bridge_touched.items() if now - t > stream_idle]:
                self._bridge_touched.pop(sid, None)
                other = self.others.get(sid)
                if other is None or other.body_complete:
                    continue
                del self.others[sid]
                log.info("client %s: HTTP/2 request on stream %d sent no body for %g s: reset", self.peer(), sid,
                         stream_idle)
                other.client_reset()
                try:
                    self.conn.reset_stream(sid, _CANCEL)
                except h2.exceptions.ProtocolError:
                    pass
                self.mark()
        idle = opts.client_idle_timeout_s
        if idle > 0 and not self.calls and not self.others and now - self.last_read > idle:
            log.info("client %s: HTTP/2 connection idle for %g s: closing", self.peer(), idle)
            self.goaway()
            self.flusher.run()
            if self.transport is not None:
                self.transport.close()
            return
        self._arm_sweep()

    def peer(self) -> str | None:
        if self._peer is None and self.transport is not None:  # asked for every request; it never changes
            peer = self.transport.get_extra_info("peername")
            self._peer = (peer[0] if peer else None,)
        return self._peer[0] if self._peer is not None else None

    def ack(self, n: int, sid: int) -> None:
        try:
            self.conn.acknowledge_received_data(n, sid)
        except h2.exceptions.ProtocolError:
            return
        self.mark()

    def data_received(self, data: bytes) -> None:
        self.now = self.last_read = time.monotonic()
        try:
            events = self.receive(data)
        except h2.exceptions.ProtocolError as err:
            log.info("client HTTP/2 protocol error: %s", err)
            self.mark()
            self.flusher.run()
            if self.transport is not None:
                self.transport.close()
            return
        handlers = self._handlers
        for ev in events:
            handler = handlers.get(type(ev))
            if handler is not None:
                try:
                    handler(ev)
                except Exception as exc:  # one stream's fault: that stream ends, the connection goes on
                    self.stream_fault(getattr(ev, "stream_id", 0), exc)
        touched = self._touched
        if touched:
            self._touched = {}
            for call in touched:
                try:
                    call.flush_up()
                except Exception as exc:
                    call.internal_error(exc)
        if self.holding:
            for call in self.holding:
                call.arm_timer()
            self.holding.clear()
        self.mark()

    def stream_fault(self, sid: int, exc: Exception) -> None:
        """An exception while handling one stream's event (a bug, a policy that raised): end that stream
        alone with a protocol-shaped error (gRPC INTERNAL; RST_STREAM INTERNAL_ERROR for a bridged HTTP/2
        request) and one log line. An exception raised outside any stream is a fault of the connection."""
        call = self.calls.get(sid)
        if call is not None:
            call.internal_error(exc)
            return
        log.error("internal error on client HTTP/2 stream %d: %s: %s", sid, type(exc).__name__, exc)
        self.others.pop(sid, None)
        if sid:
            try:
                self.conn.reset_stream(sid, _INTERNAL)
            except h2.exceptions.ProtocolError:
                pass
        else:
            # Connection-level state is suspect: end this connection only, politely.
            self.close()

    def _stream(self, sid: int) -> Call | HttpBridgeCall | None:
        call = self.calls.get(sid)
        return call if call is not None else self.others.get(sid)

    # One method per h2 event class (the table is built in __init__); other events need nothing.

    def _on_data(self, ev: Any) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.touched_at = self.now
            call.client_data(ev.data, ev.flow_controlled_length, ev.stream_ended is not None)
            self._touched[call] = None
            return
        other = self.others.get(ev.stream_id)
        if other is not None:
            self._bridge_touched[ev.stream_id] = self.now
            other.client_data(ev.data, ev.flow_controlled_length)
        else:
            self.ack(ev.flow_controlled_length, ev.stream_id)

    def _on_request(self, ev: h2.events.RequestReceived) -> None:
        self._request(ev.stream_id, ev.headers, ev.stream_ended is not None)

    def _on_ended(self, ev: h2.events.StreamEnded) -> None:
        self._bridge_touched.pop(ev.stream_id, None)
        stream = self._stream(ev.stream_id)
        if stream is not None:
            stream.client_end()

    def _on_window(self, ev: h2.events.WindowUpdated) -> None:
        if ev.stream_id == 0:
            self.unblock()
            return
        stream = self._stream(ev.stream_id)
        if stream is not None:
            stream.flush_down()

    def _on_reset(self, ev: h2.events.StreamReset) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.client_reset()
            return
        other = self.others.pop(ev.stream_id, None)
        self._bridge_touched.pop(ev.stream_id, None)
        if other is not None:
            other.client_reset()

    def _on_trailers(self, ev: h2.events.TrailersReceived) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.client_trailers_received(ev.headers)

    def _on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
        self.prefaced = True  # the client's first SETTINGS completes its connection preface
        self.unblock()

    def _on_terminated(self, ev: h2.events.ConnectionTerminated) -> None:
        if not self.calls and not self.others and self.transport is not None:
            self.write_out()
            self.transport.close()

    def _request(self, sid: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        if self.draining:
            try:
                self.conn.reset_stream(sid, _REFUSED)  # the client may retry it on a new connection
            except h2.exceptions.ProtocolError:
                pass
            return
        path = b""
        content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
        ctx = self.ctx
        if not content_type.startswith(b"application/grpc"):
            self.others[sid] = HttpBridgeCall(ctx.openai, self, sid, headers, ended)
            if not ended:
                self._bridge_touched[sid] = self.now
            return
        path_s = path.decode("utf-8", "replace")
        ext = None if path_s.startswith(ctx.local_prefixes) else ctx.registry.for_method(path_s)
        call = Call(ctx, self, self.holding, sid, headers, path_s, ext)
        self.calls[sid] = call
        call.start(ended)

    def flush_call(self, call: Any) -> None:
        call.flush_down()  # a relayed Call or an HttpBridgeCall

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._bridge_touched.clear()
        self.ctx.downstreams.discard(self)
        for call in list(self.calls.values()):
            call.client_reset()
        self.calls.clear()
        for other in list(self.others.values()):
            other.client_reset()
        self.others.clear()

    def goaway(self) -> None:
        """Graceful drain: tell the client to open no new streams while the open ones finish.

        h2's own `close_connection` moves its state machine to CLOSED, after which the streams still in
        flight could not be answered; so the GOAWAY frame is written beside it.
        """
        if self.transport is None or self.closed or self.draining:
            return
        self.draining = True
        self.write_out()
        frame = hyperframe.frame.GoAwayFrame(0)
        frame.last_stream_id = self.conn.highest_inbound_stream_id
        frame.error_code = 0
        self.transport.write(frame.serialize())

    def expire_calls(self, message: str) -> None:
        """The drain deadline passed: every gRPC call still open ends UNAVAILABLE with `message`."""
        for call in list(self.calls.values()):
            try:
                call.fail(UNAVAILABLE, message)
            except Exception as exc:
                call.internal_error(exc)
        self.mark()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            try:
                self.conn.close_connection()
                self.write_out()
            except h2.exceptions.ProtocolError:
                pass
            self.transport.close()


__all__ = ["Downstream"]
