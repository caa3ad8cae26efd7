"""One summary whatever the protocol: the same chat over HTTP/1.1, HTTP/2 and gRPC (Generate with messages,
KServe v2 with a chat-shaped input) yields the same summary, fingerprint and prefix blocks, and reaches the
same backend from a fresh proxy every time. gRPC methods routed without their message go by session or load."""

from __future__ import annotations

import json
import struct
from collections import Counter

import grpc
import httpx

from proxy.app import AffinityProxy
from proxy.core.fingerprint import Fingerprinter
from proxy.core.request import summary_from_openai
from proxy.core.routing_config import AffinityConfig
from proxy.grpc.extractors import ExtractorRegistry, GENERATION_SERVICE, KSERVE_SERVICE
from proxy.grpc.grpc_config import GrpcOptions
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2
from sim.fleet import Fleet
from tests.grpc import stubs
from tests.routing.conftest import ProxyFactory, grpc_address, model_of

Chat = list[dict[str, str]]


def _chat(i: int) -> Chat:
    return [{"role": "system", "content": "you are a careful assistant " * 20},
            {"role": "user", "content": f"question {i}: how do tides work near island {i * 31}?"},
            {"role": "assistant", "content": f"answer {i}: the moon pulls the water " * 3},
            {"role": "user", "content": f"and follow-up {i}?"}]


def _generate(model: str, chat: Chat) -> gen.GenerateRequest:
    return gen.GenerateRequest(model=model, max_tokens=2, ignore_eos=True,
                               messages=[gen.ChatMessage(role=m["role"], content=m["content"]) for m in chat])


def _infer(model: str, chat: Chat) -> kv2.ModelInferRequest:
    req = kv2.ModelInferRequest(model_name=model)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    data = json.dumps(chat).encode()
    req.raw_input_contents.append(struct.pack("<I", len(data)) + data)
    req.raw_input_contents.append(struct.pack("<i", 2))
    return req


def test_same_chat_same_summary_fingerprint_and_blocks() -> None:
    chat = _chat(3)
    registry = ExtractorRegistry(GrpcOptions())
    http = summary_from_openai("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": chat})
    g_method = GENERATION_SERVICE + "Generate"
    g = registry.summarize(g_method, registry.for_method(g_method), _generate("m", chat).SerializeToString(), None)
    k_method = KSERVE_SERVICE + "ModelInfer"
    k = registry.summarize(k_method, registry.for_method(k_method), _infer("m", chat).SerializeToString(), None)
    fp = Fingerprinter(AffinityConfig())
    want = fp.keys(http)
    assert http.key_prefix_chars is not None
    for s in (g, k):
        assert (s.prompt, s.key_prefix_chars, s.model, s.max_tokens, s.temperature) == (
            http.prompt, http.key_prefix_chars, http.model, http.max_tokens, http.temperature)
        got = fp.keys(s)
        assert (got.fingerprint, got.hash_key, got.key_blocks) == (want.fingerprint, want.hash_key, want.key_blocks)
        assert fp.blocks(got) == fp.blocks(want)


async def test_same_chat_reaches_the_same_backend_by_every_protocol(fleet: Fleet, make_proxy: ProxyFactory) -> None:
    """40 chats, each sent once to a fresh proxy per door: HTTP/1.1, HTTP/2 (bridge), gRPC Generate,
    KServe ModelInfer. Nothing is learned across proxies, so agreement is the summary's own doing."""
    model = model_of(fleet)
    doors = [await make_proxy() for _ in range(4)]
    h1, h2, g, k = doors
    where: dict[str, list[str]] = {"http1": [], "http2": [], "grpc": [], "kserve": []}
    async with httpx.AsyncClient(base_url=h1.http_url, timeout=10) as c1, \
            httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{grpc_address(h2)}", timeout=10) as c2, \
            grpc.aio.insecure_channel(grpc_address(g)) as gch, grpc.aio.insecure_channel(grpc_address(k)) as kch:
        generate = stubs.generate(gch)
        infer = stubs.model_infer(kch)
        for i in range(40):
            body = {"model": model, "max_tokens": 2, "messages": _chat(i)}
            r1 = await c1.post("/v1/chat/completions", json=body)
            assert r1.status_code == 200, r1.text
            where["http1"].append(r1.headers["x-affinity-backend"])
            r2 = await c2.post("/v1/chat/completions", json=body)
            assert r2.status_code == 200 and r2.http_version == "HTTP/2", r2.text
            where["http2"].append(r2.headers["x-affinity-backend"])
            where["grpc"].append((await generate(_generate(model, _chat(i)))).backend)
            before = {s.name: s.grpc_server.stats.methods.get("ModelInfer", 0) for s in fleet.servers}
            await infer(_infer(model, _chat(i)))
            [went] = [s.name for s in fleet.servers if s.grpc_server.stats.methods.get("ModelInfer", 0) != before[s.name]]
            where["kserve"].append(went)
    agree = sum(len({where[d][i] for d in where}) == 1 for i in range(40))
    assert agree == 40, where
    assert len(set(where["http1"])) >= 3  # and the chats spread


async def test_grpc_methods_without_an_extractor_go_by_session_else_by_load(
        fleet: Fleet, make_proxy: ProxyFactory) -> None:
    extra = "grpc:\n  extractors:\n    - {method: /affinity.v1.Generation/Generate, kind: none}\n"
    proxy: AffinityProxy = await make_proxy(extra=extra)
    model = model_of(fleet)
    async with grpc.aio.insecure_channel(grpc_address(proxy)) as ch:
        generate = stubs.generate(ch)
        spread: Counter[str] = Counter()
        for i in range(20):
            resp = await generate(gen.GenerateRequest(model=model, prompt=f"p {i}", max_tokens=1))
            spread[resp.backend] += 1
        even = 20 / len(fleet.servers)
        assert len(spread) == len(fleet.servers) and all(0.7 * even <= n <= 1.3 * even for n in spread.values()), spread
        homes: dict[str, set[str]] = {}
        for _ in range(3):
            for user in range(8):
                resp = await generate(gen.GenerateRequest(model=model, prompt="x", max_tokens=1),
                                      metadata=(("x-session-id", f"user-{user}"),))
                homes.setdefault(f"user-{user}", set()).add(resp.backend)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert len({next(iter(h)) for h in homes.values()}) >= 2
