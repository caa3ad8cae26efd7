"""proxy/listen.py: the one place listening sockets are made (data, h2c/gRPC, admin, workers' shared ports)."""

from __future__ import annotations

import socket

import pytest

from proxy.listen import listening_socket, reserve_port


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
