"""The access log: JSON lines with every field, for each protocol; sampling, rate limit, batching, text."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from proxy.config import ConfigError, parse_config
from proxy.core.decision import Reason
from proxy.core.hotspots import HotspotConfig
from proxy.observability.access_log import FILE_CHUNK, MAX_BACKLOG_BYTES, PIPE_BUF, LineSink, chunk_size
from proxy.observability.config import AccessLogConfig, LoggingConfig
from proxy.observability.logs import JsonFormatter, configure_logging
from proxy.observability.observer import Observer
from proxy.observability.record import GRPC, H2, HTTP1, PROTOCOLS, RequestRecord

from tests.observability.helpers import Clock, make_observer, record

FIELDS = ("time", "started", "request_id", "trace_id", "client", "protocol", "method", "path", "model", "adapter", "session",
          "policy", "reason", "backend", "attempts", "status", "grpc_status", "error", "ttft_s", "duration_s",
          "prompt_tokens", "cached_tokens", "bytes_in", "bytes_out", "load_score", "inflight",
          "kv_holder", "kv_cached")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_json_line_per_request_carries_every_field(protocol):
    clock = Clock()
    obs, out = make_observer(clock)
    obs.on_finish(record(1, protocol=protocol, adapter="sql-lora"))
    (line,) = out.json()
    assert tuple(line) == FIELDS
    assert line["time"] == clock.now and line["protocol"] == protocol
    assert line["request_id"] == "req-1" and line["trace_id"] == f"{1:032x}" and line["client"] == "127.0.0.1:50000"
    assert line["backend"] == "gpu-0" and line["policy"] == "affinity" and line["reason"] == "prefix_hit"
    assert line["model"] == "llama" and line["adapter"] == "sql-lora" and line["session"] == "s1"
    assert line["prompt_tokens"] == 120 and line["cached_tokens"] == 64 and line["attempts"] == 1
    assert line["bytes_in"] == 900 and line["bytes_out"] == 4000
    assert line["ttft_s"] == pytest.approx(0.1) and line["duration_s"] == pytest.approx(0.5)
    if protocol == GRPC:
        assert line["path"] == "/affinity.v1.Generation/Generate" and line["grpc_status"] == 0
    else:
        assert line["path"] == "/v1/chat/completions" and line["grpc_status"] is None


def test_a_record_stamped_by_the_lifecycle_keeps_its_time_and_unknowns_are_null():
    clock = Clock()
    obs, out = make_observer(clock)
    obs.on_finish(RequestRecord(request_id="r", time=123.5, status=400, error="invalid_request"))
    (line,) = out.json()
    assert line["time"] == 123.5 and line["backend"] is None and line["ttft_s"] is None
    assert line["error"] == "invalid_request" and line["status"] == 400


def test_failed_counts_5xx_and_grpc_server_codes_only():
    assert RequestRecord(request_id="a", status=502).failed
    assert not RequestRecord(request_id="a", status=404).failed
    assert RequestRecord(request_id="a", status=200, protocol=GRPC, grpc_status=14).failed  # UNAVAILABLE
    assert not RequestRecord(request_id="a", status=200, protocol=GRPC, grpc_status=3).failed  # INVALID_ARGUMENT


def test_sampling_is_even_and_errors_are_always_logged():
    clock = Clock()
    obs, out = make_observer(clock, AccessLogConfig(sample_ratio=0.25, flush_interval_s=0.0))
    for i in range(400):
        obs.on_finish(record(i, status=500 if i % 50 == 0 else 200))
    lines = out.json()
    errors = [l for l in lines if l["status"] == 500]
    assert len(errors) == 8
    assert len(lines) - len(errors) == pytest.approx(392 * 0.25, abs=1)
    assert obs.access_log.sampled_out == 400 - len(lines)


def test_rate_limit_drops_lines_past_the_limit_and_says_how_many():
    clock = Clock(1000.0)
    obs, out = make_observer(clock, AccessLogConfig(max_lines_per_s=10, flush_interval_s=0.0))
    for i in range(30):
        clock.now = 1000.0 + i * 0.02  # 30 requests within one second
        obs.on_finish(record(i))
    clock.now = 1001.2
    obs.on_finish(record(99))
    lines = out.json()
    assert [l.get("request_id") for l in lines[:10]] == [f"req-{i}" for i in range(10)]
    assert lines[10] == {"time": 1001.2, "event": "access_log_rate_limited", "dropped": 20, "max_lines_per_s": 10}
    assert lines[11]["request_id"] == "req-99"
    assert obs.access_log.rate_limited == 20


def test_lines_are_batched_below_pipe_buf_and_on_line_boundaries():
    clock = Clock()
    obs, out = make_observer(clock, AccessLogConfig(flush_interval_s=60.0))
    for i in range(100):
        obs.on_finish(record(i))
    assert out.chunks, "a full batch is written without waiting for the interval"
    assert all(len(c) <= PIPE_BUF and c.endswith(b"\n") for c in out.chunks)
    obs.close()
    assert [l["request_id"] for l in out.json()] == [f"req-{i}" for i in range(100)]


def test_quiet_proxy_flushes_after_the_interval():
    clock = Clock(50.0)
    obs, out = make_observer(clock, AccessLogConfig(flush_interval_s=1.0))
    obs.on_finish(record(1))  # the first write flushes (nothing flushed yet)
    clock.now = 50.5
    obs.on_finish(record(2))
    assert len(out.lines) == 1
    clock.now = 51.6
    obs.on_finish(record(3))
    assert len(out.lines) == 3


def test_file_sink_appends(tmp_path):
    path = tmp_path / "access.log"
    sink = LineSink.open(str(path), flush_interval_s=0.0)
    sink.write_line(b'{"a":1}\n', 1.0)
    sink2 = LineSink.open(str(path), flush_interval_s=0.0)
    sink2.write_line(b'{"a":2}\n', 1.0)
    assert [json.loads(l) for l in path.read_text().splitlines()] == [{"a": 1}, {"a": 2}]


def test_a_regular_file_takes_batches_of_64_kib_and_a_pipe_of_pipe_buf(tmp_path):
    """A regular file is written in 64 KiB batches of whole lines (one O_APPEND write each: several
    workers' lines never mix); a pipe keeps PIPE_BUF, its atomic size. (With 4 KiB batches to a file, ~8
    lines a write cost ~4% CPU per request on sockets; loadtest/results/peers.md, Round 5.)"""
    path = tmp_path / "access.log"
    sink = LineSink.open(str(path), flush_interval_s=60.0)
    line = b'{"request_id":"%06d","pad":"' + b"x" * 480 + b'"}\n'
    sink.write_line(line % 0, 1.0)  # the first line flushes (nothing flushed yet)
    for i in range(1, 40):  # ~20 KiB: past PIPE_BUF, not past FILE_CHUNK
        sink.write_line(line % i, 1.0)
    assert len(path.read_bytes()) == len(line % 0), "still batching: 39 lines wait for the next flush"
    for i in range(40, 200):  # ~100 KiB: at least one full batch goes out
        sink.write_line(line % i, 1.0)
    written = path.read_bytes()
    assert len(written) >= FILE_CHUNK and written.endswith(b"\n")
    sink.flush(2.0)
    assert [json.loads(x)["request_id"] for x in path.read_text().splitlines()] == [f"{i:06d}" for i in range(200)]
    read_end, write_end = os.pipe()
    try:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            assert (chunk_size(fd), chunk_size(write_end)) == (FILE_CHUNK, PIPE_BUF)
        finally:
            os.close(fd)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_text_format_is_logfmt():
    clock = Clock(7.0)
    obs, out = make_observer(clock, fmt="text")
    obs.on_finish(record(1, path='/v1/odd "path"', adapter=None, reason=Reason.HASH))
    (line,) = out.lines
    assert " reason=hash " in line
    assert line.startswith("time=7.0 started=- request_id=req-1 ")
    assert 'path="/v1/odd \\"path\\""' in line and "adapter=- " in line and "backend=gpu-0" in line


def test_access_log_off_writes_nothing_but_windows_still_fill():
    clock = Clock()
    obs, out = make_observer(clock, AccessLogConfig(enabled=False))
    obs.on_finish(record(1))
    assert obs.access_log is None and out.chunks == []
    assert obs.heatmap()["metrics"]["requests"][0][-1] == 1


def test_json_formatter_for_application_logs(capsys):
    import io
    stream = io.StringIO()
    handler = configure_logging(LoggingConfig(format="json"), "info", stream)
    try:
        logging.getLogger("proxy.test").warning("backend %s slow", "gpu-1", extra={"backend": "gpu-1"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("proxy.test").exception("failed")
    finally:
        logging.getLogger().removeHandler(handler)
    first, second = [json.loads(l) for l in stream.getvalue().splitlines() if l.startswith("{")][:2]
    assert first["level"] == "warning" and first["logger"] == "proxy.test"
    assert first["message"] == "backend gpu-1 slow" and first["backend"] == "gpu-1"
    assert isinstance(first["time"], float)
    assert second["level"] == "error" and "RuntimeError: boom" in second["exc"]
    text = io.StringIO()
    handler = configure_logging(LoggingConfig(format="text"), "info", text)
    try:
        logging.getLogger("proxy.test").info("plain")
    finally:
        logging.getLogger().removeHandler(handler)
    assert text.getvalue().rstrip().endswith("INFO proxy.test: plain")
    assert JsonFormatter().format(logging.LogRecord("x", logging.INFO, "", 0, "m %s", (object(),), None))


BACKEND = "backends: [{name: b0, url: 'http://127.0.0.1:9'}]\n"


def test_config_sections_parse_with_defaults_and_errors():
    cfg = parse_config(BACKEND)
    assert cfg.logging.format == "json" and cfg.logging.access_log.enabled
    assert cfg.hotspots.windows == 3 and cfg.hotspots.latency_rise == 2.0
    cfg = parse_config(BACKEND + "logging: {format: text, access_log: {sample_ratio: 0.1, max_lines_per_s: 500}}\n"
                       "hotspots: {windows: 5, metric: e2e}\n")
    assert cfg.logging.format == "text" and cfg.logging.access_log.sample_ratio == 0.1
    assert cfg.logging.access_log.max_lines_per_s == 500 and cfg.hotspots.windows == 5
    with pytest.raises(ConfigError) as exc:
        parse_config(BACKEND + "logging: {format: xml, access_log: {sample_ratio: 2}}\nhotspots: {min_baseline_windows: 40}\n")
    text = str(exc.value)
    assert "logging.format (line 2)" in text and "logging.access_log.sample_ratio (line 2): must be <= 1" in text
    assert "hotspots.min_baseline_windows" in text


def test_a_path_that_is_not_utf8_is_logged_with_replacement_characters():
    # Found by loadtest/fuzz http1: a request target's raw bytes are decoded with surrogateescape, and
    # msgspec refused the surrogates, so the access log raised inside the request's finish.
    clock = Clock()
    obs, out = make_observer(clock)
    bad = record(1)
    bad.path = b"/v1/\xff\xfe".decode("utf-8", "surrogateescape")
    obs.on_finish(bad)
    obs.on_finish(record(2))
    first, second = out.json()
    assert first["path"] == "/v1/\ufffd\ufffd" and first["request_id"] == "req-1"
    assert second["request_id"] == "req-2"


def test_a_pipe_nobody_reads_never_blocks_the_writer(tmp_path):
    # Issue 18's soak hang: the proxy's stdout was a pipe its parent stopped reading; once the pipe was full
    # the access log's blocking write froze the event loop (every request, health check and admin call).
    # Now what the pipe does not take waits in a bounded backlog, the rest is dropped and counted, and the
    # lines that do come through are whole and in order.
    fifo = tmp_path / "access.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader exists, and never reads while we write
    sink = LineSink.open(str(fifo), flush_interval_s=0.0)
    pad = "x" * 180
    total = 2 * (MAX_BACKLOG_BYTES + (1 << 16)) // 200  # well past the pipe (64 KiB) and the backlog
    finished = threading.Event()

    def write_all() -> None:
        for i in range(total):
            sink.write_line(json.dumps({"i": i, "pad": pad}).encode() + b"\n", float(i))
        finished.set()

    writer = threading.Thread(target=write_all, daemon=True)
    writer.start()
    blocked = not finished.wait(30)
    received = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(reader, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            received.extend(chunk)

    drain()  # (also frees a writer blocked in os.write, so that a failing run ends)
    writer.join(10)
    assert not blocked, "the access log's write blocked on a pipe nobody reads"
    assert 0 < sink.dropped < total
    for _ in range(1000):  # the reader catches up: the backlog goes out at the next flushes
        sink.flush(None)
        drain()
        if not sink._backlog:
            break
    os.close(reader)
    lines = [json.loads(line) for line in received.decode().splitlines()]  # whole lines only
    assert [line["i"] for line in lines] == list(range(len(lines)))  # in order: the newest were dropped
    assert len(lines) + sink.dropped == total
    assert len(lines) * 200 > MAX_BACKLOG_BYTES  # the backlog was kept, not thrown away


def test_dropped_lines_are_counted_in_the_metric():
    from prometheus_client import CollectorRegistry, generate_latest

    def full(data):
        return 0  # an output that takes nothing

    registry = CollectorRegistry()
    obs = Observer(LoggingConfig(access_log=AccessLogConfig(flush_interval_s=0.0)), HotspotConfig(), registry,
                   Clock(), sink=LineSink(full, 0.0, max_backlog_bytes=1000))
    for i in range(50):
        obs.on_finish(record(i))
    assert obs.access_log is not None and obs.access_log.dropped > 0
    text = generate_latest(registry).decode()
    assert f'affinity_proxy_access_log_lines_total{{outcome="dropped"}} {float(obs.access_log.dropped)}' in text


@pytest.mark.parametrize("body, expected", [
    (b'{"usage": {"prompt_tokens": 8, "completion_tokens": 6}}', (8, None)),
    (b'{"usage":{"prompt_tokens" :\r\n 12,"prompt_tokens_details":{"cached_tokens":\t3}}}', (12, 3)),
    (b'data: {"usage": {"prompt_tokens": 1}}\n\ndata: {"usage": {"prompt_tokens": 40}}\n\n', (40, None)),  # the last
    (b'{"prompt_tokens": -1, "cached_tokens": null}', (None, None)),
    (b'{"prompt_tokens":', (None, None)),
    (b'{"prompt_tokens": "7"}', (None, None)),
    (b'{"prompt_tokens": \xd9\xa3}', (None, None)),  # a non-ASCII digit is no number here
    (b'{"choices": []}', (None, None)),
])
def test_usage_is_read_off_the_answer_bytes(body: bytes, expected: tuple[int | None, int | None]) -> None:
    from proxy.observability.lifecycle import usage_of

    assert usage_of(body) == expected
