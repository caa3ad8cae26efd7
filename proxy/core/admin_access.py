"""The one rule for admin writes, whichever door they come through (HTTP admin API, gRPC ProxyAdmin).

- An admin token is configured: a write must carry ``Authorization: Bearer <token>`` (HTTP header or gRPC
  metadata), compared in constant time.
- No token: writes are accepted only when the listener they arrive on is bound to loopback; on any other
  address they are refused, since anyone who can reach the port could otherwise drain the fleet.

Plain data in, a decision out: the adapters turn a refusal into their protocol's answer (HTTP 403/401,
gRPC PERMISSION_DENIED/UNAUTHENTICATED).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Literal

NEEDS_TOKEN = ("admin write endpoints need admin.token (or token_env) when the admin listener is not on "
               "loopback")
WRONG_TOKEN = "missing or wrong bearer token"


@dataclass(frozen=True)
class Refusal:
    kind: Literal["forbidden", "unauthorized"]  # no token configured off loopback | missing or wrong token
    message: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_refusal(token: str | None, listener_host: str, authorization: str | None) -> Refusal | None:
    """Why an admin write is refused, or None when it is allowed."""
    if token is None:
        return None if is_loopback(listener_host) else Refusal("forbidden", NEEDS_TOKEN)
    given = (authorization or "").encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, f"Bearer {token}".encode("utf-8", "surrogateescape")):
        return Refusal("unauthorized", WRONG_TOKEN)
    return None


__all__ = ["NEEDS_TOKEN", "Refusal", "WRONG_TOKEN", "is_loopback", "write_refusal"]
