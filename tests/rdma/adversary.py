"""What the adversarial tests share: a tampering proxy between two engines, a listening
engine with a region to attack, and small probes (resident memory, engine addresses)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hixl import (
    Access,
    Engine,
    HandshakeError,
)
from hixl.core import wire
from hixl.testbed.net import free_tcp_port

RW = Access.REMOTE_READ | Access.REMOTE_WRITE


def addr_of(engine_id: str) -> tuple[str, int]:
    host, port = wire.parse_engine_id(engine_id)
    return host, port


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serving_engine() -> Engine:
    """A listening engine on a free port with 64 KiB registered as ``dst`` (RW)."""
    eng = Engine(f"127.0.0.1:{free_tcp_port()}")
    try:
        eng.register(np.zeros(1 << 16, np.uint8), access=RW, name="dst")
    except BaseException:
        eng.close()
        raise
    return eng


# --------------------------------------------------------------------------- a fake server's fields


def challenge_fields(engine_id: str, nonce: bytes) -> dict[str, Any]:
    fields: dict[str, Any] = {"engine_id": engine_id, "nonce": nonce}
    if "proof" in wire.Challenge.__dataclass_fields__:  # protocol version 1
        fields["proof"] = b""
    return fields


# --------------------------------------------------------------------------- a tampering proxy


class Proxy:
    """Relays one TCP connection frame by frame, letting ``tamper`` rewrite messages.

    ``tamper(direction, msg)`` gets ``"up"`` (client to server) or ``"down"`` and returns
    the message to forward. Frames are re-encoded, so only message values cross.
    """

    def __init__(self, upstream: str, tamper: Callable[[str, wire.Message], wire.Message]):
        self.upstream = upstream
        self.tamper = tamper
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.id = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.out: dict[str, socket.socket] = {}  # the last connection's socket per direction
        self.seen: dict[str, list[wire.Message]] = {"up": [], "down": []}
        self._send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self.listener.accept()
                up = socket.create_connection(addr_of(self.upstream), timeout=10)
                up.settimeout(None)
                self.socks += [down, up]
                self.out = {"up": up, "down": down}
                for src, dst, way in ((down, up, "up"), (up, down, "down")):
                    threading.Thread(target=self._relay, args=(src, dst, way), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        dec = wire.Decoder()
        with contextlib.suppress(OSError, HandshakeError):
            while data := src.recv(65536):
                for msg in dec.feed(data):
                    self.seen[way].append(msg)
                    with self._send_lock:
                        dst.sendall(wire.encode(self.tamper(way, msg)))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def inject(self, way: str, data: bytes) -> None:
        """Send ``data`` (whole frames) on the last connection, ``"up"`` or ``"down"``."""
        with self._send_lock:
            self.out[way].sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


def passthrough(way: str, msg: wire.Message) -> wire.Message:
    return msg


def wait_for(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond()`` held; ``timeout`` + 1 if it never did within ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return timeout + 1
        time.sleep(0.005)
    return time.monotonic() - t0
