"""The engine's data path at scale: errors inside a transfer, huge WR counts, the GIL,
allocations per work request, and built chains against deregistered regions."""

from __future__ import annotations

import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hixl.core.descriptors import BlockListDesc, ContiguousDesc, StridedDesc
from hixl.core.states import ConnState
from hixl.engine import Access, Connection, Engine, Region, TransferHandle
from hixl.errors import (
    AlignmentError,
    BoundsError,
    CompletionError,
    ConnectionFailed,
    RegistrationError,
)

from .conftest import listening_engine

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


@pytest.fixture
def loose() -> Iterator[tuple[Engine, Engine]]:
    """``(client, server)`` with the alignment policy off, not connected yet (tests register
    their regions first, so the handshake carries them)."""
    server = listening_engine(alignment=0)
    client = Engine("127.0.0.1:0", alignment=0)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def pattern(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def announced(client: Engine, server: Engine, name: str) -> Connection:
    """The client's connection to ``server`` once the server's region ``name`` has been
    announced on it (within 10 s)."""
    conn = client.connection(server.id)
    deadline = time.monotonic() + 10
    while not any(x.name == name for x in conn.remote_regions):
        assert time.monotonic() < deadline, f"the peer never announced its region {name!r}"
        time.sleep(0.01)
    return conn


def test_an_error_inside_a_transfer_is_reported_with_its_own_status(
    loose: tuple[Engine, Engine],
) -> None:
    """The peer's region is 4 KiB but the client believes it is 1 MiB (test hook): the
    first work requests land, a later one is refused by the target.  The transfer fails
    with that request's status, IBV_WC_REM_ACCESS_ERR -- not with the flush error of the
    requests queued behind it."""
    client, server = loose
    dst = np.zeros(4096, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(1 << 20, 1)
    r = client.register(src)
    conn = client.connect(server.id, timeout=30.0)
    good = conn.remote_region("dst")
    conn.set_remote_regions((replace(good, length=1 << 20),))
    desc = StridedDesc(offset=0, count=1024, size=256, stride=1024, alignment=None)
    with pytest.raises(CompletionError) as info:
        client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc, timeout=30)
    assert info.value.status_name == "IBV_WC_REM_ACCESS_ERR", str(info.value)
    assert conn.state is ConnState.FAILED
    rows = dst.reshape(4, 1024)
    assert np.array_equal(rows[:, :256], src.reshape(-1, 1024)[:4, :256])


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_million_two_byte_pieces_move_byte_for_byte(
    loose: tuple[Engine, Engine], op: str
) -> None:
    """2 MiB in 2-byte pieces, 4 bytes apart on both sides: 1,048,576 work requests."""
    client, server = loose
    count = 1 << 20
    theirs = pattern(4 * count, 2) if op == "read" else np.zeros(4 * count, np.uint8)
    mine = pattern(4 * count, 3) if op == "write" else np.zeros(4 * count, np.uint8)
    server.register(theirs, access=RW, name="buf")
    r = client.register(mine, access=Access.LOCAL_WRITE)
    client.connect(server.id, timeout=30.0)
    desc = StridedDesc(offset=0, count=count, size=2, stride=4, alignment=None)
    t0 = time.monotonic()
    if op == "write":
        client.put(server.id, r, "buf", local_desc=desc, remote_desc=desc, timeout=600)
        src, dst = mine, theirs
    else:
        client.get(server.id, r, "buf", local_desc=desc, remote_desc=desc, timeout=600)
        src, dst = theirs, mine
    print(f"{op} of {count} WRs: {time.monotonic() - t0:.1f} s")
    pieces = dst.reshape(count, 4)
    assert np.array_equal(pieces[:, :2], src.reshape(count, 4)[:, :2])
    assert not pieces[:, 2:].any()


def test_a_10000_wr_put_allocates_far_fewer_python_objects(
    loose: tuple[Engine, Engine],
) -> None:
    """A repeated 10,000-WR put (plan and chain reused) peaks at well under 16 bytes of
    Python memory per WR: no object is made per work request (the smallest is 16)."""
    client, server = loose
    n = 10_000
    dst = np.zeros(n * 128, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(n * 128, 4)
    r = client.register(src)
    client.connect(server.id, timeout=30.0)
    desc = StridedDesc(offset=0, count=n, size=64, stride=128, alignment=None)
    client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc)  # warm the caches
    dst[:] = 0
    tracemalloc.start()
    try:
        client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"10,000-WR put: tracemalloc peak {peak} bytes")
    rows = dst.reshape(n, 128)
    assert np.array_equal(rows[:, :64], src.reshape(n, 128)[:, :64])
    assert peak < 16 * n


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

    def rate(self, fn: Callable[[], object]) -> tuple[float, float]:
        n0, t0 = self.n, time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return (self.n - n0) / dt, dt

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def test_another_thread_keeps_running_during_a_long_put(loose: tuple[Engine, Engine]) -> None:
    client, server = loose
    dst = np.zeros(8 << 20, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(8 << 20, 5)
    r = client.register(src)
    client.connect(server.id, timeout=30.0)
    rows = StridedDesc(offset=0, count=2048, size=4000, stride=4096, alignment=None)
    counter = Counter()
    # Up to three tries, each measuring idle and busy rates back to back: the VM's two
    # CPUs are shared with the host's other work, and one try has read 0.2 there.  A put
    # that held the GIL while it posts and waits would read near 0 every time.
    ratios: list[str] = []
    try:
        time.sleep(0.05)
        for _ in range(3):
            idle, _ = counter.rate(lambda: time.sleep(0.3))
            busy, took = counter.rate(
                lambda: client.put(server.id, r, "dst", local_desc=rows, remote_desc=rows)
            )
            print(f"counter: idle {idle:.0f}/s, during a {took * 1e3:.0f} ms put {busy:.0f}/s")
            ratios.append(f"{busy / idle:.2f}")
            if busy > 0.25 * idle:
                break
    finally:
        counter.stop()
    got, want = dst.reshape(2048, 4096), src.reshape(2048, 4096)
    assert np.array_equal(got[:, :4000], want[:, :4000]) and not got[:, 4000:].any()
    assert busy > 0.25 * idle, f"busy/idle counting rates of the tries: {ratios}"


def test_a_deregistered_region_is_refused_and_its_memory_registered_again_works(
    loose: tuple[Engine, Engine],
) -> None:
    client, server = loose
    dst = np.zeros(64 * 256, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(64 * 256, 6)
    desc = StridedDesc(offset=0, count=64, size=128, stride=256, alignment=None)
    r = client.register(src)
    client.connect(server.id, timeout=30.0)
    client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc)  # chain built, pooled
    client.deregister(r)
    dst[:] = 0
    with pytest.raises(RegistrationError, match="not a region registered"):
        client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc)
    assert not dst.any()
    r2 = client.register(src)  # same memory, new keys: the old chain must not be used
    client.put(server.id, r2, "dst", local_desc=desc, remote_desc=desc)
    got, want = dst.reshape(64, 256), src.reshape(64, 256)
    assert np.array_equal(got[:, :128], want[:, :128]) and not got[:, 128:].any()


def _regions_for(
    op: str, client: Engine, server: Engine, n: int, seed: int
) -> tuple[Region, Callable[..., None], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``n`` bytes on each side for ``op`` (the side read from holds a pattern, the other
    zeros), the server's registered as "mem", the client connected; returns the client's
    region, its ``put`` or ``get``, and the local and remote memory."""
    remote_mem = pattern(n, seed) if op == "read" else np.zeros(n, np.uint8)
    local_mem = np.zeros(n, np.uint8) if op == "read" else pattern(n, seed + 1)
    server.register(remote_mem, access=RW, name="mem")
    r = client.register(local_mem, access=RW)
    client.connect(server.id, timeout=30.0)
    return r, client.put if op == "write" else client.get, local_mem, remote_mem


@pytest.mark.parametrize("op", ["write", "read"])
def test_one_layout_at_ever_new_offsets_moves_the_right_bytes(
    loose: tuple[Engine, Engine], op: str
) -> None:
    """A stream moves one strided layout to a new offset on both sides every time (as KV
    writes do): the engine plans the layout once and reuses its chain, shifted, so every
    transfer must still land exactly its own bytes, and a placement that reaches past a
    region's end is refused before anything is posted, as on the first call."""
    client, server = loose
    n = 1 << 16
    r, move, local_mem, remote_mem = _regions_for(op, client, server, n, seed=2)
    src, dst = (local_mem, remote_mem) if op == "write" else (remote_mem, local_mem)
    expect = dst.copy()
    for k, (lo, ro) in enumerate([(0, 5000), (777, 0), (4096, 9999), (123, 40000), (0, 5000)]):
        ldesc = StridedDesc(offset=lo + 16 * 63, count=16, size=40, stride=-63, alignment=None)
        rdesc = StridedDesc(offset=ro, count=20, size=32, stride=100, alignment=None)
        move(server.id, r, "mem", local_desc=ldesc, remote_desc=rdesc, timeout=30)
        lsrc = [lo + 16 * 63 - 63 * i for i in range(16)]
        lbytes = np.concatenate([local_mem[a : a + 40] for a in lsrc])
        rbytes = np.concatenate([remote_mem[ro + 100 * i : ro + 100 * i + 32] for i in range(20)])
        if op == "write":
            for i in range(20):
                expect[ro + 100 * i : ro + 100 * i + 32] = lbytes[32 * i : 32 * i + 32]
        else:
            for i, a in enumerate(lsrc):
                expect[a : a + 40] = rbytes[40 * i : 40 * i + 40]
        assert np.array_equal(dst, expect), f"transfer {k} at local {lo} remote {ro}"
    before = dst.copy()
    too_far = StridedDesc(offset=n - 1900 + 1, count=20, size=32, stride=100, alignment=None)
    ldesc = StridedDesc(offset=16 * 63, count=16, size=40, stride=-63, alignment=None)
    with pytest.raises(BoundsError, match=f"remote out of bounds: offset={n - 1900 + 1 + 1900} "):
        move(server.id, r, "mem", local_desc=ldesc, remote_desc=too_far, timeout=30)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_new_layout_of_a_known_size_refills_an_idle_chain_and_moves_its_bytes(
    loose: tuple[Engine, Engine], op: str
) -> None:
    """Layouts of one size (as many WRs and SGEs) but of different shapes, one after the
    other, as a paged KV cache's block lists are: the first allocates its chain, each
    later one takes the idle chain of the one before and fills it anew
    (``Diagnostics.chains_refilled``), and every transfer lands exactly its own bytes,
    none of the layout whose chain it took."""
    client, server = loose
    n = 1 << 16
    r, move, local_mem, remote_mem = _regions_for(op, client, server, n, seed=5)
    src, dst = (local_mem, remote_mem) if op == "write" else (remote_mem, local_mem)
    before = client.diagnostics()
    # 64 rows of 48 B each time (64 WRs of one SGE), at three strides and offsets.
    for k, (stride, lo, ro) in enumerate([(100, 0, 1000), (160, 3000, 0), (72, 50, 20000)]):
        dst[:] = 0
        ldesc = StridedDesc(offset=lo, count=64, size=48, stride=stride, alignment=None)
        rdesc = StridedDesc(offset=ro, count=64, size=48, stride=stride + 8, alignment=None)
        move(server.id, r, "mem", local_desc=ldesc, remote_desc=rdesc, timeout=30)
        lrows = [(lo + stride * i, ro + (stride + 8) * i) for i in range(64)]
        expect = np.zeros_like(dst)
        for la, ra in lrows:
            if op == "write":
                expect[ra : ra + 48] = src[la : la + 48]
            else:
                expect[la : la + 48] = src[ra : ra + 48]
        assert np.array_equal(dst, expect), f"layout {k} (stride {stride})"
    after = client.diagnostics()
    assert after.chains_built - before.chains_built == 1
    assert after.chains_refilled - before.chains_refilled == 2


@pytest.mark.parametrize("op", ["write", "read"])
def test_block_lists_of_one_size_refill_one_chain_and_move_their_bytes(
    loose: tuple[Engine, Engine], op: str
) -> None:
    """Block lists of 600 blocks in random order whose remote blocks touch in one run of
    a different length each time, so their plans differ in WRs (504, 358 and 426 on a
    device of 32 SGEs per WR): the first builds a chain, the next two refill it
    (``Diagnostics.chains_refilled``), and each lands exactly its own bytes."""
    client, server = loose
    n = 1 << 16
    r, move, local_mem, remote_mem = _regions_for(op, client, server, n, seed=13)
    src, dst = (local_mem, remote_mem) if op == "write" else (remote_mem, local_mem)
    rng = np.random.default_rng(17)
    blocks, size = 600, 8
    before = client.diagnostics()
    for k, touching in enumerate([100, 250, 180]):
        apart = touching * size + 8 + 2 * size * np.arange(blocks - touching)
        ro = np.concatenate([size * np.arange(touching), apart])
        lo = 16 * rng.permutation(4 * blocks)[:blocks]  # never touching
        order = rng.permutation(blocks)
        ro, lo = ro[order], lo[order]
        lengths = np.full(blocks, size)
        ldesc = BlockListDesc(offsets=lo, lengths=lengths, alignment=None)
        rdesc = BlockListDesc(offsets=ro, lengths=lengths, alignment=None)
        dst[:] = 0
        move(server.id, r, "mem", local_desc=ldesc, remote_desc=rdesc, timeout=30)
        byte = np.arange(size)
        at_l, at_r = lo[:, None] + byte, ro[:, None] + byte
        s_at, d_at = (at_l, at_r) if op == "write" else (at_r, at_l)
        expect = np.zeros_like(dst)
        expect[d_at] = src[s_at]
        assert np.array_equal(dst, expect), f"list {k} ({touching} blocks touching)"
    after = client.diagnostics()
    assert after.chains_built - before.chains_built == 1
    assert after.chains_refilled - before.chains_refilled == 2


@pytest.mark.parametrize("op", ["write", "read"])
def test_the_first_large_layout_fills_the_chain_made_with_the_engine_and_moves_its_bytes(
    loose: tuple[Engine, Engine], op: str
) -> None:
    """An engine formats one chain of 8192 WRs (for WRITEs) when it is made; the first
    layout of more than 4096 WRs takes it, cut to its own size (a READ rewrites the
    opcodes), and the next layout of that size refills it.  Both land exactly their own
    bytes, none of the other's, and only that first chain counts as built."""
    client, server = loose
    rows, size = 6000, 8
    n = rows * 32 + 4096
    r, move, local_mem, remote_mem = _regions_for(op, client, server, n, seed=11)
    src, dst = (local_mem, remote_mem) if op == "write" else (remote_mem, local_mem)
    before = client.diagnostics()
    for k, (stride, lo, ro) in enumerate([(16, 0, 64), (24, 8, 0)]):
        dst[:] = 0
        ldesc = StridedDesc(offset=lo, count=rows, size=size, stride=stride, alignment=None)
        rdesc = StridedDesc(offset=ro, count=rows, size=size, stride=stride + 8, alignment=None)
        move(server.id, r, "mem", local_desc=ldesc, remote_desc=rdesc, timeout=60)
        byte = np.arange(size)
        at_l = (lo + stride * np.arange(rows))[:, None] + byte
        at_r = (ro + (stride + 8) * np.arange(rows))[:, None] + byte
        s_at, d_at = (at_l, at_r) if op == "write" else (at_r, at_l)
        expect = np.zeros_like(dst)
        expect[d_at] = src[s_at]
        assert np.array_equal(dst, expect), f"layout {k} (stride {stride})"
    after = client.diagnostics()
    assert after.chains_built - before.chains_built == 1
    assert after.chains_refilled - before.chains_refilled == 1


@pytest.mark.parametrize("op", ["write", "read"])
def test_ranges_of_one_size_at_new_offsets_move_their_bytes_and_are_checked_each_time(
    pair: tuple[Engine, Engine], op: str
) -> None:
    """Single ranges of one size at a new offset on both sides every call (KV blocks
    written where each belongs) repeat the first call's checked plan: every call lands
    exactly its own bytes, and an offset that reaches past a region's end or breaks the
    engine's 64-byte alignment is refused before anything is posted, as on a first call."""
    client, server = pair
    n, size = 1 << 16, 4096
    r, move, local_mem, remote_mem = _regions_for(op, client, server, n, seed=7)
    src, dst = (local_mem, remote_mem) if op == "write" else (remote_mem, local_mem)

    def rng(offset: int) -> ContiguousDesc:
        return ContiguousDesc(offset=offset, nbytes=size, alignment=None)

    expect = dst.copy()
    offsets = [(0, 0), (64, 8192), (n - size, 128), (4096, n - size), (0, 0), (192, 64)]
    for k, (lo, ro) in enumerate(offsets):
        move(server.id, r, "mem", local_desc=rng(lo), remote_desc=rng(ro), timeout=30)
        s_off, d_off = (lo, ro) if op == "write" else (ro, lo)
        expect[d_off : d_off + size] = src[s_off : s_off + size]
        assert np.array_equal(dst, expect), f"transfer {k} at local {lo} remote {ro}"
    before = dst.copy()
    past = n - size + 64
    with pytest.raises(BoundsError, match=f"remote out of bounds: offset={past} "):
        move(server.id, r, "mem", local_desc=rng(0), remote_desc=rng(past), timeout=30)
    with pytest.raises(BoundsError, match=f"local out of bounds: offset={past} "):
        move(server.id, r, "mem", local_desc=rng(past), remote_desc=rng(0), timeout=30)
    with pytest.raises(AlignmentError):
        move(server.id, r, "mem", local_desc=rng(0), remote_desc=rng(4104), timeout=30)
    with pytest.raises(AlignmentError):
        move(server.id, r, "mem", local_desc=rng(8), remote_desc=rng(0), timeout=30)
    assert np.array_equal(dst, before)
    move(server.id, r, "mem", local_desc=rng(640), remote_desc=rng(1280), timeout=30)
    s_off, d_off = (640, 1280) if op == "write" else (1280, 640)
    expect[d_off : d_off + size] = src[s_off : s_off + size]
    assert np.array_equal(dst, expect)


@pytest.fixture(params=[1, 2], ids=["1-lane", "2-lanes"])
def connected_lanes(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine, int]]:
    """``(client, server, lanes)``, connected, both ends with ``lanes`` queue pairs."""
    lanes = request.param
    server = listening_engine(lanes=lanes)
    client = Engine("127.0.0.1:0", lanes=lanes)
    try:
        client.connect(server.id, timeout=30.0)
        yield client, server, lanes
    finally:
        client.close()
        server.close()


def test_coalesced_puts_fail_from_the_bad_one_on(
    connected_lanes: tuple[Engine, Engine, int],
) -> None:
    """Puts issued back to back go out in few ``post_send`` calls, only the last of each
    signaled; a bad key in the middle still fails exactly its own put with its status.
    On one lane (one queue pair, completing in order) the earlier ones complete with
    their bytes and the later ones fail with the connection; over two lanes, every other
    put either completes with its bytes or fails with the connection, and none hangs."""
    client, server, lanes = connected_lanes
    n, size = 48, 1024
    dst = np.zeros(n * size, np.uint8)
    server.register(dst, access=Access.REMOTE_WRITE, name="dst")
    conn = announced(client, server, "dst")
    good = conn.remote_region("dst")
    bad = replace(good, rkey=good.rkey ^ 0x00FF00, name="bad")
    conn.set_remote_regions((good, bad))  # test hook: as if the peer had announced both
    src = np.random.default_rng(5).integers(1, 256, n * size, dtype=np.uint8)
    r = client.register(src)

    # A clean stream first: every byte lands, in fewer posts than calls.
    before = client.diagnostics()
    handles = [
        client.put_async(
            server.id,
            r,
            good,
            local_desc=ContiguousDesc(offset=i * size, nbytes=size),
            remote_desc=ContiguousDesc(offset=i * size, nbytes=size),
        )
        for i in range(n)
    ]
    for h in handles:
        h.wait(timeout=30)
    after = client.diagnostics()
    assert np.array_equal(dst, src)
    assert after.posted_wrs - before.posted_wrs == n
    assert after.send_posts - before.send_posts < n, (before, after)

    # The same with a bad key at put 30.
    dst[:] = 0
    cut = 30
    maybe: list[TransferHandle | None] = []
    for i in range(n):
        try:
            maybe.append(
                client.put_async(
                    server.id,
                    r,
                    bad if i == cut else good,
                    local_desc=ContiguousDesc(offset=i * size, nbytes=size),
                    remote_desc=ContiguousDesc(offset=i * size, nbytes=size),
                    timeout=20,
                )
            )
        except ConnectionFailed:  # the bad put already failed the connection
            assert i > cut
            maybe.append(None)
    done = 0
    for i, m in enumerate(maybe):
        if i == cut:
            assert m is not None
            with pytest.raises(CompletionError) as info:
                m.wait(timeout=30)
            assert info.value.status_name in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR")
        elif lanes == 1 and i < cut:
            assert m is not None
            m.wait(timeout=30)
            done += 1
        elif lanes == 1:
            if m is not None:
                with pytest.raises(ConnectionFailed):
                    m.wait(timeout=30)
        elif m is not None:
            try:
                m.wait(timeout=30)
            except ConnectionFailed:
                continue
            assert np.array_equal(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
            done += 1
    if lanes == 1:
        assert done == cut and np.array_equal(dst[: cut * size], src[: cut * size])
    assert conn.state is ConnState.FAILED


def test_single_messages_through_the_slot_ring_keep_order_with_chains_and_notifications(
    connected_lanes: tuple[Engine, Engine, int],
) -> None:
    """Asynchronous single puts and gets go through each lane's ring of slots
    (``Diagnostics.slot_messages``), many more of them than a ring holds and with more
    in flight than a ring has slots; strided transfers of many WRs and notifications are queued
    between them.  Every byte lands, every handle finishes once, and each notification
    arrives only after everything queued before it (on every lane) has landed."""
    client, server, lanes = connected_lanes
    size, n = 512, 1200  # > 4 rings of 256 slots
    dst = np.zeros(n * size, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(n * size, 11)
    back = np.zeros(n * size, np.uint8)
    r = client.register(src)
    rb = client.register(back, access=Access.LOCAL_WRITE)
    announced(client, server, "dst")
    before = client.diagnostics()
    handles: list[TransferHandle] = []
    strided = StridedDesc(offset=0, count=64, size=size, stride=2 * size)
    for i in range(n):
        d = ContiguousDesc(offset=i * size, nbytes=size)
        handles.append(client.put_async(server.id, r, "dst", local_desc=d, remote_desc=d))
        if len(handles) > 300:  # more in flight than a group holds, fewer than the queue
            handles.pop(0).wait(timeout=30)
        if i % 200 == 199:  # a chain of 64 WRs, then a notification behind all of it
            handles.append(
                client.put_async(server.id, r, "dst", local_desc=strided, remote_desc=strided)
            )
            upto = (i + 1) * size
            client.transfer_async(server.id, [], notify=f"upto-{upto}")
    for h in handles:
        h.wait(timeout=30)
    for i in range(199, n, 200):
        upto = (i + 1) * size
        server.wait_notification(f"upto-{upto}", timeout=30)
    assert np.array_equal(dst, src)
    # And back, by single gets.
    gets = [
        client.get_async(
            server.id,
            rb,
            "dst",
            local_desc=ContiguousDesc(offset=i * size, nbytes=size),
            remote_desc=ContiguousDesc(offset=i * size, nbytes=size),
        )
        for i in range(n)
    ]
    for h in gets:
        h.wait(timeout=30)
        assert h.done() and h.error is None
    assert np.array_equal(back, src)
    after = client.diagnostics()
    # Most go through the rings; a message that finds all 256 slots of its lane waiting
    # for their post (more than a ring queued and not posted yet) takes the chain path,
    # queued behind them, which the byte checks above cover too.
    assert after.slot_messages - before.slot_messages > n
    assert after.pending_transfers == 0


def test_a_ring_message_never_gets_a_deadline_later_than_its_own_timeout(
    connected_lanes: tuple[Engine, Engine, int],
) -> None:
    """Single puts with mixed timeouts, fast enough that most join an open group of
    their lane's ring: a member's deadline is its group's, the earliest of theirs, and
    a message that joins with a shorter timeout than the group's members moves it.  So
    each handle's deadline is at most its call's end plus its own timeout (and the
    stream completes)."""
    client, server, lanes = connected_lanes
    size, n = 256, 600
    dst = np.zeros(n * size, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(n * size, 31)
    r = client.register(src)
    announced(client, server, "dst")
    rng = np.random.default_rng(5)
    timeouts = rng.choice([60.0, 30.0, 20.0, 45.0, 15.0], size=n)
    before = client.diagnostics()
    handles = []
    for i in range(n):
        d = ContiguousDesc(offset=i * size, nbytes=size)
        h = client.put_async(server.id, r, "dst", local_desc=d, remote_desc=d, timeout=timeouts[i])
        end = time.monotonic()
        assert h.deadline <= end + timeouts[i], (i, h.deadline - end, timeouts[i])
        handles.append(h)
    for h in handles:
        h.wait(timeout=60)
    assert np.array_equal(dst, src)
    assert client.diagnostics().slot_messages - before.slot_messages > n // 2


def test_a_thread_polling_done_finishes_its_transfers_without_the_progress_thread(
    connected_lanes: tuple[Engine, Engine, int],
) -> None:
    """A thread that polls ``done()`` and runs only Python in between keeps the GIL; with
    the switch interval at one second the progress thread gets it about once a second.
    Polling drives the engine on the polling thread (it posts and reaps), so single puts
    and a strided one still finish in a small part of that second, and land."""
    client, server, lanes = connected_lanes
    size, n = 4096, 12
    dst = np.zeros(n * size * 2, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(n * size * 2, 41)
    r = client.register(src)
    announced(client, server, "dst")
    descs: list[ContiguousDesc | StridedDesc] = [
        ContiguousDesc(offset=i * size, nbytes=size) for i in range(n)
    ]
    descs.append(StridedDesc(offset=n * size, count=n, size=size // 2, stride=size))
    took = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        for d in descs:
            start = time.monotonic()
            h = client.put_async(server.id, r, "dst", local_desc=d, remote_desc=d, timeout=30)
            while not h.done() and time.monotonic() - start < 10:
                pass  # Python only: the GIL is not let go here
            took.append(time.monotonic() - start)
            h.wait(timeout=30)
    finally:
        sys.setswitchinterval(old)
    assert np.array_equal(dst[: n * size], src[: n * size])
    for k in range(n):  # the strided put's rows
        row = slice(n * size + k * size, n * size + k * size + size // 2)
        assert np.array_equal(dst[row], src[row]), k
    assert statistics.median(took) < 0.25, sorted(took)


def test_notifications_wait_for_ring_messages_queued_before_them(
    connected_lanes: tuple[Engine, Engine, int],
) -> None:
    """A notification queued right behind single puts is delivered only once their bytes
    are in the peer's memory: the peer checks its buffer when the notification arrives."""
    client, server, lanes = connected_lanes
    size, n = 4096, 64
    dst = np.zeros(n * size, np.uint8)
    server.register(dst, access=RW, name="dst")
    announced(client, server, "dst")
    for round_ in range(5):
        src = pattern(n * size, 20 + round_)
        r = client.register(src)
        for i in range(n):
            d = ContiguousDesc(offset=i * size, nbytes=size)
            client.put_async(server.id, r, "dst", local_desc=d, remote_desc=d)
        client.notify(server.id, f"round-{round_}")
        server.wait_notification(f"round-{round_}", timeout=30)
        assert np.array_equal(dst, src), f"round {round_}: a notification overtook its data"
        client.deregister(r)
