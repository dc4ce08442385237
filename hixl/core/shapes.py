"""Planning by shape: a descriptor split into a shape and a place, planned once per shape.

Planning is translation invariant: a descriptor of a dense type (contiguous, strided,
n-dimensional strided, or a block list that is evenly spaced) is fixed, up to where it
starts, by a small hashable *shape*.  :func:`place` splits a descriptor into that shape
and its position in its region, :func:`plan_shapes` plans two shapes (with their lowest
bytes at offset 0), and :func:`shift_plan` moves such a plan to where the descriptors
really lie.  A caller can so keep one plan per pair of shapes and reuse it for every
request of the same form, wherever its bytes sit.

Pure like :mod:`hixl.core.plan`: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hixl.core.descriptors import (
    BlockListDesc,
    ContiguousDesc,
    Descriptor,
    NdStridedDesc,
    Segments,
    StridedDesc,
)
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.errors import DescriptorError

__all__ = ["Placement", "place", "plan_shapes", "shape_desc", "shift_plan"]


class Placement(NamedTuple):
    """A descriptor split into its *shape* and where the shape sits in its region.

    ``shape`` is a hashable tuple that fixes every element relative to the lowest byte;
    ``base`` is the offset of the lowest byte, ``span`` the bytes from there to one past
    the highest byte (so the descriptor fits a region of ``n`` bytes iff
    ``base + span <= n``) and ``nbytes`` its stream length.  All in bytes.
    """

    shape: tuple[Any, ...]
    base: int
    span: int
    nbytes: int


def place(desc: object) -> Placement | None:
    """Split a :class:`ContiguousDesc`, :class:`StridedDesc` or :class:`NdStridedDesc`.

    O(ndim), no arrays.  Returns None for every other type (:class:`Segments`, block
    lists), which are planned as they are.  Planning is translation invariant: with
    ``pl, pr = place(local), place(remote)``, ``plan_transfer(local, remote, ...)`` equals
    ``shift_plan(plan_transfer(shape_desc(pl.shape), shape_desc(pr.shape), ...), pl.base,
    pr.base)``, and one raises iff the other does.
    """
    t = type(desc)
    if t is ContiguousDesc:
        c: ContiguousDesc = desc  # type: ignore[assignment]
        return Placement(("contiguous", c.nbytes), c.offset, c.nbytes, c.nbytes)
    if t is StridedDesc:
        s: StridedDesc = desc  # type: ignore[assignment]
        step = (s.count - 1) * s.stride
        return Placement(
            ("strided", s.count, s.size, s.stride),
            s.offset + min(0, step),
            abs(step) + s.size,
            s.count * s.size,
        )
    if t is NdStridedDesc:
        d: NdStridedDesc = desc  # type: ignore[assignment]
        low = high = 0
        count = 1
        for n, st in zip(d.shape, d.strides, strict=True):
            step = (n - 1) * st
            if step < 0:
                low += step
            else:
                high += step
            count *= n
        return Placement(
            ("nd", d.shape, d.strides, d.size), d.offset + low, high - low + d.size, count * d.size
        )
    if t is BlockListDesc or t is Segments:
        seg: Segments = desc.to_segments()  # type: ignore[attr-defined]
        off = seg.offsets
        if off.size == 1:
            size = int(seg.lengths[0])
            return Placement(("contiguous", size), int(off[0]), size, size)
        stride = int(off[1]) - int(off[0])
        if int(off[-1]) - int(off[0]) != (off.size - 1) * stride:
            return None  # not evenly spaced (one look at the ends; most block lists)
        shortest, size = seg.length_range()
        if shortest != size or not bool((np.diff(off) == stride).all()):
            return None
        step = (off.size - 1) * stride
        return Placement(
            ("strided", int(off.size), size, stride),
            int(off[0]) + min(0, step),
            abs(step) + size,
            seg.nbytes,
        )
    return None


def shape_desc(shape: tuple[Any, ...]) -> Descriptor:
    """The descriptor of a :func:`place` shape with its lowest byte at offset 0.

    Its alignment policy is off: alignment depends on where a shape is placed, so it is
    checked per placement (:func:`hixl.core.plan.check_alignment`).
    """
    kind = shape[0]
    if kind == "contiguous":
        return ContiguousDesc(offset=0, nbytes=shape[1], alignment=None)
    if kind == "strided":
        _, count, size, stride = shape
        return StridedDesc(
            offset=-min(0, (count - 1) * stride),
            count=count,
            size=size,
            stride=stride,
            alignment=None,
        )
    if kind == "nd":
        _, dims, strides, size = shape
        low = sum(min(0, (n - 1) * s) for n, s in zip(dims, strides, strict=True))
        return NdStridedDesc(offset=-low, shape=dims, strides=strides, size=size, alignment=None)
    raise DescriptorError(f"not a descriptor shape: {shape!r}")


def plan_shapes(
    local: tuple[Any, ...], remote: tuple[Any, ...], op: Op, limits: DeviceLimits
) -> Plan:
    """``plan_transfer(shape_desc(local), shape_desc(remote), op, limits)`` for two shapes
    that :func:`place` made from descriptors (so valid already): a strided shape's
    descriptor is built without checking its numbers again."""
    return plan_transfer(_placed_desc(local), _placed_desc(remote), op, limits)


def _placed_desc(shape: tuple[Any, ...]) -> Descriptor:
    """:func:`shape_desc` of a shape :func:`place` made (its numbers are valid)."""
    if shape[0] != "strided":
        return shape_desc(shape)
    _, count, size, stride = shape
    desc: StridedDesc = object.__new__(StridedDesc)
    put = object.__setattr__
    put(desc, "offset", -min(0, (count - 1) * stride))
    put(desc, "count", count)
    put(desc, "size", size)
    put(desc, "stride", stride)
    put(desc, "alignment", None)
    return desc


def shift_plan(plan: Plan, local_by: int, remote_by: int) -> Plan:
    """``plan`` with every local offset moved by ``local_by`` and every remote one by
    ``remote_by`` bytes (either may be negative; the results must stay >= 0)."""
    return Plan(
        op=plan.op,
        limits=plan.limits,
        wr_remote_offset=plan.wr_remote_offset + np.int64(remote_by),
        wr_length=plan.wr_length,
        wr_sge_start=plan.wr_sge_start,
        sge_local_offset=plan.sge_local_offset + np.int64(local_by),
        sge_length=plan.sge_length,
    )
