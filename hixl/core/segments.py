"""Segments: the one form every descriptor is reduced to, and the checks it rests on.

A :class:`Segments` is an ordered list of byte ranges ``[offsets[i], offsets[i] +
lengths[i])`` held as two read-only int64 numpy arrays, offsets relative to the start of a
registered region. Its order is the order in which a transfer reads or writes the bytes.
The planner (``hixl.core.plan``) works on this form only; the descriptor types of
:mod:`hixl.core.descriptors` build one with ``to_segments()``. This module also holds the
limits (:data:`INT64_MAX`, :data:`MAX_SEGMENTS`, :data:`DEFAULT_ALIGNMENT`) and the value
checks the descriptors share; bad values raise :class:`~hixl.errors.DescriptorError`.
Every public name here can also be imported from :mod:`hixl.core.descriptors`.

This module is pure: no I/O, no clock, no pyverbs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from hixl.core.checks import plain_int
from hixl.errors import DescriptorError

__all__ = [
    "DEFAULT_ALIGNMENT",
    "INT64_MAX",
    "MAX_SEGMENTS",
    "Segments",
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
    result = plain_int(name, value, DescriptorError, (bool, np.bool_))
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
