"""The fuzz targets, one per door, in one table (`TARGETS`). Each: `setup()` once, `one(data)` per input
(raises on a crash: an unexpected exception or a broken invariant), `seeds()` a starting corpus.

Imported inside `atheris.instrument_imports()` by loadtest/fuzz/__main__.py, so every proxy module they
import is coverage-instrumented; tests/hardening/test_fuzz_smoke.py runs each for a few seconds.
"""

from __future__ import annotations

import abc
import asyncio
import importlib.util
import json
import logging
import re
import socket
import struct
import threading
from typing import Any, Callable, ClassVar

import atheris

# ---------------------------------------------------------------------------------------- helpers


def _fdp_json(fdp: Any, depth: int = 0) -> Any:
    """A JSON value built from the input, biased towards what OpenAI bodies contain."""
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 6 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(4)
    if kind == 3:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if kind in (4, 5):
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40)) if kind == 4 else \
            fdp.PickValueInList(["user", "system", "assistant", "tool", "text", "image_url", "m", ""])
    if kind in (6, 7):
        return [_fdp_json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    keys = ["model", "messages", "prompt", "role", "content", "type", "text", "max_tokens", "n", "stream",
            "input", "user", "session_id", "temperature", "max_completion_tokens", "best_of", "tools",
            "stream_options", "include_usage", "image_url", "url", "name"]
    return {fdp.PickValueInList(keys) if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(6):
            _fdp_json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 6))}


class Target(abc.ABC):
    doc: ClassVar[str] = ""

    def setup(self) -> None:
        pass

    def seeds(self) -> list[bytes]:
        return []

    @abc.abstractmethod
    def one(self, data: bytes) -> None:
        """Run one input; raise (or let escape) what counts as a crash for this door."""


# ------------------------------------------------------------------------------------------ summary


class Summary(Target):
    doc = "OpenAI body -> RequestSummary (proxy/core/request.py summary_from_openai); only a 400 may come out"

    def setup(self) -> None:
        from proxy.core.request import RequestError, summary_from_openai
        from proxy.dataplane.openai import ROUTED_ENDPOINTS, parse_json

        self.summarise = summary_from_openai
        self.parse = parse_json
        self.rejected = RequestError
        self.paths = sorted(ROUTED_ENDPOINTS)

    def seeds(self) -> list[bytes]:
        return [json.dumps(b).encode() for b in (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "image_url", "image_url": {"url": "x"}}]}]},
            {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3, "stream": True},
            {"model": "m", "prompt": [1, 2, 3]}, {"model": "m", "input": ["x", "y"]},
            {"model": "m", "messages": [], "session_id": "s", "user": "u", "max_completion_tokens": 9})]

    def one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        path = self.paths[fdp.ConsumeIntInRange(0, len(self.paths) - 1)]
        mode = fdp.ConsumeIntInRange(0, 1)
        rest = fdp.ConsumeBytes(fdp.remaining_bytes())
        if mode == 0:
            try:
                body = self.parse(rest)
            except ValueError:  # not JSON, too deep: the pipeline's 400 invalid_json
                return
        else:
            body = _fdp_json(atheris.FuzzedDataProvider(rest))
        try:
            summary = self.summarise(path, body, session_key=None)
        except self.rejected:  # the pipeline's 400 invalid_value
            return
        assert isinstance(summary.prompt, str)
        assert isinstance(summary.prompt_tokens_est, int) and summary.prompt_tokens_est >= 0
        assert isinstance(summary.prompt_bytes, bytes)  # what the fingerprint hashes: must encode


# ------------------------------------------------------------------------------------------- config


class ConfigLoader(Target):
    doc = "YAML -> Config (proxy/config.py parse_config); only ConfigError may come out; dump round-trips"

    def setup(self) -> None:
        from proxy.config import ConfigError, dump_config, parse_config

        self.parse = parse_config
        self.dump = dump_config
        self.rejected = ConfigError

    def seeds(self) -> list[bytes]:
        return [s.encode() for s in (
            "backends:\n  - {name: a, url: 'http://127.0.0.1:8000', weight: 2}\n",
            "listen: {port: 8080}\nadmin: {port: 9090, token: x}\nrouting: {policy: affinity}\n"
            "backends:\n  - {name: a, url: 'http://h:1', grpc: 'h:2', models: [m]}\n  - {name: b, url: 'http://h:3'}\n",
            "discovery: {enabled: true}\nbackends: []\n",
            "grpc_listen: {port: 8081}\ngrpc:\n  extractors:\n    - {method: /a.B/C, kind: fields, prompt: [1]}\n"
            "backends:\n  - {name: a, url: 'http://h:1'}\n",
            "timeouts: {connect_s: .inf}\nbackends:\n  - {name: a, url: 'http://h:1', weight: .nan}\n",
            "overload: {action: queue}\nretries: {attempts: 3}\nhealth_checks: {interval_ms: 100}\n"
            "backends:\n  - {name: a, url: 'http://h:1'}\n",
        )]

    def one(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        try:
            config = self.parse(text)
        except self.rejected:
            return
        again = self.parse(self.dump(config))  # what check-config prints must load back, to the same value
        assert again == config, "dump_config does not round-trip"


# ----------------------------------------------------------------------------------------- response


class Response(Target):
    doc = "upstream HTTP/1.1 responses (proxy/wire/http1.py ResponseParser); any split gives the same events"

    def setup(self) -> None:
        from proxy.wire import http1

        self.http1 = http1

    def seeds(self) -> list[bytes]:
        return [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: application/json\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\nuntil close",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"a;ext=1\r\ndata: x\n\n\r\n0\r\n\r\n",
        ]

    def _run(self, parser_args: dict[str, Any], pieces: list[bytes], eof: bool) -> list[Any]:
        parser = self.http1.ResponseParser(**parser_args)
        events: list[Any] = []
        try:
            for piece in pieces:
                events.extend(parser.feed(piece))
            if eof:
                events.extend(parser.feed_eof())
        except self.http1.ProtocolError as exc:
            # What the bytes before the offending ones completed rides on the error (a consumer may
            # deliver it before failing): fed whole, that is all of it; fed in pieces, the earlier
            # pieces' events were returned already and the error carries only the last piece's.
            events.extend(exc.events)
            events.append(("error", type(exc).__name__))
        return _normalise(events)

    def one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        args = {"head_request": fdp.ConsumeBool()}
        raw = fdp.ConsumeBool()
        cuts = sorted({fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 4))})
        eof = fdp.ConsumeBool()
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
        whole = self._run(args, [body], eof)
        pieces, last = [], 0
        for c in cuts:
            c = min(c, len(body))
            pieces.append(body[last:c])
            last = c
        pieces.append(body[last:])
        split = self._run(args, pieces, eof)
        assert whole == split, f"split feeding differs: {whole!r} != {split!r}"
        if raw:
            parser = self.http1.ResponseParser(**args)
            parser.raw_chunks = True
            try:
                parser.feed(body)
            except self.http1.ProtocolError:
                pass


class RequestDiff(Target):
    doc = ("client HTTP/1.1 requests: the data path's parser (proxy/wire/http1_llhttp.py, llhttp) against the "
           "reference RequestParser (proxy/wire/http1.py); the same events, states and errors at any split")

    def setup(self) -> None:
        from loadtest.fuzz.differential import observe
        from proxy.wire import http1, http1_llhttp

        self.observe = observe
        self.reference = http1.RequestParser
        self.candidate = http1_llhttp.LlhttpRequestParser

    def seeds(self) -> list[bytes]:
        post = (b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                b"Content-Length: 7\r\n\r\n{\"a\":1}")
        # Parameter bytes: one read whole; one split in three, limit 100 bytes, then the end of the stream.
        return [params + w for params in (b"\x00\x00\x00", b"\x0d\x40\xc0") for w in (
            post,
            post + b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + post,
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
            b"5;e=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
            b"\r\nOPTIONS * HTTP/1.1\r\nConnection: close, Upgrade\r\nUpgrade: h2c\r\n\r\n",
            b"PROPFIND /a\xe9 HTTP/1.1\r\nX: caf\xe9 \t\r\nContent-Length: 1, 1\r\n\r\nz",
        )]

    def one(self, data: bytes) -> None:
        # Three bytes of parameters (read plainly, so a mutation of the request keeps them), then the wire.
        if len(data) < 3:
            return
        flags, a, b = data[0], data[1], data[2]
        wire = data[3:]
        max_head = (64 * 1024, 100, 30, 64 * 1024)[flags & 3]
        eof = bool(flags & 4)
        cuts = sorted({a * len(wire) // 256, b * len(wire) // 256}) if flags & 8 else []
        pieces = [wire[i:j] for i, j in zip([0, *cuts], [*cuts, len(wire)])]
        ref = self.observe(self.reference, pieces, max_head, eof)
        new = self.observe(self.candidate, pieces, max_head, eof)
        assert new == ref, f"the llhttp parser differs from the reference on {pieces!r}:\n{new!r}\n{ref!r}"


def _normalise(events: list[Any]) -> list[Any]:
    """Events with consecutive Data joined: how bytes are split into Data events is not a property."""
    out: list[Any] = []
    for ev in events:
        name = type(ev).__name__
        if name in ("Data", "RawChunks"):
            if out and isinstance(out[-1], list) and out[-1][0] == name:
                out[-1][1] += ev.data
            else:
                out.append([name, bytes(ev.data)])
        elif name in ("Response", "Informational"):
            out.append((name, ev.status, ev.reason, ev.http_version, tuple(ev.headers)))
        elif name == "EndOfMessage":
            out.append((name, tuple(ev.trailers)))
        else:
            out.append(ev)
    return [tuple(x) if isinstance(x, list) else x for x in out]


# ------------------------------------------------------------------------------------------ metrics


class Metrics(Target):
    doc = "metrics pages (proxy/control/scrape.py + adapters MetricsReader), every engine; nothing may raise"

    def setup(self) -> None:
        from proxy.control.adapters import ADAPTERS, MetricsReader

        self.readers = [MetricsReader()] + [MetricsReader(engine=e) for e in sorted(ADAPTERS)]

    def seeds(self) -> list[bytes]:
        return [s.encode() for s in (
            '# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} 1\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:kv_cache_usage_perc 0.25\n',
            'sglang:num_running_reqs{name="x"} 2\nsglang:num_queue_reqs 4\nsglang:token_usage 0.1\n',
            'nv_inference_pending_request_count{model="m",version="1"} 7\n',
            'tgi_queue_size 3\ntgi_batch_current_size 9\n',
            'lmcache:x{a="b\\"c",d="\\n"} NaN\nfoo +Inf 1700000000\nbar -1e308\n',
        )]

    def one(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        for reader in self.readers:
            reading = reader.read(text)
            for name in ("running", "waiting", "kv_usage"):
                value = getattr(reading, name, None)
                assert value is None or isinstance(value, (int, float)), (name, value)


# --------------------------------------------------------------------------------------------- h2


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.out += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(">I", sid & 0x7FFFFFFF) + payload


class H2(Target):
    doc = "client HTTP/2 + gRPC frames into proxy/grpc/downstream.py (fake transport); nothing escapes"

    def setup(self) -> None:
        import hpack

        from proxy.app import AffinityProxy
        from proxy.config import parse_config
        from proxy.grpc.downstream import Downstream

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.errors: list[str] = []
        self.loop.set_exception_handler(lambda loop, ctx: self.errors.append(str(ctx.get("exception") or ctx)))
        errors = self.errors

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                errors.append(record.getMessage())

        logging.getLogger("proxy.grpc").addHandler(Collect(logging.ERROR))
        logging.getLogger("affinity_proxy").addHandler(Collect(logging.ERROR))
        from sim.fleet import start_fleet

        self.fleet = self.loop.run_until_complete(start_fleet(1, grpc_port=0, speed=1000.0))
        s = self.fleet.servers[0]
        self.proxy = AffinityProxy(parse_config(
            "listen: {port: 0}\nadmin: {port: 0}\ngrpc_listen: {port: 0}\ntelemetry: {enabled: false}\n"
            "health_checks: {enabled: false}\ngrpc: {first_message_timeout_s: 0.001}\n"
            f"backends:\n  - {{name: s, url: '{s.url}', grpc: '{s.grpc_address}'}}\n"
            "  - {name: dead, url: 'http://127.0.0.1:9', grpc: '127.0.0.1:9'}\n"))
        self.loop.run_until_complete(self.proxy.start())
        assert self.proxy.grpc is not None and self.proxy.grpc.ctx is not None
        self.ctx = self.proxy.grpc.ctx
        self.Downstream = Downstream
        self.encoder = hpack.Encoder()
        paths = [b"/affinity.v1.Generation/Generate", b"/affinity.v1.Generation/GenerateStream",
                 b"/inference.GRPCInferenceService/ModelInfer", b"/grpc.health.v1.Health/Check",
                 b"/affinity.admin.v1.ProxyAdmin/SetWeight", b"/v1/chat/completions", b"/x.Y/Z"]
        self.paths = paths

    def seeds(self) -> list[bytes]:
        return [bytes([1, 0, 1, 0, 9, 1, 0, 2, 0, 7]) + b"\x0a\x05hello\x18\x04", bytes([0]) + _frame(4, 0, 0, b""),
                bytes([1, 3, 3, 1, 2, 1, 5, 0, 1, 1, 3, 8])]

    def _structured(self, fdp: Any) -> bytes:
        """A sequence of mostly well-formed frames: HEADERS with gRPC or HTTP request heads, DATA with gRPC
        messages, resets, window updates, settings, pings, GOAWAY, CONTINUATION, garbage."""
        out = [_frame(4, 0, 0, b"")]
        for _ in range(fdp.ConsumeIntInRange(1, 12)):
            kind = fdp.ConsumeIntInRange(0, 9)
            sid = fdp.PickValueInList([1, 3, 5, 7, 0, 2, 2**31 - 1])
            if kind <= 2:
                path = fdp.PickValueInList(self.paths)
                grpc = not path.startswith(b"/v1/")
                headers = [(b":method", fdp.PickValueInList([b"POST", b"GET", b"PUT"])), (b":scheme", b"http"),
                           (b":path", path), (b":authority", b"p")]
                if grpc:
                    headers += [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
                else:
                    headers += [(b"content-type", b"application/json")]
                if fdp.ConsumeBool():
                    headers.append((fdp.PickValueInList([b"grpc-timeout", b"grpc-encoding", b"x-session-id",
                                                         b"content-length", b"authorization"]),
                                    fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))))
                block = self.encoder.encode(headers)
                out.append(_frame(1, 0x4 | (0x1 if fdp.ConsumeBool() else 0), sid, block))
            elif kind <= 5:
                payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
                if fdp.ConsumeBool():
                    payload = b"\x00" + struct.pack(">I", len(payload)) + payload
                out.append(_frame(0, 0x1 if fdp.ConsumeBool() else 0, sid, payload))
            elif kind == 6:
                out.append(_frame(3, 0, sid, struct.pack(">I", fdp.ConsumeIntInRange(0, 15))))
            elif kind == 7:
                out.append(_frame(8, 0, sid, struct.pack(">I", fdp.ConsumeIntInRange(0, 2**31))))
            elif kind == 8:
                out.append(_frame(fdp.ConsumeIntInRange(0, 12), fdp.ConsumeIntInRange(0, 255), sid,
                                  fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))))
            else:
                out.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)))
        return b"".join(out)

    def one(self, data: bytes) -> None:
        self.loop.run_until_complete(self._one(data))  # the proxy's callbacks run inside a loop, as for real
        if self.errors:
            errors, self.errors[:] = list(self.errors), []
            raise AssertionError("a fault was contained or reached the event loop: " + "; ".join(errors[:3]))

    async def _one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        structured = fdp.ConsumeBool()
        spins = fdp.ConsumeIntInRange(0, 3)
        if structured:
            stream = PREFACE + self._structured(fdp)
        else:
            stream = PREFACE + fdp.ConsumeBytes(fdp.remaining_bytes())
        down = self.Downstream(self.ctx)
        transport = _Transport()
        down.connection_made(transport)
        pos = 0
        while pos < len(stream):
            step = 1 + (stream[pos] * 7) % 97 if structured else len(stream)
            down.data_received(stream[pos:pos + step])  # an exception escaping here kills a real connection
            pos += step
            if transport.closing:
                break
        for _ in range(spins):
            await asyncio.sleep(0)
        down.connection_lost(None)
        await asyncio.sleep(0)
        assert not down.calls and not down.others, "streams left behind after the connection was lost"


# ---------------------------------------------------------------------------------------------- http1


# The backend refused a target for a byte >= 0x80 (its message quotes the line it saw, escaped): the proxy passes
# such a target on (it is logged and routed with surrogateescape) and relays the backend's own 400; every other
# head the backend's parser refuses, the proxy should have refused first. Matched on the backend's message, not
# on the input: the proxy answers an input whose client side closed at once (499) before its backend has read
# it, so a refusal can be logged during the next input.
_HIGH_BIT = re.compile(r"\\x[89a-f][0-9a-f]")


class Http1(Target):
    doc = ("raw bytes into the HTTP/1.1 listener over a socket, a fake backend behind; never a 500, a hang, or a "
           "malformed head passed on to the backend")

    def setup(self) -> None:
        from aiohttp import http_exceptions, web

        # What the backend's (aiohttp's) parser refused: a malformed request the proxy forwarded.
        self.refused: list[BaseException] = []
        refused = self.refused

        class Refused(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.exc_info and record.exc_info[1] is not None:
                    refused.append(record.exc_info[1])

        logging.getLogger("aiohttp.server").addHandler(Refused(logging.ERROR))
        self.unknown_method = http_exceptions.BadHttpMethod
        self.bad_url = http_exceptions.InvalidURLError

        from proxy.app import AffinityProxy
        from proxy.config import parse_config

        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def backend(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if b'"stream": true' in body:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: {}\n\ndata: [DONE]\n\n")
                return resp
            return web.json_response({"choices": [{"message": {"content": "ok"}}], "n": len(body)})

        async def start() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", backend)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = self.runner.addresses[0][1]
            self.proxy = AffinityProxy(parse_config(
                "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
                "limits: {max_body_bytes: 65536}\n"
                f"backends:\n  - {{name: b, url: 'http://127.0.0.1:{port}', models: [m]}}\n"))
            await self.proxy.start()
            self.port = int(self.proxy.http_url.rsplit(":", 1)[1])

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(30)

    def seeds(self) -> list[bytes]:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        return [
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
            b"GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\nGET /health HTTP/1.1\r\nHost: p\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"1b\r\n{\"model\":\"m\",\"prompt\":\"x\"}\r\n0\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 40\r\n\r\n"
            b'{"model":"m","stream": true,"prompt":"x"}',
        ]

    def one(self, data: bytes) -> None:
        # 20 s: a generous bound on a loaded machine; every exchange here takes milliseconds when idle.
        with socket.create_connection(("127.0.0.1", self.port), timeout=20) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            got = bytearray()
            try:
                while chunk := s.recv(65536):
                    got += chunk
            except socket.timeout:
                raise AssertionError(f"no answer within 20 s to a closed request stream: {bytes(data[:120])!r}")
        # A method the backend does not know is a token all the same (the proxy is right to pass it on).
        refused = [e for e in self.refused if not isinstance(e, self.unknown_method)
                   and not (isinstance(e, self.bad_url) and _HIGH_BIT.search(str(e)))]
        self.refused.clear()
        assert not refused, f"the proxy passed on a head its backend refuses: {refused[0]!r} for {bytes(data[:200])!r}"
        # Every answer is HTTP; none is the proxy's own 500 (a fault of the proxy, not of the input). The main
        # port serves h2c too: an input that opens with the HTTP/2 preface is answered in HTTP/2 frames (the
        # server's SETTINGS first; the h2 target fuzzes that side).
        if got and data.startswith(PREFACE):
            assert got[3:4] == b"\x04", got[:80]  # a SETTINGS frame: 3-byte length, type 4
            return
        if got:
            assert got.startswith(b"HTTP/1."), got[:80]
            assert b"HTTP/1.1 500 " not in got and b"HTTP/1.0 500 " not in got, got[:300]


# ------------------------------------------------------------------------------------------ kv_events


class KVEvents(Target):
    doc = "vLLM KV-event ZeroMQ frames (proxy/wire/kv_events.py); only KVEventDecodeError may come out"

    def setup(self) -> None:
        import msgpack

        from proxy.wire import kv_events

        self.kv = kv_events
        self.pack = msgpack.packb

    def seeds(self) -> list[bytes]:
        import msgpack

        stored = ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU"]
        tagged = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": 9,
                  "token_ids": [1, 2], "block_size": 2, "group_idx": 0, "extra_keys": [None]}
        return [bytes([0, 0]) + msgpack.packb(b) for b in (
            [1.5, [stored, ["BlockRemoved", [1]], ["AllBlocksCleared"]], 0],
            {"ts": 2, "events": [tagged, {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU"},
                                 {"type": "Future"}], "data_parallel_rank": 1})]

    def _value(self, fdp: Any, depth: int = 0) -> Any:
        kind = fdp.ConsumeIntInRange(0, 9 if depth < 5 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return fdp.ConsumeBool()
        if kind == 2:
            return fdp.ConsumeIntInRange(-(2**63), 2**64 - 1) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 9)
        if kind == 3:
            return fdp.ConsumeFloat()
        if kind == 4:
            return fdp.PickValueInList(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "x", ""])
        if kind == 5:
            return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 33))
        if kind in (6, 7, 8):
            return [self._value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 6))]
        keys = ["ts", "events", "data_parallel_rank", "type", "block_hashes", "parent_block_hash", "token_ids",
                "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"]
        return {fdp.PickValueInList(keys): self._value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 7))}

    def one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        door = fdp.ConsumeIntInRange(0, 2)
        structured = fdp.ConsumeBool()
        if structured:
            payload = self.pack(self._value(fdp))
        else:
            payload = fdp.ConsumeBytes(fdp.remaining_bytes())
        kv = self.kv
        try:
            if door == 0:
                batch = kv.decode_payload(payload, seq=7)
            elif door == 1:
                batch = kv.decode_message([b"kv", fdp.ConsumeBytes(8) if not structured else (7).to_bytes(8, "big"),
                                           payload])
            else:
                frames = [b"", (3).to_bytes(8, "big"), payload] if structured else [payload[:1], payload[1:9],
                                                                                    payload[9:]]
                batch = kv.decode_replay(frames)
        except kv.KVEventDecodeError:
            return
        if batch is not None:
            assert all(type(ev).__name__ in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
                       for ev in batch.events), batch


TARGETS: dict[str, Callable[[], Target]] = {
    "http1": Http1,
    "h2": H2,
    "response": Response,
    "request_diff": RequestDiff,
    "summary": Summary,
    "config": ConfigLoader,
    "metrics": Metrics,
}
if importlib.util.find_spec("proxy.wire.kv_events") is not None:  # the decoder landed with the KV-event index
    TARGETS["kv_events"] = KVEvents

__all__ = ["TARGETS", "Target"]
