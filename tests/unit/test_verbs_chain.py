"""Work-request chains in C memory (no device needed: building a chain only fills memory).

Every check reads the chain back through cffi's own view of ``struct ibv_send_wr`` and
``struct ibv_sge`` (pointer chasing from the head along ``next`` and ``sg_list``), not
through the numpy views that wrote it, and compares with the plan's arrays.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl.core.descriptors import ContiguousDesc, StridedDesc
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.errors import ArgumentError, DescriptorError, RegistrationError
from hixl.verbs._ffi import address, ffi
from hixl.verbs.chain import SEND_FENCE, SEND_SIGNALED, WR_BYTES, ChainMemory, SendChain

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LADDR, RADDR = 0x7F00_1234_0000, 0x5500_0000_1000


def walk(chain: SendChain) -> list[dict[str, object]]:
    """Follow ``next`` from the head with cffi, reading every WR and its SGEs."""
    out: list[dict[str, object]] = []
    wr = chain.head
    while wr != ffi.NULL:
        assert len(out) <= chain.capacity, "chain links form a cycle"
        sges = [
            (int(wr.sg_list[k].addr), int(wr.sg_list[k].length), int(wr.sg_list[k].lkey))
            for k in range(wr.num_sge)
        ]
        out.append(
            {
                "wr_id": int(wr.wr_id),
                "opcode": int(wr.opcode),
                "flags": int(wr.send_flags),
                "remote": int(wr.wr.rdma.remote_addr),
                "rkey": int(wr.wr.rdma.rkey),
                "sges": sges,
            }
        )
        wr = wr.next
    return out


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    size = draw(st.integers(1, 64))
    count = draw(st.integers(1, 200))
    lstride = size + draw(st.integers(0, 64))
    local = StridedDesc(
        offset=draw(st.integers(0, 512)), count=count, size=size, stride=lstride, alignment=None
    )
    remote: ContiguousDesc | StridedDesc
    if draw(st.booleans()):
        remote = ContiguousDesc(
            offset=draw(st.integers(0, 512)), nbytes=count * size, alignment=None
        )
    else:
        rsize = draw(
            st.sampled_from(
                [d for d in range(1, size * count + 1) if (size * count) % d == 0 and d <= 256]
            )
        )
        rcount = size * count // rsize
        remote = StridedDesc(
            offset=draw(st.integers(0, 512)),
            count=rcount,
            size=rsize,
            stride=rsize + draw(st.integers(0, 32)),
            alignment=None,
        )
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    limits = DeviceLimits(
        max_sge=draw(st.integers(1, 32)),
        max_sge_rd=draw(st.integers(1, 32)),
        max_msg_sz=draw(st.integers(1, 4096)),
    )
    return plan_transfer(local, remote, op, limits)


#: A plan and the keys and opcode to fill a chain from it with.
FILLS = given(
    plan=plans(),
    lkey=st.integers(0, 2**32 - 1),
    rkey=st.integers(0, 2**32 - 1),
    opcode=st.sampled_from([0, 4]),
)


def expected(plan: Plan, lkey: int, rkey: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    out = []
    for roff, sges in plan.wrs():
        out.append((RADDR + roff, rkey, [(LADDR + o, n, lkey) for o, n in sges]))
    return out


@PROPS
@FILLS
def test_filled_chain_equals_the_plan(plan: Plan, lkey: int, rkey: int, opcode: int) -> None:
    chain = SendChain.for_plan(
        plan, opcode=opcode, local_addr=LADDR, lkey=lkey, remote_addr=RADDR, rkey=rkey
    )
    got = walk(chain)
    assert len(got) == plan.num_wrs == chain.num_wrs
    assert [(g["remote"], g["rkey"], g["sges"]) for g in got] == expected(plan, lkey, rkey)
    assert all(g["opcode"] == opcode and g["flags"] == 0 and g["wr_id"] == 0 for g in got)
    # SGEs are laid out in order, one array: WR i's sg_list is &sges[wr_sge_start[i]]
    sg_lists = [int(ffi.cast("uintptr_t", chain.head[i].sg_list)) for i in range(plan.num_wrs)]
    assert sg_lists == [chain.sge_base + 16 * int(s) for s in plan.wr_sge_start[:-1]]


@PROPS
@given(
    local=st.integers(0, 2**47),
    remote=st.integers(0, 2**47),
    nbytes=st.integers(0, 2**31),
    lkey=st.integers(0, 2**32 - 1),
    rkey=st.integers(0, 2**32 - 1),
    opcode=st.sampled_from([0, 4]),
)
def test_a_single_chain_equals_the_filled_chain_of_its_one_range(
    local: int, remote: int, nbytes: int, lkey: int, rkey: int, opcode: int
) -> None:
    """``SendChain.single`` (cffi stores only) writes what ``fill`` writes for one range."""
    one = SendChain.single(
        opcode=opcode, local_addr=local, nbytes=nbytes, lkey=lkey, remote_addr=remote, rkey=rkey
    )
    ref = SendChain(1, 1)
    ref.fill(
        opcode=opcode,
        remote_addr=[remote],
        rkey=rkey,
        sge_start=[0, 1],
        sge_addr=[local],
        sge_length=[nbytes],
        lkey=lkey,
    )
    assert walk(one) == walk(ref)
    assert one.num_wrs == one.num_sges == 1
    assert int(ffi.cast("uintptr_t", one.head[0].sg_list)) == one.sge_base
    # Its numpy views, made on first use, read the same C memory.
    assert one.wrs.tobytes() != b"" and int(one.sges["addr"][0]) == local
    one.shift(8, 16)
    moved = walk(one)[0]
    assert moved["remote"] == remote + 16 and moved["sges"] == [(local + 8, nbytes, lkey)]


@PROPS
@given(plan=plans(), every=st.integers(1, 70), first=st.integers(0, 2**40))
def test_signals_one_per_group_and_ids_name_the_group(plan: Plan, every: int, first: int) -> None:
    chain = SendChain.for_plan(plan, opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
    groups = chain.set_signals(first, every)
    n = plan.num_wrs
    assert groups == -(-n // every)
    got = walk(chain)
    for i, g in enumerate(got):
        assert g["wr_id"] == first + i // every
        last_of_group = (i + 1) % every == 0 or i == n - 1
        assert g["flags"] == (SEND_SIGNALED if last_of_group else 0)
    # exactly one signaled WR per group
    assert sum(1 for g in got if g["flags"]) == groups


@PROPS
@given(plan=plans(), data=st.data())
def test_signals_on_a_sub_range_leave_the_rest_alone(plan: Plan, data: st.DataObject) -> None:
    chain = SendChain.for_plan(plan, opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
    n = plan.num_wrs
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    every = data.draw(st.integers(1, 40))
    groups = chain.set_signals(77, every, start, stop)
    assert groups == -(-(stop - start) // every)
    for i, g in enumerate(walk(chain)):
        if start <= i < stop:
            k = i - start
            assert g["wr_id"] == 77 + k // every
            last = (k + 1) % every == 0 or i == stop - 1
            assert g["flags"] == (SEND_SIGNALED if last else 0)
        else:
            assert g["wr_id"] == 0 and g["flags"] == 0


@PROPS
@given(a=plans(), b=plans())
def test_refill_with_another_plan_reuses_the_memory(a: Plan, b: Plan) -> None:
    """A chain refilled in place reads exactly as a fresh one built from the new plan."""
    cap = max(a.num_wrs, b.num_wrs)
    chain = SendChain(cap, max(a.num_sges, b.num_sges))
    base = chain.wr_base
    chain.fill_plan(a, opcode=0, local_addr=LADDR, lkey=3, remote_addr=RADDR, rkey=4)
    chain.set_signals(7, 3)
    chain.fill_plan(b, opcode=4, local_addr=LADDR, lkey=5, remote_addr=RADDR, rkey=6)
    # a fill clears what signal() and fence() set too (one WR's flags each)
    last = b.num_wrs - 1
    chain.signal(last)
    chain.fence(0)
    chain.fill_plan(b, opcode=4, local_addr=LADDR, lkey=5, remote_addr=RADDR, rkey=6)
    assert chain.wr_base == base
    got = walk(chain)
    assert [(g["remote"], g["rkey"], g["sges"]) for g in got] == expected(b, 5, 6)
    assert all(g["flags"] == 0 and g["wr_id"] == 0 and g["opcode"] == 4 for g in got)
    # growing back to the first plan's size relinks the WRs the shorter fill cut off
    chain.fill_plan(a, opcode=0, local_addr=LADDR, lkey=3, remote_addr=RADDR, rkey=4)
    assert [(g["remote"], g["rkey"], g["sges"]) for g in walk(chain)] == expected(a, 3, 4)


@PROPS
@given(
    steps=st.lists(
        st.tuples(plans(), st.sampled_from([0, 4]), st.booleans(), st.sampled_from([8, 9])),
        min_size=2,
        max_size=5,
    ),
    made_for=st.booleans(),
)
def test_any_sequence_of_refills_reads_as_a_fresh_chain(
    steps: list[tuple[Plan, int, bool, int]], made_for: bool
) -> None:
    """Whatever a chain held before (other plans, opcodes, keys, signals), a fill leaves it
    reading exactly as a new chain filled the same way: every field, every link; whether
    the chain was made empty or for its first plan."""
    kws: list[dict[str, Any]] = [
        {"opcode": opcode, "local_addr": LADDR, "lkey": 9, "remote_addr": RADDR, "rkey": rkey}
        for _, opcode, _, rkey in steps
    ]
    plans_ = [plan for plan, _, _, _ in steps]
    if made_for:  # sized for the largest plan, made for it
        big = max(range(len(plans_)), key=lambda i: (plans_[i].num_wrs, plans_[i].num_sges))
        chain = SendChain.for_plan(plans_[big], **kws[big])
        if any(p.num_sges > chain.sge_capacity for p in plans_):
            chain = SendChain(chain.capacity, max(p.num_sges for p in plans_))
    else:
        chain = SendChain(max(p.num_wrs for p in plans_), max(p.num_sges for p in plans_))
    for (plan, _, signal, _), kw in zip(steps, kws, strict=True):
        chain.fill_plan(plan, **kw)
        assert walk(chain) == walk(SendChain.for_plan(plan, **kw))
        if signal:
            chain.set_signals(5, 2)


def rows(count: int) -> Plan:
    """A plan of ``count`` WRs of one 8-byte SGE each (a layer's rows)."""
    desc = StridedDesc(offset=0, count=count, size=8, stride=16, alignment=None)
    return plan_transfer(desc, desc, Op.WRITE, DeviceLimits())


@PROPS
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3), data=st.data())
def test_ids_and_flags_follow_any_sequence_of_fills_and_signals(
    sizes: list[int], data: st.DataObject
) -> None:
    """Fills, signal patterns (whole chain or a range), and single WRs signaled,
    unsignaled or fenced, in any order: after each step every WR's ``wr_id`` and flags
    are what the calls say (a model), the WRs a shorter fill hid included."""
    chain = SendChain.for_plan(
        rows(max(sizes)), opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2
    )
    model = [(0, 0)] * chain.capacity  # (wr_id, flags) of every WR the chain has room for
    n = chain.num_wrs
    for _ in range(data.draw(st.integers(1, 12))):
        step = data.draw(st.sampled_from(["fill", "keep", "signals", "range", "one", "flag"]))
        if step in ("fill", "keep"):
            n = data.draw(st.sampled_from(sizes))
            keep = step == "keep"
            chain.fill_plan(
                rows(n),
                opcode=0,
                local_addr=LADDR,
                lkey=1,
                remote_addr=RADDR,
                rkey=2,
                keep_ids=keep,
            )
            if not keep:  # clears every WR's, hidden ones too; keep_ids: all stay
                model = [(0, 0)] * chain.capacity
        elif step in ("signals", "range", "one"):
            start, stop = 0, n
            if step == "range":
                start = data.draw(st.integers(0, n - 1))
                stop = data.draw(st.integers(start + 1, n))
            elif step == "one":
                start = data.draw(st.integers(0, n - 1))
                stop = start + 1
            every = data.draw(st.integers(1, 9))
            first = data.draw(st.integers(0, 1000))
            chain.set_signals(first, every, start, stop)
            for i in range(start, stop):
                k = i - start
                last = (k + 1) % every == 0 or i == stop - 1
                model[i] = (first + k // every, SEND_SIGNALED if last else 0)
        else:
            i = data.draw(st.integers(0, n - 1))
            how = data.draw(st.sampled_from(["signal", "unsignal", "fence"]))
            wr_id, flags = model[i]
            if how == "signal":
                chain.signal(i)
                flags |= SEND_SIGNALED
            elif how == "unsignal":
                chain.unsignal(i)
                flags &= ~SEND_SIGNALED
            else:
                chain.fence(i)
                flags |= SEND_FENCE
            model[i] = (wr_id, flags)
        assert [(g["wr_id"], g["flags"]) for g in walk(chain)] == model[:n]


@PROPS
@given(a=plans(), b=plans(), every=st.integers(1, 9), first=st.integers(0, 1000))
def test_a_fill_that_keeps_the_ids_then_signals_reads_as_a_fresh_chain_signaled(
    a: Plan, b: Plan, every: int, first: int
) -> None:
    """``keep_ids`` skips clearing ``wr_id`` and the flags; once the whole chain is
    signaled, as the engine does before every post, nothing of the plan before shows."""
    kw: dict[str, Any] = {"local_addr": LADDR, "lkey": 3, "remote_addr": RADDR, "rkey": 4}
    chain = SendChain(max(a.num_wrs, b.num_wrs), max(a.num_sges, b.num_sges))
    chain.fill_plan(a, opcode=0, **kw)
    chain.set_signals(first + 17, every + 1)
    chain.signal(0)
    chain.fill_plan(b, opcode=4, keep_ids=True, **kw)
    chain.set_signals(first, every)
    fresh = SendChain.for_plan(b, opcode=4, **kw)
    fresh.set_signals(first, every)
    assert walk(chain) == walk(fresh)


def _chain_args(lkey: int, rkey: int, opcode: int) -> dict[str, Any]:
    return {"opcode": opcode, "local_addr": LADDR, "lkey": lkey, "remote_addr": RADDR, "rkey": rkey}


def _leave_old_wrs_in_memory(plan: Plan, kw: dict[str, Any]) -> None:
    """A chain for ``plan`` under another rkey, signalled, then freed: its blocks go back
    to ``_MEMORY`` with their WRs still written."""
    dirty = SendChain.for_plan(plan, memory=_MEMORY, **{**kw, "rkey": kw["rkey"] ^ 1})
    dirty.set_signals(7, 3)
    del dirty


@PROPS
@FILLS
def test_a_blank_chain_cut_to_a_plan_and_filled_is_byte_for_byte_one_made_for_it(
    plan: Plan, lkey: int, rkey: int, opcode: int
) -> None:
    """A blank chain made in advance, larger than the plan, in memory another chain held
    before, then cut to the plan's size (``shrink``) and filled, holds exactly the bytes
    of a chain made for that plan: every WR, its links (the last one ends the chain)
    and every SGE; its views are the plan's size."""
    kw = _chain_args(lkey, rkey, opcode)
    _leave_old_wrs_in_memory(plan, kw)
    cap = plan.num_wrs + 5
    blank = SendChain.blank(cap, max(cap, plan.num_sges + 2), 4, _MEMORY, one_each=True)
    blank.shrink(plan.num_wrs, plan.num_sges)
    blank.fill_plan(plan, keep_ids=True, **kw)
    made = SendChain.for_plan(plan, **kw)
    assert walk(blank) == walk(made)
    assert np.array_equal(wr_words(blank), wr_words(made))
    assert blank.sges.tobytes() == made.sges.tobytes()
    assert (blank.capacity, blank.sge_capacity) == (plan.num_wrs, plan.num_sges)
    assert len(blank._views()[0]) == plan.num_wrs and len(blank._words()[1]) == plan.num_sges


def test_shrink_refuses_to_grow_or_to_cut_a_filled_chain() -> None:
    chain = SendChain.blank(8, 8, 4, one_each=True)
    for bad in ((0, 1), (1, 0), (9, 8), (8, 9)):
        with pytest.raises(ArgumentError, match="shrink"):
            chain.shrink(*bad)
    chain.shrink(4, 4)
    chain.fill_plan(rows(4), opcode=4, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
    with pytest.raises(ArgumentError, match="shrink"):
        chain.shrink(2, 2)
    with pytest.raises(ArgumentError, match="chain too small"):
        chain.fill_plan(rows(5), opcode=4, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)


def wr_words(chain: SendChain) -> np.ndarray:
    """Every byte of the chain's filled WRs as 64-bit words, read through ``head``, with
    the pointers (``next``, ``sg_list``) made relative to the chain's own arrays."""
    n = chain.num_wrs
    words = np.frombuffer(ffi.buffer(chain.head, n * WR_BYTES), np.uint64).reshape(n, -1).copy()
    for col, base in ((1, chain.wr_base), (2, chain.sge_base)):
        nonzero = words[:, col] != 0
        words[nonzero, col] -= np.uint64(base)
    return words


@PROPS
@FILLS
def test_a_chain_made_for_a_plan_is_byte_for_byte_an_empty_chain_filled(
    plan: Plan, lkey: int, rkey: int, opcode: int
) -> None:
    """``for_plan`` writes its memory once instead of zeroing it first: every byte of
    every WR (the unions hixl does not use included) and of every SGE is what a zeroed
    chain filled from the same plan holds."""
    kw = _chain_args(lkey, rkey, opcode)
    made = SendChain.for_plan(plan, **kw)
    filled = SendChain(made.capacity, made.sge_capacity)
    filled.fill_plan(plan, **kw)
    assert np.array_equal(wr_words(made), wr_words(filled))
    assert made.sges.tobytes() == filled.sges.tobytes()
    assert wr_words(made)[-1, 1] == 0  # the last WR ends the chain


_MEMORY = ChainMemory(reserve=64 << 10)


@PROPS
@FILLS
def test_a_chain_in_kept_memory_reads_as_one_in_new_memory(
    plan: Plan, lkey: int, rkey: int, opcode: int
) -> None:
    """Memory a freed chain gave back holds its old WRs; a new chain made in it must
    read exactly as one made in fresh memory."""
    kw = _chain_args(lkey, rkey, opcode)
    _leave_old_wrs_in_memory(plan, kw)
    made = SendChain.for_plan(plan, memory=_MEMORY, **kw)
    fresh = SendChain.for_plan(plan, **kw)
    assert walk(made) == walk(fresh)
    assert np.array_equal(wr_words(made), wr_words(fresh))


def test_kept_memory_is_reused_and_what_is_kept_beyond_the_reserve_is_bounded() -> None:
    mem = ChainMemory(reserve=1 << 20, retain=256 << 10)
    a = mem.allocator("char[]", 100_000)  # the 128 KiB class, from the reserve
    where = address(a)
    del a
    b = mem.allocator("char[]", 70_000)  # same class: the same block again
    assert address(b) == where
    big = [mem.allocator("char[]", 512 << 10) for _ in range(3)]  # 1 MiB reserve runs out
    assert mem.heap_blocks == 2  # two blocks came from the C heap
    del big
    assert mem.heap_blocks == 0 and mem.heap_kept == 0  # past `retain`, back to the heap
    with pytest.raises(ArgumentError):
        ChainMemory(reserve=-1)


def test_closed_memory_gives_its_reserve_back_when_its_last_chain_goes() -> None:
    mem = ChainMemory(reserve=1 << 20, retain=4 << 20)
    plan = plan_transfer(
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        Op.WRITE,
        DeviceLimits(),
    )
    kw: dict[str, Any] = {"opcode": 0, "local_addr": LADDR, "lkey": 1, "remote_addr": RADDR}
    held = SendChain.for_plan(plan, rkey=2, memory=mem, **kw)
    freed = SendChain.for_plan(plan, rkey=2, memory=mem, **kw)
    extra = mem.allocator("char[]", 2 << 20)  # past the reserve: from the heap
    del freed, extra  # both kept for reuse
    assert mem.heap_kept == 2 << 20
    mem.close()
    assert mem.heap_kept == 0  # free blocks go at once
    assert mem.reserve_held  # `held` still writes into it
    assert walk(held)[0]["rkey"] == 2
    del held
    assert not mem.reserve_held
    after = SendChain.for_plan(plan, rkey=3, memory=mem, **kw)  # from the heap now
    assert mem.heap_blocks == 2 and walk(after)[0]["rkey"] == 3
    del after
    assert mem.heap_blocks == 0 and mem.heap_kept == 0


def test_chain_memory_is_freed_by_reference_counting_alone() -> None:
    """The reserve (2 MiB in an engine) must not wait for the cyclic collector, which runs
    by object counts and not bytes: an engine made and closed in a loop grew by it."""
    plan = plan_transfer(
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        Op.WRITE,
        DeviceLimits(),
    )
    kw: dict[str, Any] = {"opcode": 0, "local_addr": LADDR, "lkey": 1, "remote_addr": RADDR}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        mem = ChainMemory(reserve=1 << 20)
        gone = weakref.ref(mem)
        chain = SendChain.for_plan(plan, rkey=2, memory=mem, **kw)
        del chain, mem
        assert gone() is None, "the chain memory is kept alive by a reference cycle"
    finally:
        if was_enabled:
            gc.enable()


def test_numpy_views_alias_the_c_memory() -> None:
    chain = SendChain(4, 4)
    plan = plan_transfer(
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        ContiguousDesc(offset=0, nbytes=64, alignment=None),
        Op.WRITE,
        DeviceLimits(max_msg_sz=16),
    )
    chain.fill_plan(plan, opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
    chain.wrs["rkey"][2] = 0xABCD
    assert int(chain.head[2].wr.rdma.rkey) == 0xABCD
    chain.head[1].wr_id = 99
    assert int(chain.wrs["wr_id"][1]) == 99
    assert address(chain.head) == chain.wr_base
    assert chain.wr_address(3) == chain.wr_base + 3 * 128


def test_wrs_without_sges_fill_a_chain_with_fewer_sges_than_wrs() -> None:
    """A fill works out the WRs' words in the chain's SGE memory when it has room for
    one SGE per WR; WRs of no SGE can leave it less room than that."""
    for sges in (2, 4):
        chain = SendChain(4, sges)
        chain.fill(
            opcode=0,
            remote_addr=np.array([10, 20, 30, 40], np.uint64),
            rkey=7,
            sge_start=np.array([0, 1, 1, 1, 2]),
            sge_addr=np.array([100, 200]),
            sge_length=np.array([1, 2]),
            lkey=9,
        )
        wrs = chain.wrs
        assert wrs["num_sge"].tolist() == [1, 0, 0, 1]
        assert wrs["remote_addr"].tolist() == [10, 20, 30, 40]
        assert wrs["rkey"].tolist() == [7] * 4
        assert wrs["sg_list"].tolist() == [chain.sge_base + 16 * i for i in (0, 1, 1, 1)]
        assert chain.sges["addr"].tolist() == [100, 200]
        assert chain.sges["length"].tolist() == [1, 2]
        assert chain.sges["lkey"].tolist() == [9, 9]


def test_bad_fills_are_refused_with_their_numbers() -> None:
    chain = SendChain(2, 2)
    with pytest.raises(ArgumentError, match="3 WRs"):
        chain.fill(
            opcode=0,
            remote_addr=[1, 2, 3],
            rkey=1,
            sge_start=[0, 1, 2, 3],
            sge_addr=[1, 2, 3],
            sge_length=[1, 1, 1],
            lkey=1,
        )
    with pytest.raises(DescriptorError, match="sge_start"):
        chain.fill(
            opcode=0,
            remote_addr=[1],
            rkey=1,
            sge_start=[0, 2],
            sge_addr=[1],
            sge_length=[1],
            lkey=1,
        )
    with pytest.raises(DescriptorError, match="2\\*\\*32|0..4294967295"):
        chain.fill(
            opcode=0,
            remote_addr=[1],
            rkey=1,
            sge_start=[0, 1],
            sge_addr=[1],
            sge_length=[2**32],
            lkey=1,
        )
    with pytest.raises(DescriptorError, match="32-bit"):
        chain.fill(
            opcode=0,
            remote_addr=[1],
            rkey=2**32,
            sge_start=[0, 1],
            sge_addr=[1],
            sge_length=[1],
            lkey=1,
        )
    with pytest.raises(ArgumentError, match="outside"):
        chain.set_signals(0, 1)


def test_a_chain_over_a_closed_region_is_refused() -> None:
    class Region:  # the one attribute check_regions reads, as MemoryRegion has it
        closed = False

    region = Region()
    chain = SendChain(1, 1)
    chain.fill(
        opcode=0,
        remote_addr=[1],
        rkey=1,
        sge_start=[0, 1],
        sge_addr=[1],
        sge_length=[1],
        lkey=1,
        regions=(region,),
    )
    chain.check_regions()
    region.closed = True
    with pytest.raises(RegistrationError, match="closed memory region"):
        chain.check_regions()


def test_filling_allocates_no_python_object_per_wr() -> None:
    """Refilling and re-signalling 10,000 WRs grows Python's heap by a bounded amount."""
    import sys

    row = StridedDesc(offset=0, count=10_000, size=64, stride=128, alignment=None)
    plan = plan_transfer(row, row, Op.WRITE, DeviceLimits())
    chain = SendChain.for_plan(plan, opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
    chain.set_signals(0, 64)
    before = sys.getallocatedblocks()
    peak = before
    for i in range(5):
        chain.fill_plan(plan, opcode=0, local_addr=LADDR, lkey=1, remote_addr=RADDR, rkey=2)
        chain.set_signals(i * 1000, 64)
        peak = max(peak, sys.getallocatedblocks())
    assert peak - before < 200, f"{peak - before} blocks for a 10,000-WR refill"
    assert np.array_equal(chain.wrs["num_sge"], np.ones(10_000))
