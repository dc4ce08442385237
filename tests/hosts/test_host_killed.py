"""host1's VM is cut off in the middle of a put: host0 fails it in time and stays usable.

The victim leaves no FIN and no NAK (the runner kills its QEMU): its packets just stop.
rxe keeps retransmitting (retry count 7), so what ends the put is its deadline:
``TransferTimeout`` after ``TIMEOUT_S``, never a hang. The other errors are accepted too,
in case a device gives up earlier (``IBV_WC_RETRY_EXC_ERR``) or the control socket
notices first.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from hixl import Access, CompletionError, ConnectionFailed, ConnState, Engine, TransferTimeout
from hixl.testbed.hosts import Control, HostEnv

from .agent import pattern
from .driver import remote_buffer

TIMEOUT_S = 12.0
NBYTES = 16 << 20  # about 1.5 s on this wire: long enough to be cut in the middle


@pytest.mark.kills_peer
def test_peer_host_vanishes_mid_transfer(
    engine: Engine, agent: Control, peer_id: str, host: HostEnv
) -> None:
    remote_buffer(agent, engine, peer_id, "victim", NBYTES)
    src = np.full(NBYTES, 0xAB, np.uint8)
    region = engine.register(src, name="victim-src")
    agent.call("vanish_when_written", name="victim", seconds=60.0)
    agent.close()  # host1 is about to vanish: nothing more to say to it
    t0 = time.monotonic()
    handle = engine.put_async(peer_id, region, "victim", timeout=TIMEOUT_S)
    with pytest.raises((CompletionError, TransferTimeout, ConnectionFailed)) as err:
        handle.wait(timeout=TIMEOUT_S + 10.0)
    took = time.monotonic() - t0
    print(f"put to the vanished host failed after {took:.2f} s: {err.value!r}")
    assert took < TIMEOUT_S + 2.0
    until = time.monotonic() + 2.0  # marked FAILED in the round that failed the put
    while engine.connection(peer_id).state is not ConnState.FAILED:
        assert time.monotonic() < until, engine.connection(peer_id)
        time.sleep(0.01)

    # The survivor is still usable: new memory, a new connection, a verified transfer.
    with Engine(f"{host.address}:5001", insecure=True) as other:
        dst = np.zeros(1 << 20, np.uint8)
        other.register(dst, access=Access.REMOTE_WRITE, name="survivor")
        small = pattern(3, 1 << 20)
        r = engine.register(small, name="survivor-src")
        engine.connect(other.id, timeout=10.0)
        engine.put(other.id, r, "survivor", notify="alive", timeout=30.0)
        other.wait_notification("alive", timeout=10.0)
        assert np.array_equal(dst, small)
        engine.disconnect(other.id)
