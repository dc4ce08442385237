"""What a peer's control messages may cost the engine after the handshake, on the null
device (engines open no kernel device; see benchmarks/backends/nulldev.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from benchmarks.backends.nulldev import null_device
from hixl import Access, ConnState, Engine
from hixl.core import wire
from hixl.core.seal import Opener, session_keys
from hixl.engine.connection import REGIONS_FRAMES_PER_S
from hixl.testbed.net import free_tcp_port
from hixl.testbed.rawpeer import accepted, raw_handshake


@pytest.fixture(autouse=True)
def _null() -> Iterator[None]:
    with null_device():
        yield


def _wait(cond: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _regions(n: int) -> tuple[wire.RemoteRegion, ...]:
    return tuple(
        wire.RemoteRegion(
            addr=0x10000 + i * 4096, length=4096, rkey=i + 1, access=6, name=f"{i:0128d}"
        )
        for i in range(n)
    )


def test_a_control_frame_over_the_limit_fails_that_connection_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sealed REGIONS frame larger than CONTROL_MAX_PAYLOAD is refused from its header
    (never decoded): that connection fails, the others stay."""
    big = wire.encode(wire.Regions(add=_regions(200)))
    assert len(big) - wire.HEADER_SIZE > wire.CONTROL_MAX_PAYLOAD
    with (
        Engine(f"127.0.0.1:{free_tcp_port()}") as srv,
        Engine("127.0.0.1:0") as honest,
        caplog.at_level(logging.WARNING, logger="hixl"),
    ):
        srv.register(np.zeros(4096, np.uint8), access=Access.REMOTE_WRITE, name="dst")
        honest.connect(srv.id)
        c = raw_handshake(srv.id, "127.0.0.1:0~b16", srv.device.gid)
        try:
            assert accepted(c), c.received
            assert _wait(lambda: "127.0.0.1:0~b16" in srv.peers, 5)
            c.sock.sendall(c.sealer().seal(big))
            gone = _wait(lambda: "127.0.0.1:0~b16" not in srv.peers, 5)
        finally:
            c.close()
        assert gone, srv.peers
        assert srv.connection(honest.id).state is ConnState.READY
    said = [r.getMessage() for r in caplog.records if "~b16" in r.getMessage()]
    assert any(f"more than max_payload={wire.CONTROL_MAX_PAYLOAD}" in m for m in said), said


def test_many_registrations_reach_a_connected_peer() -> None:
    """600 registrations with 128-character names while a peer is connected: every
    announcement fits the peer's control-frame limit, and the peer sees all of them."""
    with Engine(f"127.0.0.1:{free_tcp_port()}") as srv, Engine("127.0.0.1:0") as cli:
        cli.connect(srv.id)
        bufs = [np.zeros(4096, np.uint8) for _ in range(600)]
        for i, b in enumerate(bufs):
            srv.register(b, access=Access.REMOTE_WRITE, name=f"{i:0128d}")
        conn = cli.connection(srv.id)
        assert _wait(lambda: len(conn.remote_regions) == 600, 10), len(conn.remote_regions)
        assert conn.state is ConnState.READY


def test_a_burst_of_registrations_reaches_a_peer_in_few_frames() -> None:
    """200 registrations in a row while a peer is connected: the peer learns of every one,
    in at most the REGIONS frames the pace allows (a burst of REGIONS_FRAMES_PER_S, then
    that many a second, the changes made meanwhile merged), not in a frame each."""
    with Engine(f"127.0.0.1:{free_tcp_port()}") as srv:
        c = raw_handshake(srv.id, "127.0.0.1:0~b0257", srv.device.gid)
        try:
            assert accepted(c), c.received
            assert _wait(lambda: "127.0.0.1:0~b0257" in srv.peers, 5)
            challenge = next(m for m in c.received if isinstance(m, wire.Challenge))
            accept = next(m for m in c.received if isinstance(m, wire.Accept))
            assert c.hello is not None and c.info is not None
            opener = Opener(session_keys(None, c.hello, challenge, c.info, accept)[1])
            bufs = [np.zeros(256, np.uint8) for _ in range(200)]
            start = time.monotonic()
            for b in bufs:
                srv.register(b, access=Access.REMOTE_WRITE)
            held: dict[tuple[int, int], wire.RemoteRegion] = {}
            frames = 0
            while len(held) < 200:
                msg = c.recv()
                assert msg is not None, f"peer saw {len(held)} of 200 regions, then silence"
                inner = opener.open(msg)
                if isinstance(inner, wire.Regions):
                    frames += 1
                    for r in inner.remove:
                        held.pop((r.rkey, r.addr), None)
                    held.update(((r.rkey, r.addr), r) for r in inner.add)
            took = time.monotonic() - start
        finally:
            c.close()
    # The pace's burst and rate, plus the frames of the last change let through (one
    # change may need several frames): at most all 200 regions' worth.
    split = len(wire.regions_frames(add=tuple(held.values())))
    allowed = REGIONS_FRAMES_PER_S * (1 + took) + 1 + split
    assert frames <= allowed, f"{frames} REGIONS frames in {took:.2f} s (at most {allowed:.0f})"
    assert {r.addr for r in held.values()} == {b.ctypes.data for b in bufs}
