"""Strided put/get and notifications between two kernels over a virtual RoCE wire."""

from __future__ import annotations

import hashlib

import numpy as np

from hixl import Access, ContiguousDesc, Engine, StridedDesc
from hixl.testbed.hosts import Control

from .agent import pattern
from .driver import remote_buffer


def test_strided_put_lands_bit_exact_with_notification(
    engine: Engine, agent: Control, peer_id: str
) -> None:
    count, size, src_stride, dst_stride, dst_off = 300, 960, 1024, 2048, 64
    nbytes = dst_off + count * dst_stride
    remote_buffer(agent, engine, peer_id, "put-dst", nbytes)
    src = pattern(11, count * src_stride)
    region = engine.register(src, name="put-src")
    engine.put(
        peer_id,
        region,
        "put-dst",
        local_desc=StridedDesc(offset=0, count=count, size=size, stride=src_stride),
        remote_desc=StridedDesc(offset=dst_off, count=count, size=size, stride=dst_stride),
        notify="strided-put",
        notify_message=b"300 rows",
        timeout=60.0,
    )
    note = agent.call("wait_note", name="strided-put", seconds=30.0)
    assert note["peer"] == engine.id
    assert bytes.fromhex(note["message"]) == b"300 rows"
    want = np.zeros(nbytes, np.uint8)
    for i in range(count):
        want[dst_off + i * dst_stride : dst_off + i * dst_stride + size] = src[
            i * src_stride : i * src_stride + size
        ]
    assert agent.call("sha", name="put-dst")["sha"] == hashlib.sha256(want.tobytes()).hexdigest()


def test_strided_get_reads_the_remote_pattern(engine: Engine, agent: Control, peer_id: str) -> None:
    count, size, stride = 129, 4160, 8192  # rows longer than either path MTU
    remote = remote_buffer(agent, engine, peer_id, "get-src", count * stride, seed=23)
    theirs = pattern(23, count * stride)
    assert remote["sha"] == hashlib.sha256(theirs.tobytes()).hexdigest()
    dst = np.zeros(count * size, np.uint8)
    region = engine.register(dst, access=Access.LOCAL_WRITE, name="get-dst")
    engine.get(
        peer_id,
        region,
        "get-src",
        local_desc=ContiguousDesc(offset=0, nbytes=count * size),
        remote_desc=StridedDesc(offset=0, count=count, size=size, stride=stride),
        timeout=60.0,
    )
    want = theirs.reshape(count, stride)[:, :size].reshape(-1)
    assert np.array_equal(dst, want)


def test_notifications_cross_both_ways_in_order(
    engine: Engine, agent: Control, peer_id: str
) -> None:
    for i in range(5):
        engine.notify(peer_id, f"n{i}", f"from host0 #{i}".encode(), timeout=10.0)
    for i in range(5):
        got = agent.call("wait_note", name=f"n{i}", seconds=20.0)
        assert bytes.fromhex(got["message"]) == f"from host0 #{i}".encode()
    for i in range(3):
        agent.call("notify", peer=engine.id, name=f"back{i}", message=f"#{i}".encode().hex())
    seen = [engine.wait_notification(f"back{i}", timeout=20.0, peer=peer_id) for i in range(3)]
    assert [n.message for n in seen] == [b"#0", b"#1", b"#2"]


def test_a_channel_moves_ranges_both_ways_across_the_wire(
    engine: Engine, agent: Control, peer_id: str
) -> None:
    """A channel on the connection's direct lane, across hosts: puts land where asked
    (checked by host1's hash), gets read host1's bytes back, sizes across the path MTU."""
    nbytes = 256 * 1024
    remote_buffer(agent, engine, peer_id, "chan-buf", nbytes)
    src = pattern(31, nbytes)
    back = np.zeros(nbytes, np.uint8)
    r_src = engine.register(src, name="chan-src")
    r_back = engine.register(back, access=Access.LOCAL_WRITE, name="chan-back")
    want = np.zeros(nbytes, np.uint8)
    moves = [(0, 4096, 4096), (65536, 0, 192), (8192, 131072, 9000 // 64 * 64), (128, 64, 64)]
    with engine.channel(peer_id, r_src, "chan-buf") as ch:
        for lo, ro, n in moves:
            ch.put(lo, ro, n, timeout=60.0)
            want[ro : ro + n] = src[lo : lo + n]
    got = agent.call("sha", name="chan-buf")["sha"]
    assert got == hashlib.sha256(want.tobytes()).hexdigest()
    with engine.channel(peer_id, r_back, "chan-buf") as ch:
        for _, ro, n in moves:
            ch.get(ro, ro, n, timeout=60.0)
    assert np.array_equal(back, want)
