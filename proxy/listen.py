"""Every listening socket of the proxy is opened here: the HTTP data listener, the h2c/gRPC listener, the
admin listener, and the ports the --workers processes share.

The servers are handed a bound, listening socket (the HTTP/1.1 listener and asyncio's
`create_server(sock=...)`), so socket options, TLS (proxy/tls.py) and ALPN have this one place to go.

One port for every protocol: the main data listener accepts HTTP/1.1, HTTP/2 over TLS (ALPN `h2`), h2c
with prior knowledge (the 24-byte connection preface) and gRPC. `ProtocolSniffer` is the tiny adapter
that decides per connection, from the negotiated ALPN or the first bytes, and hands the transport to the
HTTP/1.1 protocol or to the HTTP/2 side (proxy/grpc/downstream.py), both generically:
``proto = factory(); transport.set_protocol(proto); proto.connection_made(transport); proto.data_received(first)``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Callable


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


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A connection that sends no byte for this long is closed, unless the listener says otherwise (the HTTP/1.1
# listener passes its client header timeout: an idle socket is closed as the HTTP/1.1 side would close it).
SNIFF_TIMEOUT_S = 30.0

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class ProtocolSniffer(asyncio.Protocol):
    """The first protocol of every main-listener connection: picks HTTP/1.1 or HTTP/2, then steps aside.

    Over TLS the negotiated ALPN decides at once (the handshake is over when `connection_made` runs);
    without ALPN (plaintext, or a TLS client that offered none) the first bytes do: the exact HTTP/2
    connection preface means h2c with prior knowledge, anything else is HTTP/1.1. At most 24 bytes are
    held back, and they are handed to the chosen protocol as its first `data_received`.
    """

    __slots__ = ("_http1", "_h2", "_transport", "_buf", "_timer", "_timeout_s")

    def __init__(self, http1: ProtocolFactory, h2: ProtocolFactory, timeout_s: float = SNIFF_TIMEOUT_S) -> None:
        self._http1 = http1
        self._h2 = h2
        self._timeout_s = timeout_s
        self._transport: asyncio.BaseTransport | None = None
        self._buf = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sslobj = transport.get_extra_info("ssl_object")
        alpn = sslobj.selected_alpn_protocol() if sslobj is not None else None
        if alpn == "h2":
            self._hand(self._h2, b"")
        elif alpn == "http/1.1":
            self._hand(self._http1, b"")
        else:
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, transport.close)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        n = min(len(buf), len(H2_PREFACE))
        if buf[:n] != H2_PREFACE[:n]:
            self._hand(self._http1, buf)
        elif n == len(H2_PREFACE):
            self._hand(self._h2, buf)
        else:
            self._buf = buf

    def eof_received(self) -> bool:
        return False  # closed before a protocol was chosen: nothing to answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _hand(self, factory: ProtocolFactory, first: bytes) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        assert transport is not None
        self._buf = b""
        proto = factory()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if first:
            proto.data_received(first)  # type: ignore[attr-defined]  # both sides are stream protocols


def sniffing(http1: ProtocolFactory, h2: ProtocolFactory | None, timeout_s: float = SNIFF_TIMEOUT_S) -> ProtocolFactory:
    """The protocol factory of a listener that serves HTTP/1.1 and, when `h2` is given, HTTP/2 too; a
    connection that sends nothing for `timeout_s` before a protocol is chosen is closed."""
    if h2 is None:
        return http1
    return lambda: ProtocolSniffer(http1, h2, timeout_s)


__all__ = [
    "ADMIN_BACKLOG", "DATA_BACKLOG", "H2_PREFACE", "ProtocolSniffer", "listening_socket",
    "reserve_port", "sniffing",
]
