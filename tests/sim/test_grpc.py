"""The simulator's gRPC front end (sim/grpc.py) seen by a grpcio client: KServe surface and
how simulator faults become gRPC outcomes (what the proxy's failure handling is tested against)."""

from __future__ import annotations

import grpc
import pytest

from sim.fleet import Fleet
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2
from tests.grpc import stubs
from tests.grpc.conftest import channel_to, fleet  # noqa: F401  # the gRPC tests' fixtures: a gRPC fleet, channels


def _infer(model: str, prompt: bytes, max_tokens: int) -> kv2.ModelInferRequest:
    req = kv2.ModelInferRequest(model_name=model, id="q")
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(prompt)
    m = req.inputs.add(name="max_tokens", datatype="INT64", shape=[1])
    m.contents.int64_contents.append(max_tokens)
    return req


async def test_kserve_surface(fleet: Fleet, channel_to) -> None:
    server = fleet.servers[0]
    ch = channel_to(server.grpc_address)
    model = server.backend.engine.model_name
    base = "/inference.GRPCInferenceService/"
    live = ch.unary_unary(base + "ServerLive", request_serializer=kv2.ServerLiveRequest.SerializeToString,
                          response_deserializer=kv2.ServerLiveResponse.FromString)
    assert (await live(kv2.ServerLiveRequest())).live
    ready = ch.unary_unary(base + "ModelReady", request_serializer=kv2.ModelReadyRequest.SerializeToString,
                           response_deserializer=kv2.ModelReadyResponse.FromString)
    assert (await ready(kv2.ModelReadyRequest(name=model))).ready
    meta = ch.unary_unary(base + "ModelMetadata", request_serializer=kv2.ModelMetadataRequest.SerializeToString,
                          response_deserializer=kv2.ModelMetadataResponse.FromString)
    md = await meta(kv2.ModelMetadataRequest(name=model))
    assert "text_input" in [t.name for t in md.inputs] and md.outputs[0].name == "text_output"

    # A bad request inside ModelStreamInfer is reported in the stream (Triton's way), which stays usable.
    stream = stubs.model_stream_infer(ch)()
    await stream.write(_infer("no-such-model", b"a b", 2))
    first = await stream.read()
    assert first.error_message
    await stream.write(_infer(model, b"a b c", 3))
    await stream.done_writing()
    finals = []
    while (m := await stream.read()) != grpc.aio.EOF:
        finals.append(m)
    assert not any(m.error_message for m in finals)
    assert finals[-1].infer_response.parameters["triton_final_response"].bool_param


async def test_faults_map_to_grpc_statuses(fleet: Fleet, channel_to) -> None:
    server = fleet.servers[0]
    generate = stubs.generate(channel_to(server.grpc_address))
    await server.set_faults({"fail_rate": 1.0, "fail_status": 503})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(gen.GenerateRequest(prompt="x y", max_tokens=2))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await server.set_faults({"fail_rate": 0.0, "drop_after_chunks": 2})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stubs.generate_stream(channel_to(server.grpc_address))(
                gen.GenerateRequest(prompt="x y", max_tokens=50, ignore_eos=True)):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # a cut connection, not a clean status
    assert server.grpc_server.stats.dropped == 1
