"""A live listener facing garbage: every bad handshake is refused, and it keeps serving."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl import Access, Engine
from hixl.core import wire as _wire
from hixl.engine.handshake import FIRST_FRAME_S
from hixl.testbed.net import free_tcp_port


@pytest.fixture(scope="module")
def listener() -> Iterator[Engine]:
    eng = Engine(f"127.0.0.1:{free_tcp_port()}", handshake_timeout=HANDSHAKE_TIMEOUT)
    eng.register(np.zeros(4096, np.uint8), access=Access.REMOTE_WRITE, name="secret")
    try:
        yield eng
    finally:
        eng.close()


HANDSHAKE_TIMEOUT = 2.0
V = _wire.PROTOCOL_VERSION


def _send_raw(engine: Engine, data: bytes, half_close: bool = True) -> tuple[bytes, float]:
    """Send ``data`` as a client would; return what came back and when the listener closed.

    Fails the test when the listener has not closed the socket within its handshake
    deadline plus a second of slack.
    """
    host, port = engine.id.rsplit(":", 1)
    limit = HANDSHAKE_TIMEOUT + 1.0
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            s.settimeout(max(0.01, t0 + limit - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                pytest.fail(f"listener kept a bad handshake open for more than {limit} s")
            if not chunk:
                break
            out += chunk
        return out, time.monotonic() - t0


def _refused(reply: bytes) -> None:
    """The listener answered a bad handshake with ERROR frames or nothing, never with keys."""
    msgs = _wire.Decoder().feed(reply)
    assert all(isinstance(m, _wire.Error) for m in msgs), msgs


def _still_serves(engine: Engine) -> None:
    with Engine("127.0.0.1:0") as client:
        conn = client.connect(engine.id, timeout=20)
        assert conn.remote_region("secret").length == 4096
        client.disconnect(engine.id)


hello = _wire.encode(_wire.Hello(engine_id="127.0.0.1:0~ab", nonce=bytes(16)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.binary(max_size=256),  # garbage
        st.integers(1, len(hello) - 1).map(lambda n: hello[:n]),  # truncated
        st.binary(max_size=64).map(lambda b: struct.pack("!4sHHI", b"HIXL", V, 1, 1 << 30) + b),
        st.binary(max_size=64).map(lambda b: struct.pack("!4sHHI", b"HIXL", 9, 1, 4) + b),
        st.binary(min_size=1, max_size=200).map(
            lambda b: struct.pack("!4sHHI", b"HIXL", V, 3, len(b)) + b
        ),  # INFO junk first
    )
)
def test_bad_handshakes_are_refused(listener: Engine, data: bytes) -> None:
    reply, _ = _send_raw(listener, data)
    _refused(reply)


def test_listener_keeps_serving_after_fuzz(listener: Engine) -> None:
    _send_raw(listener, b"\x00" * 100)
    _, waited = _send_raw(listener, hello[:5], half_close=False)  # a slow client times out
    # ... at the first step's deadline (its HELLO is due within FIRST_FRAME_S), not before
    assert waited >= FIRST_FRAME_S - 0.05, f"closed after {waited:.2f} s, before its deadline"
    _still_serves(listener)


def test_oversized_frame_is_refused_without_buffering(listener: Engine) -> None:
    reply, _ = _send_raw(listener, struct.pack("!4sHHI", b"HIXL", V, 1, 0xFFFFFFFF))
    _refused(reply)
    _still_serves(listener)
