"""How an exchange with a backend failed (raised by proxy/upstream/http1.py).

A module of their own, imported by the upstream client: exception classes that derive from the built-in
OSError and TimeoutError families cannot be compiled by mypyc (proxy/native), so they stay interpreted.
"""

from __future__ import annotations

import asyncio


class UpstreamError(ConnectionError):
    """The exchange with a backend failed; subclasses say how far it got."""


class UpstreamConnectError(UpstreamError):
    """Nothing reached the backend: refused, unreachable, or the connect timed out."""


class UpstreamReset(UpstreamError):
    """The connection broke before the response was complete."""


class UpstreamProtocolError(UpstreamError):
    """The backend answered something that is not HTTP/1.x."""


class UpstreamTimeout(asyncio.TimeoutError):
    """The whole exchange took longer than `timeouts.request_s`."""
