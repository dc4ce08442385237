"""Who may listen without a token, on the null device (engines open no kernel device; see
benchmarks/backends/nulldev.py)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import struct
import time
from collections.abc import Iterator

import pytest

from benchmarks.backends.nulldev import null_device
from hixl import Engine
from hixl.core import wire
from hixl.engine.handshake import WAIT_S
from hixl.errors import ArgumentError
from hixl.testbed.net import free_tcp_port
from hixl.testbed.rawpeer import RawClient


@pytest.fixture(autouse=True)
def _null() -> Iterator[None]:
    with null_device():
        yield


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "192.168.0.7", "[::]", "[fe80::1]"])
def test_listening_off_loopback_without_a_token_is_refused_naming_the_fix(host: str) -> None:
    with pytest.raises(ArgumentError, match=r"without a token.*token=.*insecure=True") as err:
        Engine(f"{host}:5000")
    assert "'hixl token'" in str(err.value)


def test_loopback_clients_and_tokens_need_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hixl"):
        for kwargs in (
            {"engine_id": f"127.0.0.1:{free_tcp_port()}"},
            {"engine_id": f"127.0.0.2:{free_tcp_port('127.0.0.2')}"},
            {"engine_id": f"0.0.0.0:{free_tcp_port('0.0.0.0')}", "token": secrets.token_hex(32)},
            {"engine_id": "10.1.2.3:0"},  # a client: it listens nowhere
        ):
            Engine(**kwargs).close()  # type: ignore[arg-type]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_insecure_listens_off_loopback_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hixl"):
        eng = Engine(f"0.0.0.0:{free_tcp_port('0.0.0.0')}", insecure=True)
        eng.close()
    warned = [r.getMessage() for r in caplog.records if eng.id in r.getMessage()]
    assert len(warned) == 1 and "without a token" in warned[0], warned


# --------------------------------------------------------------------------- per-source limits


def _busy_message(c: RawClient) -> str | None:
    msg = c.recv()
    return msg.message if isinstance(msg, wire.Error) and msg.code == wire.ErrorCode.BUSY else None


def _first_error(c: RawClient) -> wire.Error | None:
    msg = c.recv()
    return msg if isinstance(msg, wire.Error) else None


def test_handshakes_from_all_of_127_8_count_as_one_source() -> None:
    """4 idle sockets from each of 127.0.0.2..5 against max_handshakes_per_source=4: one
    host taking more loopback addresses gets no more handshakes.  The others wait for a
    slot, unread, and hear BUSY naming the source when none frees in time."""
    with Engine(f"127.0.0.1:{free_tcp_port()}", max_handshakes_per_source=4) as srv:
        socks = [RawClient(srv.id, f"127.0.0.{2 + i % 4}", timeout=5.0) for i in range(16)]
        try:
            most = 0
            deadline = time.monotonic() + WAIT_S + 2
            while srv.diagnostics().refused_busy < 4 and time.monotonic() < deadline:
                most = max(most, srv.diagnostics().handshakes)
                time.sleep(0.01)
            answers = [_first_error(c) for c in socks]
            diag = srv.diagnostics()
        finally:
            for s in socks:
                s.close()
    busy = [a.message for a in answers if a is not None and a.code == wire.ErrorCode.BUSY]
    late = [a for a in answers if a is not None and a.code == wire.ErrorCode.TIMEOUT]
    assert most <= 4 and diag.handshakes <= 4, (most, diag)
    assert len(busy) + len(late) == 16, answers  # each one had a slot or heard why not
    assert len(busy) >= 4 and diag.refused_busy == len(busy), (busy, diag)
    assert "127.0.0.0/8 (counted as one source)" in busy[0], busy
    assert f"waited {WAIT_S} s" in busy[0], busy


def test_one_source_holds_at_most_its_share_of_the_pre_auth_buffer() -> None:
    """12 sockets from one source each send a HELLO, then all but one byte of an INFO
    frame of the largest size: past a quarter of the handshakes' buffer budget (8 of
    those), the server refuses them (BUSY) instead of holding 12 MiB for one source."""
    frame = wire.MAX_PAYLOAD
    head = struct.pack("!4sHHI", b"HIXL", wire.PROTOCOL_VERSION, wire.MsgType.INFO, frame)
    with Engine(f"127.0.0.1:{free_tcp_port()}") as srv:
        socks = []
        try:
            for _ in range(12):
                c = RawClient(srv.id, "127.0.0.2", timeout=3.0)
                socks.append(c)
                c.send(wire.Hello(engine_id="127.0.0.2:0~ab", nonce=wire.make_nonce()))
                assert isinstance(c.recv(), wire.Challenge)
                with contextlib.suppress(OSError):  # refused while sending: reset
                    c.sock.sendall(head + bytes(frame - 1))
            time.sleep(0.5)  # the progress thread reads what was sent
            answers = [_busy_message(c) for c in socks]
            held = srv.diagnostics().handshakes
        finally:
            for c in socks:
                c.close()
    refused = [a for a in answers if a is not None]
    assert held <= 8, f"{held} half-sent INFO frames of 1 MiB held for one source"
    assert len(refused) >= 4 and "from one source" in refused[0], answers
