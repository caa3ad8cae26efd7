"""proxy/listen.py: the one place listening sockets are made (data, h2c/gRPC, admin, workers' shared ports)."""

from __future__ import annotations

import socket

import pytest

from proxy.listen import H2_PREFACE, ProtocolSniffer, listening_socket, reserve_port


def test_port_zero_gets_a_real_listening_port() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and sock.getblocking() is False
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # accepted into the backlog: the socket listens
    finally:
        sock.close()


def test_a_taken_port_is_a_clear_error_unless_shared_on_purpose() -> None:
    first = listening_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listening_socket("127.0.0.1", port)
    finally:
        first.close()
    # The workers' scheme: the supervisor reserves the port, every worker listens on it with SO_REUSEPORT.
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    workers = [listening_socket("127.0.0.1", port, reuse_port=True) for _ in range(2)]
    try:
        assert {w.getsockname()[1] for w in workers} == {port}
    finally:
        for w in workers:
            w.close()
        reserved.close()


def test_host_names_resolve_to_one_address() -> None:
    sock = listening_socket("localhost", 0)
    try:
        assert sock.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        sock.close()


class _Recorder:
    def __init__(self, kind: str, made: list[tuple[str, bytes]]) -> None:
        self.kind = kind
        self.made = made
        self.transport: object = None

    def connection_made(self, transport: object) -> None:
        self.transport = transport
        self.made.append((self.kind, b""))

    def data_received(self, data: bytes) -> None:
        self.made.append((self.kind, data))


class _Transport:
    def __init__(self, alpn: str | None = None) -> None:
        self.protocol: object = None
        self.closed = False
        self._alpn = alpn

    def get_extra_info(self, name: str) -> object:
        if name == "ssl_object" and self._alpn is not None:
            alpn = self._alpn

            class _Ssl:
                def selected_alpn_protocol(self) -> str:
                    return alpn
            return _Ssl()
        return None

    def set_protocol(self, protocol: object) -> None:
        self.protocol = protocol

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("alpn", "chunks", "kind", "first"), [
    (None, [b"GET / HTTP/1.1\r\n"], "http1", b"GET / HTTP/1.1\r\n"),
    (None, [b"P", b"OST / HTTP/1.1\r\n"], "http1", b"POST / HTTP/1.1\r\n"),  # 'P' alone could be either
    (None, [H2_PREFACE[:10], H2_PREFACE[10:] + b"\x00\x00"], "h2", H2_PREFACE + b"\x00\x00"),
    ("h2", [], "h2", b""),  # TLS: ALPN decides before any byte
    ("http/1.1", [], "http1", b""),
])
async def test_sniffer_hands_the_transport_to_the_right_protocol(alpn: str | None, chunks: list[bytes],
                                                                  kind: str, first: bytes) -> None:
    made: list[tuple[str, bytes]] = []
    sniffer = ProtocolSniffer(lambda: _Recorder("http1", made), lambda: _Recorder("h2", made))  # type: ignore[arg-type, return-value]  # duck-typed test doubles
    transport = _Transport(alpn)
    sniffer.connection_made(transport)  # type: ignore[arg-type]  # a duck-typed transport
    for c in chunks:
        if transport.protocol is None:
            sniffer.data_received(c)
    assert made[0] == (kind, b"")  # connection_made on the chosen protocol, then the held-back bytes
    assert b"".join(d for _, d in made[1:]) == first
    assert isinstance(transport.protocol, _Recorder) and transport.protocol.kind == kind
    sniffer.connection_lost(None)
