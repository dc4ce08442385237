"""Someone on the wire claims the id of a connected engine: refused, nothing stalls.

host0's engine is connected to host1's. A raw client on host0 opens a new handshake to
host1 claiming host0's engine id (no token: anyone could). host1 must answer
ERROR(ALREADY_CONNECTED) without sending its keys, keep the live connection, and keep
its own puts to host0 flowing meanwhile.

The impostor holds its handshake open for ``HOLD_S`` before it sends INFO. A listener
that let a handshake block the data path would stall host1's puts for at least that
long; a put under emulation on a busy host can take a fifth of a second on its own (CI
saw 0.18 s with a 100 ms bound), so the bound on a put, ``STALL_S``, sits between the two.
"""

from __future__ import annotations

import socket
import time

import numpy as np

from hixl import Access, ConnState, Engine
from hixl.core import wire
from hixl.testbed.hosts import Control

HOLD_S = 2.0
STALL_S = 0.6


def _claim(target: str, claim: str, gid: bytes, hold_s: float) -> tuple[list[wire.Message], float]:
    """HELLO as ``claim``, then ``hold_s`` later INFO for a queue pair that does not exist.

    Returns what came back and how long the answer took after INFO was sent.
    """
    host, port = wire.parse_engine_id(target)
    got: list[wire.Message] = []
    dec = wire.Decoder()
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=10 + hold_s) as s:
        s.sendall(wire.encode(wire.Hello(engine_id=claim, nonce=wire.make_nonce())))
        info = wire.Info(
            proof=b"", qpn=0x321, psn=0, gid=gid, mtu=1024, max_sge=1, recv_slots=0,
            recv_slot_size=0,
        )  # fmt: skip
        sent_info = False
        while data := s.recv(65536):
            got += dec.feed(data)
            if not sent_info and any(isinstance(m, wire.Challenge) for m in got):
                time.sleep(hold_s)
                t0 = time.monotonic()
                s.sendall(wire.encode(info))
                sent_info = True
            if any(isinstance(m, wire.Error | wire.Accept) for m in got):
                break
    return got, time.monotonic() - t0


def test_id_takeover_across_the_wire_is_refused(
    engine: Engine, agent: Control, peer_id: str
) -> None:
    dst = np.zeros(4096, np.uint8)
    engine.register(dst, access=Access.REMOTE_WRITE, name="takeover-dst")
    agent.call("put_loop_start", peer=engine.id, name="takeover-dst")
    time.sleep(1.0)
    got, answered = _claim(peer_id, engine.id, engine.device.gid, HOLD_S)
    time.sleep(1.0)
    stats = agent.call("put_loop_stop")
    print(f"takeover across the wire: answered {got} in {answered:.3f} s; host1 puts {stats}")
    assert not any(isinstance(m, wire.Accept) for m in got), "the impostor got an ACCEPT"
    codes = [m.code for m in got if isinstance(m, wire.Error)]
    assert codes == [wire.ErrorCode.ALREADY_CONNECTED], got
    assert answered < 1.0, f"the impostor waited {answered:.2f} s for its answer"
    assert agent.call("conn", peer=engine.id)["state"] == "READY"
    assert engine.connection(peer_id).state is ConnState.READY
    assert stats["count"] > 10 and not stats["alive"], stats
    assert stats["max_s"] < STALL_S, f"host1's puts stalled up to {stats['max_s']:.3f} s"
    assert dst.any(), "host1's puts did not land"
