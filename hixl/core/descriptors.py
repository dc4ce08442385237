"""Descriptors: which bytes of a registered region a transfer touches.

Theory of operation
-------------------
Every descriptor names an ordered list of *elements*, each a run of bytes at an offset
(in bytes, relative to the start of a registered region). The bytes of a transfer are the
concatenation of its elements in that order: the *stream*. A transfer pairs the local
stream with the remote stream byte for byte, so only the stream order matters, never how
it was cut into elements.

All descriptor types normalize to one form, :class:`Segments` (from
:mod:`hixl.core.segments`): two int64 numpy arrays, ``offsets`` and ``lengths``, one entry
per element. The planner (``hixl.core.plan``) works on that form only.

=====================  ==================================================================
type                   elements
=====================  ==================================================================
:class:`ContiguousDesc`  one element, ``[offset, offset + nbytes)``
:class:`StridedDesc`     element ``i`` at ``offset + i*stride``, ``size`` bytes long
:class:`NdStridedDesc`   element ``(i0, .., ik)`` at ``offset + sum(i_j*strides_j)``, C order
:class:`BlockListDesc`   explicit ``(offset, length)`` blocks, as NIXL and Mooncake lists
=====================  ==================================================================

Values are frozen and validated when built: a descriptor that exists is well formed
(positive sizes, no int64 overflow, inside ``[0, 2**63)``, aligned under its policy).
Whether it may be a *destination* (no byte written twice) and whether it fits a region are
checked where that is known: :func:`hixl.core.plan.plan_transfer` and
:func:`hixl.core.plan.check_bounds`.

This module is pure: no I/O, no clock, no pyverbs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from hixl.core.segments import (
    DEFAULT_ALIGNMENT,
    INT64_MAX,
    MAX_SEGMENTS,
    I64Array,
    Segments,
    _int,
    _set,
    fold_dims,
    normalize_alignment,
    sort_offsets,
)
from hixl.errors import AlignmentError, DescriptorError

__all__ = [
    "DEFAULT_ALIGNMENT",
    "INT64_MAX",
    "MAX_SEGMENTS",
    "BlockListDesc",
    "ContiguousDesc",
    "Descriptor",
    "NdStridedDesc",
    "Segments",
    "StridedDesc",
    "as_segments",
    "desc_from_view",
    "fold_dims",
    "normalize_alignment",
    "sort_offsets",
]

# --------------------------------------------------------------------------- protocol


@runtime_checkable
class Descriptor(Protocol):
    """What the planner needs from a descriptor (all sizes in bytes)."""

    @property
    def nbytes(self) -> int:
        """Total bytes of all elements."""
        ...

    @property
    def count(self) -> int:
        """Number of elements."""
        ...

    def to_segments(self) -> Segments:
        """One segment per element, in stream order."""
        ...

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """``(element index, address)`` of the first misaligned element start, or None."""
        ...


def as_segments(desc: Descriptor) -> Segments:
    """Normalize any descriptor (or a :class:`Segments`) to :class:`Segments`.

    Raises :class:`DescriptorError` if ``desc`` is not a descriptor.
    """
    if isinstance(desc, Segments):
        return desc
    to_segments = getattr(desc, "to_segments", None)
    if to_segments is None:
        raise DescriptorError(f"expected a descriptor or Segments, got {type(desc).__name__}")
    seg = to_segments()
    if not isinstance(seg, Segments):
        raise DescriptorError(
            f"{type(desc).__name__}.to_segments() returned {type(seg).__name__}, not Segments"
        )
    return seg


def _policy_check(desc: Descriptor, alignment: int | None, kind: str) -> None:
    if alignment is None:
        return
    hit = desc.first_misaligned(0, alignment)
    if hit is not None:
        i, addr = hit
        raise AlignmentError(
            f"{kind} element {i} starts at offset {addr}, not a multiple of the alignment "
            f"policy {alignment} bytes (pass alignment=None to turn the check off)"
        )


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class ContiguousDesc:
    """One contiguous range ``[offset, offset + nbytes)`` of a region, in bytes.

    ``alignment`` (bytes, default 64, ``None``/0 = off) applies to ``offset``.
    Raises :class:`DescriptorError` for ``nbytes < 1``, ``offset < 0`` or int64 overflow,
    :class:`AlignmentError` for a misaligned offset.
    """

    offset: int
    nbytes: int
    alignment: int | None = DEFAULT_ALIGNMENT

    # Written out rather than generated: an application may make one per message, and the
    # generated __init__ plus a __post_init__ cost a call and three attribute reads more.
    def __init__(
        self, *, offset: int, nbytes: int, alignment: int | None = DEFAULT_ALIGNMENT
    ) -> None:
        _set(self, "offset", offset)
        _set(self, "nbytes", nbytes)
        _set(self, "alignment", alignment)
        # The common case, plain ints already valid and in normal form, in a few
        # comparisons; anything else takes the full conversion and checks below.
        if (
            type(offset) is int
            and type(nbytes) is int
            and 0 <= offset <= INT64_MAX - nbytes
            and nbytes >= 1
            and (
                alignment is None
                or (
                    type(alignment) is int
                    and alignment > 0
                    and not alignment & (alignment - 1)
                    and not offset % alignment
                )
            )
        ):
            return
        offset = _int("ContiguousDesc.offset", offset, minimum=0)
        nbytes = _int("ContiguousDesc.nbytes", nbytes, minimum=1)
        if offset > INT64_MAX - nbytes:
            raise DescriptorError(
                f"ContiguousDesc overflows int64: offset={offset} nbytes={nbytes} "
                f"ends past {INT64_MAX}"
            )
        _set(self, "offset", offset)
        _set(self, "nbytes", nbytes)
        _set(self, "alignment", normalize_alignment(alignment))
        _policy_check(self, self.alignment, "ContiguousDesc")

    @property
    def count(self) -> int:
        """Always 1."""
        return 1

    def to_segments(self) -> Segments:
        """One segment."""
        return Segments._trusted(
            np.array([self.offset], dtype=np.int64),
            np.array([self.nbytes], dtype=np.int64),
            self.nbytes,
        )

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """``(0, address)`` if ``base_address + offset`` is misaligned, else None."""
        addr = base_address + self.offset
        return None if addr % alignment == 0 else (0, addr)


@dataclass(frozen=True, slots=True, kw_only=True)
class NdStridedDesc:
    """A multi-dimensional strided descriptor, laid out like a numpy array.

    Element ``(i_0, .., i_k)`` (``0 <= i_j < shape[j]``) is ``size`` contiguous bytes at
    ``offset + sum(i_j * strides[j])``; elements are streamed in C (row-major) order. For a
    layer of KV cache: ``shape=(heads, tokens)``, ``strides=(head_stride, token_stride)``,
    ``size=head_dim * itemsize``. Strides are in bytes and may be zero or negative (a
    source may read bytes twice; a destination may not, which the planner checks).

    ``alignment`` (default 64, ``None``/0 = off) applies to the first element's start and
    to the stride of every dimension longer than 1, so every element start is aligned.

    Raises :class:`DescriptorError` when ``shape`` and ``strides`` differ in length, an
    extent or ``size`` is below 1, an element would start below 0 or end past
    ``INT64_MAX``, or the total overflows; :class:`AlignmentError` under the policy.
    """

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    size: int
    alignment: int | None = DEFAULT_ALIGNMENT

    def __post_init__(self) -> None:
        offset = _int("NdStridedDesc.offset", self.offset, minimum=0)
        size = _int("NdStridedDesc.size", self.size, minimum=1)
        try:
            shape = tuple(self.shape)
            strides = tuple(self.strides)
        except TypeError:
            raise DescriptorError(
                f"NdStridedDesc shape and strides must be sequences, got "
                f"{type(self.shape).__name__} and {type(self.strides).__name__}"
            ) from None
        if len(shape) != len(strides):
            raise DescriptorError(
                f"NdStridedDesc shape {shape} has {len(shape)} dims but strides {strides} "
                f"has {len(strides)}"
            )
        shape = tuple(_int(f"NdStridedDesc.shape[{j}]", n, minimum=1) for j, n in enumerate(shape))
        strides = tuple(_int(f"NdStridedDesc.strides[{j}]", s) for j, s in enumerate(strides))
        low = offset + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
        high = offset + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
        if low < 0:
            raise DescriptorError(
                f"NdStridedDesc reaches below offset 0: offset={offset} shape={shape} "
                f"strides={strides} lowest element starts at {low}"
            )
        if high + size > INT64_MAX:
            raise DescriptorError(
                f"NdStridedDesc overflows int64: offset={offset} shape={shape} "
                f"strides={strides} size={size} ends at {high + size} > {INT64_MAX}"
            )
        count = math.prod(shape)
        if count * size > INT64_MAX:
            raise DescriptorError(
                f"NdStridedDesc total overflows int64: {count} elements x {size} bytes "
                f"> {INT64_MAX}"
            )
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)
        object.__setattr__(self, "alignment", normalize_alignment(self.alignment))
        _policy_check(self, self.alignment, "NdStridedDesc")

    @property
    def count(self) -> int:
        """Number of elements, ``prod(shape)``."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Total bytes, ``count * size``."""
        return self.count * self.size

    def simplified(self) -> NdStridedDesc:
        """An equivalent descriptor with the fewest dimensions and largest elements.

        Drops dimensions of extent 1, folds an innermost dimension whose stride equals
        ``size`` into ``size``, and fuses dimensions ``j, j+1`` when ``strides[j] ==
        shape[j+1] * strides[j+1]``. The stream is unchanged; its elements may be fewer
        and larger (so the alignment policy then applies to the larger elements).
        """
        dims, size = fold_dims(zip(self.shape, self.strides, strict=True), self.size)
        return NdStridedDesc(
            offset=self.offset,
            shape=tuple(n for n, _ in dims),
            strides=tuple(s for _, s in dims),
            size=size,
            alignment=self.alignment,
        )

    def with_alignment(self, alignment: int | None) -> NdStridedDesc:
        """The same descriptor under another alignment policy (checked now)."""
        return NdStridedDesc(
            offset=self.offset,
            shape=self.shape,
            strides=self.strides,
            size=self.size,
            alignment=alignment,
        )

    def element_offsets(self) -> I64Array:
        """Start offset of every element, in stream order (int64, bytes)."""
        count = self.count
        if count > MAX_SEGMENTS:
            raise DescriptorError(
                f"NdStridedDesc shape={self.shape} expands to {count} segments, more than "
                f"the limit {MAX_SEGMENTS}; call simplified() or use larger elements"
            )
        offs = np.array([self.offset], dtype=np.int64)
        for n, s in zip(self.shape, self.strides, strict=True):
            step = np.arange(n, dtype=np.int64) * np.int64(s)
            offs = (offs[:, None] + step[None, :]).ravel()
        return offs

    def to_segments(self) -> Segments:
        """One segment per element, C order."""
        offs = self.element_offsets()
        return Segments._trusted(offs, np.full(offs.size, self.size, np.int64), self.nbytes)

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """First element whose start is misaligned, as ``(flat index, address)``.

        O(ndim): element starts are ``start + sum(i_j * strides_j)``, all aligned iff the
        start and every stride of a dimension longer than 1 are.
        """
        start = base_address + self.offset
        if start % alignment:
            return 0, start
        inner = self.count
        for n, s in zip(self.shape, self.strides, strict=True):
            inner //= n
            if n > 1 and s % alignment:
                return inner, start + s
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class StridedDesc:
    """hixl's strided descriptor: ``count`` elements of ``size`` bytes, ``stride`` apart.

    Element ``i`` (``0 <= i < count``) is ``[offset + i*stride, offset + i*stride + size)``,
    in bytes. ``stride == size`` is one contiguous range; ``stride > size`` leaves gaps
    (e.g. one head of every token); ``stride < size`` makes elements overlap, which only a
    transfer's source may do. One descriptor moves every head of a KV layer in one call.

    ``alignment`` (default 64, ``None``/0 = off) applies to ``offset`` and, when
    ``count > 1``, to ``stride``. Raises :class:`DescriptorError` for ``count < 1``,
    ``size < 1``, an element below offset 0, int64 overflow; :class:`AlignmentError`
    under the policy.
    """

    offset: int
    count: int
    size: int
    stride: int
    alignment: int | None = DEFAULT_ALIGNMENT

    def __post_init__(self) -> None:
        offset = _int("StridedDesc.offset", self.offset, minimum=0)
        count = _int("StridedDesc.count", self.count, minimum=1)
        size = _int("StridedDesc.size", self.size, minimum=1)
        stride = _int("StridedDesc.stride", self.stride)
        last = offset + (count - 1) * stride
        if last < 0:
            raise DescriptorError(
                f"StridedDesc reaches below offset 0: offset={offset} count={count} "
                f"stride={stride} puts the last element at {last}"
            )
        if max(offset, last) + size > INT64_MAX or count * size > INT64_MAX:
            raise DescriptorError(
                f"StridedDesc overflows int64: offset={offset} count={count} size={size} "
                f"stride={stride} reaches {max(offset, last) + size} / totals {count * size} "
                f"(limit {INT64_MAX})"
            )
        if count > MAX_SEGMENTS:
            raise DescriptorError(
                f"StridedDesc count={count} exceeds the limit of {MAX_SEGMENTS} elements"
            )
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "alignment", normalize_alignment(self.alignment))
        _policy_check(self, self.alignment, "StridedDesc")

    @property
    def nbytes(self) -> int:
        """Total bytes, ``count * size``."""
        return self.count * self.size

    def to_nd(self) -> NdStridedDesc:
        """The same descriptor as a one-dimensional :class:`NdStridedDesc`."""
        return NdStridedDesc(
            offset=self.offset,
            shape=(self.count,),
            strides=(self.stride,),
            size=self.size,
            alignment=self.alignment,
        )

    def to_segments(self) -> Segments:
        """One segment per element."""
        offs = np.int64(self.offset) + np.arange(self.count, dtype=np.int64) * np.int64(self.stride)
        return Segments._trusted(offs, np.full(self.count, self.size, np.int64), self.nbytes)

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """First misaligned element start as ``(index, address)``, or None. O(1)."""
        start = base_address + self.offset
        if start % alignment:
            return 0, start
        if self.count > 1 and self.stride % alignment:
            return 1, start + self.stride
        return None


@dataclass(frozen=True, slots=True, init=False)
class BlockListDesc:
    """An explicit list of ``(offset, length)`` blocks in bytes, in stream order.

    This is the form NIXL descriptor lists, Mooncake batches and hixl's ``TransferOpDesc``
    lists use. Build it with ``BlockListDesc(offsets=..., lengths=...)`` from arrays or with
    :meth:`from_pairs`. ``alignment`` (default 64, ``None``/0 = off) applies to every
    block's offset. Raises :class:`DescriptorError` as :class:`Segments` does and
    :class:`AlignmentError` under the policy.
    """

    segments: Segments
    alignment: int | None

    def __init__(
        self,
        *,
        offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
        alignment: int | None = DEFAULT_ALIGNMENT,
    ) -> None:
        object.__setattr__(self, "segments", Segments(offsets, lengths))
        object.__setattr__(self, "alignment", normalize_alignment(alignment))
        # The blocks themselves: first_misaligned below trusts this check.
        _policy_check(self.segments, self.alignment, "BlockListDesc")

    @classmethod
    def from_pairs(
        cls, pairs: Iterable[tuple[int, int]], *, alignment: int | None = DEFAULT_ALIGNMENT
    ) -> BlockListDesc:
        """Blocks from ``(offset, length)`` pairs (bytes)."""
        seg = Segments.from_pairs(pairs)
        return cls(offsets=seg.offsets, lengths=seg.lengths, alignment=alignment)

    @property
    def count(self) -> int:
        """Number of blocks."""
        return self.segments.count

    @property
    def nbytes(self) -> int:
        """Total bytes of all blocks."""
        return self.segments.nbytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockListDesc):
            return NotImplemented
        return self.alignment == other.alignment and self.segments == other.segments

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<BlockListDesc count={self.count} nbytes={self.nbytes} alignment={self.alignment}>"

    def to_segments(self) -> Segments:
        """The blocks, one segment each."""
        return self.segments

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """First block whose start is misaligned, as ``(index, address)``, or None."""
        own = self.alignment
        if own and own % alignment == 0 and base_address % alignment == 0:
            # Every offset is a multiple of ``own`` (checked when made; the offsets are
            # read-only), so of ``alignment``, and so is the base.
            return None
        return self.segments.first_misaligned(base_address, alignment)


# --------------------------------------------------------------------------- numpy views


def _address(arr: npt.NDArray[np.generic]) -> int:
    data = arr.__array_interface__["data"][0]
    return int(data)


def desc_from_view(
    view: npt.NDArray[np.generic],
    base: npt.NDArray[np.generic],
    *,
    alignment: int | None = DEFAULT_ALIGNMENT,
) -> NdStridedDesc:
    """The descriptor of a strided numpy ``view`` inside the contiguous buffer ``base``.

    Offsets are in bytes from the start of ``base`` (the array you registered), strides are
    the view's byte strides, and the result is :meth:`NdStridedDesc.simplified`, so its
    elements are the view's maximal contiguous runs. Example: with
    ``kv = np.empty((layers, 2, heads, tokens, head_dim), np.float16)``,
    ``desc_from_view(kv[3, 0], kv)`` is layer 3's K slice.

    Raises :class:`DescriptorError` when ``base`` is not contiguous, ``view`` is empty, or
    any byte of ``view`` lies outside ``base``; :class:`AlignmentError` under the policy
    (applied to the simplified elements).
    """
    if not isinstance(view, np.ndarray) or not isinstance(base, np.ndarray):
        raise DescriptorError(
            f"desc_from_view needs numpy arrays, got {type(view).__name__} and "
            f"{type(base).__name__}"
        )
    if not (base.flags.c_contiguous or base.flags.f_contiguous):
        raise DescriptorError(
            f"base must be a contiguous buffer, got strides {base.strides} for shape {base.shape}"
        )
    if view.size == 0:
        raise DescriptorError(f"view is empty (shape {view.shape}): nothing to describe")
    rel = _address(view) - _address(base)
    low = rel + sum(min(0, (n - 1) * s) for n, s in zip(view.shape, view.strides, strict=True))
    high = rel + sum(max(0, (n - 1) * s) for n, s in zip(view.shape, view.strides, strict=True))
    end = high + view.itemsize
    if low < 0 or end > base.nbytes:
        raise DescriptorError(
            f"view is not inside base: view bytes [{low}, {end}) relative to base, "
            f"base nbytes={base.nbytes}"
        )
    return (
        NdStridedDesc(
            offset=rel,
            shape=tuple(view.shape),
            strides=tuple(view.strides),
            size=view.itemsize,
            alignment=None,
        )
        .simplified()
        .with_alignment(alignment)
    )
