"""Property tests of the planner: random descriptors and limits against byte-level oracles.

The oracles are independent of the planner: a plain ``memoryview`` copy of the described
elements, a per-byte write counter, a dynamic program for the fewest WRs, and the
per-segment reference planner of ``benchmarks/drivers/plan.py``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plan_oracle import apply_plan

from benchmarks.drivers.plan import reference_plan
from hixl.core.descriptors import INT64_MAX, ContiguousDesc, Segments, StridedDesc
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.errors import DescriptorError

PROPS = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- oracles


def stream_of(buf: bytes | bytearray, seg: Segments) -> bytes:
    """The described bytes, element by element: the direct copy's source."""
    view = memoryview(buf)
    return b"".join(bytes(view[o : o + n]) for o, n in seg.pairs())


def direct_copy(src: bytes, src_seg: Segments, dst: bytearray, dst_seg: Segments) -> None:
    data = stream_of(src, src_seg)
    view = memoryview(dst)
    pos = 0
    for o, n in dst_seg.pairs():
        view[o : o + n] = data[pos : pos + n]
        pos += n


def writes_per_byte(plan: Plan, size: int) -> np.ndarray:
    """How many times the plan writes each destination byte."""
    count = np.zeros(size, dtype=np.int64)
    for r, sges in plan.wrs():
        if plan.op is Op.WRITE:
            count[r : r + sum(n for _, n in sges)] += 1
        else:
            for lo, n in sges:
                count[lo : lo + n] += 1
    return count


def coverage(seg: Segments, size: int) -> np.ndarray:
    count = np.zeros(size, dtype=np.int64)
    for o, n in seg.pairs():
        count[o : o + n] += 1
    return count


def fewest_wrs(local: Segments, remote: Segments, sge: int, msg: int) -> int:
    """Fewest WRs of any valid plan, by dynamic programming over bytes.

    Valid: a WR is a contiguous range of remote addresses the transfer touches, holding at
    most ``msg`` bytes and at most ``sge`` runs of consecutive local addresses. Assumes the
    remote side is disjoint (each remote byte has one local partner).
    """
    lbytes = [o + i for o, n in local.pairs() for i in range(n)]
    rbytes = [o + i for o, n in remote.pairs() for i in range(n)]
    partner = dict(zip(rbytes, lbytes, strict=True))
    addrs = sorted(partner)
    runs: list[list[int]] = []
    for a in addrs:
        if runs and runs[-1][-1] + 1 == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    total = 0
    for run in runs:
        n = len(run)
        # new[p] is true when byte p of the run does not continue byte p-1 locally.
        new = [p == 0 or partner[run[p]] != partner[run[p - 1]] + 1 for p in range(n)]
        best = [0] + [n + 1] * n
        for end in range(1, n + 1):
            pieces = 1  # local runs in [start, end)
            for start in range(end - 1, max(-1, end - msg - 1), -1):
                if start < end - 1 and new[start + 1]:
                    pieces += 1
                if pieces > sge:
                    break
                best[end] = min(best[end], best[start] + 1)
        total += best[n]
    return total


# --------------------------------------------------------------------------- strategies


@st.composite
def lengths_of(draw: st.DrawFn, total: int, max_parts: int = 10) -> list[int]:
    parts = draw(st.integers(1, min(total, max_parts)))
    cuts: list[int] = []
    if parts > 1:
        cuts = sorted(
            draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1))
        )
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


@st.composite
def side(draw: st.DrawFn, total: int, disjoint: bool) -> Segments:
    """Segments covering ``total`` bytes; disjoint ones for a destination."""
    lengths = draw(lengths_of(total))
    k = len(lengths)
    if disjoint:
        order = draw(st.sampled_from(["packed", "shuffled", "gaps"]))
        place = list(range(k)) if order != "shuffled" else draw(st.permutations(range(k)))
        gaps = (
            [0] * k
            if order == "packed"
            else draw(st.lists(st.integers(0, 6), min_size=k, max_size=k))
        )
        offsets = [0] * k
        pos = draw(st.integers(0, 8))
        for i in place:
            pos += gaps[i]
            offsets[i] = pos
            pos += lengths[i]
    else:
        offsets = draw(st.lists(st.integers(0, 40), min_size=k, max_size=k))
    return Segments(offsets, lengths)


limits_st = st.builds(
    DeviceLimits,
    max_sge=st.integers(1, 5),
    max_sge_rd=st.integers(1, 5),
    max_msg_sz=st.integers(1, 48),
)


@st.composite
def transfer(draw: st.DrawFn, source_may_overlap: bool = True) -> tuple[Segments, Segments, Op]:
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    total = draw(st.integers(1, 96))
    src_disjoint = not source_may_overlap or draw(st.booleans())
    if op is Op.WRITE:
        local = draw(side(total, disjoint=src_disjoint))
        remote = draw(side(total, disjoint=True))
    else:
        local = draw(side(total, disjoint=True))
        remote = draw(side(total, disjoint=src_disjoint))
    return local, remote, op


def end_of(seg: Segments) -> int:
    return seg.extent()[1]


# --------------------------------------------------------------------------- properties


@PROPS
@given(transfer(), limits_st, st.randoms(use_true_random=False))
def test_plan_equals_direct_copy(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits, rnd: random.Random
) -> None:
    local, remote, op = t
    plan = plan_transfer(local, remote, op, limits)
    lbuf = bytearray(rnd.randbytes(end_of(local) + 3))
    rbuf = bytearray(rnd.randbytes(end_of(remote) + 3))
    want_l, want_r = bytearray(lbuf), bytearray(rbuf)
    if op is Op.WRITE:
        direct_copy(bytes(lbuf), local, want_r, remote)
    else:
        direct_copy(bytes(rbuf), remote, want_l, local)
    apply_plan(plan, lbuf, rbuf)
    assert lbuf == want_l
    assert rbuf == want_r


@PROPS
@given(transfer(), limits_st)
def test_bytes_conserved_and_limits_hold(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    local, remote, op = t
    plan = plan_transfer(local, remote, op, limits)
    assert plan.nbytes == local.nbytes == remote.nbytes
    assert int(plan.wr_length.sum()) == int(plan.sge_length.sum()) == local.nbytes
    sge_cap = limits.max_sge_rd if op is Op.READ else limits.max_sge
    assert int(plan.sges_per_wr.max()) <= sge_cap
    assert int(plan.sges_per_wr.min()) >= 1
    assert int(plan.wr_length.max()) <= limits.max_msg_sz
    assert int(plan.sge_length.min()) >= 1
    for r, sges in plan.wrs():
        assert all(isinstance(x, int) for pair in sges for x in pair) and isinstance(r, int)
    # WR lengths are the sums of their SGEs.
    sums = np.add.reduceat(plan.sge_length, plan.wr_sge_start[:-1])
    assert np.array_equal(sums, plan.wr_length)
    assert plan.sge_length_range == (int(plan.sge_length.min()), int(plan.sge_length.max()))


@PROPS
@given(transfer(), limits_st)
def test_every_destination_byte_written_exactly_once(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    local, remote, op = t
    plan = plan_transfer(local, remote, op, limits)
    dst = remote if op is Op.WRITE else local
    size = end_of(dst)
    assert np.array_equal(writes_per_byte(plan, size), coverage(dst, size))
    assert int(writes_per_byte(plan, size).max()) == 1


@PROPS
@given(transfer(), limits_st)
def test_merging_never_increases_wrs(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    local, remote, op = t
    merged = plan_transfer(local, remote, op, limits)
    unmerged = plan_transfer(local, remote, op, limits, merge=False)
    assert merged.num_wrs <= unmerged.num_wrs
    # The unmerged plan is valid too, and does the same.
    l1, r1 = bytearray(range(256)), bytearray(range(255, -1, -1))
    l2, r2 = bytearray(l1), bytearray(r1)
    apply_plan(merged, l1, r1)
    apply_plan(unmerged, l2, r2)
    assert (l1, r1) == (l2, r2)


@PROPS
@given(transfer(source_may_overlap=False), limits_st)
def test_wr_count_is_minimal(t: tuple[Segments, Segments, Op], limits: DeviceLimits) -> None:
    local, remote, op = t
    plan = plan_transfer(local, remote, op, limits)
    assert plan.num_wrs == fewest_wrs(local, remote, limits.sge_limit(op), limits.max_msg_sz)


@PROPS
@given(transfer(), limits_st)
def test_same_plan_as_per_segment_reference(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    local, remote, op = t
    assert plan_transfer(local, remote, op, limits) == reference_plan(local, remote, op, limits)


@PROPS
@given(transfer(), limits_st, st.data())
def test_plan_ignores_how_the_stream_is_cut(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits, data: st.DataObject
) -> None:
    local, remote, op = t

    def split(seg: Segments) -> Segments:
        pairs: list[tuple[int, int]] = []
        for o, n in seg.pairs():
            cut = data.draw(st.integers(0, n - 1))
            pairs += [(o, cut), (o + cut, n - cut)] if cut else [(o, n)]
        return Segments.from_pairs(pairs)

    assert plan_transfer(split(local), split(remote), op, limits) == plan_transfer(
        local, remote, op, limits
    )


@PROPS
@given(
    st.integers(1, 12),
    st.integers(1, 16),
    st.integers(0, 24),
    limits_st,
    st.sampled_from([Op.WRITE, Op.READ]),
    st.randoms(use_true_random=False),
)
def test_strided_against_contiguous(
    count: int,
    size: int,
    extra: int,
    limits: DeviceLimits,
    op: Op,
    rnd: random.Random,
) -> None:
    strided = StridedDesc(offset=0, count=count, size=size, stride=size + extra, alignment=None)
    packed = Segments([5], [count * size])
    plan = plan_transfer(strided, packed, op, limits)
    seg = strided.to_segments()
    lbuf = bytearray(rnd.randbytes(end_of(seg)))
    rbuf = bytearray(rnd.randbytes(5 + count * size))
    want_l, want_r = bytearray(lbuf), bytearray(rbuf)
    if op is Op.WRITE:
        direct_copy(bytes(lbuf), seg, want_r, packed)
    else:
        direct_copy(bytes(rbuf), packed, want_l, seg)
    apply_plan(plan, lbuf, rbuf)
    assert (lbuf, rbuf) == (want_l, want_r)
    if extra == 0:  # stride == size: one segment, cut only by max_msg_sz
        assert plan.num_sges == plan.num_wrs == -(-count * size // limits.max_msg_sz)


@PROPS
@given(
    st.integers(1, 40),
    st.integers(1, 16),
    st.integers(-40, 40),
    st.integers(-40, 40),
    st.sampled_from(["strided", "same", "contiguous"]),
    st.integers(0, 3),
    limits_st,
    st.sampled_from([Op.WRITE, Op.READ]),
)
def test_row_descriptors_plan_as_their_segments_do(
    count: int,
    size: int,
    lstride: int,
    rstride: int,
    remote_kind: str,
    moved: int,
    limits: DeviceLimits,
    op: Op,
) -> None:
    """A :class:`StridedDesc` beside another (the same rows included) or a
    :class:`ContiguousDesc` (one KV layer, or its rows gathered into one range) is
    planned from the descriptors' numbers; the plan, or the error, is the one the
    general planner gives for the same bytes as :class:`Segments`."""

    def rows(stride: int, moved: int = 0) -> StridedDesc:  # the lowest row at moved or above
        return StridedDesc(
            offset=max(0, -(count - 1) * stride) + moved,
            count=count,
            size=size,
            stride=stride,
            alignment=None,
        )

    local = rows(lstride)
    remote: StridedDesc | ContiguousDesc
    if remote_kind == "strided":
        remote = rows(rstride)
    elif remote_kind == "same":  # the same rows on both sides, or moved by a few bytes
        remote = rows(lstride, moved)
    else:
        remote = ContiguousDesc(offset=3, nbytes=count * size, alignment=None)
    try:
        want: Plan | str = plan_transfer(local.to_segments(), remote.to_segments(), op, limits)
    except DescriptorError as exc:
        want = str(exc)
    try:
        got: Plan | str = plan_transfer(local, remote, op, limits)
    except DescriptorError as exc:
        got = str(exc)
    assert got == want
    if isinstance(got, Plan):  # the range these planners state is the arrays' own
        lengths = got.sge_length
        assert got.sge_length_range == (int(lengths.min()), int(lengths.max()))


# --------------------------------------------------------------------------- invalid input


@PROPS
@given(transfer(), limits_st, st.integers(1, 5))
def test_mismatched_totals_always_raise(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits, extra: int
) -> None:
    local, remote, op = t
    longer = Segments.from_pairs([*remote.pairs(), (end_of(remote) + 1, extra)])
    with pytest.raises(DescriptorError, match="totals differ"):
        plan_transfer(local, longer, op, limits)


@PROPS
@given(st.data(), limits_st, st.sampled_from([Op.WRITE, Op.READ]))
def test_overlapping_destination_always_raises(
    data: st.DataObject, limits: DeviceLimits, op: Op
) -> None:
    total = data.draw(st.integers(2, 64))
    dst = data.draw(side(total, disjoint=True))
    pairs = dst.pairs()
    # Move one element onto a byte that another element (or itself, shifted) covers.
    i = data.draw(st.integers(0, len(pairs) - 1))
    j = data.draw(st.integers(0, len(pairs) - 1))
    oj, nj = pairs[j]
    o, n = pairs[i]
    if i == j:
        assume(n >= 2)
        pairs.append((o + n // 2, 1))
        pairs[i] = (o, n - 1) if n > 1 else pairs[i]
        pairs = [p for p in pairs if p[1] > 0]
    else:
        pairs[i] = (oj + data.draw(st.integers(0, nj - 1)), n)
    bad = Segments.from_pairs(pairs)
    assume(bad.first_overlap() is not None)
    src = Segments([0], [bad.nbytes])
    with pytest.raises(DescriptorError, match="overlaps itself"):
        if op is Op.WRITE:
            plan_transfer(src, bad, op, limits)
        else:
            plan_transfer(bad, src, op, limits)


@PROPS
@given(
    st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=6),
    st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=6),
)
def test_segments_accept_only_valid_values(offsets: list[int], lengths: list[int]) -> None:
    ok = (
        len(offsets) == len(lengths)
        and all(n >= 1 for n in lengths)
        and all(o >= 0 for o in offsets)
        and all(o + n <= INT64_MAX for o, n in zip(offsets, lengths, strict=True))
        and sum(lengths) <= INT64_MAX
    )
    if ok:
        seg = Segments(offsets, lengths)
        assert seg.pairs() == list(zip(offsets, lengths, strict=True))
        assert seg.nbytes == sum(lengths)
    else:
        with pytest.raises(DescriptorError):
            Segments(offsets, lengths)


@PROPS
@given(
    st.integers(-4, 2**64),
    st.integers(-4, 2**40),
    st.integers(-4, 2**40),
    st.integers(-(2**62), 2**62),
)
def test_strided_accepts_only_valid_values(offset: int, count: int, size: int, stride: int) -> None:
    last = offset + (count - 1) * stride
    ok = (
        offset >= 0
        and count >= 1
        and size >= 1
        and count <= 1 << 26
        and last >= 0
        and max(offset, last) + size <= INT64_MAX
        and count * size <= INT64_MAX
    )
    if ok:
        desc = StridedDesc(offset=offset, count=count, size=size, stride=stride, alignment=None)
        assert desc.nbytes == count * size
    else:
        with pytest.raises(DescriptorError):
            StridedDesc(offset=offset, count=count, size=size, stride=stride, alignment=None)


@st.composite
def block_batches(draw: st.DrawFn) -> tuple[Segments, Segments, Op]:
    """A batch of messages: block ``i`` of each side has the same length; offsets are
    drawn freely, so remote blocks may be apart, touch or overlap, in any order."""
    n = draw(st.integers(2, 12))
    lengths = draw(st.lists(st.integers(1, 16), min_size=n, max_size=n))
    local = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    remote = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    return Segments(local, lengths), Segments(remote, lengths), op


@PROPS
@given(block_batches(), limits_st)
def test_block_batches_plan_as_the_reference_does(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    """Batches take a shortcut when no two remote blocks touch; the plan (or the error)
    is the reference planner's either way, and such a batch takes one WR per block."""
    local, remote, op = t
    try:
        want = reference_plan(local, remote, op, limits)
    except DescriptorError as exc:
        with pytest.raises(DescriptorError) as got:
            plan_transfer(local, remote, op, limits)
        assert type(got.value) is type(exc)
        return
    plan = plan_transfer(local, remote, op, limits)
    assert plan == want
    order = np.argsort(remote.offsets, kind="stable")
    ro, ln = remote.offsets[order], remote.lengths[order]
    if bool((ro[1:] > ro[:-1] + ln[:-1]).all()) and int(ln.max()) <= limits.max_msg_sz:
        assert plan.num_wrs == local.count


@st.composite
def long_block_batches(draw: st.DrawFn) -> tuple[Segments, Segments, Op]:
    """A batch of 64 to 300 messages (long enough for the planner's packed sort): blocks
    of a few sizes on a grid of slots, so that remote blocks often touch, and sometimes
    overlap or repeat."""
    n = draw(st.integers(64, 300))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    sizes = [rnd.choice((8, 16, 24)) for _ in range(n)]
    slots = 2 * n if draw(st.booleans()) else n + n // 4
    local = [8 * s for s in rnd.sample(range(4 * slots), n)]
    remote = [8 * rnd.randrange(slots) for _ in range(n)]
    if draw(st.booleans()):  # remote slots apart from each other, some still touching
        remote = [8 * s for s in rnd.sample(range(slots), n)]
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    return Segments(local, sizes), Segments(remote, sizes), op


@settings(PROPS, max_examples=120)
@given(long_block_batches(), limits_st)
def test_long_block_batches_plan_as_the_reference_does(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    """The same as for short batches, with as many blocks as sort by packed keys: the
    plan (or the error) is the reference planner's."""
    local, remote, op = t
    try:
        want = reference_plan(local, remote, op, limits)
    except DescriptorError as exc:
        with pytest.raises(DescriptorError) as got:
            plan_transfer(local, remote, op, limits)
        assert type(got.value) is type(exc)
        return
    assert plan_transfer(local, remote, op, limits) == want


@st.composite
def equal_block_batches(draw: st.DrawFn) -> tuple[Segments, Segments, Op]:
    """A batch of 2 to 300 blocks of one size (KV blocks), the shape planned by the
    lengths-as-one-number shortcut: remote blocks on a grid of slots, in ascending
    order or shuffled, apart, touching or (on a finer grid) overlapping; local blocks
    in runs that continue each other, shuffled, apart or overlapping."""
    n = draw(st.integers(2, 300))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    size = rnd.choice((8, 16, 64))
    grid = size if draw(st.booleans()) else rnd.choice((size // 2, size + 8))
    slots = n + rnd.choice((0, n // 8, n, 3 * n))
    remote = [grid * s for s in rnd.sample(range(slots), n)]
    if draw(st.booleans()):
        remote.sort()
    mode = draw(st.sampled_from(["runs", "shuffled", "apart", "overlapping"]))
    if mode == "runs":  # runs of local blocks that continue each other
        local: list[int] = []
        at = 0
        while len(local) < n:
            run = rnd.randint(1, 40)
            local.extend(at + size * i for i in range(min(run, n - len(local))))
            at += size * (run + rnd.randint(0, 3))
    elif mode == "shuffled":
        local = [size * s for s in rnd.sample(range(2 * n), n)]
    elif mode == "apart":  # never continuing each other: long remote runs stay whole
        local = [2 * size * s for s in rnd.sample(range(n), n)]
    else:  # on a finer grid: local blocks may overlap (a READ's destination may not)
        local = [size // 2 * s for s in rnd.sample(range(2 * n), n)]
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    lengths = [size] * n
    return Segments(local, lengths), Segments(remote, lengths), op


# Limits that a run of touching blocks reaches now and then: up to 40 SGEs, messages of
# a few blocks to far more.
block_limits_st = st.builds(
    DeviceLimits,
    max_sge=st.integers(1, 40),
    max_sge_rd=st.integers(1, 40),
    max_msg_sz=st.sampled_from([8, 24, 64, 256, 4096, 8 << 20]),
)


@settings(PROPS, max_examples=200)
@given(equal_block_batches(), block_limits_st)
def test_blocks_of_one_size_plan_as_the_reference_does(
    t: tuple[Segments, Segments, Op], limits: DeviceLimits
) -> None:
    """Blocks of one size take the shortcut that handles their lengths as one number
    (also when remote blocks touch): the plan (or the error) is the reference
    planner's."""
    local, remote, op = t
    try:
        want = reference_plan(local, remote, op, limits)
    except DescriptorError as exc:
        with pytest.raises(DescriptorError) as got:
            plan_transfer(local, remote, op, limits)
        assert type(got.value) is type(exc)
        return
    assert plan_transfer(local, remote, op, limits) == want


def test_a_read_of_an_overlapping_source_keeps_each_remote_run_whole() -> None:
    """Found by test_merging_never_increases_wrs: remote segments (0, 4) and (1, 7)
    overlap, and sorting the pieces by remote offset put the second segment's piece
    between the two pieces of the first, cutting its run in two (7 WRs merged against 6
    unmerged)."""
    local = Segments(
        offsets=np.array([0, 1, 2, 4, 5, 7, 8, 9, 10, 11]),
        lengths=np.array([1, 1, 1, 1, 2, 1, 1, 1, 1, 1]),
    )
    remote = Segments(offsets=np.array([0, 1]), lengths=np.array([4, 7]))
    limits = DeviceLimits(max_sge=1, max_sge_rd=2, max_msg_sz=2)
    merged = plan_transfer(local, remote, Op.READ, limits)
    assert merged.num_wrs == 6  # 2 for the 4 bytes of (0, 4), 4 for the 7 of (1, 7)
    assert merged.num_wrs <= plan_transfer(local, remote, Op.READ, limits, merge=False).num_wrs
    l1, r1 = bytearray(range(256)), bytearray(range(255, -1, -1))
    l2, r2 = bytearray(l1), bytearray(r1)
    apply_plan(merged, l1, r1)
    direct_copy(bytes(r2), remote, l2, local)
    assert l1 == l2
