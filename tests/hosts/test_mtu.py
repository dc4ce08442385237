"""Two NICs with different MTUs: each port reports its own, the connection the smaller."""

from __future__ import annotations

import hashlib

from hixl import ContiguousDesc, Engine
from hixl.testbed.hosts import Control

from .agent import pattern, port_state
from .driver import remote_buffer

# make test-hosts starts host0 with MTU 1500 and host1 with 9000: rxe's RoCE MTU is
# then 1024 and 4096. If the run was started otherwise this test fails on purpose.
HOST0_ROCE_MTU = 1024
HOST1_ROCE_MTU = 4096


def test_path_mtu_is_negotiated_down(engine: Engine, agent: Control, peer_id: str) -> None:
    assert port_state()["active_mtu"] == HOST0_ROCE_MTU
    assert agent.call("port")["active_mtu"] == HOST1_ROCE_MTU
    assert engine.connection(peer_id).mtu == HOST0_ROCE_MTU
    theirs = agent.call("conn", peer=engine.id)
    assert theirs == {"ok": True, "state": "READY", "mtu": HOST0_ROCE_MTU}


def test_transfer_at_the_negotiated_mtu(engine: Engine, agent: Control, peer_id: str) -> None:
    # One message spanning many 1024-byte packets plus a tail, written from host0.
    nbytes = 64 * HOST1_ROCE_MTU + 7 * 64
    remote_buffer(agent, engine, peer_id, "mtu-dst", nbytes)
    src = pattern(5, nbytes)
    region = engine.register(src, name="mtu-src")
    engine.put(
        peer_id,
        region,
        "mtu-dst",
        local_desc=ContiguousDesc(offset=0, nbytes=nbytes),
        remote_desc=ContiguousDesc(offset=0, nbytes=nbytes),
        notify="mtu",
        timeout=60.0,
    )
    agent.call("wait_note", name="mtu", seconds=30.0)
    assert agent.call("sha", name="mtu-dst")["sha"] == hashlib.sha256(src.tobytes()).hexdigest()
