"""The cffi data path on a real device: chains, pacing, errors, the GIL, allocations.

Two RC queue pairs on one device, connected to each other (loopback).  pyverbs serves
as the independent second binding where a value can be cross-checked.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from hixl.core.descriptors import ContiguousDesc, StridedDesc
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.errors import ArgumentError, RegistrationError, StateError
from hixl.verbs import adapter as ibv
from hixl.verbs.chain import SendChain

RW = ibv.ACCESS_LOCAL_WRITE | ibv.ACCESS_REMOTE_WRITE | ibv.ACCESS_REMOTE_READ


@pytest.fixture
def dev() -> Iterator[ibv.Device]:
    d = ibv.open_device()
    try:
        yield d
    finally:
        d.close()


def pair(
    dev: ibv.Device, depth: int = 64, cq_depth: int = 256, events: bool = False
) -> tuple[ibv.QueuePair, ibv.QueuePair, ibv.CompletionQueue]:
    cq = dev.create_cq(cq_depth, events=events)
    rcq = dev.create_cq(16)
    a = dev.create_rc_qp(cq, rcq, depth, 4, dev.caps.max_sge)
    b = dev.create_rc_qp(rcq, rcq, 4, 4, dev.caps.max_sge)
    pa, pb = random.getrandbits(24), random.getrandbits(24)
    a.connect(b.qpn, pb, pa, dev.gid, dev.active_mtu)
    b.connect(a.qpn, pa, pb, dev.gid, dev.active_mtu)
    return a, b, cq


def run_chain(
    qp: ibv.QueuePair,
    cq: ibv.CompletionQueue,
    chain: SendChain,
    every: int,
    first_id: int = 1000,
    timeout: float = 60.0,
    on_poll: Callable[[], None] | None = None,
) -> list[tuple[int, int]]:
    """Post the whole chain, paced against the send-queue depth; return error completions.

    Slots are counted by the caller, as the engine does: the completion of group ``g``
    frees every WR up to that group's last.  Returns ``[(wr_id, status), ...]`` of every
    completion that was not a success (stops at the first).
    """
    n = chain.num_wrs
    groups = chain.set_signals(first_id, every)
    assert every <= qp.max_send_wr
    posted = completed = done_groups = 0
    deadline = time.monotonic() + timeout
    while done_groups < groups:
        assert time.monotonic() < deadline, f"chain stuck: {posted=} {completed=} of {n}"
        room = qp.max_send_wr - (posted - completed)
        if posted < n and room > 0:
            posted += qp.post_chain(chain, posted, min(n, posted + room))
        wcs = cq.poll_array(64)
        if on_poll is not None:
            on_poll()
        if wcs.size == 0:
            continue
        bad = wcs["status"] != 0
        if bad.any():
            return list(zip(wcs["wr_id"].tolist(), wcs["status"].tolist(), strict=True))
        last = int(wcs["wr_id"][-1]) - first_id
        completed = min(n, (last + 1) * every)
        done_groups = last + 1
    return []


def strided_plan(count: int, size: int, stride: int, op: Op = Op.WRITE) -> Plan:
    d = StridedDesc(offset=0, count=count, size=size, stride=stride, alignment=None)
    return plan_transfer(d, d, op, DeviceLimits())


def test_device_values_agree_with_pyverbs(dev: ibv.Device) -> None:
    """Values read through cffi equal those pyverbs reads (an independent binding)."""
    from pyverbs.device import Context

    assert dev.port_state == 4  # ACTIVE
    with Context(name=dev.name) as ctx:
        pattr = ctx.query_port(dev.port)
        dattr = ctx.query_device()
        gid = ctx.query_gid(dev.port, dev.gid_index)
    assert dev.caps.max_sge == int(dattr.max_sge)
    assert dev.caps.max_qp_wr == int(dattr.max_qp_wr)
    assert dev.caps.max_msg_sz == int(pattr.max_msg_sz)
    assert dev.active_mtu == ibv.MTU_BYTES[int(pattr.active_mtu)]
    assert ibv.gid_to_str(dev.gid) == str(gid.gid) or dev.gid.hex() == str(gid.gid).replace(":", "")
    a, b, _ = pair(dev)
    assert a.state_name == b.state_name == "RTS"
    assert a.qpn != b.qpn and a.qpn > 0


def test_chain_longer_than_the_send_queue_writes_and_reads_back(dev: ibv.Device) -> None:
    depth = 32
    a, _, cq = pair(dev, depth=depth)
    count, size, stride = 1000, 48, 64  # 1000 WRs through a 32-deep send queue
    src = np.random.default_rng(5).integers(0, 256, count * stride, dtype=np.uint8)
    dst = np.zeros_like(src)
    back = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    mb = dev.register(back.ctypes.data, back.nbytes, ibv.ACCESS_LOCAL_WRITE, back)
    plan = strided_plan(count, size, stride)
    assert plan.num_wrs == count
    chain = SendChain.for_plan(
        plan,
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
        regions=(ms,),
    )
    assert run_chain(a, cq, chain, every=8) == []

    def rows(x: np.ndarray[Any, np.dtype[np.uint8]]) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return x.reshape(count, stride)

    assert np.array_equal(rows(dst)[:, :size], rows(src)[:, :size])
    assert not rows(dst)[:, size:].any()
    # the same chain memory, refilled as READs of the destination into `back`
    rplan = strided_plan(count, size, stride, Op.READ)
    chain.fill_plan(
        rplan,
        opcode=ibv.WR_RDMA_READ,
        local_addr=mb.addr,
        lkey=mb.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
        regions=(mb,),
    )
    assert run_chain(a, cq, chain, every=16, first_id=5000) == []
    assert np.array_equal(rows(back)[:, :size], rows(src)[:, :size])
    assert not rows(back)[:, size:].any()


def test_gather_chain_of_32_unequal_sges(dev: ibv.Device) -> None:
    a, _, cq = pair(dev)
    rng = np.random.default_rng(9)
    lengths = rng.integers(1, 300, 32 * 20)
    offs = np.concatenate([[0], np.cumsum(lengths + rng.integers(1, 40, lengths.size))[:-1]])
    src = rng.integers(0, 256, int(offs[-1] + lengths[-1]), dtype=np.uint8)
    dst = np.zeros(int(lengths.sum()), dtype=np.uint8)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    from hixl.core.descriptors import BlockListDesc

    plan = plan_transfer(
        BlockListDesc(offsets=offs, lengths=lengths, alignment=None),
        ContiguousDesc(offset=0, nbytes=dst.nbytes, alignment=None),
        Op.WRITE,
        DeviceLimits(max_sge=dev.caps.max_sge, max_msg_sz=dev.caps.max_msg_sz),
    )
    assert plan.num_wrs == 20 and plan.num_sges == 640
    chain = SendChain.for_plan(
        plan,
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
        regions=(ms,),
    )
    assert run_chain(a, cq, chain, every=4) == []
    want = np.concatenate([src[o : o + n] for o, n in zip(offs, lengths, strict=True)])
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("reader", ["poll_array", "poll_rows"])
def test_error_in_mid_chain_completes_with_its_own_status(dev: ibv.Device, reader: str) -> None:
    """WR 13 of 40 carries a bad rkey: its group reports REM_ACCESS_ERR, not a flush.

    Read both ways, a few completions per poll: ``poll_array`` (numpy) and ``poll_rows``
    (the fields the engine reaps with), each with the 64-bit id and the queue pair's number.
    """
    a, _, cq = pair(dev)
    src = np.arange(40 * 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    chain = SendChain.for_plan(
        _rows_plan(40, 64),
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
    )
    every, first = 8, 2**40 + 700  # an id above 32 bits comes back whole

    def read(n: int) -> list[tuple[int, int, int]]:
        """Up to ``n`` completions as (wr_id, status, qp_num)."""
        if reader == "poll_rows":
            got = [(w, st, q) for w, st, _, q in cq.poll_rows(n)]
        else:
            wcs = cq.poll_array(n)
            got = list(zip(*(wcs[f].tolist() for f in ("wr_id", "status", "qp_num")), strict=True))
        assert len(got) <= n
        return got

    assert read(8) == []
    chain.set_signals(first, every)
    chain.wrs["rkey"][13] = md.rkey ^ 0x5A5A00
    assert a.post_chain(chain) == 40
    # Group 0 succeeds; WR 13 fails with its own status under its group's id; WRs 14..39
    # are flushed, each with a completion (errors complete whether signaled or not).
    want = [(first, 0), (first + 1, ibv.WC_REM_ACCESS_ERR)]
    want += [(first + i // every, ibv.WC_WR_FLUSH_ERR) for i in range(14, 40)]
    seen: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 20
    while len(seen) < len(want) and time.monotonic() < deadline:
        seen += read(3)
    time.sleep(0.1)
    seen += read(64)
    assert [(w, st) for w, st, _ in seen] == want
    assert {q for _, _, q in seen} == {a.qpn}
    assert ibv.WC_STATUS_NAMES[seen[1][1]] == "IBV_WC_REM_ACCESS_ERR"
    assert np.array_equal(dst[: 8 * 64], src[: 8 * 64])
    assert a.state_name == "ERR"


def _rows_plan(count: int, size: int) -> Plan:
    """``count`` WRs of ``size`` bytes: a contiguous range cut by max_msg_sz."""
    d = ContiguousDesc(offset=0, nbytes=count * size, alignment=None)
    return plan_transfer(d, d, Op.WRITE, DeviceLimits(max_msg_sz=size))


def test_full_send_queue_returns_the_count_posted_and_resumes(dev: ibv.Device) -> None:
    """A post that overruns the send queue stops at bad_wr; the rest posts later."""
    a, _, cq = pair(dev, depth=16)
    src = np.arange(4096 * 4, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    chain = SendChain.for_plan(
        _rows_plan(4096, 4),
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
    )
    chain.set_signals(0, 1)
    got = a.post_chain(chain)  # far more than any send queue of depth 16 takes
    assert 16 <= got < 4096
    posted, done = got, 0
    deadline = time.monotonic() + 60
    while done < 4096:
        assert time.monotonic() < deadline
        wcs = cq.poll_array(256)
        assert (wcs["status"] == 0).all()
        done += wcs.size
        if posted < 4096 and wcs.size:
            posted += a.post_chain(chain, posted)
    assert np.array_equal(dst, src)


def test_chain_over_a_deregistered_region_is_refused_before_posting(dev: ibv.Device) -> None:
    a, _, cq = pair(dev)
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    chain = SendChain.for_plan(
        _rows_plan(4, 1024),
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
        regions=(ms, md),
    )
    assert run_chain(a, cq, chain, every=4) == []
    dst[:] = 0
    ms.close()
    with pytest.raises(RegistrationError, match="closed memory region"):
        a.post_chain(chain)
    time.sleep(0.2)
    assert cq.poll_array(8).size == 0 and not dst.any()
    assert a.state_name == "RTS"
    with pytest.raises(ArgumentError):
        a.post_chain(chain, 3, 2)


class Counter:
    """Another Python thread counting as fast as the GIL lets it."""

    def __init__(self) -> None:
        self.n = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.n += 1

    def rate(self, fn: Callable[[], Any]) -> tuple[float, float, Any]:
        """``(counts per second, seconds)`` while ``fn`` runs in this thread."""
        n0, t0 = self.n, time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        return (self.n - n0) / dt, dt, out

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def test_other_threads_run_during_a_long_post_and_a_blocking_wait(dev: ibv.Device) -> None:
    """A post that moves 4 MiB (rxe sends inside post_send) and a 0.5 s wait on the
    completion channel leave another Python thread running at a good share of its rate
    (with the GIL held it would not count at all)."""
    n_wr, size = 1024, 4096
    a, _, cq = pair(dev, depth=n_wr, cq_depth=n_wr, events=True)
    src = np.random.default_rng(3).integers(0, 256, n_wr * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    chain = SendChain.for_plan(
        _rows_plan(n_wr, size),
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
    )
    chain.set_signals(1, n_wr)
    counter = Counter()

    def fair(idle: float, during_post: float, post_s: float, during_wait: float) -> bool:
        # With the GIL held through the call the counter would not count at all; a share
        # well above zero is the point.  A post too short says nothing about the GIL.
        return during_wait > 0.25 * idle and (post_s <= 0.05 or during_post > 0.2 * idle)

    # Up to three tries, each measuring the idle rate right before the calls it judges:
    # the counter's share moves with the host's other work, never to zero unless the
    # GIL is held.
    tries: list[str] = []
    try:
        time.sleep(0.05)
        for _ in range(3):
            idle, _, _ = counter.rate(lambda: time.sleep(0.3))
            during_post, post_s, posted = counter.rate(lambda: a.post_chain(chain))
            assert posted == n_wr
            cq.arm()
            got = cq.poll_array(4)
            if got.size == 0:
                assert cq.wait(30.0), "no completion event within 30 s"
                got = cq.poll_array(4)
            assert got.size == 1 and int(got["status"][0]) == 0 and int(got["wr_id"][0]) == 1
            cq.arm()
            during_wait, wait_s, woke = counter.rate(lambda: cq.wait(0.5))
            assert woke is False and wait_s >= 0.45
            tries.append(
                f"idle {idle:.0f}/s, during a {post_s * 1e3:.0f} ms post {during_post:.0f}/s, "
                f"during a {wait_s * 1e3:.0f} ms wait {during_wait:.0f}/s"
            )
            print("counter:", tries[-1])
            if fair(idle, during_post, post_s, during_wait):
                break
    finally:
        counter.stop()
    assert np.array_equal(dst, src)
    assert fair(idle, during_post, post_s, during_wait), tries


def test_a_10000_wr_transfer_allocates_no_python_object_per_wr(dev: ibv.Device) -> None:
    n_wr = 10_000
    a, _, cq = pair(dev, depth=256, cq_depth=512)
    src = np.random.default_rng(4).integers(0, 256, n_wr * 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    ms = dev.register(src.ctypes.data, src.nbytes, ibv.ACCESS_LOCAL_WRITE, src)
    md = dev.register(dst.ctypes.data, dst.nbytes, RW, dst)
    chain = SendChain.for_plan(
        _rows_plan(n_wr, 64),
        opcode=ibv.WR_RDMA_WRITE,
        local_addr=ms.addr,
        lkey=ms.lkey,
        remote_addr=md.addr,
        rkey=md.rkey,
    )
    assert run_chain(a, cq, chain, every=64) == []  # warm: caches, arrays
    dst[:] = 0
    start = sys.getallocatedblocks()
    most = [start]

    def sample() -> None:
        most[0] = max(most[0], sys.getallocatedblocks())

    tracemalloc.start()
    try:
        errors = run_chain(a, cq, chain, every=64, on_poll=sample)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert errors == []
    assert np.array_equal(dst, src)
    grew = most[0] - start
    print(f"10,000 WRs: +{grew} allocated blocks at most, tracemalloc peak {peak} bytes")
    assert grew < 1000
    assert peak < 10 * n_wr  # any Python object per WR (>= 16 bytes each) would exceed this


def test_close_is_idempotent_and_blocks_use(dev: ibv.Device) -> None:
    a, b, cq = pair(dev)
    a.close()
    a.close()
    with pytest.raises(StateError):
        a.post_chain(SendChain(1, 1))
    cq.close()
    cq.close()
    with pytest.raises(StateError):
        cq.poll_array(1)
