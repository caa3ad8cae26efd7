"""The simulator's gRPC front end (grpclib): the project's Generation service, KServe v2 and health.

It turns a `SimBackend`'s `TokenChunk` stream into gRPC messages, the same way ``server.py`` turns it into
OpenAI JSON, so a prompt gets the same tokens, cache hits and faults on either port. What the proxy is
tested against lives here, so the failure modes are real ones:

- a call cancelled by the client (RST_STREAM, deadline) cancels the handler task; the generation is an
  async generator closed with it (``aclosing``), so the engine frees its slot and blocks at once;
- `ConnectionDropped` aborts the TCP connection without trailers, like a crashed server;
- the other `SimError`s become gRPC statuses (503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED, ...), except on
  ``ModelStreamInfer`` where Triton reports a failed request inside the stream (``error_message``) and
  keeps the stream open for the next one.

KServe inputs follow Triton's TensorRT-LLM / vLLM backends: ``text_input`` (BYTES), ``max_tokens``
(INT32/INT64/UINT32...), ``temperature`` (FP32), optional ``ignore_eos`` / ``stream`` (BOOL), given either as
typed ``contents`` or as ``raw_input_contents``; request ``parameters`` of the same names are honoured too.
The completion comes back as the ``text_output`` BYTES tensor, raw when the request used raw inputs.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream

from sim.api import ConnectionDropped, SimError, SimRequest, TokenChunk, render_chat
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2
from proxy.protos.generate_grpc import GenerationBase
from proxy.protos.kserve_v2_grpc import GRPCInferenceServiceBase

_SIM_STATUS_TO_GRPC: dict[int, Status] = {
    400: Status.INVALID_ARGUMENT,
    404: Status.NOT_FOUND,
    408: Status.DEADLINE_EXCEEDED,
    429: Status.RESOURCE_EXHAUSTED,
    499: Status.CANCELLED,
    501: Status.UNIMPLEMENTED,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
}

_TEXT_INPUT = "text_input"
_TEXT_OUTPUT = "text_output"


class GenerateBackend(Protocol):
    """What the front end needs from a simulated server (``sim`` ``SimBackend``)."""

    name: str

    def generate(self, req: SimRequest) -> AsyncIterator[TokenChunk]: ...


def grpc_status_for(err: SimError) -> Status:
    return _SIM_STATUS_TO_GRPC.get(err.status, Status.INTERNAL)


@dataclass
class CallStats:
    """Counters tests read to see what reached the backend (e.g. that a client cancel got here)."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    dropped: int = 0
    active: int = 0
    methods: dict[str, int] = field(default_factory=dict)


class _Calls:
    """Counts one call's life so cancellation is observable from outside the handler."""

    def __init__(self, stats: CallStats) -> None:
        self.stats = stats

    def start(self, method: str) -> None:
        self.stats.started += 1
        self.stats.active += 1
        self.stats.methods[method] = self.stats.methods.get(method, 0) + 1

    def end(self, outcome: str) -> None:
        self.stats.active -= 1
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)


def _drop_connection(stream: Stream[Any, Any]) -> None:
    """Cut the call's TCP connection without trailers: what a crashed server looks like on the wire.

    grpclib exposes no public way to abort one connection; the protocol stream holds its transport.
    """
    stream._stream._transport.abort()  # noqa: SLF001 - see docstring


class _Tracked:
    """Shared handler plumbing: call counting and SimError / cancellation mapping around one generation."""

    def __init__(self, backend: GenerateBackend, stats: CallStats, ids: "itertools.count[int]") -> None:
        self.backend = backend
        self.calls = _Calls(stats)
        self._ids = ids

    @property
    def name(self) -> str:
        return str(getattr(self.backend, "name", ""))

    def request_id(self, given: str) -> str:
        return given or f"grpc-{self.name}-{next(self._ids)}"

    async def run(self, method: str, stream: Stream[Any, Any], body: Any) -> None:
        """Run `body()` as one counted call; map simulator errors to gRPC statuses."""
        self.calls.start(method)
        try:
            await body()
        except asyncio.CancelledError:
            self.calls.end("cancelled")
            raise
        except ConnectionDropped:
            self.calls.end("dropped")
            _drop_connection(stream)
            raise asyncio.CancelledError() from None
        except SimError as err:
            self.calls.end("failed")
            raise GRPCError(grpc_status_for(err), err.message) from None
        except GRPCError:
            self.calls.end("failed")
            raise
        else:
            self.calls.end("finished")


def _sim_request_from_generate(req: gen.GenerateRequest, request_id: str) -> SimRequest:
    prompt = req.prompt
    if not prompt and req.messages:
        prompt = render_chat({"role": m.role, "content": m.content} for m in req.messages)
    return SimRequest(
        request_id=request_id,
        prompt=prompt,
        max_tokens=req.max_tokens or None,
        temperature=req.temperature,
        model=req.model or None,
        ignore_eos=req.ignore_eos,
    )


def _usage_pb(chunk: TokenChunk) -> gen.Usage | None:
    if chunk.usage is None:
        return None
    u = chunk.usage
    return gen.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
    )


class GenerationService(GenerationBase):
    def __init__(self, tracked: _Tracked) -> None:
        self._t = tracked

    def _response(self, chunk: TokenChunk, text: str | None = None) -> gen.GenerateResponse:
        return gen.GenerateResponse(
            text=chunk.text if text is None else text,
            index=chunk.index,
            finished=chunk.finish_reason is not None,
            finish_reason=chunk.finish_reason or "",
            usage=_usage_pb(chunk),
            backend=self._t.name,
        )

    async def Generate(self, stream: Stream[gen.GenerateRequest, gen.GenerateResponse]) -> None:
        async def body() -> None:
            req = await stream.recv_message()
            assert req is not None
            sim = _sim_request_from_generate(req, self._t.request_id(req.request_id))
            texts: list[str] = []
            last: TokenChunk | None = None
            async with aclosing(self._t.backend.generate(sim)) as chunks:
                async for chunk in chunks:
                    texts.append(chunk.text)
                    last = chunk
            if last is None:
                raise GRPCError(Status.INTERNAL, "generation produced no output")
            await stream.send_message(self._response(last, "".join(texts)))

        await self._t.run("Generate", stream, body)

    async def _stream_one(self, stream: Stream[gen.GenerateRequest, gen.GenerateResponse], req: gen.GenerateRequest) -> None:
        sim = _sim_request_from_generate(req, self._t.request_id(req.request_id))
        async with aclosing(self._t.backend.generate(sim)) as chunks:
            async for chunk in chunks:
                await stream.send_message(self._response(chunk))

    async def GenerateStream(self, stream: Stream[gen.GenerateRequest, gen.GenerateResponse]) -> None:
        async def body() -> None:
            req = await stream.recv_message()
            assert req is not None
            await self._stream_one(stream, req)

        await self._t.run("GenerateStream", stream, body)

    async def GenerateBidi(self, stream: Stream[gen.GenerateRequest, gen.GenerateResponse]) -> None:
        async def body() -> None:
            async for req in stream:
                await self._stream_one(stream, req)

        await self._t.run("GenerateBidi", stream, body)


# ---------------------------------------------------------------------------------------------- KServe v2

_RAW_FORMATS: dict[str, str] = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}


def decode_raw_bytes_tensor(raw: bytes) -> list[bytes]:
    """A raw BYTES tensor: each element is a 4-byte little-endian length followed by that many bytes."""
    out: list[bytes] = []
    pos = 0
    while pos + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise ValueError("raw BYTES tensor element runs past its end")
        out.append(raw[pos : pos + n])
        pos += n
    if pos != len(raw):
        raise ValueError("raw BYTES tensor has trailing bytes")
    return out


def encode_raw_bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _tensor_values(tensor: kv2.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[Any]:
    """The flattened elements of one input tensor, from raw bytes or typed contents."""
    dtype = tensor.datatype.upper()
    if raw is not None:
        if dtype == "BYTES":
            return list(decode_raw_bytes_tensor(raw))
        fmt = _RAW_FORMATS.get(dtype)
        if fmt is None:
            raise GRPCError(Status.INVALID_ARGUMENT, f"input '{tensor.name}': unsupported datatype {dtype}")
        size = struct.calcsize(fmt)
        if len(raw) % size:
            raise GRPCError(Status.INVALID_ARGUMENT, f"input '{tensor.name}': raw size not a multiple of {size}")
        return [v for (v,) in struct.iter_unpack("<" + fmt, raw)]
    c = tensor.contents
    for values in (
        c.bytes_contents,
        c.int_contents,
        c.int64_contents,
        c.uint_contents,
        c.uint64_contents,
        c.fp32_contents,
        c.fp64_contents,
        c.bool_contents,
    ):
        if len(values):
            return list(values)
    return []


def _param_value(p: kv2.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


@dataclass(frozen=True)
class _InferInputs:
    sim: SimRequest
    raw: bool


def _sim_request_from_infer(req: kv2.ModelInferRequest, request_id: str) -> _InferInputs:
    if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
        raise GRPCError(Status.INVALID_ARGUMENT, "raw_input_contents must have one entry per input")
    values: dict[str, list[Any]] = {}
    for i, tensor in enumerate(req.inputs):
        raw = req.raw_input_contents[i] if req.raw_input_contents else None
        try:
            values[tensor.name] = _tensor_values(tensor, raw)
        except ValueError as err:
            raise GRPCError(Status.INVALID_ARGUMENT, f"input '{tensor.name}': {err}") from None
    params = {k: _param_value(v) for k, v in req.parameters.items()}

    def first(name: str) -> Any:
        got = values.get(name)
        if got:
            return got[0]
        return params.get(name)

    texts = values.get(_TEXT_INPUT)
    if not texts:
        raise GRPCError(Status.INVALID_ARGUMENT, f"input '{_TEXT_INPUT}' (BYTES) is required")
    prompt = "\n".join(t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t) for t in texts)
    max_tokens = first("max_tokens")
    temperature = first("temperature")
    ignore_eos = first("ignore_eos")
    try:
        sim = SimRequest(
            request_id=request_id,
            prompt=prompt,
            max_tokens=int(max_tokens) if max_tokens else None,
            temperature=float(temperature) if temperature is not None else 1.0,
            model=req.model_name or None,
            ignore_eos=bool(ignore_eos),
        )
    except (TypeError, ValueError) as err:
        raise GRPCError(Status.INVALID_ARGUMENT, f"bad sampling input: {err}") from None
    return _InferInputs(sim=sim, raw=bool(req.raw_input_contents))


def _infer_response(
    req: kv2.ModelInferRequest, text: str, raw: bool, final: bool | None = None
) -> kv2.ModelInferResponse:
    data = text.encode("utf-8")
    resp = kv2.ModelInferResponse(model_name=req.model_name, model_version=req.model_version, id=req.id)
    out = resp.outputs.add(name=_TEXT_OUTPUT, datatype="BYTES", shape=[1])
    if raw:
        resp.raw_output_contents.append(encode_raw_bytes_tensor([data]))
    else:
        out.contents.bytes_contents.append(data)
    if final is not None:
        # Triton's decoupled models mark the last response of a request this way.
        resp.parameters["triton_final_response"].bool_param = final
    return resp


class InferenceService(GRPCInferenceServiceBase):
    def __init__(self, tracked: _Tracked, model: str | None, ready: ServiceStatus) -> None:
        self._t = tracked
        self._model = model
        self._ready = ready

    def _known(self, name: str) -> bool:
        return not name or self._model is None or name == self._model

    async def ServerLive(self, stream: Stream[kv2.ServerLiveRequest, kv2.ServerLiveResponse]) -> None:
        await stream.recv_message()
        await stream.send_message(kv2.ServerLiveResponse(live=True))

    async def ServerReady(self, stream: Stream[kv2.ServerReadyRequest, kv2.ServerReadyResponse]) -> None:
        await stream.recv_message()
        await stream.send_message(kv2.ServerReadyResponse(ready=self._ready.__status__() is not False))

    async def ModelReady(self, stream: Stream[kv2.ModelReadyRequest, kv2.ModelReadyResponse]) -> None:
        req = await stream.recv_message()
        assert req is not None
        ready = self._ready.__status__() is not False and self._known(req.name)
        await stream.send_message(kv2.ModelReadyResponse(ready=ready))

    async def ServerMetadata(
        self, stream: Stream[kv2.ServerMetadataRequest, kv2.ServerMetadataResponse]
    ) -> None:
        await stream.recv_message()
        await stream.send_message(
            kv2.ServerMetadataResponse(name="affinity-sim", version="1", extensions=["generate"])
        )

    async def ModelMetadata(self, stream: Stream[kv2.ModelMetadataRequest, kv2.ModelMetadataResponse]) -> None:
        req = await stream.recv_message()
        assert req is not None
        if not self._known(req.name):
            raise GRPCError(Status.NOT_FOUND, f"unknown model '{req.name}'")
        T = kv2.ModelMetadataResponse.TensorMetadata
        await stream.send_message(
            kv2.ModelMetadataResponse(
                name=req.name or (self._model or ""),
                versions=["1"],
                platform="affinity-sim",
                inputs=[
                    T(name=_TEXT_INPUT, datatype="BYTES", shape=[-1]),
                    T(name="max_tokens", datatype="INT32", shape=[-1]),
                    T(name="temperature", datatype="FP32", shape=[-1]),
                    T(name="ignore_eos", datatype="BOOL", shape=[-1]),
                    T(name="stream", datatype="BOOL", shape=[-1]),
                ],
                outputs=[T(name=_TEXT_OUTPUT, datatype="BYTES", shape=[-1])],
            )
        )

    async def ModelInfer(self, stream: Stream[kv2.ModelInferRequest, kv2.ModelInferResponse]) -> None:
        async def body() -> None:
            req = await stream.recv_message()
            assert req is not None
            inputs = _sim_request_from_infer(req, self._t.request_id(req.id))
            texts: list[str] = []
            async with aclosing(self._t.backend.generate(inputs.sim)) as chunks:
                async for chunk in chunks:
                    texts.append(chunk.text)
            await stream.send_message(_infer_response(req, "".join(texts), inputs.raw))

        await self._t.run("ModelInfer", stream, body)

    async def ModelStreamInfer(
        self, stream: Stream[kv2.ModelInferRequest, kv2.ModelStreamInferResponse]
    ) -> None:
        async def body() -> None:
            async for req in stream:
                try:
                    inputs = _sim_request_from_infer(req, self._t.request_id(req.id))
                    async with aclosing(self._t.backend.generate(inputs.sim)) as chunks:
                        async for chunk in chunks:
                            final = chunk.finish_reason is not None
                            await stream.send_message(
                                kv2.ModelStreamInferResponse(
                                    infer_response=_infer_response(req, chunk.text, inputs.raw, final)
                                )
                            )
                except ConnectionDropped:
                    raise
                except SimError as err:
                    await stream.send_message(kv2.ModelStreamInferResponse(error_message=err.message))
                except GRPCError as err:
                    await stream.send_message(kv2.ModelStreamInferResponse(error_message=str(err.message)))

        await self._t.run("ModelStreamInfer", stream, body)


# ----------------------------------------------------------------------------------------------- server


class _TrackingServer(Server):
    """A grpclib Server that remembers its connections' transports so `kill()` can cut them all."""

    def __init__(self, handlers: list[Any]) -> None:
        super().__init__(handlers)
        self.transports: set[asyncio.BaseTransport] = set()

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        transports = self.transports
        made, lost = proto.connection_made, proto.connection_lost
        mine: list[asyncio.BaseTransport] = []

        def connection_made(transport: asyncio.BaseTransport) -> None:
            transports.add(transport)
            mine.append(transport)
            made(transport)

        def connection_lost(exc: Exception | None) -> None:
            for transport in mine:
                transports.discard(transport)
            lost(exc)

        proto.connection_made = connection_made  # type: ignore[method-assign]
        proto.connection_lost = connection_lost  # type: ignore[method-assign]
        return proto


class SimGrpcServer:
    """A running gRPC front end for one simulated backend.

    `stats` counts calls as the backend saw them; `set_serving(False)` makes health checks and
    ServerReady report not serving; `kill()` drops every connection at once (a crash), `close()` stops
    gracefully.
    """

    def __init__(self, server: _TrackingServer, port: int, stats: CallStats, ready: ServiceStatus) -> None:
        self._server = server
        self.port = port
        self.stats = stats
        self._ready = ready
        self._closed = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        self._ready.set(serving)

    def kill(self) -> None:
        """Abort every open connection (no GOAWAY, no trailers) and stop accepting new ones."""
        for transport in list(self._server.transports):
            transport.abort()  # type: ignore[attr-defined]
        if not self._closed:
            self._closed = True
            self._server.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.close()
        await self._server.wait_closed()


async def start_grpc_server(
    backend: GenerateBackend, host: str, port: int, *, model: str | None = None, ssl: Any = None
) -> SimGrpcServer:
    """Serve `backend` over gRPC on host:port (0 = a free port) until `close()`.

    `model` names the model ModelReady/ModelMetadata accept (default: the backend's ``model`` attribute,
    if any; None accepts every name).
    """
    stats = CallStats()  # `ssl`: an SSLContext to serve gRPC over TLS (ALPN h2 is set on it)
    ready = ServiceStatus()
    ready.set(True)
    tracked = _Tracked(backend, stats, itertools.count(1))
    model_name = model if model is not None else getattr(backend, "model", None)
    generation = GenerationService(tracked)
    inference = InferenceService(tracked, model_name if isinstance(model_name, str) else None, ready)
    health = Health({generation: [ready], inference: [ready], OVERALL: [ready]})
    server = _TrackingServer([generation, inference, health])
    if ssl is not None:
        ssl.set_alpn_protocols(["h2"])
    await server.start(host, port, ssl=ssl)
    sockets = server._server.sockets if server._server is not None else ()  # noqa: SLF001
    bound = sockets[0].getsockname()[1] if sockets else port
    return SimGrpcServer(server, bound, stats, ready)
