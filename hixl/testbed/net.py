"""Small network helpers for tests, benchmarks and the demo: free ports, who is listening.

Both are test-bed conveniences, not part of the transfer API. ``free_tcp_port`` is racy by
nature (another process may take the port between the probe and its use), which is fine
for a single test or benchmark on one machine; callers that must not race bind port 0
themselves.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "free_tcp_port",
    "free_udp_port",
    "listening_ports",
    "read_listening_ports",
    "tcp_port_is_free",
]


def _free_port(kind: socket.SocketKind, host: str) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound to port 0, then closed)."""
    return _free_port(socket.SOCK_STREAM, host)


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port on ``host`` that was free a moment ago."""
    return _free_port(socket.SOCK_DGRAM, host)


def listening_ports(proc_net: Sequence[str]) -> set[int]:
    """TCP ports in LISTEN state (``0A``) in the texts of ``/proc/net/tcp`` and ``tcp6``.

    Pure: takes the files' contents, so it can be tested on any text.
    """
    ports: set[int] = set()
    for text in proc_net:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def read_listening_ports() -> set[int]:
    """The TCP ports this machine (or network namespace) listens on now, IPv4 and IPv6."""
    texts = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            texts.append(Path(name).read_text())
    return listening_ports(texts)


def tcp_port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` on ``host`` could be bound just now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
