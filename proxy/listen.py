"""Every listening socket of the proxy is opened here: the HTTP data listener, the h2c/gRPC listener, the
admin listener, and the ports the --workers processes share.

The servers are handed a bound, listening socket (aiohttp's `web.SockSite`, asyncio's
`create_server(sock=...)`), so socket options, and later TLS and ALPN, have this one place to go.
"""

from __future__ import annotations

import socket

DATA_BACKLOG = 4096  # the data listeners take bursts of new connections (many clients, short requests)
ADMIN_BACKLOG = 128


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]]:
    """The first passive address for `host` (a literal, a name such as localhost, or "" for all)."""
    if not host:
        return socket.AF_INET, ("0.0.0.0", port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def listening_socket(host: str, port: int, *, reuse_port: bool = False, backlog: int = DATA_BACKLOG) -> socket.socket:
    """A bound, listening, non-blocking TCP socket on host:port (0 = any free port).

    `reuse_port`: SO_REUSEPORT, so that several worker processes (proxy/multiproc/) accept on one port.
    SO_REUSEADDR only steps over TIME_WAIT leftovers of a previous run, as asyncio's own servers do.
    """
    family, sockaddr = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen) a SO_REUSEPORT socket: fixes the real port for port 0 and holds it for workers.

    SO_REUSEPORT lets any process of the same user join a listening group, so a second proxy started by
    mistake on the same port would silently take half the connections. A probe bind without SO_REUSEPORT
    fails (EADDRINUSE) while anything listens there, ours or not, and so refuses to start like a single
    process would. (SO_REUSEADDR only steps over TIME_WAIT leftovers of a previous run.)
    """
    family = _family(host)
    if port != 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


__all__ = ["ADMIN_BACKLOG", "DATA_BACKLOG", "listening_socket", "reserve_port"]
