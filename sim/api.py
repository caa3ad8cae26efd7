"""The protocol-neutral surface of one simulated server: what a front end (HTTP, gRPC) hands in and gets out.

Both front ends of the simulator (``server.py`` for OpenAI HTTP, ``grpc.py`` for the project's own
Generation service and KServe v2) call ``SimBackend.generate(SimRequest)`` and turn the ``TokenChunk``
stream into their wire format. Keeping these values plain and frozen is what lets the two front ends stay
in step: the same prompt gives the same tokens, the same cache hits and the same faults on either port.

Tokens are whitespace-separated words (``prompt.split()``), so a load generator controls token counts
exactly. Chat messages become one prompt through `render_chat`, the same ``role\\ncontent\\n`` flattening the
proxy's router keys its prefix index on, so a conversation that grows turn by turn keeps a token prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One generation request. `model` is the base model name or a LoRA adapter name (None = base)."""

    request_id: str
    prompt: str
    max_tokens: int | None = None
    temperature: float = 1.0
    model: str | None = None
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one finished request; `cached_tokens` = prompt tokens served from prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Text produced by one engine step for one request.

    `text` holds one or more tokens, each preceded by a space except the first token of the completion
    (so joining every chunk's text gives the completion). `index` counts chunks from 0. The last chunk has
    `finish_reason` ("length" or "stop") and `usage`; every other chunk has both None.
    """

    text: str
    index: int
    finish_reason: str | None = None
    usage: Usage | None = None
    num_tokens: int = 1


class SimError(Exception):
    """Base of every error `SimBackend.generate` raises; `status` is the HTTP status a front end should use
    (gRPC front ends map it: 400 INVALID_ARGUMENT, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED,
    503 UNAVAILABLE, 500 INTERNAL)."""

    status: int = 500
    type: str = "InternalServerError"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(SimError):
    """The request can never run here (empty prompt, prompt + max_tokens over the context length, ...)."""

    status = 400
    type = "BadRequestError"


class ModelNotFound(SimError):
    """`model` names neither the base model nor a LoRA adapter this server knows."""

    status = 404
    type = "NotFoundError"
    code = "model_not_found"


class InjectedFailure(SimError):
    """A fault the test asked for: the request fails with a server error (5xx) before any token."""

    status = 500
    type = "InternalServerError"
    code = "injected_fault"

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class ConnectionDropped(SimError):
    """A fault the test asked for: the front end must cut the connection now (after some chunks), without
    a clean end of stream, the way a crashed server would."""

    status = 502
    type = "ConnectionDropped"
    code = "injected_drop"


class ServerStopping(SimError):
    """The server is shutting down; requests in flight are aborted."""

    status = 503
    type = "ServiceUnavailableError"
    code = "server_stopping"


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """Flatten chat messages into one prompt as ``role\\ncontent\\n`` per message (text parts only)."""
    parts: list[str] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        elif content is None:
            content = ""
        parts.append(f"{msg.get('role', 'user')}\n{content}\n")
    return "".join(parts)


def _blocks_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content
                         if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p))
    return ""


def render_responses(body: Mapping[str, Any]) -> str:
    """An OpenAI Responses API request (`instructions`, `input` as a string or items) as one prompt."""
    turns: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        turns.append({"role": "system", "content": body["instructions"]})
    data = body.get("input")
    if isinstance(data, str):
        turns.append({"role": "user", "content": data})
    elif isinstance(data, list):
        for item in data:
            if isinstance(item, str):
                turns.append({"role": "user", "content": item})
            elif isinstance(item, Mapping) and isinstance(item.get("role"), str):
                turns.append({"role": item["role"], "content": _blocks_text(item.get("content"))})
    return render_chat(turns)


def render_anthropic(body: Mapping[str, Any]) -> str:
    """An Anthropic Messages request (`system` + `messages` of text blocks) as one prompt."""
    turns: list[dict[str, Any]] = []
    if body.get("system") is not None:
        turns.append({"role": "system", "content": _blocks_text(body["system"])})
    for m in body.get("messages") or []:
        if isinstance(m, Mapping):
            turns.append({"role": str(m.get("role", "user")), "content": _blocks_text(m.get("content"))})
    return render_chat(turns)


def count_tokens(text: str) -> int:
    """Tokens in the simulator are whitespace-separated words."""
    return len(text.split())
