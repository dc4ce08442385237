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

import time

import numpy as np

from hixl import Access, ConnState, Engine
from hixl.core import wire
from hixl.testbed.hosts import Control
from hixl.testbed.rawpeer import accepted, errors, raw_handshake

HOLD_S = 2.0
STALL_S = 0.6


def test_id_takeover_across_the_wire_is_refused(
    engine: Engine, agent: Control, peer_id: str
) -> None:
    dst = np.zeros(4096, np.uint8)
    engine.register(dst, access=Access.REMOTE_WRITE, name="takeover-dst")
    agent.call("put_loop_start", peer=engine.id, name="takeover-dst")
    try:
        time.sleep(1.0)
        # HELLO as host0's engine, then INFO for a queue pair that does not exist HOLD_S later.
        with raw_handshake(peer_id, engine.id, engine.device.gid, timeout=10, hold=HOLD_S) as thief:
            assert thief.info_sent is not None, f"no CHALLENGE: {thief.received}"
            answered = time.monotonic() - thief.info_sent
            got = thief.received
        time.sleep(1.0)
    finally:
        stats = agent.call("put_loop_stop")
    print(f"takeover across the wire: answered {got} in {answered:.3f} s; host1 puts {stats}")
    assert not accepted(thief), "the impostor got an ACCEPT"
    codes = [m.code for m in errors(thief)]
    assert codes == [wire.ErrorCode.ALREADY_CONNECTED], got
    assert answered < 1.0, f"the impostor waited {answered:.2f} s for its answer"
    assert agent.call("conn", peer=engine.id)["state"] == "READY"
    assert engine.connection(peer_id).state is ConnState.READY
    assert stats["count"] > 10 and not stats["alive"], stats
    assert stats["max_s"] < STALL_S, f"host1's puts stalled up to {stats['max_s']:.3f} s"
    assert dst.any(), "host1's puts did not land"
