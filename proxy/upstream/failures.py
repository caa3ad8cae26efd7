"""aiohttp specifics of retries: which upstream errors are which failure kind, and is the client still there.

The protocol-neutral loop, budget and backoff are in proxy/dataplane/retry.py; this module only maps aiohttp's
exception zoo onto the `Outcome` kinds the retry policy and outlier detection reason about.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from proxy.core.decision import Outcome
from proxy.upstream.errors import UpstreamConnectError


def classify_upstream_error(exc: BaseException) -> Outcome | None:
    """CONNECT_FAILURE: nothing reached the backend (refused, unreachable, connect timeout).
    RESET: the connection broke before a complete answer (closed keep-alive, reset, truncated body).
    None: the request timed out after it was sent: maybe a long prefill, not retried, counted as a 5xx.
    """
    if isinstance(exc, (UpstreamConnectError, aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return Outcome.CONNECT_FAILURE
    if isinstance(exc, asyncio.TimeoutError):
        return None
    return Outcome.RESET


def client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


__all__ = ["classify_upstream_error", "client_gone"]
