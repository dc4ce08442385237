"""Plans of descriptor shapes: a descriptor's plan is its shape's plan shifted by its base.

The engine plans a layout once and reuses it at every offset, so these
properties pin the translation invariance it relies on, against :func:`plan_transfer`
of the descriptors themselves, and the O(1) bounds test against :func:`check_bounds`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl.core.descriptors import (
    BlockListDesc,
    ContiguousDesc,
    NdStridedDesc,
    Segments,
    StridedDesc,
    as_segments,
)
from hixl.core.plan import DeviceLimits, Op, check_bounds, plan_transfer
from hixl.core.shapes import place, shape_desc, shift_plan
from hixl.errors import BoundsError, DescriptorError

offsets = st.integers(0, 1 << 20)


@st.composite
def descs(draw: st.DrawFn) -> ContiguousDesc | StridedDesc | NdStridedDesc:
    kind = draw(st.sampled_from(["contiguous", "strided", "nd"]))
    size = draw(st.integers(1, 96))
    if kind == "contiguous":
        return ContiguousDesc(
            offset=draw(offsets), nbytes=draw(st.integers(1, 4096)), alignment=None
        )
    if kind == "strided":
        count = draw(st.integers(1, 12))
        stride = draw(st.integers(-200, 200))
        low = min(0, (count - 1) * stride)
        return StridedDesc(
            offset=draw(offsets) - low, count=count, size=size, stride=stride, alignment=None
        )
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    strides = tuple(draw(st.lists(st.integers(-300, 300), min_size=ndim, max_size=ndim)))
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    return NdStridedDesc(
        offset=draw(offsets) - low, shape=shape, strides=strides, size=size, alignment=None
    )


limits_st = st.builds(
    DeviceLimits,
    max_sge=st.integers(1, 4),
    max_sge_rd=st.integers(1, 4),
    max_msg_sz=st.integers(1, 512),
)


@settings(max_examples=300, deadline=None)
@given(descs())
def test_a_shape_placed_at_its_base_is_the_descriptor(desc: object) -> None:
    p = place(desc)
    assert p is not None
    seg, at0 = as_segments(desc), as_segments(shape_desc(p.shape))  # type: ignore[arg-type]
    assert int(at0.offsets.min()) == 0
    assert np.array_equal(at0.offsets + p.base, seg.offsets)
    assert np.array_equal(at0.lengths, seg.lengths)
    assert p.nbytes == seg.nbytes
    assert p.base + p.span == int((seg.offsets + seg.lengths).max())


@settings(max_examples=300, deadline=None)
@given(descs(), descs(), st.sampled_from([Op.WRITE, Op.READ]), limits_st, st.data())
def test_shifted_shape_plan_is_the_plan(
    ldesc: object, rdesc: object, op: Op, limits: DeviceLimits, data: st.DataObject
) -> None:
    # Mostly equal totals, so that most examples plan rather than fail on the totals.
    if data.draw(st.booleans()):
        n = as_segments(ldesc).nbytes  # type: ignore[arg-type]
        rdesc = ContiguousDesc(offset=data.draw(offsets), nbytes=n, alignment=None)
    if data.draw(st.booleans()):  # the same blocks spelled out as a block list
        seg = as_segments(ldesc)  # type: ignore[arg-type]
        ldesc = BlockListDesc(offsets=seg.offsets, lengths=seg.lengths, alignment=None)
    lp, rp = place(ldesc), place(rdesc)
    assert rp is not None
    if lp is None:  # blocks not equally spaced: planned as they are
        assert isinstance(ldesc, BlockListDesc)
        return
    try:
        direct = plan_transfer(ldesc, rdesc, op, limits)  # type: ignore[arg-type]
    except DescriptorError:
        with pytest.raises(DescriptorError):
            plan_transfer(shape_desc(lp.shape), shape_desc(rp.shape), op, limits)
        return
    shaped = plan_transfer(shape_desc(lp.shape), shape_desc(rp.shape), op, limits)
    assert shift_plan(shaped, lp.base, rp.base) == direct
    assert shift_plan(direct, -lp.base, -rp.base) == shaped


@settings(max_examples=300, deadline=None)
@given(descs(), st.integers(0, (1 << 20) + 5000))
def test_base_plus_span_is_the_bounds_check(desc: object, region_length: int) -> None:
    p = place(desc)
    assert p is not None
    try:
        check_bounds(desc, region_length)  # type: ignore[arg-type]
    except BoundsError:
        assert p.base + p.span > region_length
    else:
        assert p.base + p.span <= region_length


@settings(max_examples=300, deadline=None)
@given(descs(), st.booleans())
def test_a_block_list_of_equal_equally_spaced_blocks_is_a_strided_shape(
    desc: object, jitter: bool
) -> None:
    seg = as_segments(desc)  # type: ignore[arg-type]
    offs = seg.offsets.copy()
    if jitter and offs.size > 2:
        offs[-1] += 1  # no longer equally spaced (or, as a whole descriptor, equal sizes)
    blocks = BlockListDesc(offsets=offs, lengths=seg.lengths, alignment=None)
    p = place(blocks)
    if p is None:
        assert offs.size > 2 and (
            len(set(np.diff(offs).tolist())) > 1 or len(set(seg.lengths.tolist())) > 1
        )
        return
    at0 = as_segments(shape_desc(p.shape))
    assert np.array_equal(at0.offsets + p.base, offs)
    assert np.array_equal(at0.lengths, seg.lengths)
    assert p.base + p.span == int((offs + seg.lengths).max())


def test_other_descriptors_have_no_shape() -> None:
    assert place(Segments([0, 64, 100], [8, 8, 8])) is None
    assert place(Segments([0, 64, 128], [8, 8, 9])) is None
    assert place(Segments([0, 64, 128], [8, 8, 8])) == (("strided", 3, 8, 64), 0, 136, 24)
    with pytest.raises(DescriptorError, match="not a descriptor shape"):
        shape_desc(("blocks", 3))
