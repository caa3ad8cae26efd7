"""A small HTTP/1.1 client made for relaying: pooled keep-alive connections per backend, one write per
request, and chunked responses passed through as the raw chunks the backend sent.

Why not aiohttp's client: profiling the proxy (loadtest/bench_proxy.py) put about half of its CPU per request
in `ClientSession.request` (request and response objects, header multidicts, timers, the connector's
bookkeeping, a StreamReader per response), and every SSE event took a task wake-up plus a de-chunk and a
re-chunk. Here a request is one pre-serialised `transport.write`, the response head is parsed once, a JSON
body is collected into one bytes object, and a stream of chunks goes from the upstream protocol's
`data_received` straight to the client's transport: complete chunks only (so a backend dying mid-chunk
never leaves the client with a torn chunk), no task switch per event, with back-pressure both ways.
The bytes are parsed by the sans-I/O codec in proxy/wire/http1.py (shared with the control plane's
scrape client); this module holds the connections, futures and writes around it.

The pool: per backend (scheme://host:port) a LIFO of idle connections, at most `connections_per_backend`
open, waiters queued FIFO. An idle connection is reused only within `keepalive_s` (kept below the
backends' own keep-alive, so the proxy never reuses one the server is closing) and a sweeper closes
expired ones, so a backend that went away keeps no ghost connections.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit

from multidict import CIMultiDict

from proxy.metrics import UpstreamCounters
from proxy.upstream.errors import (
    UpstreamConnectError, UpstreamError, UpstreamProtocolError, UpstreamReset, UpstreamTimeout,
)
from proxy.upstream.headers import HOP_BY_HOP
# Its MAX_HEAD (64 KiB) is the most status line + headers accepted from a backend.
from proxy.wire.http1 import (
    CHUNKED, CONTENT_LENGTH, Data, EndOfMessage, Event, ProtocolError, RawChunks, Response, ResponseParser,
)

_WRITE_HIGH_WATER = 256 * 1024  # pause reading the backend while the client has this much unsent
# Response fields that stop at the proxy (RFC 9110 7.6.1) or that it re-computes (framing).
_NOT_FORWARDED = frozenset(n.encode() for n in HOP_BY_HOP) | {b"content-length"}
_NOT_FORWARDED_LENGTHS = frozenset(map(len, _NOT_FORWARDED))  # most names need no lower() to be let through


class Backend:
    """Where one base URL's connections live."""

    __slots__ = ("key", "host", "port", "host_header", "idle", "open", "waiters", "ssl", "server_hostname")

    def __init__(self, url: str, tls: tuple[ssl.SSLContext, str | None] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// backends are supported by the relay pool, got {url!r}")
        self.key = url
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        # https://: the backend's context (built once, proxy/tls.py) and SNI name (the URL's host by default).
        self.ssl = tls[0] if tls is not None else (ssl.create_default_context() if parts.scheme == "https" else None)
        self.server_hostname = (tls[1] if tls is not None else None) or (self.host if self.ssl else None)
        self.host_header = parts.netloc.encode("latin-1")
        self.idle: deque[_Connection] = deque()
        self.open = 0
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()


class _Connection(asyncio.Protocol):
    __slots__ = ("pool", "backend", "transport", "exchange", "idle_since", "closed", "forgotten")

    def __init__(self, pool: UpstreamPool, backend: Backend) -> None:
        self.pool = pool
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.closed = False
        self.forgotten = False  # its pool slot was given back

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # create_connection gives a Transport; the protocol API types it BaseTransport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # a backend talking out of turn: the connection cannot be trusted any more
            self.close()
            return
        ex.feed(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex = self.exchange
        if ex is not None:
            ex.connection_lost(exc)
        self.pool._forget(self)

    def pause_writing(self) -> None:  # requests are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()


class Exchange:
    """One request/response on one connection. Created and driven by `UpstreamPool.request`.

    `await wait_head()` gives `status`, `raw_headers` (all of them) and `headers` (the end-to-end ones,
    ready to forward: hop-by-hop, Connection-named and framing fields removed); then either `await read()`
    for the whole body, or `relay_chunks(sink)` + `await wait_relay()` until `complete` for a chunked
    response whose raw chunks go to `sink`, or `stream()` for decoded body pieces (any framing).
    `release()` always, in a finally.

    The bytes are parsed by the sans-I/O `ResponseParser` (proxy/wire/http1.py); this class turns its events
    into futures, the pieces a reader waits for, and writes to the client's transport.
    """

    __slots__ = (
        "conn", "method_head", "status", "reason", "headers", "raw_headers", "chunked", "content_length",
        "keep_alive", "_parser", "_parts", "_raw_sink", "_piece_waiter",
        "_done", "_head_fut", "_error", "deadline", "_complete", "_sink_transport", "_paused", "_pieces", "_loop",
    )

    def __init__(self, conn: _Connection, head_only: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self._loop = loop
        self.method_head = head_only
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.chunked = False
        self.content_length: int | None = None
        self.keep_alive = True
        self._parser = ResponseParser(head_only)
        self._parts: list[bytes] = []
        self._raw_sink: Callable[[bytes], None] | None = None
        self._sink_transport: asyncio.Transport | None = None
        self._paused = False
        self._pieces: deque[bytes] | None = None
        self._piece_waiter: asyncio.Future[None] | None = None
        self._head_fut: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] | None = None  # made only if read() must wait for the body
        self._error: BaseException | None = None
        self.deadline = 0.0  # loop time after which the pool's sweep times the exchange out
        self._complete = False

    # ---------------------------------------------------------------- parsing (called from the protocol)

    def feed(self, data: bytes) -> None:
        if self._complete or self._error is not None:
            self.keep_alive = False  # bytes after the end: the backend is out of step, do not reuse
            return
        try:
            events = self._parser.feed(data)
        except ProtocolError as exc:
            self._on_events(exc.events)  # what came before the bad bytes still counts (e.g. earlier chunks)
            self._fail(UpstreamProtocolError(f"malformed response: {exc}"))
            return
        n = len(events)
        if n == 1:  # the usual read in a stream: one run of chunks, or one piece of body
            ev = events[0]
            kind = type(ev)
            if kind is RawChunks:
                self._raw_sink(ev.data)  # type: ignore[misc,union-attr]  # set with raw_chunks; kind says which
                return
            if kind is Data:
                self._emit(ev.data)  # type: ignore[union-attr]  # kind says which event it is
                return
        elif n == 3 and type(events[0]) is Response and type(events[1]) is Data and self._pieces is None:
            # The usual JSON answer: head, the whole body and the end in one read.
            self._parts.append(events[1].data)
            self._on_head(events[0])
            if type(events[2]) is EndOfMessage:
                self.keep_alive = self.keep_alive and self._parser.reusable  # nothing may follow the end
                self._finish()
                return
            self._on_events(events[2:])
            return
        self._on_events(events)

    def _on_events(self, events: list[Event]) -> None:
        for ev in events:
            kind = type(ev)
            if kind is Data:
                self._emit(ev.data)  # type: ignore[union-attr]  # kind says which event it is
            elif kind is Response:
                self._on_head(ev)  # type: ignore[arg-type]  # kind says which event it is
            elif kind is EndOfMessage:
                self.keep_alive = self.keep_alive and self._parser.reusable  # nothing may follow the end
                self._finish()
            elif kind is RawChunks:
                sink = self._raw_sink
                assert sink is not None
                sink(ev.data)  # type: ignore[union-attr]  # kind says which event it is
            # Informational (100 Continue, 103 Early Hints): skipped, the final answer follows.

    def _on_head(self, response: Response) -> None:
        self.status = response.status
        self.reason = response.reason.decode("latin-1")
        raw = self.raw_headers = response.headers
        headers = self.headers
        add = headers.add
        for name, value in raw:
            if len(name) not in _NOT_FORWARDED_LENGTHS or name.lower() not in _NOT_FORWARDED:
                add(name.decode("latin-1"), value.decode("latin-1"))
        named = response.connection
        if named:  # fields the Connection header names are hop-by-hop too
            for token in named:
                if token and token != b"close" and token != b"keep-alive":
                    headers.popall(token.decode("latin-1"), None)
        self.keep_alive = response.keep_alive
        framing = response.framing
        if framing is CHUNKED:
            self.chunked = True
        elif framing is CONTENT_LENGTH:
            self.content_length = response.content_length
        if not self._head_fut.done():
            self._head_fut.set_result(None)

    def _emit(self, piece: bytes) -> None:
        pieces = self._pieces
        if pieces is not None:
            pieces.append(piece)
            w = self._piece_waiter
            if w is not None and not w.done():
                w.set_result(None)
        else:
            self._parts.append(piece)

    def _finish(self) -> None:
        self._complete = True
        w = self._piece_waiter
        if w is not None and not w.done():
            w.set_result(None)
        done = self._done
        if done is not None and not done.done():
            done.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = exc
        for fut in (self._head_fut, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: whoever awaits it next re-raises it; nobody awaiting is fine
        w = self._piece_waiter
        if w is not None and not w.done():
            w.set_result(None)
        self.keep_alive = False
        self.conn.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._complete or self._error is not None:
            return
        try:
            self._on_events(self._parser.feed_eof())  # the end of a body delimited by the close
        except ProtocolError:
            pass
        if not self._complete:
            self._fail(UpstreamReset(f"backend closed the connection{': ' + str(exc) if exc else ''}"))

    def timeout(self) -> None:
        self._fail(UpstreamTimeout("upstream request timed out"))

    # ---------------------------------------------------------------- consumer side

    async def wait_head(self) -> None:
        await self._head_fut

    @property
    def head(self) -> asyncio.Future[None]:
        """Done when the response head arrived (awaiting it raises what failed the exchange before)."""
        return self._head_fut

    def body(self) -> bytes:
        """The whole (de-chunked) body of a `complete` exchange: `read()` without a coroutine."""
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        """The whole (de-chunked) body."""
        if not self._complete:
            if self._error is not None:
                raise self._error
            if self._done is None:
                self._done = self._loop.create_future()
            await self._done
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def relay_chunks(self, transport: asyncio.Transport) -> None:
        """Write this chunked response's complete raw chunks straight to `transport` from now on.

        The downstream response must itself be chunked (HTTP/1.1, headers already sent): the raw chunks are
        then valid framing there too; the terminating chunk is left for the caller's write_eof.
        """
        assert self.chunked
        self._sink_transport = transport
        self._raw_sink = self._write_down
        if self._parts:  # de-chunked pieces that arrived with the head: re-frame them once
            for part in self._parts:
                transport.write(b"%x\r\n%s\r\n" % (len(part), part))
            self._parts = []
        # From now on the parser hands over complete chunks as framed; a partial one it holds comes that way.
        self._parser.raw_chunks = True

    def _write_down(self, raw: bytes) -> None:
        t = self._sink_transport
        assert t is not None
        if t.is_closing():
            return
        t.write(raw)
        if not self._paused and t.get_write_buffer_size() > _WRITE_HIGH_WATER:
            self._paused = True
            up = self.conn.transport
            if up is not None:
                up.pause_reading()
            w = self._piece_waiter
            if w is not None and not w.done():
                w.set_result(None)

    @property
    def paused(self) -> bool:
        return self._paused

    async def wait_relay(self) -> None:
        """Until the relayed response completes, fails, or the client needs draining (check `paused`)."""
        if self._complete or self._paused:
            return
        # Read into a local each time: a test of the attribute itself would stay narrowed past the await
        # for mypy, and compiled code (proxy/native) enforces the narrowed type (None) on the second read.
        error = self._error
        if error is not None:
            raise error
        await self._next_piece()
        error = self._error
        if error is not None and not self._paused:
            raise error

    async def _next_piece(self) -> None:
        """Sleep until the protocol callbacks report progress (a piece, the end, an error, a pause)."""
        self._piece_waiter = self._loop.create_future()
        try:
            await self._piece_waiter
        finally:
            self._piece_waiter = None

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            up = self.conn.transport
            if up is not None and not self.conn.closed:
                up.resume_reading()

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stream(self) -> AsyncIterator[bytes]:
        """Decoded body pieces as they arrive (any framing); for clients that cannot take raw chunks."""
        pieces = self._pieces = deque(self._parts)
        self._parts = []
        return _Pieces(self, pieces)

    def release(self) -> None:
        """Return the connection to the pool if the exchange completed cleanly, else close it."""
        conn = self.conn
        conn.pool._live.discard(self)
        conn.exchange = None
        if self._complete and self._paused:
            self.resume()  # the last chunk tipped the client's buffer over the mark: the connection is still fine
        if self._complete and self.keep_alive and not conn.closed:
            conn.pool._put_idle(conn)
        else:
            conn.close()
            conn.pool._forget(conn)


class _Pieces:
    """`Exchange.stream()`: an async iterator class rather than an async generator, which mypyc cannot
    compile (proxy/native)."""

    __slots__ = ("exchange", "pieces")

    def __init__(self, exchange: Exchange, pieces: deque[bytes]) -> None:
        self.exchange = exchange
        self.pieces = pieces

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        pieces = self.pieces
        exchange = self.exchange
        while True:
            if pieces:
                return pieces.popleft()
            if exchange._complete:
                raise StopAsyncIteration
            if exchange._error is not None:
                raise exchange._error
            await exchange._next_piece()


class UpstreamPool:
    def __init__(
        self,
        counters: UpstreamCounters,
        *,
        connections_per_backend: int,
        keepalive_s: float,
        connect_timeout_s: float,
        request_timeout_s: float,
        tls: Callable[[str], tuple[ssl.SSLContext, str | None] | None] | None = None,
    ) -> None:
        """`tls(url)`: the SSLContext and SNI name of an https:// backend (proxy/upstream/factory.py)."""
        self.counters = counters
        self._tls = tls
        self.limit = connections_per_backend
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._backends: dict[str, Backend] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        # Exchanges in progress, timed out by one periodic check rather than a timer each: a timer per
        # request (call_later + cancel) costs more than the rest of the pool's work on it.
        self._live: set[Exchange] = set()
        self._deadline_check: asyncio.TimerHandle | None = None
        self._tick = min(1.0, max(0.01, request_timeout_s / 10))
        self._loop: asyncio.AbstractEventLoop | None = None

    def backend(self, url: str) -> Backend:
        b = self._backends.get(url)
        if b is None:
            b = self._backends[url] = Backend(url, self._tls(url) if self._tls is not None else None)
        return b

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="upstream-idle-sweeper")

    def _check_deadlines(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for ex in [e for e in self._live if e.deadline <= now]:
            self._live.discard(ex)
            ex.timeout()  # nothing happens to one that completed or failed already
        self._deadline_check = loop.call_later(self._tick, self._check_deadlines) if self._live else None

    async def close(self) -> None:
        self._closed = True
        if self._deadline_check is not None:
            self._deadline_check.cancel()
            self._deadline_check = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for b in self._backends.values():
            while b.idle:
                b.idle.pop().close()
            while b.waiters:
                w = b.waiters.popleft()
                if not w.done():
                    w.set_result(None)

    def close_idle(self, url: str) -> int:
        """Close the idle connections to a backend now (it was removed or drained); returns how many."""
        b = self._backends.get(url.rstrip("/"))
        if b is None:
            return 0
        n = len(b.idle)
        while b.idle:
            conn = b.idle.pop()
            conn.close()
        return n

    def idle_connections(self, url: str) -> int:
        b = self._backends.get(url.rstrip("/"))
        return 0 if b is None else len(b.idle)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s / 2)
            cutoff = time.monotonic() - self.keepalive_s
            for b in self._backends.values():
                # Idle connections are LIFO: the oldest are on the left.
                while b.idle and b.idle[0].idle_since < cutoff:
                    b.idle.popleft().close()

    def _idle_connection(self, b: Backend) -> _Connection | None:
        """The most recently used idle connection still fit for reuse, or None."""
        idle = b.idle
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.closed or now - conn.idle_since > self.keepalive_s:
                    conn.close()
                    continue
                return conn
        return None

    async def _acquire(self, b: Backend) -> _Connection:
        """A connection when none is idle: a new one, or the next one given back (FIFO) at the limit."""
        if b.open >= self.limit:
            waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
            b.waiters.append(waiter)
            try:
                conn_or_slot = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    handed = waiter.result()
                    if handed is not None:
                        self._put_idle(handed)  # pass the connection on to the next waiter
                    else:
                        self._wake_slot(b)  # pass the free slot on
                raise
            if conn_or_slot is not None:
                return conn_or_slot
            if self._closed:
                raise UpstreamConnectError("the upstream pool is closed")
            # A slot was freed (a connection closed): open a new one below.
        b.open += 1
        try:
            conn = await self._connect(b)
        except BaseException:
            b.open -= 1
            self._wake_slot(b)
            raise
        return conn

    async def _connect(self, b: Backend) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, b), b.host, b.port, ssl=b.ssl,
                                       server_hostname=b.server_hostname), self.connect_timeout_s
            )
        except asyncio.TimeoutError:
            raise UpstreamConnectError(f"connect to {b.host}:{b.port} timed out") from None
        except ssl.SSLError as exc:  # before OSError, its base: a certificate from another CA, a bad handshake
            reason = (f"certificate verify failed: {exc.verify_message}"
                      if isinstance(exc, ssl.SSLCertVerificationError) else exc.reason)
            raise UpstreamConnectError(
                f"TLS handshake with {b.host}:{b.port} failed: {reason or exc}") from exc
        except OSError as refused:
            raise UpstreamConnectError(
                f"cannot connect to {b.host}:{b.port}: {refused.strerror or refused}") from refused
        self.counters.new_connections += 1
        return conn

    def _put_idle(self, conn: _Connection) -> None:
        b = conn.backend
        while b.waiters:
            w = b.waiters.popleft()
            if not w.done():
                w.set_result(conn)
                return
        conn.idle_since = time.monotonic()
        b.idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: free its slot (once)."""
        if conn.forgotten:
            return
        conn.forgotten = True
        b = conn.backend
        try:
            b.idle.remove(conn)
        except ValueError:
            pass
        b.open -= 1
        self._wake_slot(b)

    def _wake_slot(self, b: Backend) -> None:
        while b.waiters:
            w = b.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def request(self, url: str, head: bytes, body: bytes, *, head_only: bool = False) -> Exchange:
        """Send `head` (request line + headers, ending in a blank line) and `body` to the backend at `url`;
        returns once the response head arrived. The caller must `release()` the exchange."""
        b = self._backends.get(url)
        if b is None:
            b = self.backend(url)
        conn = self._idle_connection(b)  # the usual case: no coroutine for the checkout
        if conn is None:
            conn = await self._acquire(b)
        ex = self._start(conn, head, body, head_only)
        try:
            await ex._head_fut
        except BaseException:
            ex.release()
            raise
        return ex

    def send(self, url: str, head: bytes, body: bytes, *, head_only: bool = False) -> Exchange | None:
        """`request` without a coroutine, for the usual case: with an idle connection to `url`, send on it
        and return the exchange at once (await `ex.head` for the response head; `release()` it always);
        None when no connection is idle (then `await request(...)`, which may connect or wait)."""
        b = self._backends.get(url)
        if b is None:
            b = self.backend(url)
        conn = self._idle_connection(b)
        if conn is None:
            return None
        return self._start(conn, head, body, head_only)

    def _start(self, conn: _Connection, head: bytes, body: bytes, head_only: bool) -> Exchange:
        loop = self._loop
        if loop is None:  # known from the first request: get_running_loop costs a getpid() on 3.11
            loop = self._loop = asyncio.get_running_loop()
        ex = Exchange(conn, head_only, loop)
        conn.exchange = ex
        ex.deadline = loop.time() + self.request_timeout_s
        self._live.add(ex)
        if self._deadline_check is None:
            self._deadline_check = loop.call_later(self._tick, self._check_deadlines)
        assert conn.transport is not None
        conn.transport.write(head + body if body else head)
        return ex
