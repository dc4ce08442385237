"""Lanes: several queue pairs per connection, posted by two threads at once.

Single requests go round robin over the lanes, which complete in any order among
themselves; a notification still arrives only after everything queued before it on
every lane has landed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from hixl.core.descriptors import BlockListDesc, ContiguousDesc
from hixl.engine import Access, Engine, Region, TransferHandle, TransferStatus

from .conftest import listening_engine

RW = Access.REMOTE_READ | Access.REMOTE_WRITE


def _put_each(client: Engine, peer: str, r: Region, n: int, size: int) -> list[TransferHandle]:
    """``n`` puts of ``size`` bytes, block ``i`` of ``r`` to block ``i`` of the peer's "dst"."""
    return [
        client.put_async(
            peer,
            r,
            "dst",
            local_desc=ContiguousDesc(offset=i * size, nbytes=size),
            remote_desc=ContiguousDesc(offset=i * size, nbytes=size),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(("ours", "theirs"), [(2, 2), (3, 1), (1, 2), (3, 2)])
def test_a_connection_has_as_many_lanes_as_both_ends_made(ours: int, theirs: int) -> None:
    server = listening_engine(lanes=theirs)
    client = Engine("127.0.0.1:0", lanes=ours)
    try:
        size, n = 4096, 16
        dst = np.zeros(size * n, np.uint8)
        server.register(dst, access=RW, name="dst")
        src = np.random.default_rng(ours * 10 + theirs).integers(0, 256, size * n, np.uint8)
        r = client.register(src)
        conn = client.connect(server.id, timeout=30)
        assert len(conn.lanes) == min(ours, theirs)
        deadline = time.monotonic() + 10  # the server adopts it once READY has arrived
        while client.id not in server.peers:
            assert time.monotonic() < deadline, "the server never saw the connection"
            time.sleep(0.01)
        assert len(server.connection(client.id).lanes) == min(ours, theirs)
        handles = _put_each(client, server.id, r, n, size)
        for h in handles:
            h.wait(30)
            assert h.status is TransferStatus.DONE
        assert np.array_equal(dst, src)
        back = np.zeros_like(src)
        client.get(server.id, client.register(back, access=Access.LOCAL_WRITE), "dst")
        assert np.array_equal(back, src)
    finally:
        client.close()
        server.close()


def test_a_notification_waits_for_the_data_on_every_lane(pair: tuple[Engine, Engine]) -> None:
    """Puts spread over the lanes, then at once a notification (lane 0): when the target
    sees it, every byte of every put has landed.  Without the hold, the notification
    overtakes puts still queued or in flight on the other lane."""
    client, server = pair
    size, n, rounds = 16384, 48, 6
    dst = np.zeros(size * n, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = np.zeros(size * n, np.uint8)
    r = client.register(src)
    conn = client.connect(server.id, timeout=30)
    assert len(conn.lanes) == 2
    for k in range(rounds):
        src[:] = np.random.default_rng(k).integers(0, 256, src.size, np.uint8)
        handles = _put_each(client, server.id, r, n, size)
        h = client.transfer_async(server.id, [], notify=f"round{k}")
        server.wait_notification(f"round{k}", timeout=60)
        landed = np.array_equal(dst, src)
        for x in [*handles, h]:
            x.wait(60)
        assert landed, f"round {k}: the notification came before all the data"


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize(("n", "size"), [(4096, 256), (4, 256 * 1024)], ids=["long", "large"])
def test_a_long_transfer_is_cut_over_the_lanes(
    pair: tuple[Engine, Engine], op: str, n: int, size: int
) -> None:
    """A request of thousands of WRs, or of a few large ones, goes out in a part per
    lane; repeated (the chain comes back from the pool) with new bytes each time, and
    with a notification that arrives only after every part has landed."""
    client, server = pair
    theirs = np.zeros(2 * n * size, np.uint8)
    server.register(theirs, access=RW, name="mem")
    mine = np.zeros(2 * n * size, np.uint8)
    r = client.register(mine, access=Access.LOCAL_WRITE)
    conn = client.connect(server.id, timeout=30)
    assert len(conn.lanes) == 2
    offsets = np.arange(n, dtype=np.int64) * 2 * size  # every other slot: n WRs
    desc = BlockListDesc(offsets=offsets, lengths=np.full(n, size), alignment=None)
    src, dst = (mine, theirs) if op == "write" else (theirs, mine)
    view = dst.reshape(n, 2 * size)[:, :size]
    for k in range(3):
        src[:] = np.random.default_rng(k).integers(0, 256, src.size, np.uint8)
        dst[:] = 0
        if op == "write":
            h = client.put_async(
                server.id, r, "mem", local_desc=desc, remote_desc=desc, notify=f"n{k}"
            )
            server.wait_notification(f"n{k}", timeout=60)
            landed = np.array_equal(view, src.reshape(n, 2 * size)[:, :size])
            h.wait(60)
            assert landed, f"round {k}: notified before every part landed"
        else:
            client.get(server.id, r, "mem", local_desc=desc, remote_desc=desc, timeout=60)
        assert np.array_equal(view, src.reshape(n, 2 * size)[:, :size]), f"round {k}"
        assert not dst.reshape(n, 2 * size)[:, size:].any(), "a byte between blocks was written"
