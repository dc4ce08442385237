"""Free local ports for test servers, benchmarks and the multi-host tier."""

from __future__ import annotations

import socket

__all__ = ["free_tcp_port", "free_udp_port"]


def _free(kind: socket.SocketKind, host: str) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing is bound to right now (it may be taken later)."""
    return _free(socket.SOCK_STREAM, host)


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port on ``host`` that nothing is bound to right now."""
    return _free(socket.SOCK_DGRAM, host)
