"""Routing on the prompt read from the first message: the same prompt keeps its backend (KV-cache reuse),
different prompts spread, whichever proto carried them."""

from __future__ import annotations

import struct
from collections import defaultdict

from loadtest.sim.fleet import Fleet
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
