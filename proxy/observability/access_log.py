"""The access log: one line per finished request, cheap enough to stay on under load.

It bypasses the `logging` module on purpose: a `Logger.info` call with a formatter and a handler costs
several µs before any byte is written, more than the whole line should (the target is <= 5 µs a request).
A `RequestRecord` is encoded straight into a shared buffer by msgspec (no dict built per request) and the
buffer goes to the file descriptor in batches that never exceed PIPE_BUF and always end on a line
boundary, so the lines of several worker processes writing to one pipe never interleave mid-line.
"""

from __future__ import annotations

import copy

import enum
import os
import select
from typing import Callable, Literal

import msgspec

from proxy.observability.config import AccessLogConfig
from proxy.observability.record import RequestRecord

# Writes of at most PIPE_BUF bytes to a pipe are atomic (POSIX); 4096 on Linux.
PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
_FIELDS = RequestRecord.__struct_fields__


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LineSink:
    """Whole lines to a file descriptor, batched: flushed when the next line would pass PIPE_BUF or when
    `flush_interval_s` has passed since the last flush (checked on each write: a quiet proxy's last lines
    wait for the next request, `flush()` or `close()`)."""

    def __init__(self, write: Callable[[bytes], None], flush_interval_s: float = 1.0) -> None:
        self._write = write
        self._interval = flush_interval_s
        self._buf = bytearray()
        self._last_flush = float("-inf")

    @classmethod
    def open(cls, path: str | None, flush_interval_s: float = 1.0) -> "LineSink":
        """Standard output for None, else the file at `path` opened for appending (created if missing)."""
        fd = 1 if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return cls(lambda data: _write_all(fd, data), flush_interval_s)

    @property
    def buffer(self) -> bytearray:
        return self._buf

    def commit(self, start: int, now: float) -> None:
        """The bytes after `start` in `buffer` form one new line: write out what must go."""
        buf = self._buf
        if len(buf) > PIPE_BUF and start > 0:
            self._write(bytes(buf[:start]))  # everything before this line, then keep the line for later
            del buf[:start]
        if len(buf) >= PIPE_BUF or now - self._last_flush >= self._interval:
            self.flush(now)

    def write_line(self, line: bytes, now: float) -> None:
        start = len(self._buf)
        self._buf += line
        self.commit(start, now)

    def flush(self, now: float | None = None) -> None:
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            self._write(data)
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
        forced = self._always_errors and record.failed
        if self._ratio < 1.0 and not forced:
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
            if self._in_second >= self._limit and not forced:
                self._suppressed += 1
                self.rate_limited += 1
                return
            self._in_second += 1
        sink = self._sink
        if self._json:
            buf = sink.buffer
            start = len(buf)
            try:
                self._encoder.encode_into(record, buf, -1)
            except UnicodeEncodeError:
                # A client's raw bytes that are not UTF-8 (a path or header decoded with surrogateescape,
                # found by loadtest/fuzz http1): logged with U+FFFD in their place, never a crash.
                del buf[start:]
                self._encoder.encode_into(_printable(record), buf, -1)
            buf += b"\n"
            sink.commit(start, now)
        else:
            sink.write_line(self._text(record), now)
        self.written += 1

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
