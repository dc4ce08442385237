"""Single messages through a ring of slots: the slot writer, open chunks in the send
window, and the handles of a group (no device needed).

The window model is the one of ``test_window.py``: a fake RC send queue reads each WR's
``wr_id`` and signal flag from the chain's C memory and completes signaled WRs in order.
Messages arrive one at a time and, as the engine does (``SinglePaths._ring_enqueuer``), join the
lane's open chunk while it is the backlog's last chunk and none of it is taken, else open
a chunk of their own with a block of ids.
"""

from __future__ import annotations

import struct
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_window import Device, make_chunk

from hixl.core.window import Chunk, SendWindow
from hixl.engine.handles import GroupHandle, MemberHandle, TransferStatus
from hixl.errors import ArgumentError, CompletionError, ConnectionFailed, RegistrationError
from hixl.verbs._ffi import address, ffi
from hixl.verbs.chain import SEND_SIGNALED, SGE_DTYPE, WR_BYTES
from hixl.verbs.slot_ring import SLOT_SGE_OFFSET, SlotRing

U32 = st.integers(0, 0xFFFF_FFFF)
U64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 64),
    writes=st.lists(
        st.tuples(st.integers(0, 63), U64, st.sampled_from([0, 4]), U64, U32, U32, U64, U32),
        max_size=30,
    ),
)
def test_a_slot_write_sets_that_slot_and_nothing_else(
    capacity: int, writes: list[tuple[int, ...]]
) -> None:
    ring = SlotRing(capacity)
    chain = ring.chain
    links = chain.wrs["next"].copy()
    lists = chain.wrs["sg_list"].copy()
    want: dict[int, tuple[int, ...]] = {}
    for slot, wr_id, opcode, laddr, n, lkey, raddr, rkey in writes:
        slot %= capacity
        ring.write(slot, wr_id, opcode, laddr, n, lkey, raddr, rkey)
        want[slot] = (wr_id, opcode, laddr, n, lkey, raddr, rkey)
    wrs = chain.wrs
    assert (wrs["next"] == links).all() and (wrs["sg_list"] == lists).all()
    assert (wrs["num_sge"] == 1).all()
    assert chain.wrs["next"][-1] == 0  # a range never wraps
    for slot in range(capacity):
        w = wrs[slot]
        # The SGE the provider reads, where the WR's sg_list points: inside the slot's
        # own WR, in the bytes an RDMA READ or WRITE leaves unread.
        assert int(w["sg_list"]) == address(chain.head) + slot * WR_BYTES + SLOT_SGE_OFFSET
        s = np.frombuffer(
            ffi.buffer(ffi.cast("char *", int(w["sg_list"])), SGE_DTYPE.itemsize), SGE_DTYPE
        )[0]
        got = (
            int(w["wr_id"]),
            int(w["opcode"]),
            int(s["addr"]),
            int(s["length"]),
            int(s["lkey"]),
            int(w["remote_addr"]),
            int(w["rkey"]),
        )
        assert got == want.get(slot, (0, 0, 0, 0, 0, 0, 0))
        assert int(w["send_flags"]) == 0  # unsignaled until a batch ends on it


def test_a_slot_write_refuses_a_value_too_wide_for_its_field() -> None:
    ring = SlotRing(4)
    with pytest.raises(struct.error, match="format requires"):
        ring.write(0, 1, 4, 0, 1 << 32, 1, 0, 1)


class Lane:
    """The engine's joining rule over one window and one ring (ids: a block per chunk)."""

    def __init__(self, capacity: int) -> None:
        self.ring = SlotRing(capacity)
        self.window = SendWindow()
        self.written = self.released = 0
        self.open: Chunk | None = None
        self.next_id = 1
        self.sent_addrs: list[int] = []  # remote address of every message, in queue order
        self.chunks: list[int] = []  # first ids of the chunks queued, in order

    def put(self, raddr: int, region: object) -> bool:
        cap = self.ring.capacity
        if self.written - self.released >= cap:
            return False  # the engine queues it as a chain of its own
        slot = self.written % cap
        chunk = self.open
        if (
            chunk is not None
            and chunk.stop == slot
            and not chunk.posted
            and self.window.last is chunk
        ):
            k = slot - chunk.start
            chunk.stop, chunk.groups = slot + 1, k + 1
            assert chunk.regions is not None
            if chunk.regions[-1] is not region:
                chunk.regions.append(region)
        else:
            k = 0
            chunk = Chunk(self.ring.chain, slot, slot + 1, len(self.sent_addrs), 1, self.next_id)
            chunk.groups, chunk.regions, chunk.ring = 1, [region], self
            self.next_id += cap
            self.open = chunk
            self.window.queue1(chunk)
            self.chunks.append(chunk.first_id)
        self.ring.write(slot, chunk.first_id + k, 4, 0x1000, 8, 1, raddr, 2)
        self.written += 1
        self.sent_addrs.append(raddr)
        return True


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(
    capacity=st.integers(1, 32),
    depth=st.integers(4, 64),
    messages=st.integers(1, 120),
    others=st.lists(st.integers(1, 20), max_size=4),
    steps=st.data(),
)
def test_messages_in_open_chunks_go_out_once_in_order_and_free_their_slots(
    capacity: int, depth: int, messages: int, others: list[int], steps: st.DataObject
) -> None:
    lane = Lane(capacity)
    window, dev = lane.window, Device()
    region = SimpleNamespace(closed=False)
    expected: list[int] = []  # remote addresses in post order, messages and chains
    finished: list[int] = []  # first ids of the chunks finished, in order
    queued = 0
    extra = deque(others)
    for _ in range(100_000):
        if queued == messages and not extra and not window.backlog and not dev.queue:
            break
        idle = not window.backlog and not dev.queue
        least = 1 if idle and queued < messages else 0
        for _ in range(steps.draw(st.integers(least, 4), label="messages")):
            if queued < messages and lane.put(0x10_0000 + queued * 64, region):
                expected.append(0x10_0000 + queued * 64)
                queued += 1
        between: bool = bool(extra) and steps.draw(st.booleans(), label="a chain between")
        if between:
            size = extra.popleft()
            chunk = make_chunk(size, 3, lane.next_id, 3)
            lane.next_id += chunk.groups
            window.queue1(chunk)
            lane.chunks.append(chunk.first_id)
            expected.extend(int(a) for a in chunk.chain.wrs["remote_addr"])
        takes = 1 if not dev.queue else steps.draw(st.integers(0, 2), label="batches")
        for _ in range(takes if window.backlog else 0):
            batch = window.take_batch(depth)
            if batch is None:
                assert window.in_flight > 0
                break
            chain, _, hi = batch.pieces[-1]
            assert int(chain.wrs[hi - 1]["send_flags"]) & SEND_SIGNALED
            dev.post(batch.pieces)
            window.end_batch()
            for c in batch.finished:  # the post returned: the slots are free again
                if c.ring is lane:
                    lane.released += c.stop - c.start
        n = steps.draw(st.integers(0, 16), label="executed")
        if not window.backlog and queued == messages and not extra:
            n = max(n, 1)
        for wr_id in dev.complete_some(n):
            for c, done in window.completed(wr_id):
                if done:
                    finished.append(c.first_id)
        # A chunk of messages raises one completion per batch it ends, not one per WR.
        assert window.in_flight <= depth
        assert lane.written - lane.released <= capacity
    assert queued == messages and not window.backlog and not dev.queue
    assert dev.posted_addrs == expected
    assert window.in_flight == 0 and window.pending == 0
    assert lane.released == lane.written
    assert finished == lane.chunks  # each chunk once, in queue order


def test_a_closed_region_of_an_open_chunk_is_refused_before_posting() -> None:
    lane = Lane(8)
    a, b = SimpleNamespace(closed=False), SimpleNamespace(closed=False)
    lane.put(0x1000, a)
    lane.put(0x2000, b)
    b.closed = True
    with pytest.raises(RegistrationError, match="closed memory region"):
        lane.window.take_batch(16)
    assert not lane.window.poster and lane.window.in_flight == 0


def _group(n: int) -> tuple[GroupHandle, list[MemberHandle]]:
    g = GroupHandle("peer", deadline=1e18, reap=None)
    return g, [MemberHandle(g, i, 4096) for i in range(n)]


def test_members_share_their_groups_outcome() -> None:
    g, members = _group(3)
    assert all(m.status is TransferStatus.PENDING and not m.done() for m in members)
    g.finish(None)
    for m in members:
        assert m.status is TransferStatus.DONE and m.error is None and m.done()
        m.wait()
    assert "nbytes=4096" in repr(members[0]) and "status=done" in repr(members[0])


def test_after_a_completion_error_members_before_it_landed_and_later_ones_failed() -> None:
    g, members = _group(4)
    err = CompletionError("RDMA transfer to peer", 10, "IBV_WC_REM_ACCESS_ERR", 7, 0)
    g.fail_at = 2
    g.rest = ConnectionFailed("connection to peer failed: completion error")
    g.finish(err)
    g.finish(ConnectionFailed("later"))  # the first outcome stays
    for m in members[:2]:
        assert m.status is TransferStatus.DONE and m.error is None
        m.wait()
    assert members[2].status is TransferStatus.FAILED and members[2].error is err
    with pytest.raises(CompletionError):
        members[2].wait()
    assert members[3].error is g.rest
    with pytest.raises(ConnectionFailed, match="completion error"):
        members[3].wait()


def test_a_members_wait_times_out_while_its_group_is_pending() -> None:
    g, members = _group(1)
    from hixl.errors import TransferTimeout

    with pytest.raises(TransferTimeout):
        members[0].wait(timeout=0.01)
    assert members[0].status is TransferStatus.PENDING
    with pytest.raises(ArgumentError, match="group"):
        members[0].finish(None)
