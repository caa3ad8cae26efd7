"""One client HTTP/2 connection on the gRPC listener: h2 events in, dispatched to the stream they belong to.

gRPC requests (content-type application/grpc...) become relayed `Call`s (proxy/grpc/call.py); any other
request is a plain HTTP/2 request for the OpenAI pipeline (`HttpBridgeCall`, proxy/grpc/bridge.py). Each
h2 event class maps to one method in one table, as grpclib's EventsProcessor does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import h2.errors
import h2.events
import h2.exceptions
import hyperframe.frame

from proxy.grpc.bridge import HttpBridgeCall
from proxy.grpc.call import Call
from proxy.grpc.connection import FastData, H2Side
from proxy.grpc.context import RelayContext

log = logging.getLogger(__name__)

_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
_INTERNAL = h2.errors.ErrorCodes.INTERNAL_ERROR


class Downstream(H2Side):
    """One client HTTP/2 connection on the gRPC listener."""

    def __init__(self, ctx: RelayContext) -> None:
        super().__init__(ctx.flusher, client_side=False)
        self.ctx = ctx
        self.calls: dict[int, Call] = {}
        self.others: dict[int, HttpBridgeCall] = {}  # non-gRPC requests (HTTP bridge), by stream id
        self.holding: list[Call] = []  # calls that started holding during the current read
        self.draining = False
        self._touched: dict[Call, None] = {}  # calls given client data during the current read
        self._handlers: dict[type, Callable[[Any], None]] = {
            FastData: self._on_data,
            h2.events.DataReceived: self._on_data,
            h2.events.RequestReceived: self._on_request,
            h2.events.StreamEnded: self._on_ended,
            h2.events.WindowUpdated: self._on_window,
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

    def peer(self) -> str | None:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return peer[0] if peer else None

    def ack(self, n: int, sid: int) -> None:
        try:
            self.conn.acknowledge_received_data(n, sid)
        except h2.exceptions.ProtocolError:
            return
        self.mark()

    def data_received(self, data: bytes) -> None:
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
            call.client_data(ev.data, ev.flow_controlled_length, ev.stream_ended is not None)
            self._touched[call] = None
            return
        other = self.others.get(ev.stream_id)
        if other is not None:
            other.client_data(ev.data, ev.flow_controlled_length)
        else:
            self.ack(ev.flow_controlled_length, ev.stream_id)

    def _on_request(self, ev: h2.events.RequestReceived) -> None:
        self._request(ev.stream_id, ev.headers, ev.stream_ended is not None)

    def _on_ended(self, ev: h2.events.StreamEnded) -> None:
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
        if other is not None:
            other.client_reset()

    def _on_trailers(self, ev: h2.events.TrailersReceived) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.client_trailers_received(ev.headers)

    def _on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
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

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            try:
                self.conn.close_connection()
                self.write_out()
            except h2.exceptions.ProtocolError:
                pass
            self.transport.close()


__all__ = ["Downstream"]
