"""The access log: one line per finished request, cheap enough to stay on under load.

It bypasses the `logging` module on purpose: a `Logger.info` call with a formatter and a handler costs
several µs before any byte is written, more than the whole line should (the target is <= 5 µs a request).
A `RequestRecord` is encoded straight into a shared buffer by msgspec (no dict built per request) and the
buffer goes to the file descriptor in batches that never exceed PIPE_BUF (64 KiB for a regular file) and always end on a line
boundary, so the lines of several worker processes writing to one pipe never interleave mid-line.

Writing never blocks the event loop. The log goes to standard output by default, and a pipe whose reader
stops reading (a stalled log shipper, a parent that reads one line and no more, a pager left open) fills in
64 KiB: a blocking write would then freeze every request, health check and admin call of the process. A
pipe, socket or terminal is written only while poll() says it takes more; what it does not take waits, up
to `MAX_BACKLOG_BYTES` of whole lines, for the next flush, and lines beyond that are dropped and counted
(`LineSink.dropped`, the `dropped` outcome of `affinity_proxy_access_log_lines`). A regular file is written
as before (poll() always says it is writable).
"""

from __future__ import annotations

import copy

import enum
import os
import select
import stat
from typing import Callable, Literal

import msgspec

from proxy.observability.config import AccessLogConfig
from proxy.observability.record import RequestRecord

# Writes of at most PIPE_BUF bytes to a pipe are atomic (POSIX); 4096 on Linux.
PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
_FIELDS = RequestRecord.__struct_fields__


# Lines an output that does not drain may hold back before new ones are dropped (per process).
MAX_BACKLOG_BYTES = 1 << 20

Write = Callable[[bytes | bytearray], "int | None"]


# A regular file takes bigger batches: an O_APPEND write of whole lines is one append whatever its size (the
# kernel holds the file's lock for the whole write), so several workers' lines never mix, and one write per
# ~120 lines instead of per ~8 is ~4 µs less CPU per request on sockets (loadtest/results/peers.md, Round 5).
FILE_CHUNK = 64 * 1024


def chunk_size(fd: int) -> int:
    """How many bytes one write to `fd` may carry: FILE_CHUNK for a regular file, else PIPE_BUF (a pipe's
    atomic size: a pipe, a socket, a terminal, a character device)."""
    try:
        return FILE_CHUNK if stat.S_ISREG(os.fstat(fd).st_mode) else PIPE_BUF
    except OSError:
        return PIPE_BUF


def _fd_writer(fd: int, chunk: int = PIPE_BUF) -> Callable[[bytes | bytearray], int]:
    """A write to `fd` that never blocks on a full pipe/socket: it writes chunks of at most `chunk` bytes
    (PIPE_BUF for a pipe: atomic, a chunk is never split and never mixed with another process's) ending on a
    line boundary while poll() reports room for one, and returns how many bytes went out."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)

    def write(data: bytes | bytearray) -> int:
        done, size = 0, len(data)
        with memoryview(data) as view:
            while done < size:
                if not poller.poll(0):
                    break  # no room: the caller keeps the rest (POLLERR/POLLHUP fall to os.write's error)
                end = min(done + chunk, size)
                if end < size:
                    cut = data.rfind(b"\n", done, end)
                    if cut >= 0:
                        end = cut + 1  # else one line longer than PIPE_BUF: written in pieces
                done += os.write(fd, view[done:end])
        return done

    return write


class LineSink:
    """Whole lines to a file descriptor, batched: flushed when the next line would pass `chunk` or when
    `flush_interval_s` has passed since the last flush (checked on each write: a quiet proxy's last lines
    wait for the next request, `flush()` or `close()`)."""

    def __init__(self, write: Write, flush_interval_s: float = 1.0,
                 max_backlog_bytes: int = MAX_BACKLOG_BYTES, chunk: int = PIPE_BUF) -> None:
        """`write(data)` returns how many bytes of `data` it wrote (None: all of them); the rest is kept, up
        to `max_backlog_bytes`, and offered again first at the next write or flush. `chunk`: the batch
        written at once (what one write of `write` may carry)."""
        self._write = write
        self._chunk = chunk
        self._interval = flush_interval_s
        self._buf = bytearray()
        self._last_flush = float("-inf")
        self._backlog = bytearray()  # bytes the output did not take yet (whole lines, but for a split long one)
        self._max_backlog = max_backlog_bytes
        self.dropped = 0  # lines dropped because the output did not drain

    @classmethod
    def open(cls, path: str | None, flush_interval_s: float = 1.0) -> "LineSink":
        """Standard output for None, else the file at `path` opened for appending (created if missing)."""
        fd = 1 if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        chunk = chunk_size(fd)
        return cls(_fd_writer(fd, chunk), flush_interval_s, chunk=chunk)

    def _out(self, data: bytes) -> None:
        backlog = self._backlog
        if backlog:
            if len(backlog) + len(data) > self._max_backlog:
                self.dropped += data.count(b"\n")
            else:
                backlog += data
            n = self._write(backlog)  # (no copy: the writer holds no view of it once it returns)
            del backlog[: len(backlog) if n is None else n]
            return
        n = self._write(data)
        if n is not None and n < len(data):
            backlog += data[n:]  # even above the cap: the rest of a line already begun must follow it

    @property
    def buffer(self) -> bytearray:
        return self._buf

    def commit(self, start: int, now: float) -> None:
        """The bytes after `start` in `buffer` form one new line: write out what must go."""
        buf = self._buf
        chunk = self._chunk
        if len(buf) > chunk and start > 0:
            self._out(bytes(buf[:start]))  # everything before this line, then keep the line for later
            del buf[:start]
        if len(buf) >= chunk or now - self._last_flush >= self._interval:
            self.flush(now)

    def write_line(self, line: bytes, now: float) -> None:
        start = len(self._buf)
        self._buf += line
        self.commit(start, now)

    def flush(self, now: float | None = None) -> None:
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            self._out(data)
        elif self._backlog:
            self._out(b"")
        if now is not None:
            self._last_flush = now


def _logfmt_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, enum.Enum):  # proxy.core.decision.Reason: its value, not "Reason.HASH"
        value = value.value
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\r\t'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


class AccessLog:
    """Sampling, the per-second line limit and the encoding of one record into its sink."""

    def __init__(self, config: AccessLogConfig, fmt: Literal["json", "text"], sink: LineSink) -> None:
        self.config = config
        self._sink = sink
        self._json = fmt == "json"
        self._encoder = msgspec.json.Encoder()
        self._ratio = config.sample_ratio
        self._credit = 0.0
        self._limit = config.max_lines_per_s
        self._always_errors = config.always_log_errors
        self._second = -1
        self._in_second = 0
        self._suppressed = 0  # rate-limited in the current second, reported when it ends
        # Counters exported to Prometheus by the Observer.
        self.written = 0
        self.sampled_out = 0
        self.rate_limited = 0

    def write(self, record: RequestRecord, now: float) -> None:
        forced: bool | None = None  # an error that is always logged; found out only where a line may be dropped
        if self._ratio < 1.0:
            forced = self._always_errors and record.failed
            if not forced:
                # Evenly spaced deterministic sampling: a credit that earns `ratio` per request.
                self._credit += self._ratio
                if self._credit < 1.0:
                    self.sampled_out += 1
                    return
                self._credit -= 1.0
        if self._limit is not None:
            second = int(now)
            if second != self._second:
                if self._suppressed:
                    self._summary(now)
                self._second, self._in_second = second, 0
            if self._in_second >= self._limit and not (
                    forced if forced is not None else self._always_errors and record.failed):
                self._suppressed += 1
                self.rate_limited += 1
                return
            self._in_second += 1
        sink = self._sink
        if self._json:
            buf = sink._buf
            start = len(buf)
            try:
                self._encoder.encode_into(record, buf, -1)
            except UnicodeEncodeError:
                # A client's raw bytes that are not UTF-8 (a path or header decoded with surrogateescape,
                # found by loadtest/fuzz http1): logged with U+FFFD in their place, never a crash.
                del buf[start:]
                self._encoder.encode_into(_printable(record), buf, -1)
            buf += b"\n"
            # `sink.commit(start, now)` only when it has something to do (a flush is due): most lines
            # just stay in the buffer.
            if len(buf) >= sink._chunk or now - sink._last_flush >= sink._interval:
                sink.commit(start, now)
        else:
            sink.write_line(self._text(record), now)
        self.written += 1

    @property
    def dropped(self) -> int:
        """Lines dropped because the output did not drain (a stalled pipe; see LineSink)."""
        return self._sink.dropped

    def _text(self, record: RequestRecord) -> bytes:
        line = " ".join(f"{name}={_logfmt_value(getattr(record, name))}" for name in _FIELDS) + "\n"
        return line.encode("utf-8", "replace")

    def _summary(self, now: float) -> None:
        n, self._suppressed = self._suppressed, 0
        if self._json:
            line = self._encoder.encode({"time": now, "event": "access_log_rate_limited", "dropped": n,
                                         "max_lines_per_s": self._limit}) + b"\n"
        else:
            line = f"time={now} event=access_log_rate_limited dropped={n} max_lines_per_s={self._limit}\n".encode()
        self._sink.write_line(line, now)

    def flush(self, now: float | None = None) -> None:
        if self._suppressed and now is not None and int(now) != self._second:
            self._summary(now)
        self._sink.flush(now)


def _printable(record: RequestRecord) -> RequestRecord:
    """A copy of `record` whose strings are valid UTF-8 (surrogates become U+FFFD)."""
    out = copy.copy(record)
    for name in _FIELDS:
        value = getattr(out, name)
        if isinstance(value, str):
            setattr(out, name, value.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    return out
