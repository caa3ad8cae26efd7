"""Routing inputs read off the protobuf wire must equal what the real protobuf decoder sees."""

from __future__ import annotations

import gzip
import struct
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import ConfigError, parse_config
from proxy.core.request import summary_from_openai
from proxy.wire import grpc as wire
from proxy.grpc.extractors import KINDS, ExtractorRegistry, parse_generate, parse_kserve
from proxy.grpc.grpc_config import ExtractorKind, GrpcOptions, MethodExtractorConfig
from proxy.protos import generate_pb2 as gen
from proxy.protos import kserve_v2_pb2 as kv2


def framed(payload: bytes, compressed: bool = False) -> bytes:
    return bytes([1 if compressed else 0]) + struct.pack(">I", len(payload)) + payload


def test_generate_fields() -> None:
    msg = gen.GenerateRequest(model="lora-a", prompt="hello world", max_tokens=77, temperature=0.5,
                              session_id="s1", request_id="r")
    f = parse_generate(msg.SerializeToString())
    assert (f.prompt, f.model, f.max_tokens, f.session) == ("hello world", "lora-a", 77, "s1")
    assert f.temperature == pytest.approx(0.5)


def test_generate_chat_messages_flatten_like_openai() -> None:
    msg = gen.GenerateRequest(messages=[gen.ChatMessage(role="system", content="be brief"),
                                        gen.ChatMessage(role="user", content="hi")])
    f = parse_generate(msg.SerializeToString())
    openai = summary_from_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert f.prompt == openai.prompt


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(max_size=300), model=st.text(max_size=20), max_tokens=st.integers(0, 2**32 - 1),
       temperature=st.floats(0, 2, width=32), session=st.text(max_size=20))
def test_generate_matches_protobuf(prompt: str, model: str, max_tokens: int, temperature: float,
                                   session: str) -> None:
    msg = gen.GenerateRequest(prompt=prompt, model=model, max_tokens=max_tokens, temperature=temperature,
                              session_id=session, ignore_eos=True)
    f = parse_generate(msg.SerializeToString())
    assert f.prompt == prompt
    assert f.model == (model or None)
    assert f.max_tokens == (max_tokens or None)
    assert f.session == (session or None)
    if temperature:
        assert f.temperature == pytest.approx(temperature)


def _kserve(raw: bool, datatype_max: str = "INT32") -> kv2.ModelInferRequest:
    req = kv2.ModelInferRequest(model_name="ensemble", id="x")
    text = req.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    mt = req.inputs.add(name="max_tokens", datatype=datatype_max, shape=[1, 1])
    temp = req.inputs.add(name="temperature", datatype="FP32", shape=[1, 1])
    if raw:
        req.raw_input_contents.append(struct.pack("<I", 12) + b"hello triton")
        fmt = {"INT32": "<i", "INT64": "<q", "UINT32": "<I"}[datatype_max]
        req.raw_input_contents.append(struct.pack(fmt, 64))
        req.raw_input_contents.append(struct.pack("<f", 0.25))
    else:
        text.contents.bytes_contents.append(b"hello triton")
        if datatype_max == "INT64":
            mt.contents.int64_contents.append(64)
        elif datatype_max == "UINT32":
            mt.contents.uint_contents.append(64)
        else:
            mt.contents.int_contents.append(64)
        temp.contents.fp32_contents.append(0.25)
    return req


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("dtype", ["INT32", "INT64", "UINT32"])
def test_kserve_typed_and_raw_inputs(raw: bool, dtype: str) -> None:
    f = parse_kserve(_kserve(raw, dtype).SerializeToString())
    assert (f.prompt, f.model, f.max_tokens) == ("hello triton", "ensemble", 64)
    assert f.temperature == pytest.approx(0.25)


def test_kserve_vllm_sampling_parameters_and_request_parameters() -> None:
    req = kv2.ModelInferRequest(model_name="vllm_model")
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"prompt text")
    sp = req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    sp.contents.bytes_contents.append(b'{"max_tokens": 33, "temperature": 0.7}')
    req.parameters["sequence_id"].int64_param = 1234
    f = parse_kserve(req.SerializeToString())
    assert (f.prompt, f.max_tokens, f.session) == ("prompt text", 33, "1234")
    assert f.temperature == pytest.approx(0.7)


def test_generic_field_path_extractor_from_yaml() -> None:
    cfg = parse_config(
        "backends: [{name: a, url: 'http://127.0.0.1:1'}]\n"
        "grpc:\n"
        "  extractors:\n"
        "    - {method: /acme.v1.Llm/Complete, kind: fields, prompt: [8, 2], model: [1], max_tokens: [3],\n"
        "       temperature: [4], session: [5]}\n"
    )
    reg = ExtractorRegistry(cfg.grpc)
    ext = reg.for_method("/acme.v1.Llm/Complete")
    # Reuse GenerateRequest's layout as "some other proto": field 8 is repeated {1: role, 2: content}.
    msg = gen.GenerateRequest(model="m", max_tokens=9, temperature=1.5, ignore_eos=True,
                              messages=[gen.ChatMessage(role="user", content="first"),
                                        gen.ChatMessage(role="user", content="second")])
    raw = msg.SerializeToString() + b"\x2a\x03abc"  # field 5 (LEN) "abc" appended: the session
    s = reg.summarize("/acme.v1.Llm/Complete", ext, raw, metadata_key=None)
    assert (s.prompt, s.model, s.max_tokens, s.session_key) == ("first\nsecond", "m", 9, "abc")
    assert s.temperature == pytest.approx(1.5)
    assert s.endpoint == "/acme.v1.Llm/Complete" and s.prompt_tokens_est > 0


def test_methods_without_extractor_route_on_metadata_only() -> None:
    reg = ExtractorRegistry(GrpcOptions())
    ext = reg.for_method("/other.Service/Call")
    assert not ext.needs_message
    s = reg.summarize("/other.Service/Call", ext, None, metadata_key="user-7")
    assert s.prompt == "" and s.session_key == "user-7"
    assert reg.route_key_header(ext) == b"x-session-id"


def test_malformed_message_routes_without_prompt() -> None:
    reg = ExtractorRegistry(GrpcOptions())
    ext = reg.for_method("/affinity.v1.Generation/Generate")
    s = reg.summarize("/affinity.v1.Generation/Generate", ext, b"\x12\xff\x01abc", metadata_key=None)
    assert s.prompt == ""


def test_gzip_first_message_is_decompressed_for_routing_only() -> None:
    payload = gen.GenerateRequest(prompt="zipped prompt", max_tokens=3).SerializeToString()
    frame = framed(gzip.compress(payload), compressed=True)
    compressed, body = wire.first_message(frame)  # type: ignore[misc]  # first_message returns an optional pair; this frame is whole
    assert compressed
    plain = wire.decompress(body, "gzip", 1 << 20)
    assert plain is not None and parse_generate(plain).prompt == "zipped prompt"
    # A bomb bigger than the routing limit is not inflated.
    bomb = gzip.compress(b"\0" * 100_000)
    assert wire.decompress(bomb, "gzip", 1000) is None
    assert wire.decompress(b"junk", "snappy", 1000) is None


def test_partial_frames_wait_for_the_whole_message() -> None:
    frame = framed(b"\x12\x03abc")
    assert wire.first_message(frame[:3]) is None
    assert wire.first_message(frame[:-1]) is None
    assert wire.first_message(frame + b"more") == (False, b"\x12\x03abc")


@pytest.mark.parametrize("seconds,encoded", [(0.3, b"300000u"), (5, b"5000000u"), (250.0, b"250000m"),
                                             (1e-9, b"1n")])
def test_grpc_timeout_format_roundtrip(seconds: float, encoded: bytes) -> None:
    assert wire.format_timeout(seconds) == encoded
    parsed = wire.parse_timeout(encoded)
    assert parsed is not None and parsed == pytest.approx(seconds, rel=1e-6)
    assert wire.parse_timeout(b"12x") is None and wire.parse_timeout(b"123456789S") is None


def test_extractor_config_errors_name_path_and_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("grpc:\n  extractors:\n    - {method: Complete, kind: fields}\n")
    text = str(info.value)
    assert "grpc.extractors[0].method (line 3)" in text
    assert "grpc.extractors[0].prompt" in text
    with pytest.raises(ConfigError) as info:
        parse_config("grpc:\n  extractors:\n    - {method: /a.B/C, kind: kserve, prompt: [1]}\n")
    assert "only apply to kind: fields" in str(info.value)
    assert MethodExtractorConfig(method="/a.B/C", kind="none").kind == "none"


def test_the_yaml_kinds_are_the_kinds_table() -> None:
    assert set(typing.get_args(ExtractorKind)) == set(KINDS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_builds_an_extractor_from_config(kind: str) -> None:
    path = "/acme.v1.Llm/Complete"
    entry = MethodExtractorConfig(method=path, kind=kind, prompt=(1,) if kind == "fields" else ())  # type: ignore[arg-type]  # kind is one of the Literal's values, read from the table
    ext = ExtractorRegistry(GrpcOptions(extractors=(entry,))).for_method(path)
    assert ext.kind == kind and ext.needs_message is (kind != "none")
