"""Runs of single-WR chains (:class:`hixl.verbs.chain.ChainRun`) and the send window.

No device: a model provider walks the WRs through their C ``next`` links, as
``ibv_post_send`` does, so the links a run makes are what is checked.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl.core.window import Chunk, SendWindow
from hixl.errors import ArgumentError, RegistrationError
from hixl.verbs._ffi import ffi
from hixl.verbs.chain import (
    RUN_ID_MASK,
    RUN_TAG_SHIFT,
    SEND_SIGNALED,
    ChainRun,
    SendChain,
)


def one(tag: int, regions: tuple[Any, ...] = ()) -> SendChain:
    """A single-WR chain whose remote address names it."""
    return SendChain.single(
        opcode=0,
        local_addr=4096 * tag,
        nbytes=64,
        lkey=1,
        remote_addr=(tag + 1) << 12,
        rkey=2,
        regions=regions,
    )


def walk(head: Any, count: int | None = None) -> list[tuple[int, bool, int]]:
    """``(wr_id, signaled, remote_addr)`` of the WRs a provider would post from ``head``:
    ``count`` of them, or up to the NULL ``next``."""
    out: list[tuple[int, bool, int]] = []
    w = head
    while w != ffi.NULL and (count is None or len(out) < count):
        out.append((int(w.wr_id), bool(w.send_flags & SEND_SIGNALED), int(w.wr.rdma.remote_addr)))
        w = w.next
    return out


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 70), first=st.integers(0, RUN_ID_MASK))
def test_a_run_is_one_list_signaled_once_with_its_requests_tagged(k: int, first: int) -> None:
    chains = [one(i) for i in range(k)]
    run = ChainRun(chains[0], first)
    for c in chains[1:]:
        run.append(c)
    assert run.num_wrs == k
    got = walk(run.head)  # up to the NULL: the run ends at its last WR
    assert [a for _, _, a in got] == [(i + 1) << 12 for i in range(k)]
    assert [s for _, s, _ in got] == [False] * (k - 1) + [True]
    ids = [w for w, _, _ in got]
    assert ids[-1] == first  # the completion of the whole run
    for i, wr_id in enumerate(ids[:-1]):  # a failure of request i names it: tag i + 1,
        assert wr_id >> RUN_TAG_SHIFT == i + 1 and wr_id & RUN_ID_MASK == first  # never 0
    assert len(set(ids)) == k  # the last's plain id included: every request told apart
    assert run.link_end(k) == chains[-1].head[0]
    for i, c in enumerate(chains):
        assert run.index_of(c.wr_base) == i
    assert run.index_of(chains[0].wr_base + 1) is None
    run.unlink()
    for c in chains:  # each chain is a list of its own again, reusable as it is
        assert len(walk(c.head)) == 1


def test_a_run_is_posted_whole_and_made_of_single_wrs() -> None:
    run = ChainRun(one(0), 5)
    run.append(one(1))
    with pytest.raises(ArgumentError, match="posted whole"):
        run.link_end(1)
    with pytest.raises(ArgumentError, match="one WR"):
        run.append(SendChain(2, 2))
    with pytest.raises(ArgumentError, match="one WR"):
        ChainRun(SendChain(2, 2), 0)
    with pytest.raises(ArgumentError, match="outside"):
        run.unsignal(2)


def test_a_run_over_a_closed_region_is_refused() -> None:
    open_, closed = SimpleNamespace(closed=False), SimpleNamespace(closed=False)
    run = ChainRun(one(0, (open_,)), 1)
    run.append(one(1, (open_,)))
    run.append(one(2, (closed,)))
    assert run.regions == (open_, closed)  # each region once
    run.check_regions()
    closed.closed = True
    with pytest.raises(RegistrationError, match="closed memory region"):
        run.check_regions()


def test_a_reused_chain_gets_its_signal_back() -> None:
    """A chain left unsignaled inside a run is signaled again by set_signals (its cached
    flags are forgotten when the run rewrites them)."""
    a, b = one(0), one(1)
    a.set_signals(3, 1)
    run = ChainRun(a, 7)
    run.append(b)
    run.unlink()
    a.set_signals(3, 1)
    assert walk(a.head) == [(3, True, 1 << 12)]


class Provider:
    """An RC send queue fed by links: WRs in post order, completions for signaled ones."""

    def __init__(self) -> None:
        self.queue: deque[tuple[int, bool, int]] = deque()
        self.posted: list[int] = []

    def post(self, pieces: list[tuple[Any, int, int]]) -> None:
        for chain, lo, hi in pieces:
            for wr in walk(chain.head + lo, hi - lo):
                self.queue.append(wr)
                self.posted.append(wr[2])

    def complete_some(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(min(n, len(self.queue))):
            wr_id, signaled, _ = self.queue.popleft()
            if signaled:
                out.append(wr_id)
        return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(n=st.integers(1, 120), group=st.integers(1, 16), depth=st.integers(16, 64), steps=st.data())
def test_requests_coalesced_into_runs_finish_once_in_order(
    n: int, group: int, depth: int, steps: st.DataObject
) -> None:
    """Requests of one WR queued as the engine queues them: appended to the run at the end
    of the backlog while it is unposted and shorter than ``group``, else a new run.  Each
    finishes once, in queue order; a run is never cut by a batch; every WR goes out once."""
    window = SendWindow()
    dev = Provider()
    finished: list[int] = []
    next_id, queued = 1, 0
    for _ in range(100_000):
        if queued == n and not window.backlog and not dev.queue:
            break
        least = 1 if queued < n and not window.backlog and not dev.queue else 0
        for _ in range(steps.draw(st.integers(least, 4), label="queued")):
            if queued == n:
                break
            chain = one(queued)
            tail = window.tail
            if tail is not None and tail.handles is not None and tail.stop < group:
                tail.chain.append(chain)
                tail.stop = tail.every = tail.stop + 1
                tail.handles.append(queued)
            else:
                chunk = Chunk(ChainRun(chain, next_id), 0, 1, None, 1, next_id, 1)
                chunk.handles = [queued]
                next_id += 1
                window.queue1(chunk)
            queued += 1
        if window.backlog and (not dev.queue or steps.draw(st.booleans(), label="take")):
            batch = window.take_batch(depth)
            if batch is not None:
                for chain, lo, hi in batch.pieces:
                    assert (lo, hi) == (0, chain.num_wrs), "a run goes out whole"
                dev.post(batch.pieces)
                window.end_batch()
                for chunk in batch.finished:
                    chunk.chain.unlink()  # as the engine does once the post returned
            else:
                assert window.in_flight > 0
        for wr_id in dev.complete_some(steps.draw(st.integers(0, 16), label="executed")):
            for chunk, done in window.completed(wr_id):
                if done:
                    assert chunk.handles is not None
                    finished.extend(chunk.handles)
    assert finished == list(range(n))
    assert dev.posted == [(i + 1) << 12 for i in range(n)]
    assert window.in_flight == 0


def test_the_tag_of_a_failed_request_names_it() -> None:
    """A run's request that fails completes under its tagged id (signaled or not); the
    id without its tag ends the run in the window, and the tag says which request."""
    window = SendWindow()
    chains = [one(i) for i in range(5)]
    run = ChainRun(chains[0], 40)
    for c in chains[1:]:
        run.append(c)
    chunk = Chunk(run, 0, 5, None, 5, 40, 1)
    chunk.handles = list(range(5))
    window.queue1(chunk)
    batch = window.take_batch(64)
    assert batch is not None
    dev = Provider()
    dev.post(batch.pieces)
    window.end_batch()
    wr_id = dev.queue[2][0]  # request 2 fails: its completion carries its own id
    assert wr_id >> RUN_TAG_SHIFT == 3
    assert dev.queue[0][0] != 40  # the first request's id is tagged too (not the run's)
    got = window.completed(wr_id & RUN_ID_MASK)
    assert got == [(chunk, True)]
    assert np.array_equal(np.array(chunk.handles), np.arange(5))
