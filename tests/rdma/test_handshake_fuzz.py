"""A live listener facing garbage: every bad handshake is refused, and it keeps serving."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl import Access, Engine, _wire
from hixl.testbed.net import free_tcp_port


@pytest.fixture(scope="module")
def listener() -> Iterator[Engine]:
    eng = Engine(f"127.0.0.1:{free_tcp_port()}", handshake_timeout=2.0)
    eng.register(np.zeros(4096, np.uint8), access=Access.REMOTE_WRITE, name="secret")
    try:
        yield eng
    finally:
        eng.close()


def _send_raw(engine: Engine, data: bytes, half_close: bool = True) -> bytes:
    """Send ``data`` as a client would and return whatever comes back before close."""
    host, port = engine.id.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _no_keys_leaked(reply: bytes) -> None:
    # Whatever the listener answered, it never sent an ACCEPT (which carries rkeys).
    dec = _wire.Decoder()
    try:
        msgs = dec.feed(reply)
    except Exception:  # noqa: BLE001 - a partial reply is fine, we look for ACCEPT only
        msgs = []
    assert not any(isinstance(m, _wire.Accept) for m in msgs)


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
        st.binary(max_size=64).map(lambda b: struct.pack("!4sHHI", b"HIXL", 1, 1, 1 << 30) + b),
        st.binary(max_size=64).map(lambda b: struct.pack("!4sHHI", b"HIXL", 9, 1, 4) + b),
        st.binary(min_size=1, max_size=200).map(
            lambda b: struct.pack("!4sHHI", b"HIXL", 1, 3, len(b)) + b
        ),  # INFO junk first
    )
)
def test_bad_handshakes_are_refused(listener: Engine, data: bytes) -> None:
    _no_keys_leaked(_send_raw(listener, data))


def test_listener_keeps_serving_after_fuzz(listener: Engine) -> None:
    _send_raw(listener, b"\x00" * 100)
    _send_raw(listener, hello[:5], half_close=False)  # a slow client times out
    _still_serves(listener)


def test_oversized_frame_is_refused_without_buffering(listener: Engine) -> None:
    reply = _send_raw(listener, struct.pack("!4sHHI", b"HIXL", 1, 1, 0xFFFFFFFF))
    _no_keys_leaked(reply)
    _still_serves(listener)
