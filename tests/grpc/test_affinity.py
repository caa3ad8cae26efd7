"""Routing on the prompt read from the first message: the same prompt keeps its backend (KV-cache reuse),
different prompts spread, whichever proto carried them."""

from __future__ import annotations

import struct
from collections import defaultdict

from sim.fleet import Fleet
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2
from tests.grpc import stubs
from tests.grpc.conftest import fleet_entries, proxy_address

PROMPTS = [f"document {i} " + " ".join(f"w{i}x{j}" for j in range(200)) for i in range(8)]


def _infer(model: str, prompt: str) -> kv2.ModelInferRequest:
    req = kv2.ModelInferRequest(model_name=model)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    data = prompt.encode()
    req.raw_input_contents.append(struct.pack("<I", len(data)) + data)
    req.raw_input_contents.append(struct.pack("<i", 2))
    return req


async def test_same_prompt_same_backend_over_grpc(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet), policy="affinity")
    ch = channel_to(proxy_address(proxy))
    generate = stubs.generate(ch)
    infer = stubs.model_infer(ch)
    model = fleet.servers[0].backend.engine.model_name
    by_backend = {s.name: s for s in fleet.servers}
    placed: dict[str, set[str]] = defaultdict(set)
    for _ in range(3):
        for p in PROMPTS:
            resp = await generate(gen.GenerateRequest(model=model, prompt=p, max_tokens=2, ignore_eos=True))
            placed[p].add(resp.backend)
    assert all(len(b) == 1 for b in placed.values()), placed
    assert len({next(iter(b)) for b in placed.values()}) > 1  # prompts are spread, not all on one

    # KServe ModelInfer (raw tensors) with a prompt already placed via Generate follows it there.
    before = {name: s.grpc_server.stats.methods.get("ModelInfer", 0) for name, s in by_backend.items()}
    await infer(_infer(model, PROMPTS[0]))
    after = {name: s.grpc_server.stats.methods.get("ModelInfer", 0) for name, s in by_backend.items()}
    [went] = [name for name in after if after[name] != before[name]]
    assert went == next(iter(placed[PROMPTS[0]]))


async def test_metadata_route_key_for_methods_routed_without_their_message(echoes, make_proxy, channel_to) -> None:  # type: ignore[no-untyped-def]
    """`kind: none` routes at the headers, on the session metadata: one session, one backend."""
    from tests.grpc.conftest import echo_entries

    extra = "grpc:\n  extractors:\n    - {method: /affinity.v1.Generation/Generate, kind: none}\n"
    proxy = await make_proxy(echo_entries(echoes), policy="affinity", extra=extra)
    generate = stubs.generate(channel_to(proxy_address(proxy)))
    homes: dict[str, set[str]] = defaultdict(set)
    for round_ in range(3):
        for user in range(8):
            resp = await generate(gen.GenerateRequest(prompt=f"different every time {round_}"),
                                  metadata=(("x-session-id", f"user-{user}"),))
            homes[f"user-{user}"].add(resp.backend)
    assert all(len(b) == 1 for b in homes.values()), homes
    assert len({next(iter(b)) for b in homes.values()}) == 2
