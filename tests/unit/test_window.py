"""The send window's rules, on real chains of WRs in C memory (no device needed).

A small model of an RC send queue runs against :class:`hixl.core.window.SendWindow`: the
window reserves batches, the model "posts" them (reads each WR's ``wr_id`` and signal
flag from the chain's memory, as a provider would) and completes them in order, one
completion per signaled WR.  Hypothesis picks the chunks, the queue depth, and when
batches are taken and completions delivered.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl.core.window import MAX_BATCHES, Chunk, SendWindow
from hixl.errors import ArgumentError, RegistrationError
from hixl.verbs.chain import SEND_SIGNALED, SendChain


def make_chunk(size: int, every: int, first_id: int, tag: int) -> Chunk:
    chain = SendChain(size, size)
    chain.fill(
        opcode=0,
        remote_addr=np.arange(size, dtype=np.uint64) * 64 + (tag << 20),
        rkey=1,
        sge_start=np.arange(size + 1),
        sge_addr=np.zeros(size, dtype=np.uint64),
        sge_length=np.ones(size, dtype=np.int64),
        lkey=1,
    )
    chunk = Chunk(chain, 0, size, tag, every, first_id)
    chunk.groups = chain.set_signals(first_id, every)
    return chunk


def make_chunks(specs: list[tuple[int, int]]) -> list[Chunk]:
    """Chunks of ``(size, every)`` with increasing ids, tagged 0, 1, ..."""
    chunks, next_id = [], 1
    for tag, (size, every) in enumerate(specs):
        chunk = make_chunk(size, every, next_id, tag)
        next_id += chunk.groups
        chunks.append(chunk)
    return chunks


def queue_chunks(window: SendWindow, specs: list[tuple[int, int]]) -> list[Chunk]:
    chunks = make_chunks(specs)
    window.queue(chunks)
    return chunks


class Device:
    """An RC send queue: WRs in post order, completions for signaled ones, in order."""

    def __init__(self) -> None:
        self.queue: deque[tuple[int, bool, int]] = deque()  # (wr_id, signaled, remote_addr)
        self.posted_addrs: list[int] = []

    def post(self, pieces: list[tuple[Any, int, int]]) -> None:
        for chain, lo, hi in pieces:
            wrs = chain.wrs[lo:hi]
            for w in wrs:
                signaled = bool(int(w["send_flags"]) & SEND_SIGNALED)
                self.queue.append((int(w["wr_id"]), signaled, int(w["remote_addr"])))
                self.posted_addrs.append(int(w["remote_addr"]))

    def complete_some(self, n: int) -> list[int]:
        """Execute up to ``n`` WRs; the wr_ids of the completions they raise."""
        out = []
        for _ in range(min(n, len(self.queue))):
            wr_id, signaled, _ = self.queue.popleft()
            if signaled:
                out.append(wr_id)
        return out


chunk_specs = st.lists(
    st.tuples(st.integers(1, 40), st.sampled_from([1, 2, 3, 8])), min_size=1, max_size=12
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(specs=chunk_specs, depth=st.integers(8, 64), steps=st.data())
def test_every_chunk_finishes_once_in_order_within_the_depth(
    specs: list[tuple[int, int]], depth: int, steps: st.DataObject
) -> None:
    window = SendWindow()
    chunks = make_chunks(specs)
    arriving = deque(chunks)  # queued a few at a time, between batches, as callers do
    dev = Device()
    finished: list[int] = []
    posted_whole: list[int] = []
    ends: list[int] = []  # the device-queue position of each batch's last WR
    executed = 0
    for _ in range(100_000):
        if not window.backlog and not dev.queue and not arriving:
            break
        least = 1 if not window.backlog and not dev.queue else 0
        for _ in range(min(len(arriving), steps.draw(st.integers(least, 3), label="queued"))):
            chunk = arriving.popleft()
            # A blocking request of one group may be reserved whole and posted at once
            # (take_solo), which the window allows only while it is idle.
            idle = not window.backlog and not window.poster and window.in_flight == 0
            if chunk.groups == 1 and steps.draw(st.booleans(), label="solo"):
                if window.take_solo(chunk):
                    assert idle and not dev.queue
                    dev.post([(chunk.chain, chunk.start, chunk.stop)])
                    ends.append(len(dev.posted_addrs))
                    posted_whole.append(chunk.handle)
                    window.end_batch()
                    continue
                assert not idle
            window.queue1(chunk)
        takes = 1 if not dev.queue else steps.draw(st.integers(0, 3), label="batches taken")
        for _ in range(takes if window.backlog else 0):
            batch = window.take_batch(depth)
            if batch is None:  # no room, only inside a group, or MAX_BATCHES out:
                assert window.in_flight > 0  # what is out must complete first
                break
            assert batch.pieces, "a batch posts something"
            # The batch's last WR is signaled: what is out always raises a completion.
            chain, _, hi = batch.pieces[-1]
            assert int(chain.wrs[hi - 1]["send_flags"]) & SEND_SIGNALED
            dev.post(batch.pieces)
            ends.append(len(dev.posted_addrs))
            posted_whole.extend(c.handle for c in batch.finished)
            window.end_batch()
        assert 0 <= window.in_flight <= depth
        # At most MAX_BATCHES batches are out: what a queue owes its CQ stays bounded.
        assert sum(1 for e in ends if e > executed) <= MAX_BATCHES
        n = steps.draw(st.integers(0, 16), label="WRs executed")
        executed += min(n, len(dev.queue))
        for wr_id in dev.complete_some(n):
            for chunk, done in window.completed(wr_id):
                if done:
                    finished.append(chunk.handle)
        # WRs executed with no signaled one after them yet still count as in flight.
        assert window.in_flight >= len(dev.queue)
    assert not window.backlog and not dev.queue, "the window stopped making progress"
    assert finished == list(range(len(chunks)))  # each once, in queue order
    assert posted_whole == list(range(len(chunks)))
    assert window.in_flight == 0 and window.pending == 0
    # Every WR of every chunk went out exactly once, in order.
    expected = [int(a) for c in chunks for a in c.chain.wrs["remote_addr"]]
    assert dev.posted_addrs == expected


@settings(max_examples=200, deadline=None)
@given(specs=chunk_specs, depth=st.integers(8, 64), data=st.data())
def test_a_failed_wr_is_charged_to_its_own_chunk(
    specs: list[tuple[int, int]], depth: int, data: st.DataObject
) -> None:
    """A WR that fails completes under its own id, signaled or not: the chunks before it
    are done and the last chunk returned is the one that owns it."""
    window = SendWindow()
    chunks = queue_chunks(window, specs)
    total = sum(c.size for c in chunks)
    bad = data.draw(st.integers(0, total - 1), label="failing WR")
    owner, offset = 0, bad
    while offset >= chunks[owner].size:
        offset -= chunks[owner].size
        owner += 1
    bad_id = chunks[owner].first_id + offset // chunks[owner].every
    dev = Device()
    for executed in range(bad + 1):
        if not dev.queue:
            batch = window.take_batch(depth)
            assert batch is not None
            dev.post(batch.pieces)
            window.end_batch()
        wr_id, signaled, _ = dev.queue.popleft()
        if executed < bad:
            if signaled:
                window.completed(wr_id)
            continue
        assert wr_id == bad_id
        got = window.completed(wr_id)  # the error completion, whatever the flag says
        assert got and got[-1][0] is chunks[owner]
        assert all(done for _, done in got[:-1])
        assert all(c.done == c.size for c in chunks[:owner])
    flushed = window.drain()
    assert window.in_flight == 0 and not window.backlog
    assert all(c.handle >= owner for c in flushed)


def test_a_closed_region_at_the_head_is_refused_and_later_ones_wait() -> None:
    window = SendWindow()
    a, b, c = (make_chunk(4, 2, 1 + 2 * i, i) for i in range(3))
    window.queue([a, b, c])
    b.chain.regions = (SimpleNamespace(closed=True),)  # as a deregistered region reads
    batch = window.take_batch(64)
    assert batch is not None and [p[0] for p in batch.pieces] == [a.chain]
    # a went out alone, so it kept its signal
    assert int(a.chain.wrs[3]["send_flags"]) & SEND_SIGNALED
    window.end_batch()
    with pytest.raises(RegistrationError):
        window.take_batch(64)
    assert window.head is b and window.in_flight == 4


def test_take_batch_refuses_a_second_poster() -> None:
    window = SendWindow()
    queue_chunks(window, [(4, 1), (4, 1)])
    assert window.take_batch(4) is not None
    with pytest.raises(AssertionError):
        window.take_batch(8)
    window.end_batch()
    assert window.take_batch(8) is not None


def test_a_held_chunk_and_those_behind_it_wait_until_released() -> None:
    window = SendWindow()
    a, b, c = queue_chunks(window, [(4, 2), (1, 1), (3, 1)])
    b.held = True
    batch = window.take_batch(64)
    assert batch is not None and batch.finished == [a]  # stops before the held one
    window.end_batch()
    assert window.take_batch(64) is None  # nothing but held work is left: no error either
    assert window.oldest_id == a.first_id
    assert list(window.waiting()) == [b, c]
    window.completed(a.first_id + a.groups - 1)
    assert window.oldest_id == b.first_id
    b.held = False
    batch = window.take_batch(64)
    assert batch is not None and batch.finished == [b, c]
    window.end_batch()


def test_oldest_id_of_an_empty_window_is_none() -> None:
    assert SendWindow().oldest_id is None


def test_take_solo_reserves_only_an_idle_window() -> None:
    window = SendWindow()
    busy, solo, later = make_chunks([(4, 4), (1, 1), (1, 1)])
    window.queue1(busy)
    assert not window.take_solo(solo)  # work queued: it would overtake it
    batch = window.take_batch(16)
    assert batch is not None
    assert not window.take_solo(solo)  # a batch is being posted
    window.end_batch()
    assert not window.take_solo(solo)  # WRs out: still not idle
    assert [(c.handle, done) for c, done in window.completed(busy.first_id)] == [(0, True)]
    assert window.take_solo(solo)
    assert window.poster and window.in_flight == 1 and window.oldest_id == solo.first_id
    window.end_batch()
    window.queue1(later)  # queued behind it, posted once it completes
    assert window.take_batch(16) is not None
    window.end_batch()
    done = window.completed(later.first_id)
    assert [(c.handle, d) for c, d in done] == [(1, True), (2, True)]
    assert window.in_flight == 0 and window.pending == 0


def test_take_solo_refuses_a_chunk_of_several_groups() -> None:
    (chunk,) = make_chunks([(4, 2)])
    with pytest.raises(ArgumentError):
        SendWindow().take_solo(chunk)
