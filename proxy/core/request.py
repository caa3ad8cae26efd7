"""What the router needs to know about one request, whatever protocol it came in on.

The data planes (HTTP, gRPC) parse just enough of a request to fill a `RequestSummary` and hand it to a
policy. Keeping this one plain, frozen value between the protocols and the routing core is what lets the
core stay pure: it never sees bytes, headers or sockets, and the same prompt routes the same way whether it
arrived as OpenAI JSON or as a KServe v2 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# A word-count heuristic would under-count code and CJK; 4 bytes per token is the usual rule of thumb for
# BPE tokenisers on English text and errs on the side of more tokens (more load) for dense text.
BYTES_PER_TOKEN_ESTIMATE = 4


class RequestError(ValueError):
    """A request body that cannot be routed; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    # Length in characters of the leading system/developer messages (chat; None: none or no structure):
    # content many conversations share, which the affinity cost check does not chase in an idle fleet.
    shared_prefix_chars: int | None = None
    # Chat requests: the messages as sent, for the precise KV index, which renders them with the model's own
    # chat template (proxy/dataplane/tokenize.py). Not part of equality: `prompt` already is.
    messages: tuple[Any, ...] | None = field(default=None, compare=False)

    @property
    def prompt_bytes(self) -> bytes:
        return self.prompt.encode("utf-8", "surrogatepass")


def estimate_tokens(text: str) -> int:
    if text.isascii():  # O(1) in CPython: skips encoding a long prompt just to count its bytes
        return (len(text) + BYTES_PER_TOKEN_ESTIMATE - 1) // BYTES_PER_TOKEN_ESTIMATE
    return (len(text.encode("utf-8", "surrogatepass")) + BYTES_PER_TOKEN_ESTIMATE - 1) // BYTES_PER_TOKEN_ESTIMATE


def _flatten_content(content: Any, where: str) -> str:
    """Chat content is a string or a list of parts; only text parts shape the KV cache we can predict."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping):
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
            else:
                raise RequestError(f"{where}[{i}] must be an object or a string", where)
        return "\n".join(texts)
    raise RequestError(f"{where} must be a string or a list of content parts", where)


def _prompt_from_completions(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(p, int) for p in prompt):
            # Token ids: route on their textual form; identical id sequences still share prefixes.
            return " ".join(map(str, prompt))
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return "\n".join(" ".join(map(str, p)) for p in prompt)
    raise RequestError("'prompt' must be a string, a list of strings or a list of token ids", "prompt")


# Roles whose messages are typically shared by many conversations (the system prompt).
_SHARED_ROLES = frozenset({"system", "developer"})


def _prompt_from_messages(messages: Any) -> tuple[str, int | None, int | None]:
    """The flattened prompt, the end (in characters) of its first non-system message, and the end of
    the system/developer messages before it (None when it starts with another role)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    parts: list[str] = []
    length = 0
    key_end: int | None = None
    shared_end: int | None = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise RequestError(f"messages[{i}] must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}].role must be a string", f"messages[{i}].role")
        part = f"{role}\n{_flatten_content(msg.get('content'), f'messages[{i}].content')}\n"
        parts.append(part)
        if key_end is None and role not in _SHARED_ROLES and length:
            shared_end = length
        length += len(part)
        if key_end is None and role not in _SHARED_ROLES:
            key_end = length
    return "".join(parts), key_end, shared_end


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
    """Build a summary from a parsed OpenAI-style JSON body.

    `endpoint` is the request path (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``).
    `adapters` names the models known to be LoRA adapters; a request for one of them gets `adapter` set so
    affinity can keep an adapter's traffic where it is already loaded.
    """
    if not isinstance(body, Mapping):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    key_prefix_chars: int | None = None
    shared_prefix_chars: int | None = None
    if endpoint.endswith("/chat/completions"):
        prompt, key_prefix_chars, shared_prefix_chars = _prompt_from_messages(body.get("messages"))
    elif endpoint.endswith("/completions"):
        if "prompt" not in body:
            raise RequestError("'prompt' is required", "prompt")
        prompt = _prompt_from_completions(body.get("prompt"))
    elif endpoint.endswith("/embeddings"):
        if "input" not in body:
            raise RequestError("'input' is required", "input")
        prompt = _prompt_from_completions(body.get("input"))
    else:
        prompt = ""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    return RequestSummary(
        prompt=prompt,
        model=model,
        adapter=model if model is not None and model in adapters else None,
        max_tokens=_opt_int(body, "max_tokens", "max_completion_tokens"),
        temperature=_opt_float(body, "temperature"),
        stream=stream,
        session_key=session_key,
        prompt_tokens_est=estimate_tokens(prompt),
        endpoint=endpoint,
        key_prefix_chars=key_prefix_chars,
        shared_prefix_chars=shared_prefix_chars,
        messages=tuple(body["messages"]) if endpoint.endswith("/chat/completions") else None,
    )
