"""OpenAI-shaped errors, as bytes: a JSON error body and an SSE error event (no transport, no framework).

Clients (the `openai` SDK first of all) parse `{"error": {"message", "type", "param", "code"}}`; anything
else surfaces as an opaque failure. Mid-stream the status line is long gone, so the same object travels as
one SSE `data:` event, which the SDK turns into an `APIError`. Both HTTP paths (aiohttp for HTTP/1.1,
the HTTP/2 bridge on the gRPC listener) build their error answers from these.
"""

from __future__ import annotations

import json


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def sse_error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    """A final SSE event; it starts with a blank line in case the backend died in the middle of an event."""
    return b"\n\ndata: " + error_body(message, type_, code) + b"\n\n"


class ClientGone(ConnectionResetError):
    """The client left while its request was being answered (its connection was closing when the answer's
    first bytes were written): nothing is answered, and nothing is said of the backend. A ConnectionError, so
    that the protocol adapters end the connection as they do for any write to a departed client."""


__all__ = ["ClientGone", "error_body", "sse_error_event"]
