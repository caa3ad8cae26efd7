"""Routing inputs from a gRPC call's first message, read off the wire (see `wire`).

One extractor per method, chosen by the full method path. Each returns the same `RequestSummary` the HTTP
side builds from OpenAI JSON, so a prompt routes to the same backend whichever protocol carried it. An
extractor never rejects a call: a message it cannot read is routed without a prompt and the backend, which
owns the schema, gives the client the real error.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

from proxy.core.request import RequestError, RequestSummary, estimate_tokens, prompt_from_messages, prompt_from_turns
from proxy.wire import grpc as wire
from proxy.grpc.grpc_config import GrpcOptions, MethodExtractorConfig

GENERATION_SERVICE = "/affinity.v1.Generation/"
KSERVE_SERVICE = "/inference.GRPCInferenceService/"


@dataclass(frozen=True, slots=True)
class Fields:
    """What an extractor found in a message; every field optional."""

    prompt: str = ""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    session: str | None = None
    # Where the prompt's distinguishing prefix ends, for chat-shaped messages (RequestSummary.key_prefix_chars).
    key_prefix_chars: int | None = None
    media: tuple[int, ...] = ()


Parser = Callable[[bytes], Fields]


@dataclass(frozen=True, slots=True)
class Extractor:
    """How to route one method: `parse` is None for methods routed on metadata alone (no message wait)."""

    kind: str
    parse: Parser | None
    stream: bool = False
    route_key_metadata: str | None = None
    # The top-level string field that names the model (YAML `models` aliases rewrite it); None: not known.
    model_field: int | None = None

    @property
    def needs_message(self) -> bool:
        return self.parse is not None


def flatten_messages(messages: list[tuple[str, str]]) -> tuple[str, int | None]:
    """Chat turns as ``role\\ncontent\\n`` each, and the end of the first non-system turn: the one
    flattening of proxy/core/request.py (`prompt_from_turns`), so the same conversation has the same
    prompt, fingerprint, key prefix and prefix blocks over HTTP and gRPC."""
    return prompt_from_turns(messages)


def _chat_message(buf: memoryview) -> tuple[str, str]:
    role = content = ""
    for number, wtype, value in wire.iter_fields(buf):
        if number == 1 and wtype == wire.LEN:
            role = wire.as_text(value)
        elif number == 2 and wtype == wire.LEN:
            content = wire.as_text(value)
    return role, content


# ----------------------------------------------------------------------------- affinity.v1.Generation


def parse_generate(payload: bytes) -> Fields:
    """affinity.v1.GenerateRequest: model=1, prompt=2, max_tokens=3, temperature=4 (float),
    session_id=7, messages=8 (repeated ChatMessage{role=1, content=2})."""
    prompt = ""
    model = None
    max_tokens = None
    temperature = None
    session = None
    messages: list[tuple[str, str]] = []
    for number, wtype, value in wire.iter_fields(payload):
        if number == 2 and wtype == wire.LEN:
            prompt = wire.as_text(value)
        elif number == 1 and wtype == wire.LEN:
            model = wire.as_text(value) or None
        elif number == 3:
            max_tokens = wire.as_int(wtype, value) or None
        elif number == 4:
            temperature = wire.as_float(wtype, value)
        elif number == 7 and wtype == wire.LEN:
            session = wire.as_text(value) or None
        elif number == 8 and wtype == wire.LEN:
            assert isinstance(value, memoryview)
            messages.append(_chat_message(value))
    key_end = None
    if not prompt and messages:
        prompt, key_end = flatten_messages(messages)
    return Fields(prompt, model, max_tokens, temperature, session, key_end)


# ------------------------------------------------------------------------------ KServe v2 ModelInfer

_RAW_INT = {"INT8": "<b", "INT16": "<h", "INT32": "<i", "INT64": "<q",
            "UINT8": "<B", "UINT16": "<H", "UINT32": "<I", "UINT64": "<Q"}
_RAW_FLOAT = {"FP32": "<f", "FP64": "<d"}


@dataclass(slots=True)
class _Tensor:
    name: str = ""
    datatype: str = ""
    texts: list[bytes] | None = None
    ints: list[int] | None = None
    floats: list[float] | None = None


def _tensor_contents(buf: memoryview, t: _Tensor) -> None:
    """InferTensorContents: int_contents=2, int64=3, uint=4, uint64=5 (varints, maybe packed),
    fp32=6 (fixed32), fp64=7 (fixed64), bytes_contents=8."""
    for number, wtype, value in wire.iter_fields(buf):
        if number == 8 and wtype == wire.LEN:
            assert isinstance(value, memoryview)
            if t.texts is None:
                t.texts = []
            t.texts.append(bytes(value))
        elif 2 <= number <= 5:
            items = wire.packed_or_single(wtype, value, wire.VARINT)
            if t.ints is None:
                t.ints = []
            for w, v in items:
                n = wire.as_int(w, v)
                if number == 2 and n >= 1 << 31:  # int32 stored sign-extended
                    n -= 1 << 32
                t.ints.append(n)
        elif number in (6, 7):
            items = wire.packed_or_single(wtype, value, wire.FIXED32 if number == 6 else wire.FIXED64)
            if t.floats is None:
                t.floats = []
            t.floats.extend(wire.as_float(w, v) for w, v in items)


def _input_tensor(buf: memoryview) -> _Tensor:
    """InferInputTensor: name=1, datatype=2, contents=5."""
    t = _Tensor()
    for number, wtype, value in wire.iter_fields(buf):
        if number == 1 and wtype == wire.LEN:
            t.name = wire.as_text(value)
        elif number == 2 and wtype == wire.LEN:
            t.datatype = wire.as_text(value).upper()
        elif number == 5 and wtype == wire.LEN:
            assert isinstance(value, memoryview)
            _tensor_contents(value, t)
    return t


def _apply_raw(t: _Tensor, raw: bytes) -> None:
    if t.datatype == "BYTES":
        texts = []
        pos = 0
        while pos + 4 <= len(raw):
            (n,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            texts.append(raw[pos : pos + n])
            pos += n
        t.texts = texts
    elif t.datatype in _RAW_INT:
        fmt = _RAW_INT[t.datatype]
        size = struct.calcsize(fmt)
        t.ints = [v for (v,) in struct.iter_unpack(fmt, raw[: len(raw) - len(raw) % size])]
    elif t.datatype in _RAW_FLOAT:
        fmt = _RAW_FLOAT[t.datatype]
        size = struct.calcsize(fmt)
        t.floats = [v for (v,) in struct.iter_unpack(fmt, raw[: len(raw) - len(raw) % size])]


def _infer_parameter(buf: memoryview) -> object:
    """InferParameter oneof: bool=1, int64=2, string=3, double=4, uint64=5."""
    out: object = None
    for number, wtype, value in wire.iter_fields(buf):
        if number in (1, 2, 5):
            out = wire.as_int(wtype, value)
        elif number == 3 and wtype == wire.LEN:
            out = wire.as_text(value)
        elif number == 4:
            out = wire.as_float(wtype, value)
    return out


def _map_entry(buf: memoryview) -> tuple[str, object]:
    key = ""
    val: object = None
    for number, wtype, value in wire.iter_fields(buf):
        if number == 1 and wtype == wire.LEN:
            key = wire.as_text(value)
        elif number == 2 and wtype == wire.LEN:
            assert isinstance(value, memoryview)
            val = _infer_parameter(value)
    return key, val


def parse_kserve(payload: bytes) -> Fields:
    """inference.ModelInferRequest: model_name=1, parameters=4, inputs=5, raw_input_contents=7.

    Triton LLM models take ``text_input`` (BYTES), ``max_tokens``, ``temperature`` as tensors; the vLLM
    backend takes a ``sampling_parameters`` JSON string instead. Request parameters of the same names
    (and Triton's ``sequence_id`` / a ``session_id``) are read too.
    """
    model = None
    tensors: list[_Tensor] = []
    raws: list[bytes] = []
    params: dict[str, object] = {}
    for number, wtype, value in wire.iter_fields(payload):
        if wtype != wire.LEN:
            continue
        assert isinstance(value, memoryview)
        if number == 5:
            tensors.append(_input_tensor(value))
        elif number == 7:
            raws.append(bytes(value))
        elif number == 1:
            model = wire.as_text(value) or None
        elif number == 4:
            k, v = _map_entry(value)
            params[k] = v
    for t, raw in zip(tensors, raws):
        _apply_raw(t, raw)
    by_name = {t.name: t for t in tensors}

    def number_of(name: str) -> float | int | None:
        t = by_name.get(name)
        if t is not None:
            if t.ints:
                return t.ints[0]
            if t.floats:
                return t.floats[0]
        p = params.get(name)
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            return p
        return None

    prompt = ""
    key_end: int | None = None
    media: tuple[int, ...] = ()
    text = by_name.get("text_input")
    if text is not None and text.texts:
        prompt = "\n".join(b.decode("utf-8", "replace") for b in text.texts)
        chat = _chat_json(prompt)
        if chat is not None:
            prompt, key_end, media = chat
    max_tokens = number_of("max_tokens")
    temperature = number_of("temperature")
    sampling = by_name.get("sampling_parameters")
    if sampling is not None and sampling.texts:
        try:
            sp = json.loads(sampling.texts[0])
        except ValueError:
            sp = None
        if isinstance(sp, Mapping):
            if max_tokens is None and isinstance(sp.get("max_tokens"), int):
                max_tokens = sp["max_tokens"]
            if temperature is None and isinstance(sp.get("temperature"), (int, float)):
                temperature = sp["temperature"]
    session = params.get("session_id", params.get("sequence_id"))
    return Fields(
        prompt=prompt,
        model=model,
        max_tokens=int(max_tokens) if max_tokens else None,
        temperature=float(temperature) if temperature is not None else None,
        session=str(session) if session not in (None, "", 0) else None,
        key_prefix_chars=key_end,
        media=media,
    )


def _chat_json(text: str) -> tuple[str, int | None, tuple[int, ...]] | None:
    """A chat-shaped `text_input`: a JSON list of OpenAI messages, or an object with `messages`. Read as
    `/v1/chat/completions` reads its messages; anything else is plain prompt text (None)."""
    head = text.lstrip()[:1]
    if head not in ("[", "{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, Mapping):
        value = value.get("messages")
    if not isinstance(value, list) or not value or not all(isinstance(m, Mapping) and "role" in m for m in value):
        return None
    try:
        return prompt_from_messages(value)
    except RequestError:
        return None


# ------------------------------------------------------------------------------- generic field paths


def _values_at(payload: memoryview | bytes, path: tuple[int, ...]) -> list[tuple[int, object]]:
    """Every (wire type, value) at a field-number path; repeated fields and repeated parents fan out."""
    found: list[tuple[int, object]] = []
    head, rest = path[0], path[1:]
    for number, wtype, value in wire.iter_fields(payload):
        if number != head:
            continue
        if not rest:
            found.append((wtype, value))
        elif wtype == wire.LEN:
            assert isinstance(value, memoryview)
            found.extend(_values_at(value, rest))
    return found


def fields_parser(cfg: MethodExtractorConfig) -> Parser:
    """A parser for any proto, from field-number paths (strings, ints, floats by wire type)."""

    def text_at(payload: bytes, path: tuple[int, ...]) -> str | None:
        if not path:
            return None
        vals = [wire.as_text(v) for w, v in _values_at(payload, path) if w == wire.LEN]
        return "\n".join(vals) if vals else None

    def number_at(payload: bytes, path: tuple[int, ...], as_float: bool) -> float | int | None:
        if not path:
            return None
        for w, v in _values_at(payload, path):
            if w in (wire.VARINT, wire.FIXED32, wire.FIXED64):
                return wire.as_float(w, v) if as_float else wire.as_int(w, v)
        return None

    def parse(payload: bytes) -> Fields:
        prompt = text_at(payload, cfg.prompt) or ""
        key_end = None
        if not prompt and cfg.messages:
            turns = [_chat_message(v) for w, v in _values_at(payload, cfg.messages)
                     if w == wire.LEN and isinstance(v, memoryview)]
            prompt, key_end = flatten_messages(turns)
        max_tokens = number_at(payload, cfg.max_tokens, False)
        temperature = number_at(payload, cfg.temperature, True)
        session = text_at(payload, cfg.session)
        if session is None and cfg.session:
            n = number_at(payload, cfg.session, False)
            session = None if n is None else str(n)
        return Fields(
            prompt=prompt,
            model=text_at(payload, cfg.model) or None,
            max_tokens=int(max_tokens) if max_tokens else None,
            temperature=float(temperature) if temperature is not None else None,
            session=session or None,
            key_prefix_chars=key_end,
        )

    return parse


# ------------------------------------------------------------------------------------------ registry

# The one table of extractor kinds (YAML `grpc.extractors[].kind` -> the parser it builds for a method;
# None: route on metadata alone, without waiting for the message). Adding a kind is its parser plus one
# entry here and its name in grpc_config.ExtractorKind (the YAML choices; a test keeps the two equal).
KINDS: Mapping[str, Callable[[MethodExtractorConfig], Parser | None]] = {
    "generate": lambda cfg: parse_generate,
    "kserve": lambda cfg: parse_kserve,
    "fields": fields_parser,
    "none": lambda cfg: None,
}

_NO_MESSAGE = Extractor(kind="none", parse=None)


def _model_field(cfg: MethodExtractorConfig) -> int | None:
    if cfg.kind in ("generate", "kserve"):
        return 1  # GenerateRequest.model, ModelInferRequest.model_name
    return cfg.model[0] if cfg.kind == "fields" and len(cfg.model) == 1 else None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def with_string_field(payload: bytes, number: int, value: str) -> bytes:
    """`payload` (one protobuf message) with top-level field `number` set to the string `value`: every
    occurrence dropped, the new one written first, every other field's bytes kept as they were. Raises
    wire.WireError on a message it cannot walk."""
    data = value.encode("utf-8")
    out = bytearray(_varint(number << 3 | wire.LEN) + _varint(len(data)) + data)
    mv = memoryview(payload)
    pos, end = 0, len(mv)
    while pos < end:
        start = pos
        key, pos = wire.read_varint(mv, pos)
        wtype = key & 7
        if wtype == wire.VARINT:
            _, pos = wire.read_varint(mv, pos)
        elif wtype == wire.LEN:
            n, pos = wire.read_varint(mv, pos)
            pos += n
        elif wtype == wire.FIXED32:
            pos += 4
        elif wtype == wire.FIXED64:
            pos += 8
        else:  # groups (long deprecated) and anything else: not rewritten
            raise wire.WireError(f"cannot rewrite a message with wire type {wtype}")
        if pos > end:
            raise wire.WireError("field runs past the message")
        if key >> 3 != number:
            out += mv[start:pos]
    return bytes(out)


def _builtin() -> dict[str, Extractor]:
    g, k = GENERATION_SERVICE, KSERVE_SERVICE
    return {
        g + "Generate": Extractor("generate", parse_generate, model_field=1),
        g + "GenerateStream": Extractor("generate", parse_generate, stream=True, model_field=1),
        g + "GenerateBidi": Extractor("generate", parse_generate, stream=True, model_field=1),
        k + "ModelInfer": Extractor("kserve", parse_kserve, model_field=1),
        k + "ModelStreamInfer": Extractor("kserve", parse_kserve, stream=True, model_field=1),
    }


class ExtractorRegistry:
    """Method path -> extractor: built-ins, overridden and extended by the `grpc.extractors` config."""

    def __init__(self, options: GrpcOptions) -> None:
        self._options = options
        table = _builtin()
        for entry in options.extractors:
            old = table.get(entry.method)
            stream = old.stream if old is not None else False
            table[entry.method] = Extractor(entry.kind, KINDS[entry.kind](entry), stream,
                                            entry.route_key_metadata, _model_field(entry))
        self._table = table

    def for_method(self, method: str) -> Extractor:
        return self._table.get(method, _NO_MESSAGE)

    def summarize(
        self, method: str, ext: Extractor, payload: bytes | None, metadata_key: str | None,
        adapters: frozenset[str] = frozenset(),
    ) -> RequestSummary:
        """The summary of one call. `payload` is the (decompressed) first message, or None when the
        method has no extractor or its message could not be had; `metadata_key` is the route key read
        from the call's metadata, which a session field in the message overrides. `adapters` names the
        LoRA adapters loaded in the fleet: a call for one of them gets the summary's `adapter` set."""
        fields = Fields()
        if payload is not None and ext.parse is not None:
            try:
                fields = ext.parse(payload)
            except (wire.WireError, UnicodeDecodeError, struct.error, ValueError):
                fields = Fields()
        prompt = fields.prompt
        return RequestSummary(
            prompt=prompt,
            model=fields.model,
            adapter=fields.model if fields.model is not None and fields.model in adapters else None,
            max_tokens=fields.max_tokens,
            temperature=fields.temperature,
            stream=ext.stream,
            session_key=fields.session or metadata_key,
            prompt_tokens_est=estimate_tokens(prompt) if prompt else 0,
            endpoint=method,
            key_prefix_chars=fields.key_prefix_chars,
            media=fields.media,
        )

    def with_model(self, ext: Extractor, payload: bytes, model: str) -> bytes | None:
        """The first message naming `model` instead (a YAML `models` alias's served name), or None when
        this method's model field is not known or the message cannot be rewritten."""
        if ext.model_field is None:
            return None
        try:
            return with_string_field(payload, ext.model_field, model)
        except wire.WireError:
            return None

    def route_key_header(self, ext: Extractor) -> bytes | None:
        key = ext.route_key_metadata or self._options.session_metadata
        return None if key is None else key.lower().encode("ascii")
