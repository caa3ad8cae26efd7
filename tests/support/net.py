"""Ports and connections on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on right now (for a server a test starts, stops and starts again on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def established_to(port: int) -> int:
    """Established TCP connections whose remote end is 127.0.0.1:`port` (client side), from /proc/net/tcp."""
    count = 0
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and remote == f"0100007F:{port:04X}":
                count += 1
    return count
