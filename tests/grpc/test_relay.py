"""grpcio client -> affinity-proxy gRPC listener -> backends: the relay's observable behaviour."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sim.fleet import Fleet
from proxy.core.decision import Outcome
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2
from tests.grpc import stubs
from tests.grpc.conftest import echo_entries, fleet_entries, proxy_address
from tests.grpc.echo import EchoBackend
from tests.support import until


def _req(prompt: str = "a b c d", max_tokens: int = 4, **kw: object) -> gen.GenerateRequest:
    return gen.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def test_unary_round_robin_over_the_fleet(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    call = stubs.generate(channel_to(proxy_address(proxy)))
    seen = []
    for _ in range(6):
        resp = await call(_req())
        assert resp.finished and resp.usage.completion_tokens == 4
        assert len(resp.text.split()) == 4
        seen.append(resp.backend)
    # One client connection, yet every call is balanced on its own.
    assert seen == ["sim-0", "sim-1", "sim-2"] * 2


async def test_server_streaming_and_bidi(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    ch = channel_to(proxy_address(proxy))
    chunks = [m async for m in stubs.generate_stream(ch)(_req(max_tokens=12))]
    assert sum(len(m.text.split()) for m in chunks) == 12
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert all(not m.finished for m in chunks[:-1])

    bidi = stubs.generate_bidi(ch)()
    totals = []
    for prompt in ("one two", "three four five"):
        await bidi.write(_req(prompt, max_tokens=3))
        words = 0
        while True:
            m = await bidi.read()
            words += len(m.text.split())
            if m.finished:
                break
        totals.append(words)
    await bidi.done_writing()
    assert await bidi.read() == grpc.aio.EOF
    assert totals == [3, 3]
    assert await bidi.code() == grpc.StatusCode.OK


async def test_kserve_model_infer_and_stream_through_proxy(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    ch = channel_to(proxy_address(proxy))
    req = kv2.ModelInferRequest(model_name=fleet.servers[0].backend.engine.model_name, id="r1")
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"hello there general kenobi")
    t = req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    t.contents.int_contents.append(5)
    t = req.inputs.add(name="ignore_eos", datatype="BOOL", shape=[1])
    t.contents.bool_contents.append(True)
    resp = await stubs.model_infer(ch)(req)
    assert resp.id == "r1" and resp.outputs[0].name == "text_output"
    assert len(resp.outputs[0].contents.bytes_contents[0].split()) == 5

    stream = stubs.model_stream_infer(ch)()
    await stream.write(req)
    await stream.done_writing()
    words = 0
    async for m in stream:
        assert not m.error_message
        words += len(m.infer_response.outputs[0].contents.bytes_contents[0].split())
    assert words == 5


async def test_metadata_trailers_status_details_pass_unchanged(echoes: list[EchoBackend], make_proxy,
                                                               channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes))
    call_fn = stubs.generate(channel_to(proxy_address(proxy)))
    md = (("x-plain", "v1"), ("x-blob-bin", b"\x00\x01\xfe\xff"), ("x-session-id", "s-42"))
    call = call_fn(_req("hi"), metadata=md)
    resp = await call
    assert resp.text == "hi"
    initial = dict(await call.initial_metadata())
    assert initial["x-backend"] == resp.backend
    assert initial["echo-x-blob-bin"] == b"\x00\x01\xfe\xff"
    trailing = dict(await call.trailing_metadata())
    assert trailing["x-trailer"] == "done"
    assert trailing["x-trailer-bin"] == b"\x00\xffbin"
    assert trailing["echo-x-plain"] == "v1"

    failing = call_fn(_req("hi", model="fail"), metadata=md)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await failing
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "échec: precondition % failed"
    trailing = dict(err.trailing_metadata())
    assert trailing["grpc-status-details-bin"] == b"\x08\x09\x12\x04why?"
    assert trailing["x-trailer-bin"] == b"\x00\xffbin"


async def test_gzip_compressed_call_both_ways(echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes))
    ch = channel_to(proxy_address(proxy), compression=grpc.Compression.Gzip)
    prompt = "compress me " * 200
    call = stubs.generate(ch)(_req(prompt, model="compress"), compression=grpc.Compression.Gzip)
    resp = await call
    assert resp.text == prompt
    # The proxy routed on a decompressed copy of the compressed first message and forwarded the original.
    assert proxy.grpc is not None and proxy.grpc.ctx is not None
    assert proxy.grpc.ctx.decompressed_for_routing == 1


async def test_deadline_exceeded(echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes))
    stream = stubs.generate_stream(channel_to(proxy_address(proxy)))
    # An endless stream, one message per 50 ms; the client allows 0.3 s.
    call = stream(_req("tick", max_tokens=0, temperature=0.05), timeout=0.3)
    got = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            got += 1
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got >= 1
    # The backend saw a deadline too (grpc-timeout passed on): its handler was cancelled.
    await until(lambda: sum(e.cancelled for e in echoes) == 1, timeout=5, message="one backend handler cancelled")


async def test_client_cancel_reaches_backend(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    stream = stubs.generate_stream(channel_to(proxy_address(proxy)))
    call = stream(_req("long story", max_tokens=8000))
    first = await call.read()
    assert first.text
    call.cancel()
    stats = [s.grpc_server.stats for s in fleet.servers]
    await until(lambda: sum(st.cancelled for st in stats) == 1, timeout=5, message="one backend call cancelled")
    assert sum(st.active for st in stats) == 0
    # And the proxy's in-flight accounting is back to zero.
    assert proxy.inflight.total_requests == 0


async def test_backend_killed_mid_stream_gives_unavailable(fleet: Fleet, make_proxy, channel_to) -> None:
    outcomes: list[tuple[str, Outcome]] = []
    proxy = await make_proxy(fleet_entries(fleet), on_outcome=lambda name, outcome: outcomes.append((name, outcome)))
    stream = stubs.generate_stream(channel_to(proxy_address(proxy)))
    call = stream(_req("long story", max_tokens=8000))
    first = await call.read()
    victim = fleet.by_name(first.backend)
    assert victim is not None
    victim.grpc_server.kill()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            m = await call.read()
            assert m != grpc.aio.EOF
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert first.backend in info.value.details()
    assert proxy.inflight.total_requests == 0
    assert outcomes == [(first.backend, Outcome.STREAM_FAILURE)]


async def test_connect_failure_is_retried_on_another_backend(fleet: Fleet, make_proxy, channel_to) -> None:
    entries = fleet_entries(fleet)
    dead = fleet.servers[0]
    dead.grpc_server.kill()
    outcomes: list[tuple[str, Outcome]] = []
    proxy = await make_proxy(entries, on_outcome=lambda name, outcome: outcomes.append((name, outcome)))
    call = stubs.generate(channel_to(proxy_address(proxy)))
    backends = [(await call(_req())).backend for _ in range(4)]
    assert dead.name not in backends
    assert proxy.grpc is not None and proxy.grpc.ctx is not None and proxy.grpc.ctx.retried >= 1
    # Passive outlier detection hears about the refused connection, and about the successes elsewhere.
    assert (dead.name, Outcome.CONNECT_FAILURE) in outcomes
    assert sum(1 for _, o in outcomes if o is Outcome.SUCCESS) == 4
    # The failed attempt is accounted to the dead backend as an HTTP attempt would be: one lease each,
    # with the status its client would have got (UNAVAILABLE = 503).
    exposition = proxy.metrics.exposition().decode()
    assert f'affinity_proxy_requests_total{{backend="{dead.name}",status="503"}}' in exposition


async def test_unknown_method_passes_through_as_backend_status(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    ch = channel_to(proxy_address(proxy))
    call = ch.unary_unary("/no.such.Service/Method", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(b"\x0a\x01x")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_no_backend_available_is_unavailable(fleet: Fleet, make_proxy, channel_to) -> None:
    proxy = await make_proxy(fleet_entries(fleet))
    for s in fleet.servers:
        proxy.store.update(lambda snap, name=s.name: snap.replace_backend(name, weight=0.0))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stubs.generate(channel_to(proxy_address(proxy)))(_req())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no backend" in info.value.details()


async def test_call_whose_first_message_is_late_is_routed_without_it(echoes: list[EchoBackend], make_proxy,
                                                                     channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes), extra="grpc: {first_message_timeout_s: 0.1}\n")
    bidi = stubs.generate_bidi(channel_to(proxy_address(proxy)))()
    # Nothing written yet: after the timeout the proxy routes on metadata alone and the backend sees the call.
    await until(lambda: sum(e.calls for e in echoes) == 1, timeout=5, message="the backend sees the call")
    await bidi.write(_req("late"))
    assert (await bidi.read()).text == "LATE"
    await bidi.done_writing()
    assert await bidi.read() == grpc.aio.EOF


async def test_stop_drains_streams_in_flight(echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes), extra="timeouts: {drain_s: 5}\n")
    stream = stubs.generate_stream(channel_to(proxy_address(proxy)))
    call = stream(_req("drain", max_tokens=20, temperature=0.02))
    assert (await call.read()).index == 0
    stopping = asyncio.ensure_future(proxy.stop())
    rest = []
    while (m := await call.read()) != grpc.aio.EOF:
        rest.append(m.index)
    assert rest == list(range(1, 20))
    assert await call.code() == grpc.StatusCode.OK
    await stopping


async def test_plain_h2_path_when_fast_path_is_off(monkeypatch, echoes: list[EchoBackend], make_proxy,
                                                   channel_to) -> None:
    """The DATA fast path is an optimisation over h2; the relay must behave the same without it."""
    import proxy.grpc.connection as h2side

    monkeypatch.setattr(h2side, "_FAST_PATH", False)
    proxy = await make_proxy(echo_entries(echoes))
    ch = channel_to(proxy_address(proxy))
    assert (await stubs.generate(ch)(_req("slow path"))).text == "slow path"
    got = [m.index async for m in stubs.generate_stream(ch)(_req("s", max_tokens=50))]
    assert got == list(range(50))
    assert all(not d.fast for d in proxy.grpc.ctx.downstreams)  # type: ignore[union-attr]


async def test_retries_follow_the_shared_retry_policy(fleet: Fleet, make_proxy, channel_to) -> None:
    """`retries: {enabled: false}` turns the gRPC retry off too: the client hears why the attempt failed."""
    dead = fleet.servers[0]
    dead.grpc_server.kill()
    proxy = await make_proxy(fleet_entries(fleet), extra="retries: {enabled: false}\n")
    call = stubs.generate(channel_to(proxy_address(proxy)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(_req())  # round robin: the first call goes to the dead backend
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot connect to backend sim-0" in info.value.details()
    assert proxy.grpc is not None and proxy.grpc.ctx is not None and proxy.grpc.ctx.retried == 0


async def test_calls_carry_a_request_id_to_the_backend(echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    """As over HTTP: a client's x-request-id is kept; without one the proxy adds a process-unique id."""
    proxy = await make_proxy(echo_entries(echoes))
    call = stubs.generate(channel_to(proxy_address(proxy)))
    ids = set()
    for _ in range(20):
        c = call(_req())
        await c
        ids.add(dict(await c.initial_metadata())["echo-x-request-id"])
    assert len(ids) == 20 and all(len(i) == 32 for i in ids)
    c = call(_req(), metadata=(("x-request-id", "client-chosen-1"),))
    await c
    assert dict(await c.initial_metadata())["echo-x-request-id"] == "client-chosen-1"
