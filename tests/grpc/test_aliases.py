"""YAML `models` aliases and fallbacks on gRPC, as on HTTP: Generate and KServe ModelInfer calls for a public
name reach a backend of the served model, which is asked for the served name (the first message is
rewritten), and the alias's fallback takes them while the served model has no routable backend."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.snapshot import Health, Snapshot
from proxy.grpc.extractors import with_string_field
from proxy.protos import generate_pb2 as gen, kserve_v2_pb2 as kv2
from proxy.wire import grpc as wire
from sim.fleet import Fleet, start_fleet
from tests.grpc import stubs


@pytest.fixture
async def two_models() -> AsyncIterator[tuple[Fleet, Fleet]]:
    big = await start_fleet(2, grpc_port=0, speed=200.0, model_name="org/big-70b", name_prefix="big")
    small = await start_fleet(2, grpc_port=0, speed=200.0, model_name="org/small-8b", name_prefix="small")
    yield big, small
    await big.stop()
    await small.stop()


@pytest.fixture
async def proxy(two_models: tuple[Fleet, Fleet]) -> AsyncIterator[AffinityProxy]:
    big, small = two_models
    lines = [f"  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}', models: ['{m}']}}"
             for fleet, m in ((big, "org/big-70b"), (small, "org/small-8b")) for s in fleet.servers]
    text = ("listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nrouting: {policy: affinity}\n"
            "models:\n  gpt-4o: {served: org/big-70b, fallback: org/small-8b}\n  gpt-4o-mini: {served: org/small-8b}\n"
            "backends:\n" + "\n".join(lines) + "\n")
    p = AffinityProxy(parse_config(text))
    await p.start()
    yield p
    await p.stop()


def _infer(model: str, text: str) -> kv2.ModelInferRequest:
    req = kv2.ModelInferRequest(model_name=model, id="q")
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(text.encode())
    t = req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    t.contents.int_contents.append(2)
    return req


async def test_generate_and_kserve_calls_for_an_alias_reach_the_served_model_and_fall_back(
        two_models: tuple[Fleet, Fleet], proxy: AffinityProxy) -> None:
    big, _ = two_models
    assert proxy.grpc is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
        generate, stream, infer = stubs.generate(ch), stubs.generate_stream(ch), stubs.model_infer(ch)
        for i in range(4):
            resp = await generate(gen.GenerateRequest(model="gpt-4o", prompt=f"question {i}", max_tokens=2))
            assert resp.backend.startswith("big-")
            # a compressed first message is rewritten too (and forwarded uncompressed)
            resp = await generate(gen.GenerateRequest(model="gpt-4o-mini", prompt=f"q {i}", max_tokens=2),
                                  compression=grpc.Compression.Gzip)
            assert resp.backend.startswith("small-")
            parts = [m async for m in stream(gen.GenerateRequest(model="gpt-4o", prompt=f"s {i}", max_tokens=2))]
            assert parts and all(m.backend.startswith("big-") for m in parts)
            answer = await infer(_infer("gpt-4o-mini", f"kserve {i}"))
            assert answer.model_name == "org/small-8b"  # the backend was asked for the served name
        # asked for by a name no backend serves and no alias maps: NOT_FOUND, as before
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(gen.GenerateRequest(model="no-such-model", prompt="x", max_tokens=1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        def down(snap: Snapshot) -> Snapshot:
            for s in big.servers:
                snap = snap.replace_backend(s.name, health=Health.UNHEALTHY)
            return snap

        proxy.store.update(down)
        for i in range(4):
            resp = await generate(gen.GenerateRequest(model="gpt-4o", prompt=f"question {i}", max_tokens=2))
            assert resp.backend.startswith("small-")
            answer = await infer(_infer("gpt-4o", f"kserve {i}"))
            assert answer.model_name == "org/small-8b"


def test_the_model_field_is_replaced_and_every_other_field_kept() -> None:
    req = gen.GenerateRequest(model="public", prompt="hello", max_tokens=7, temperature=0.5,
                              messages=[gen.ChatMessage(role="user", content="hi")])
    out = gen.GenerateRequest.FromString(with_string_field(req.SerializeToString(), 1, "org/served"))
    assert out.model == "org/served" and out.prompt == "hello" and out.max_tokens == 7
    assert out.temperature == 0.5 and out.messages[0].content == "hi"
    doubled = req.SerializeToString() + gen.GenerateRequest(model="again").SerializeToString()
    assert gen.GenerateRequest.FromString(with_string_field(doubled, 1, "x")).model == "x"
    with pytest.raises(wire.WireError):
        with_string_field(b"\x0a\x05ab", 1, "x")  # a length that runs past the message
