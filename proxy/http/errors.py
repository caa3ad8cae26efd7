"""OpenAI-shaped errors, as JSON responses and as SSE events.

Clients (the `openai` SDK first of all) parse `{"error": {"message", "type", "param", "code"}}`; anything
else surfaces as an opaque failure. Mid-stream the status line is long gone, so the same object travels as
one SSE `data:` event, which the SDK turns into an `APIError`.
"""

from __future__ import annotations

import json

from aiohttp import web


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_, code, param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    """A final SSE event; it starts with a blank line in case the backend died in the middle of an event."""
    return b"\n\ndata: " + error_body(message, type_, code) + b"\n\n"
