"""Descriptors: which bytes of a registered region a transfer touches.

Theory of operation
-------------------
Every descriptor names an ordered list of *elements*, each a run of bytes at an offset
(in bytes, relative to the start of a registered region). The bytes of a transfer are the
concatenation of its elements in that order: the *stream*. A transfer pairs the local
stream with the remote stream byte for byte, so only the stream order matters, never how
it was cut into elements.

All descriptor types normalize to one form, :class:`Segments`: two int64 numpy arrays,
``offsets`` and ``lengths``, one entry per element. The planner (``hixl.core.plan``) works on
that form only.

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
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

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

I64Array = npt.NDArray[np.int64]

#: Largest byte offset or total a descriptor may reach (offsets are int64).
INT64_MAX = (1 << 63) - 1
#: Default alignment policy for element starts and strides, in bytes (the hixl design's 64).
DEFAULT_ALIGNMENT = 64
#: Most segments one descriptor may expand to (about 1 GiB of int64 offsets and lengths).
MAX_SEGMENTS = 1 << 26


# --------------------------------------------------------------------------- helpers


def _int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int (numpy integers accepted, bool and float refused), at
    least ``minimum`` and at most ``maximum`` (when given) and never above ``INT64_MAX``."""
    if isinstance(value, bool | np.bool_):
        raise DescriptorError(f"{name} must be an integer, got bool {value!r}")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise DescriptorError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if minimum is not None and result < minimum:
        raise DescriptorError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise DescriptorError(f"{name} must be <= {maximum}, got {result}")
    if result > INT64_MAX:
        raise DescriptorError(f"{name}={result} exceeds the int64 limit {INT64_MAX}")
    return result


def fold_dims(dims: Iterable[tuple[int, int]], size: int) -> tuple[list[tuple[int, int]], int]:
    """The fewest, largest elements of a stream of ``size``-byte elements over ``dims``
    (``(extent, byte stride)`` pairs, outermost first): extents of 1 dropped, an innermost
    dimension whose stride equals the element size folded into it, and dimensions ``j,
    j+1`` fused when ``stride[j] == extent[j+1] * stride[j+1]``.  The stream of bytes is
    unchanged.  Returns the remaining dimensions and the element size."""
    live = [(n, s) for n, s in dims if n > 1]
    changed = True
    while changed:
        changed = False
        if live and live[-1][1] == size:
            size *= live.pop()[0]
            changed = True
        j = 0
        while j + 1 < len(live):
            (n0, s0), (n1, s1) = live[j], live[j + 1]
            if s0 == n1 * s1:
                live[j : j + 2] = [(n0 * n1, s1)]
                changed = True
            else:
                j += 1
    return live, size


_set = object.__setattr__  # a frozen dataclass's own __init__ writes fields this way


def normalize_alignment(alignment: object) -> int | None:
    """Validate an alignment policy value: ``None`` or ``0`` turn it off.

    Returns the alignment in bytes (a power of two) or ``None`` when off.
    Raises :class:`DescriptorError` for negative values, non-integers and non-powers of two.
    """
    if alignment is None:
        return None
    a = _int("alignment", alignment, minimum=0)
    if a == 0:
        return None
    if a & (a - 1):
        raise DescriptorError(f"alignment must be a power of two in bytes, got {a}")
    return a


def _readonly(arr: I64Array) -> I64Array:
    arr.setflags(write=False)
    return arr


def _to_i64(name: str, values: object) -> I64Array:
    """A fresh, read-only, 1-D int64 copy of ``values``; refuses floats, bools, >int64."""
    try:
        arr = np.asarray(values)
        if arr.dtype == object:
            arr = np.asarray(values, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as exc:
        raise DescriptorError(f"{name} must be int64 integers: {exc}") from None
    if arr.ndim != 1:
        raise DescriptorError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise DescriptorError(f"{name} is empty: a descriptor needs at least 1 segment")
    if arr.dtype.kind not in "iu":
        raise DescriptorError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8:
        big = np.flatnonzero(arr > np.uint64(INT64_MAX))
        if big.size:
            i = int(big[0])
            raise DescriptorError(f"{name}[{i}]={int(arr[i])} exceeds the int64 limit {INT64_MAX}")
    if arr.dtype == np.int64 and isinstance(values, list | tuple):
        return _readonly(arr)  # asarray made it from the list: already a fresh copy
    return _readonly(np.array(arr, dtype=np.int64, copy=True))


def _checked_total(lengths: I64Array, shortest: int, longest: int) -> int:
    """Sum of positive int64 ``lengths``, ``shortest`` to ``longest`` each; raises if it
    exceeds ``INT64_MAX``."""
    n = int(lengths.size)
    if n * longest <= INT64_MAX:
        return n * longest if shortest == longest else int(lengths.sum())
    # Partial sums of positive values only decrease where int64 wrapped around.
    csum = np.cumsum(lengths)
    wrapped = np.flatnonzero(csum[1:] <= csum[:-1])
    if wrapped.size:
        raise DescriptorError(
            f"total length overflows int64: the first {int(wrapped[0]) + 2} of {n} segments "
            f"already sum past {INT64_MAX} bytes"
        )
    return int(csum[-1])


def _refuse_segments(off: I64Array, ln: I64Array) -> NoReturn:
    """Raise :class:`DescriptorError` naming the first invalid segment."""
    bad = np.flatnonzero(ln <= 0)
    if bad.size:
        i = int(bad[0])
        raise DescriptorError(f"segment {i} has length {int(ln[i])}: lengths must be >= 1")
    bad = np.flatnonzero(off < 0)
    if bad.size:
        i = int(bad[0])
        raise DescriptorError(f"segment {i} has offset {int(off[i])}: offsets must be >= 0")
    i = int(np.flatnonzero(off > INT64_MAX - ln)[0])
    raise DescriptorError(
        f"segment {i} overflows int64: offset={int(off[i])} length={int(ln[i])} "
        f"ends past {INT64_MAX}"
    )


# --------------------------------------------------------------------------- Segments


def sort_offsets(offsets: I64Array, below: int | None = None) -> tuple[I64Array, I64Array]:
    """``(order, offsets[order])`` for ``order`` the stable argsort of ``offsets``
    (int64, all ``>= 0``; all ``< below`` when that is given, which spares finding the
    highest).

    When the offsets leave room for it, each is shifted left by the bits of its index
    and the index put in those bits: one plain sort of those numbers gives the stable
    order (equal offsets sort by index) and the sorted offsets, at a fraction of a
    stable argsort's cost (timsort, for int64)."""
    n = offsets.size
    bits = max(n - 1, 1).bit_length()
    if n < 64 or (int(offsets.max()) + 1 if below is None else below) > 1 << (62 - bits):
        order = np.argsort(offsets, kind="stable")
        return order, offsets[order]
    packed = np.left_shift(offsets, bits)
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    order = packed & np.int64((1 << bits) - 1)
    packed >>= bits
    return order, packed


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Segments:
    """The normal form: ordered byte ranges ``[offsets[i], offsets[i] + lengths[i])``.

    ``offsets`` and ``lengths`` are read-only int64 arrays in bytes, relative to the start
    of a registered region. Their order is the stream order of the transfer.

    Invariants, checked on construction (:class:`DescriptorError` otherwise): at least one
    segment, every length ``>= 1``, every offset ``>= 0``, every end and the total
    ``<= INT64_MAX``. Segments may overlap each other (allowed on a transfer's source side).
    A Segments is itself a descriptor (:meth:`to_segments` returns it).
    """

    offsets: I64Array
    lengths: I64Array
    nbytes: int
    # The highest end, once found (-1 before): see max_end.
    _end: int = field(init=False, repr=False, compare=False)
    # The shortest and longest length, once found (None before): see length_range.
    _lengths: tuple[int, int] | None = field(init=False, repr=False, compare=False)

    def __init__(self, offsets: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        off = _to_i64("offsets", offsets)
        ln = _to_i64("lengths", lengths)
        if off.size != ln.size:
            raise DescriptorError(
                f"offsets and lengths differ in size: {off.size} offsets, {ln.size} lengths"
            )
        if off.size > MAX_SEGMENTS:
            raise DescriptorError(f"{off.size} segments exceed the limit of {MAX_SEGMENTS}")
        # Four reductions check the values and say what the planner asks later: the
        # shortest and longest length and, for blocks of one size, the highest end.
        shortest, longest = int(ln.min()), int(ln.max())
        if shortest <= 0 or int(off.min()) < 0:
            _refuse_segments(off, ln)
        end = -1
        if shortest == longest:
            highest = int(off.max())
            if highest > INT64_MAX - longest:
                _refuse_segments(off, ln)
            end = highest + longest
        elif (off > INT64_MAX - ln).any():
            _refuse_segments(off, ln)
        object.__setattr__(self, "offsets", off)
        object.__setattr__(self, "lengths", ln)
        object.__setattr__(self, "nbytes", _checked_total(ln, shortest, longest))
        object.__setattr__(self, "_end", end)
        object.__setattr__(self, "_lengths", (shortest, longest))

    @classmethod
    def _trusted(cls, offsets: I64Array, lengths: I64Array, nbytes: int) -> Segments:
        """Build without validation, for arrays derived from validated Segments."""
        seg = object.__new__(cls)
        object.__setattr__(seg, "offsets", _readonly(offsets))
        object.__setattr__(seg, "lengths", _readonly(lengths))
        object.__setattr__(seg, "nbytes", nbytes)
        object.__setattr__(seg, "_end", -1)
        object.__setattr__(seg, "_lengths", None)
        return seg

    def max_end(self) -> int:
        """The highest ``offsets[i] + lengths[i]`` in bytes: found once and kept (the
        arrays are read-only), so checking a list against a region again is O(1)."""
        end = self._end
        if end < 0:
            shortest, longest = self.length_range()
            if shortest == longest:  # one length: the highest offset ends highest
                end = int(self.offsets.max()) + longest
            else:
                end = int(np.add(self.offsets, self.lengths).max())
            object.__setattr__(self, "_end", end)
        return end

    def length_range(self) -> tuple[int, int]:
        """The shortest and the longest segment, in bytes: found once and kept (the
        arrays are read-only).  Equal for blocks of one size, which the planner and a
        chain's fill then treat as one number."""
        known = self._lengths
        if known is None:
            ln = self.lengths
            known = (int(ln.min()), int(ln.max()))
            object.__setattr__(self, "_lengths", known)
        return known

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int]]) -> Segments:
        """Segments from ``(offset, length)`` pairs in bytes, e.g. a ``TransferOpDesc`` list.

        Raises :class:`DescriptorError` as the constructor does (also for an empty list).
        """
        items = list(pairs)
        if not items:
            raise DescriptorError("no (offset, length) pairs: a descriptor needs at least 1")
        try:
            offsets = [p[0] for p in items]
            lengths = [p[1] for p in items]
            if any(len(p) != 2 for p in items):
                raise TypeError("pair of 2 expected")
        except (TypeError, IndexError) as exc:
            raise DescriptorError(f"expected (offset, length) pairs: {exc}") from None
        return cls(offsets, lengths)

    @property
    def count(self) -> int:
        """Number of segments."""
        return int(self.offsets.size)

    def __len__(self) -> int:
        return int(self.offsets.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segments):
            return NotImplemented
        return bool(
            np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<Segments count={self.count} nbytes={self.nbytes} extent={self.extent()}>"

    def to_segments(self) -> Segments:
        """Return ``self``: Segments is already the normal form."""
        return self

    def pairs(self) -> list[tuple[int, int]]:
        """The segments as a list of ``(offset, length)`` Python ints."""
        return list(zip(self.offsets.tolist(), self.lengths.tolist(), strict=True))

    def extent(self) -> tuple[int, int]:
        """``(lowest offset, highest end)`` in bytes: the byte span the segments touch."""
        return int(self.offsets.min()), int((self.offsets + self.lengths).max())

    def merged(self) -> Segments:
        """Fuse neighbours in stream order that are adjacent in memory.

        Segment ``i+1`` joins segment ``i`` when ``offsets[i] + lengths[i] ==
        offsets[i+1]``; the stream (and so any transfer) is unchanged. A strided descriptor
        with ``stride == size`` becomes one segment. Vectorized, O(count).
        """
        off, ln = self.offsets, self.lengths
        if off.size == 1:
            return self
        breaks = off[1:] != off[:-1] + ln[:-1]
        if bool(breaks.all()):
            return self
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        return Segments._trusted(off[starts], np.add.reduceat(ln, starts), self.nbytes)

    def first_overlap(self) -> tuple[int, int] | None:
        """Indices ``(i, j)`` of two segments that share a byte, or ``None`` if disjoint.

        Vectorized: one stable sort by offset, O(count log count).
        """
        off, ln = self.offsets, self.lengths
        if off.size == 1:
            return None
        if bool((off[1:] >= off[:-1]).all()):
            order = None
            so, se = off, off + ln
        else:
            order, so = sort_offsets(off)
            se = so + ln[order]
        # Sorted by start, some segment overlaps an earlier one iff one starts before its
        # predecessor ends (induction: if none does, each starts after all earlier ends).
        bad = np.flatnonzero(so[1:] < se[:-1])
        if not bad.size:
            return None
        k = int(bad[0]) + 1
        prev = k - 1
        if order is None:
            return prev, k
        return int(order[prev]), int(order[k])

    def check_disjoint(self, what: str = "destination") -> None:
        """Raise :class:`DescriptorError` if any byte is covered by two segments.

        A destination must be disjoint: otherwise a byte would be written twice and the
        result would depend on completion order. The message names both segments.
        """
        hit = self.first_overlap()
        if hit is None:
            return
        i, j = sorted(hit)
        oi, li = int(self.offsets[i]), int(self.lengths[i])
        oj, lj = int(self.offsets[j]), int(self.lengths[j])
        shared = min(oi + li, oj + lj) - max(oi, oj)
        raise DescriptorError(
            f"{what} overlaps itself: segment {i} [{oi}, {oi + li}) and segment {j} "
            f"[{oj}, {oj + lj}) share {shared} bytes"
        )

    def first_misaligned(self, base_address: int, alignment: int) -> tuple[int, int] | None:
        """First segment whose start ``base_address + offset`` is not a multiple of
        ``alignment``, as ``(index, address)``; ``None`` if all are aligned."""
        if alignment & (alignment - 1) or alignment > 1 << 62:
            rem = (base_address % alignment + self.offsets % alignment) % alignment
        else:  # a power of two: a mask instead of two divisions per segment
            mask = alignment - 1
            rem = self.offsets & np.int64(mask)
            if base_address & mask:
                rem += base_address & mask
                rem &= mask
        bad = np.flatnonzero(rem)
        if not bad.size:
            return None
        i = int(bad[0])
        return i, base_address + int(self.offsets[i])


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
