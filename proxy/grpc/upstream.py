"""Backend-facing HTTP/2 connections: many streams per connection, another connection when full.

A backend's connections live in a `BackendPool`. A call takes the first connection that has received
the backend's SETTINGS (so its MAX_CONCURRENT_STREAMS is known, instead of guessing and being refused) and
has a free stream slot; when none has, the pool opens another connection, up to
`grpc.max_connections_per_backend`, rather than queueing calls behind one connection's limit. Calls that
arrive while a connection is being opened wait for it in order.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
from typing import Any, Callable

import h2.events
import h2.exceptions

from proxy.grpc.connection import FastData, FastWindow, Flusher, H2Side
from proxy.grpc.streams import BackendStream
from proxy.tls import ClientTls, describe_tls_error, grpc_host_port

log = logging.getLogger(__name__)


class Upstream(H2Side):
    """One HTTP/2 connection to one backend."""

    def __init__(self, pool: "BackendPool") -> None:
        super().__init__(pool.flusher, client_side=True)
        self.pool = pool
        self.ready = False  # the backend's SETTINGS arrived
        self.in_setup = True  # counted in the pool's `connecting` until ready or dead
        self.goaway = False  # no new streams (GOAWAY received or closing)
        # Liveness and idleness, read by the pools' sweeper (`Pools.sweep`); the hot path only sets a flag
        # and bumps a counter, the sweeper turns them into times.
        self.heard = False  # some frame arrived since the last sweep
        self.opened = 0  # streams opened so far
        self.last_heard = 0.0
        self.ping_sent = 0.0  # when the outstanding PING went out; 0 = none outstanding
        self.idle_since = 0.0  # when the sweeper first saw it without calls; 0 = busy
        self.opened_seen = 0
        self._touched: dict[BackendStream, None] = {}  # calls given response data during this read
        self._handlers: dict[type, Callable[[Any], None]] = {
            FastData: self._on_data,
            h2.events.DataReceived: self._on_data,
            h2.events.ResponseReceived: self._on_response,
            h2.events.TrailersReceived: self._on_trailers,
            h2.events.StreamEnded: self._on_ended,
            h2.events.WindowUpdated: self._on_window,
            FastWindow: self._on_window,
            h2.events.StreamReset: self._on_reset,
            h2.events.RemoteSettingsChanged: self._on_settings,
            h2.events.ConnectionTerminated: self._on_terminated,
        }

    @property
    def capacity(self) -> int:
        return int(self.conn.remote_settings.max_concurrent_streams) - len(self.calls)

    @property
    def usable(self) -> bool:
        return self.ready and not self.goaway and not self.closed and self.capacity > 0

    # asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        opts = self.pool.options
        self.init_settings(opts.max_concurrent_streams, opts.stream_window_bytes, opts.connection_window_bytes)
        self.mark()

    def data_received(self, data: bytes) -> None:
        self.heard = True
        try:
            events = self.receive(data)
        except h2.exceptions.ProtocolError as err:
            log.warning("backend %s: HTTP/2 protocol error: %s", self.pool.name, err)
            self._fail(f"protocol error from backend {self.pool.name}")
            return
        handlers = self._handlers
        for ev in events:
            handler = handlers.get(type(ev))
            if handler is not None:
                try:
                    handler(ev)
                except Exception as exc:  # one call's fault ends that call, not the backend connection
                    call = self.calls.get(getattr(ev, "stream_id", 0))
                    if call is None:
                        raise
                    call.internal_error(exc)
        touched = self._touched
        if touched:
            self._touched = {}
            for call in touched:
                try:
                    call.flush_down()
                except Exception as exc:
                    call.internal_error(exc)
        self.mark()

    # One method per h2 event class (the table is built in __init__); other events need nothing.

    def _on_data(self, ev: Any) -> None:
        call = self.calls.get(ev.stream_id)
        if call is None:
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        else:
            call.up_data(ev.data, ev.flow_controlled_length)
            self._touched[call] = None

    def _on_response(self, ev: h2.events.ResponseReceived) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.up_headers(ev.headers, ev.stream_ended is not None)

    def _on_trailers(self, ev: h2.events.TrailersReceived) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.up_trailers(ev.headers)

    def _on_ended(self, ev: h2.events.StreamEnded) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.up_ended()

    def _on_window(self, ev: h2.events.WindowUpdated) -> None:
        if ev.stream_id == 0:
            self.unblock()
        else:
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.flush_up()

    def _on_reset(self, ev: h2.events.StreamReset) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            call.up_reset(ev.error_code)

    def _on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
        if not self.ready:
            self.ready = True
            self.pool.connection_ready(self)
        else:
            # A changed initial window may have opened every stream's window.
            self.unblock()
            self.pool.capacity_changed()

    def _on_terminated(self, ev: h2.events.ConnectionTerminated) -> None:
        self.goaway = True
        last = ev.last_stream_id
        self.pool.discard(self)
        for sid, call in list(self.calls.items()):
            if last is None or sid > last:
                # Never processed by the backend: safe to send elsewhere.
                call.up_lost(f"backend {self.pool.name} refused the stream (GOAWAY)", refused=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        reason = f"connection to backend {self.pool.name} lost"
        if exc is not None:
            reason += f": {exc}"
        for call in list(self.calls.values()):
            call.up_lost(reason, refused=False)
        self.calls.clear()

    def flush_call(self, call: BackendStream) -> None:
        call.flush_up()

    def _fail(self, reason: str) -> None:
        for call in list(self.calls.values()):
            call.up_lost(reason, refused=False)
        self.calls.clear()
        self.pool.discard(self)
        if self.transport is not None:
            self.transport.abort()

    # used by calls -----------------------------------------------------------------------------------

    def open_stream(self, call: BackendStream, headers: list[tuple[bytes, bytes]]) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, headers)
        self.calls[sid] = call
        self.opened += 1
        self.mark()
        return sid

    def release(self, sid: int) -> None:
        if self.calls.pop(sid, None) is not None:
            self.pool.capacity_changed()

    def reset(self, sid: int, code: int) -> None:
        try:
            self.conn.reset_stream(sid, code)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        self.mark()
        self.release(sid)

    def sweep(self, now: float) -> None:
        """Keepalive and idle reaping, once per sweeper tick (see `GrpcOptions` for the knobs)."""
        opts = self.pool.options
        if self.heard:
            self.heard = False
            self.last_heard = now
            self.ping_sent = 0.0
        if self.calls or self.opened != self.opened_seen:
            self.opened_seen = self.opened
            self.idle_since = 0.0
        elif not self.idle_since:
            self.idle_since = now
        if self.ping_sent and now - self.ping_sent >= opts.ping_timeout_s:
            log.warning("backend %s: no answer to a PING within %g s; dropping the connection",
                        self.pool.name, opts.ping_timeout_s)
            self._fail(f"backend {self.pool.name} stopped answering (no PING answer within "
                       f"{opts.ping_timeout_s:g} s)")
            return
        if self.calls:
            if (opts.ping_interval_s and not self.ping_sent and self.last_heard
                    and now - self.last_heard >= opts.ping_interval_s):
                try:
                    self.conn.ping(b"affinity")
                except h2.exceptions.ProtocolError:
                    return
                self.ping_sent = now
                self.mark()
        elif opts.idle_timeout_s and self.idle_since and now - self.idle_since >= opts.idle_timeout_s:
            self.pool.discard(self)
            self.close()

    def close(self) -> None:
        self.goaway = True
        if self.transport is not None and not self.closed:
            try:
                self.conn.close_connection()
                self.write_out()
            except h2.exceptions.ProtocolError:
                pass
            self.transport.close()


class BackendPool:
    """The HTTP/2 connections to one backend address."""

    def __init__(self, name: str, address: str, options: "PoolOptions", flusher: Flusher,
                 tls: tuple[ssl.SSLContext, str | None] | None = None) -> None:
        """`address`: host:port (h2c) or grpcs://host:port, whose `tls` context and SNI name are given."""
        self.name = name
        self.host, self.port = grpc_host_port(address)
        self.ssl = tls[0] if tls is not None else None
        self.server_hostname = ((tls[1] if tls is not None else None) or self.host) if self.ssl else None
        self.address = address
        self.options = options
        self.flusher = flusher
        self.conns: list[Upstream] = []
        self.connecting = 0
        self.waiters: collections.deque[BackendStream] = collections.deque()
        self.closed = False

    def take(self) -> Upstream | None:
        """A connection with a free stream slot, or None (the caller then waits via `wait`)."""
        for up in self.conns:
            if up.usable:
                return up
        return None

    def wait(self, call: BackendStream) -> None:
        self.waiters.append(call)
        self._maybe_connect()

    def cancel_wait(self, call: BackendStream) -> None:
        try:
            self.waiters.remove(call)
        except ValueError:
            pass

    def _maybe_connect(self) -> None:
        if self.closed or not self.waiters:
            return
        # One connection being opened serves every waiter it has room for; open more only past that.
        if self.connecting == 0 and len(self.conns) < self.options.max_connections_per_backend:
            self.connecting += 1
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: Upstream(self), self.host, self.port, ssl=self.ssl,
                                       server_hostname=self.server_hostname),
                self.options.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as err:
            self.connecting -= 1
            why = describe_tls_error(err) or err or type(err).__name__
            reason = f"cannot connect to backend {self.name} at {self.address}: {why}"
            waiters, self.waiters = self.waiters, collections.deque()
            for call in waiters:
                call.connect_failed(reason)
            return
        # `connection_ready` (on the backend's SETTINGS) adds the connection and serves waiters.

    def connection_ready(self, up: Upstream) -> None:
        up.in_setup = False
        up.last_heard = asyncio.get_running_loop().time()
        self.connecting -= 1
        if self.closed:
            up.close()
            return
        self.conns.append(up)
        self.capacity_changed()

    def capacity_changed(self) -> None:
        while self.waiters:
            up = self.take()
            if up is None:
                self._maybe_connect()
                return
            self.waiters.popleft().attach(up)

    def discard(self, up: Upstream) -> None:
        if up in self.conns:
            self.conns.remove(up)
        if up.in_setup:
            # It died before its SETTINGS: it was still counted as connecting.
            up.in_setup = False
            self.connecting -= 1
            waiters, self.waiters = self.waiters, collections.deque()
            for call in waiters:
                call.connect_failed(f"connection to backend {self.name} closed during setup")
        else:
            self.capacity_changed()

    def close(self) -> None:
        self.closed = True
        for up in list(self.conns):
            up.close()
        self.conns.clear()


class PoolOptions:
    """The pool's knobs, copied out of `GrpcOptions` / `TimeoutsConfig` once."""

    __slots__ = (
        "max_concurrent_streams",
        "stream_window_bytes",
        "connection_window_bytes",
        "max_connections_per_backend",
        "connect_timeout_s",
        "ping_interval_s",
        "ping_timeout_s",
        "idle_timeout_s",
    )

    def __init__(
        self,
        max_concurrent_streams: int,
        stream_window_bytes: int,
        connection_window_bytes: int,
        max_connections_per_backend: int,
        connect_timeout_s: float,
        ping_interval_s: float = 0.0,
        ping_timeout_s: float = 20.0,
        idle_timeout_s: float = 0.0,
    ) -> None:
        self.max_concurrent_streams = max_concurrent_streams
        self.stream_window_bytes = stream_window_bytes
        self.connection_window_bytes = connection_window_bytes
        self.max_connections_per_backend = max_connections_per_backend
        self.connect_timeout_s = connect_timeout_s
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.idle_timeout_s = idle_timeout_s

    @property
    def sweep_every_s(self) -> float | None:
        """How often the sweeper looks: a quarter of the shortest knob in use (within 50 ms .. 5 s), so
        an idle connection or a missing PING answer is acted on within 25% of its limit."""
        knobs = [k for k in (self.ping_interval_s, self.idle_timeout_s) if k]
        if self.ping_interval_s:
            knobs.append(self.ping_timeout_s)
        if not knobs:
            return None
        return min(5.0, max(0.05, min(knobs) / 4))


class Pools:
    """Every backend's pool, keyed by backend name; an address change (reload) replaces the pool."""

    def __init__(self, options: PoolOptions, flusher: Flusher, tls: ClientTls | None = None) -> None:
        """`tls`: the contexts of grpcs:// backends (proxy/upstream/factory.py `backend_tls`)."""
        self.options = options
        self.flusher = flusher
        self.tls = tls if tls is not None else ClientTls(lambda key: None)
        self._pools: dict[str, BackendPool] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the keepalive/idle sweeper (when PINGs or idle reaping are configured)."""
        every = self.options.sweep_every_s
        if every is not None and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(every), name="grpc-upstream-sweeper")

    async def _sweep(self, every: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            self.sweep(loop.time())

    def sweep(self, now: float) -> None:
        for pool in list(self._pools.values()):
            for up in list(pool.conns):
                up.sweep(now)

    def get(self, name: str, address: str) -> BackendPool:
        pool = self._pools.get(name)
        if pool is None or pool.address != address:
            if pool is not None:
                pool.close()
            pool = self._pools[name] = BackendPool(name, address, self.options, self.flusher,
                                                   self.tls.for_grpc(address))
        return pool

    def prune(self, keep: Callable[[str], bool]) -> None:
        """Close the pools of backends no longer configured, once they carry no call (calls in flight
        to a removed backend finish; the next prune after them closes the pool)."""
        for name in [n for n in self._pools if not keep(n)]:
            pool = self._pools[name]
            if not pool.waiters and not any(up.calls for up in pool.conns):
                self._pools.pop(name).close()

    def all(self) -> list[BackendPool]:
        return list(self._pools.values())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
