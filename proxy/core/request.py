"""What the router needs to know about one request, whatever protocol it came in on.

The data planes (HTTP, gRPC) parse just enough of a request to fill a `RequestSummary` and hand it to a
policy. Keeping this one plain, frozen value between the protocols and the routing core is what lets the
core stay pure: it never sees bytes, headers or sockets, and the same prompt routes the same way whether it
arrived as OpenAI JSON or as a KServe v2 tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import xxhash

from proxy.core.frozen import fast_init

# A word-count heuristic would under-count code and CJK; 4 bytes per token is the usual rule of thumb for
# BPE tokenisers on English text and errs on the side of more tokens (more load) for dense text.
BYTES_PER_TOKEN_ESTIMATE = 4


class RequestError(ValueError):
    """A request body that cannot be routed; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@fast_init  # built for every request: the generated frozen __init__ costs 2.5x (proxy/core/frozen.py)
@dataclass(frozen=True, slots=True)
class RequestSummary:
    """The routing inputs of one request. `prompt` is the text the KV cache is keyed on.

    For chat requests the messages are flattened in order as ``role\\n content\\n`` so that a conversation
    that grows turn by turn keeps its earlier turns as a byte prefix: that is what makes multi-turn chats
    hit the prefix index of the backend that served the earlier turns.
    """

    prompt: str
    model: str | None = None
    adapter: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False
    session_key: str | None = None
    prompt_tokens_est: int = 0
    endpoint: str = ""
    # Length in characters of the prompt's distinguishing prefix, when the request's structure says where
    # it ends (chat: through the first message that is not a system/developer message). Consistent hashing
    # keys on it so a conversation's turns share a backend while conversations that only share a system
    # prompt spread (see proxy/core/fingerprint.py). None: no structure, the core decides.
    key_prefix_chars: int | None = None
    # xxh3 of each non-text content part (image/audio/video/file URL, data or id), in order: they shape
    # the KV cache too but cannot be laid out as prompt bytes, so they are folded into the exact
    # fingerprint (two requests differing only in an image are not an exact repeat).
    media: tuple[int, ...] = ()
    # Length in characters of the leading system/developer messages (chat; None: none or no structure):
    # content many conversations share, which the affinity cost check does not chase in an idle fleet.
    shared_prefix_chars: int | None = None
    # Chat requests: the messages as sent, for the precise KV index, which renders them with the model's own
    # chat template (proxy/dataplane/tokenize.py). Not part of equality: `prompt` already is.
    messages: tuple[Any, ...] | None = field(default=None, compare=False)
    # Responses API: the `previous_response_id` the request continues, and the backend whose engine stored
    # that response (learned by the data plane from the answers it relayed; None: unknown). An engine
    # keeps stored responses in its own memory, so the Router sends the request there while it is routable.
    previous_response_id: str | None = None
    state_home: str | None = None

    @property
    def prompt_bytes(self) -> bytes:
        return self.prompt.encode("utf-8", "surrogatepass")


def estimate_tokens(text: str) -> int:
    if text.isascii():  # O(1) in CPython: skips encoding a long prompt just to count its bytes
        return (len(text) + BYTES_PER_TOKEN_ESTIMATE - 1) // BYTES_PER_TOKEN_ESTIMATE
    return (len(text.encode("utf-8", "surrogatepass")) + BYTES_PER_TOKEN_ESTIMATE - 1) // BYTES_PER_TOKEN_ESTIMATE




# ------------------------------------------------------------------------------------------ content

# Content-part types that carry text, across OpenAI chat (`text`), the Responses API (`input_text`,
# `output_text`), Anthropic (`text`) and refusals echoed back in a history (`refusal`).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
_MEDIA_DOMAIN = b"affinity-proxy/media/v1"


class _Content:
    """What a summariser reads off one body: the routing prompt and the facts around it."""

    __slots__ = ("texts", "length", "key_end", "shared_end", "media", "session", "previous_response")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.length = 0
        self.key_end: int | None = None
        # End of the leading system/developer/tools turns (None when the prompt starts with another role).
        self.shared_end: int | None = None
        self.media: list[int] = []
        self.session: str | None = None
        self.previous_response: str | None = None

    def turn(self, role: str, text: str) -> None:
        """One ``role\\ntext\\n`` turn; the first turn whose role is not shared ends the key prefix."""
        part = f"{role}\n{text}\n"
        self.texts.append(part)
        if self.key_end is None and role not in _SHARED_ROLES:
            if self.length:
                self.shared_end = self.length
            self.length += len(part)
            self.key_end = self.length
        else:
            self.length += len(part)

    def raw(self, text: str) -> None:
        self.texts.append(text)
        self.length += len(text)

    def medium(self, part: Any) -> None:
        encoded = json.dumps(part, sort_keys=True, ensure_ascii=False, default=str)
        self.media.append(xxhash.xxh3_64_intdigest(encoded.encode("utf-8", "surrogatepass"), _xxh_media_seed))

    @property
    def prompt(self) -> str:
        return "".join(self.texts)


_xxh_media_seed = xxhash.xxh3_64_intdigest(_MEDIA_DOMAIN)


def _parts_text(content: Any, where: str, out: _Content) -> str:
    """Chat content: a string or a list of parts. Text parts are the prompt; every other part (image,
    audio, video, file, tool use...) is folded into `out.media`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif type(part) is dict or isinstance(part, Mapping):  # parsed JSON: a dict, no ABC check
                text = part.get("text")
                kind = part.get("type", "text")
                # Only a string can be a text part's type: a list or an object there is unhashable (the set
                # lookup raised TypeError), and like a number it is folded into `out.media` below.
                if isinstance(kind, str) and kind in _TEXT_PARTS and isinstance(text, str):
                    texts.append(text)
                elif part.get("type") == "tool_result":  # Anthropic: its content is text or blocks again
                    texts.append(_parts_text(part.get("content"), f"{where}[{i}].content", out))
                else:
                    out.medium(part)
            else:
                raise RequestError(f"{where}[{i}] must be an object or a string", where)
        return "\n".join(texts)
    raise RequestError(f"{where} must be a string or a list of content parts", where)


def _flat_texts(value: Any, name: str) -> str:
    """A string, a list of strings, a list of token ids or a list of lists of ids, as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(p, str) for p in value):
            return "\n".join(value)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            # Token ids: route on their textual form; identical id sequences still share prefixes.
            return " ".join(map(str, value))
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in value):
            return "\n".join(" ".join(map(str, p)) for p in value)
    raise RequestError(f"'{name}' must be a string, a list of strings or a list of token ids", name)


# Roles whose messages are typically shared by many conversations (the system prompt, tool schemas).
_SHARED_ROLES = frozenset({"system", "developer", "tools"})


def _messages(messages: Any, out: _Content, name: str = "messages") -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'{name}' must be a non-empty list", name)
    for i, msg in enumerate(messages):
        if type(msg) is not dict and not isinstance(msg, Mapping):  # parsed JSON: a dict, no ABC check
            raise RequestError(f"{name}[{i}] must be an object", f"{name}[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise RequestError(f"{name}[{i}].role must be a string", f"{name}[{i}].role")
        out.turn(role, _parts_text(msg.get("content"), f"{name}[{i}].content", out))


def prompt_from_turns(turns: list[tuple[str, str]]) -> tuple[str, int | None]:
    """Chat turns (role, text) as the routing prompt and the end of its key prefix: the ONE flattening
    of a conversation, used by every protocol (OpenAI/Anthropic JSON here, gRPC in proxy/grpc)."""
    out = _Content()
    for role, text in turns:
        out.turn(role, text)
    return out.prompt, out.key_end


def prompt_from_messages(messages: Any) -> tuple[str, int | None, tuple[int, ...]]:
    """OpenAI-shaped chat messages (from any protocol: a KServe tensor holding chat JSON, say) as the
    routing prompt, its key-prefix end and its media hashes, exactly as `/v1/chat/completions` reads them.
    Raises RequestError."""
    out = _Content()
    _messages(messages, out)
    return out.prompt, out.key_end, tuple(out.media)


def _tools(tools: Any, out: _Content) -> None:
    """Tool schemas are rendered into the prompt ahead of the conversation (chat templates put them in the
    system turn): a shared turn, as stable bytes (sorted keys)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", "tools")
    if tools:
        out.turn("tools", json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":")))


def _chat(body: Mapping[str, Any], out: _Content) -> None:
    _messages(body.get("messages"), out)


def _completions(body: Mapping[str, Any], out: _Content) -> None:
    if "prompt" not in body:
        raise RequestError("'prompt' is required", "prompt")
    out.raw(_flat_texts(body.get("prompt"), "prompt"))


def _embeddings(body: Mapping[str, Any], out: _Content) -> None:
    if "input" not in body:
        raise RequestError("'input' is required", "input")
    out.raw(_flat_texts(body.get("input"), "input"))


def _responses(body: Mapping[str, Any], out: _Content) -> None:
    """OpenAI Responses API: `instructions` (a system turn), `tools`, then `input` (a string, or items:
    messages with string or part-list content, function calls and their outputs)."""
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", "instructions")
        out.turn("system", instructions)
    _tools(body.get("tools"), out)
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise RequestError("'previous_response_id' must be a string", "previous_response_id")
        out.session = "response:" + prev
        out.previous_response = prev
    data = body.get("input")
    if data is None:
        if prev is None:
            raise RequestError("'input' is required", "input")
        return
    if isinstance(data, str):
        out.turn("user", data)
        return
    if not isinstance(data, list):
        raise RequestError("'input' must be a string or a list of input items", "input")
    for i, item in enumerate(data):
        where = f"input[{i}]"
        if isinstance(item, str):
            out.turn("user", item)
            continue
        if not isinstance(item, Mapping):
            raise RequestError(f"{where} must be an object or a string", where)
        kind = item.get("type", "message")
        if kind == "message" or "role" in item:
            role = item.get("role")
            if not isinstance(role, str):
                raise RequestError(f"{where}.role must be a string", f"{where}.role")
            out.turn(role, _parts_text(item.get("content"), f"{where}.content", out))
        elif kind == "function_call":
            out.turn("assistant", f"{item.get('name', '')}({item.get('arguments', '')})")
        elif kind == "function_call_output":
            output = item.get("output")
            out.turn("tool", output if isinstance(output, str) else json.dumps(output, sort_keys=True))
        else:
            out.medium(item)  # reasoning items, item references, ...: opaque, but they shape the answer


def _anthropic_messages(body: Mapping[str, Any], out: _Content) -> None:
    """Anthropic Messages API (as vLLM and SGLang serve it): `system` (a string or text blocks), `tools`,
    `messages` (content a string or blocks: text, image, document, tool_use, tool_result)."""
    system = body.get("system")
    if system is not None:
        out.turn("system", _parts_text(system, "system", out))
    _tools(body.get("tools"), out)
    _messages(body.get("messages"), out)


def _rerank(body: Mapping[str, Any], out: _Content) -> None:
    """vLLM/Jina/Cohere rerank: `query` and `documents` (strings, or objects with `text`)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise RequestError("'query' must be a string", "query")
    docs = body.get("documents")
    if not isinstance(docs, list):
        raise RequestError("'documents' must be a list", "documents")
    out.turn("query", query)
    for i, doc in enumerate(docs):
        if isinstance(doc, Mapping) and isinstance(doc.get("text"), str):
            out.raw(doc["text"] + "\n")
        elif isinstance(doc, str):
            out.raw(doc + "\n")
        else:
            out.medium(doc)


def _score(body: Mapping[str, Any], out: _Content) -> None:
    """vLLM score: `text_1` against `text_2` (each a string or a list of strings)."""
    for name in ("text_1", "text_2"):
        if name not in body:
            raise RequestError(f"'{name}' is required", name)
        out.turn(name, _flat_texts(body[name], name))


def _prompt_or_messages(body: Mapping[str, Any], out: _Content) -> None:
    """vLLM /tokenize and /pooling: chat `messages`, or `prompt` / `input` text."""
    if "messages" in body:
        _messages(body.get("messages"), out)
        return
    for name in ("prompt", "input"):
        if name in body:
            out.raw(_flat_texts(body[name], name))
            return
    raise RequestError("'prompt', 'input' or 'messages' is required", "prompt")


Summariser = Callable[[Mapping[str, Any], _Content], None]

# The ONE endpoint table: request path -> what is read off its body. The data plane routes on content
# exactly the paths listed here (proxy/dataplane/openai.py); every other request is routed by load or by
# its session key. README "What is parsed" describes each entry.
SUMMARISERS: Mapping[str, Summariser] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/embeddings": _embeddings,
    "/v1/responses": _responses,
    "/v1/messages": _anthropic_messages,
    "/rerank": _rerank,
    "/v1/rerank": _rerank,
    "/v2/rerank": _rerank,
    "/score": _score,
    "/v1/score": _score,
    "/tokenize": _prompt_or_messages,
    "/pooling": _prompt_or_messages,
}


def _opt_int(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"'{key}' must be an integer", key)
        return value
    return None


def _opt_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number", key)
    return float(value)


def summary_from_openai(
    endpoint: str,
    body: Any,
    *,
    session_key: str | None = None,
    adapters: frozenset[str] = frozenset(),
) -> RequestSummary:
    """Build a summary from a parsed JSON body of one of the `SUMMARISERS` endpoints (OpenAI, Anthropic,
    vLLM). Another endpoint gets no prompt (routed by load or session).

    `adapters` names the models known to be LoRA adapters; a request for one of them gets `adapter` set so
    affinity can keep an adapter's traffic where it is already loaded. A `session_key` from the request's
    header wins over one the body implies (`previous_response_id`).
    """
    if type(body) is not dict and not isinstance(body, Mapping):  # a parsed body is a dict: skip the ABC check
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    summarise = SUMMARISERS.get(endpoint)
    key_end: int | None = None
    shared_end: int | None = None
    media: tuple[int, ...] = ()
    implied_session: str | None = None
    previous_response: str | None = None
    if summarise is _completions and type(text := body.get("prompt")) is str:
        prompt = text  # a completion's one string prompt (what `_completions` would make of it, no _Content)
    else:
        out = _Content()
        if summarise is not None:
            summarise(body, out)
        texts = out.texts
        prompt = texts[0] if len(texts) == 1 else "".join(texts)
        key_end, shared_end, implied_session, previous_response = (
            out.key_end, out.shared_end, out.session, out.previous_response)
        if out.media:
            media = tuple(out.media)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:  # absent, or the others (and each one's error) in `_opt_int`'s order
        max_tokens = _opt_int(body, "max_tokens", "max_completion_tokens", "max_output_tokens")
    temperature = body.get("temperature")
    if type(temperature) is int:  # (not a bool: its type is bool) what `_opt_float` makes of it
        temperature = float(temperature)
    elif type(temperature) is not float:
        temperature = _opt_float(body, "temperature")
    # Positional, in field order (proxy/core/frozen.py: the cheapest call).
    return RequestSummary(
        prompt,
        model,
        model if model is not None and model in adapters else None,  # adapter
        max_tokens,
        temperature,
        stream,
        session_key if session_key is not None else implied_session,
        estimate_tokens(prompt),  # prompt_tokens_est
        endpoint,
        key_end,  # key_prefix_chars
        media,
        shared_end,  # shared_prefix_chars
        tuple(body["messages"]) if endpoint.endswith("/chat/completions") else None,
        previous_response,  # previous_response_id
    )
