"""A grpcio (not grpclib) backend that reflects what it received, for pass-through checks.

grpclib cannot produce compressed messages or `grpc-status-details-bin`; grpcio can, which is what makes
this backend the reference for "everything passes unchanged": it answers on the Generation service's
methods with the request's metadata echoed as initial metadata and trailers (``-bin`` included), a
``grpc-status-details-bin`` trailer, and optionally a non-OK status.
"""

from __future__ import annotations

import asyncio

import grpc

from proxy.protos import generate_pb2 as gen

SERVICE = "affinity.v1.Generation"


class EchoBackend:
    def __init__(self, name: str, options: list[tuple[str, object]] | None = None) -> None:
        self.name = name
        self.options = options or []
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.calls = 0
        self.cancelled = 0
        self.received_metadata: list[tuple[tuple[str, str | bytes], ...]] = []
        self.started_streaming = asyncio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _echo_metadata(self, context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
        md = tuple((k, v) for k, v in context.invocation_metadata() or ())
        self.received_metadata.append(md)
        return [(f"echo-{k}", v) for k, v in md if k.startswith("x-")]

    async def _generate(self, req: gen.GenerateRequest, context: grpc.aio.ServicerContext) -> gen.GenerateResponse:
        self.calls += 1
        echoed = self._echo_metadata(context)
        if req.model == "compress":
            context.set_compression(grpc.Compression.Gzip)
        await context.send_initial_metadata([("x-backend", self.name), *echoed])
        trailers = [("x-trailer", "done"), ("x-trailer-bin", b"\x00\xffbin"), *echoed]
        if req.model == "fail":
            trailers.append(("grpc-status-details-bin", b"\x08\x09\x12\x04why?"))
            context.set_trailing_metadata(trailers)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "échec: precondition % failed")
        context.set_trailing_metadata(trailers)
        return gen.GenerateResponse(text=req.prompt, backend=self.name, finished=True)

    async def _stream(self, req: gen.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        """Streams `max_tokens` messages (forever when 0) with `temperature` seconds between them."""
        self.calls += 1
        self._echo_metadata(context)
        i = 0
        try:
            while req.max_tokens == 0 or i < req.max_tokens:
                yield gen.GenerateResponse(text=f"{req.prompt}-{i}", index=i, backend=self.name,
                                           finished=req.max_tokens != 0 and i == req.max_tokens - 1)
                self.started_streaming.set()
                i += 1
                if req.temperature:
                    await asyncio.sleep(req.temperature)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _bidi(self, requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        self.calls += 1
        async for req in requests:
            yield gen.GenerateResponse(text=req.prompt[:16].upper(), index=req.max_tokens, backend=self.name)
            if req.temperature:  # a slow consumer: wait before taking the next request
                await asyncio.sleep(req.temperature)

    async def start(self) -> None:
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_unary_rpc_method_handler(
                self._generate, request_deserializer=gen.GenerateRequest.FromString,
                response_serializer=gen.GenerateResponse.SerializeToString),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                self._stream, request_deserializer=gen.GenerateRequest.FromString,
                response_serializer=gen.GenerateResponse.SerializeToString),
            "GenerateBidi": grpc.stream_stream_rpc_method_handler(
                self._bidi, request_deserializer=gen.GenerateRequest.FromString,
                response_serializer=gen.GenerateResponse.SerializeToString),
        })
        self.server = grpc.aio.server(options=self.options)
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None
