"""Transfer planning: local and remote descriptors in, RDMA work requests out.

Theory of operation
-------------------
A transfer pairs the local stream with the remote stream byte for byte (see
``hixl.core.descriptors``): stream byte ``p`` lives at local offset ``L(p)`` and remote offset
``R(p)``. A work request (WR) is one contiguous remote range plus a list of local
scatter/gather entries (SGEs); a WRITE gathers the SGEs into the remote range, a READ
scatters the remote range into the SGEs. Limits, per WR:

* at most ``max_sge`` SGEs for WRITE, ``max_sge_rd`` for READ;
* at most ``max_msg_sz`` bytes (so every SGE is also at most that long).

Planning, all vectorized with numpy (no Python loop per segment):

1. Merge neighbours that are adjacent in memory on each side (``stride == size`` becomes
   one segment).
2. Cut the stream at every local and every remote segment boundary: each *piece* is
   contiguous on both sides.
3. Order the pieces by remote offset (stable). The plan depends only on the byte mapping,
   not on how the stream was enumerated or cut (except for a READ whose remote source
   repeats bytes, which keeps stream order: see below). On the way, check that the
   destination (remote for WRITE, local for READ) never receives a byte twice.
4. Fuse pieces that continue each other on both sides. A *remote run* is a maximal chain of
   pieces, each starting where the previous one ends in remote memory; within a run, the
   fused pieces are the *local pieces*.
5. Pack each run greedily: a WR starting at byte ``x`` of a run ends at
   ``min(x + max_msg_sz, end of the S-th local piece counted from the one holding x)``.

Minimality. Call a plan valid when each WR's remote range lies in one remote run, its
SGEs follow the run's local pieces in order, and it respects the limits. Every valid plan
of a run cuts the run into consecutive WR byte ranges, and a sub-range of a feasible range
is feasible (fewer bytes, no more local pieces). So the greedy cut is never behind any
other valid plan after each WR, and it uses the fewest WRs: ``num_wrs`` is the minimum
over all valid plans. When the remote side does not overlap itself (always for WRITE,
whose destination is remote) the runs are exactly the maximal contiguous ranges of
remote memory the transfer touches, and no plan at all can use fewer WRs. When it does
overlap itself (a READ whose source repeats bytes), sorting would put one remote
segment's pieces on both sides of another's and cut its run in two, so the pieces keep
their stream order instead and a run is a stretch of the stream that is contiguous in
remote memory. Either way merging never increases the count: an unmerged plan is a
valid plan of the merged runs.

Where both limits bind in one run (some ``S`` consecutive local pieces exceed
``max_msg_sz``: pieces of hundreds of KiB), step 5 walks that run in Python, once per WR
rather than once per segment; elsewhere the WR boundaries are computed in closed form.

This module is pure: no I/O, no clock, no pyverbs.
"""

from __future__ import annotations

import bisect
import enum
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from hixl.core.descriptors import (
    ContiguousDesc,
    Descriptor,
    Segments,
    StridedDesc,
    as_segments,
    normalize_alignment,
    sort_offsets,
)
from hixl.errors import AlignmentError, BoundsError, DescriptorError

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_MSG_SZ_LIMIT",
    "DeviceLimits",
    "Op",
    "Plan",
    "check_alignment",
    "check_bounds",
    "plan_transfer",
]

I64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: ``ibv_sge.length`` and ``max_msg_sz`` are 32-bit in verbs, so no WR may be longer.
MAX_MSG_SZ_LIMIT = 0xFFFF_FFFF


class Op(enum.Enum):
    """Direction of a one-sided transfer, seen from the local side."""

    #: Local memory to remote memory (RDMA WRITE): the remote side is the destination.
    WRITE = "write"
    #: Remote memory to local memory (RDMA READ): the local side is the destination.
    READ = "read"


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """Per-work-request limits of a device/port (``ibv_query_device``/``ibv_query_port``).

    ``max_sge``: SGEs per WRITE WR; ``max_sge_rd``: SGEs per READ WR; ``max_msg_sz``:
    bytes per WR. Defaults are rxe's (32, 32, 8 MiB). Raises :class:`DescriptorError` unless
    every value is an int ``>= 1`` and ``max_msg_sz <= 2**32 - 1``.
    """

    max_sge: int = 32
    max_sge_rd: int = 32
    max_msg_sz: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("max_sge", "max_sge_rd", "max_msg_sz"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise DescriptorError(
                    f"DeviceLimits.{name} must be an int, got {type(value).__name__} {value!r}"
                )
            if value < 1:
                raise DescriptorError(f"DeviceLimits.{name} must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))
        if self.max_msg_sz > MAX_MSG_SZ_LIMIT:
            raise DescriptorError(
                f"DeviceLimits.max_msg_sz={self.max_msg_sz} exceeds the 32-bit verbs limit "
                f"{MAX_MSG_SZ_LIMIT}"
            )

    def sge_limit(self, op: Op) -> int:
        """SGEs allowed per WR for ``op``: ``max_sge`` for WRITE, ``max_sge_rd`` for READ."""
        return self.max_sge_rd if op is Op.READ else self.max_sge


DEFAULT_LIMITS = DeviceLimits()


def _i64(name: str, arr: npt.ArrayLike) -> I64Array:
    out = np.array(arr, dtype=np.int64, copy=True)
    if out.ndim != 1:
        raise DescriptorError(f"Plan.{name} must be 1-D, got shape {out.shape}")
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """Work requests for one transfer, in CSR form (all offsets and lengths in bytes).

    WR ``w`` covers remote ``[wr_remote_offset[w], wr_remote_offset[w] + wr_length[w])``
    and its SGEs are entries ``wr_sge_start[w] .. wr_sge_start[w+1] - 1`` of
    ``sge_local_offset``/``sge_length``, in order; their lengths sum to ``wr_length[w]``.
    Offsets are relative to the registered regions: the caller adds region addresses.
    WRs are ordered by remote offset and may be posted in any order (destinations are
    disjoint). Arrays are read-only int64. Raises :class:`DescriptorError` when built from
    inconsistent arrays.
    """

    op: Op
    limits: DeviceLimits
    wr_remote_offset: I64Array
    wr_length: I64Array
    wr_sge_start: I64Array
    sge_local_offset: I64Array
    sge_length: I64Array
    nbytes: int = field(init=False)
    # (shortest, longest) SGE length, when known: set by the planners that know it from
    # their descriptors, else found on first use (see sge_length_range).
    _length_range: tuple[int, int] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "wr_remote_offset",
            "wr_length",
            "wr_sge_start",
            "sge_local_offset",
            "sge_length",
        ):
            object.__setattr__(self, name, _i64(name, getattr(self, name)))
        n_wr, n_sge = self.wr_remote_offset.size, self.sge_local_offset.size
        if self.wr_length.size != n_wr or self.wr_sge_start.size != n_wr + 1:
            raise DescriptorError(
                f"Plan arrays disagree: {n_wr} remote offsets, {self.wr_length.size} WR "
                f"lengths, {self.wr_sge_start.size} indptr entries (want {n_wr + 1})"
            )
        if self.sge_length.size != n_sge:
            raise DescriptorError(
                f"Plan arrays disagree: {n_sge} SGE offsets but {self.sge_length.size} lengths"
            )
        ptr = self.wr_sge_start
        if int(ptr[0]) != 0 or int(ptr[-1]) != n_sge or bool((np.diff(ptr) < 1).any()):
            raise DescriptorError(
                f"Plan.wr_sge_start must rise from 0 to {n_sge} by >= 1 per WR, got "
                f"first={int(ptr[0])} last={int(ptr[-1])}"
            )
        total = int(self.wr_length.sum())
        if total != int(self.sge_length.sum()):
            raise DescriptorError(
                f"Plan moves {total} bytes by WR lengths but {int(self.sge_length.sum())} "
                f"by SGE lengths"
            )
        object.__setattr__(self, "nbytes", total)
        object.__setattr__(self, "_length_range", None)

    @property
    def sge_length_range(self) -> tuple[int, int]:
        """The shortest and longest SGE length, ``(0, 0)`` for a plan without SGEs: known
        from the descriptors for a layer's rows, else found once and kept (the arrays are
        read-only).  What a chain's fill checks against the 32-bit length field, and
        whether it writes one length for all."""
        known = self._length_range
        if known is None:
            ln = self.sge_length
            known = (int(ln.min()), int(ln.max())) if ln.size else (0, 0)
            object.__setattr__(self, "_length_range", known)
        return known

    @property
    def num_wrs(self) -> int:
        """Number of work requests."""
        return int(self.wr_remote_offset.size)

    @property
    def num_sges(self) -> int:
        """Number of SGEs over all work requests."""
        return int(self.sge_local_offset.size)

    @property
    def sges_per_wr(self) -> I64Array:
        """SGE count of every WR (int64 array of length ``num_wrs``)."""
        return np.diff(self.wr_sge_start)

    def wrs(self) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        """Yield ``(remote_offset, [(local_offset, length), ...])`` per WR, as Python ints."""
        remote = self.wr_remote_offset.tolist()
        ptr = self.wr_sge_start.tolist()
        local = self.sge_local_offset.tolist()
        length = self.sge_length.tolist()
        for w, r in enumerate(remote):
            a, b = ptr[w], ptr[w + 1]
            yield r, list(zip(local[a:b], length[a:b], strict=True))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            self.op is other.op
            and self.limits == other.limits
            and all(
                np.array_equal(getattr(self, n), getattr(other, n))
                for n in (
                    "wr_remote_offset",
                    "wr_length",
                    "wr_sge_start",
                    "sge_local_offset",
                    "sge_length",
                )
            )
        )

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def _fresh(
        cls,
        op: Op,
        limits: DeviceLimits,
        wr_remote_offset: I64Array,
        wr_length: I64Array,
        wr_sge_start: I64Array,
        sge_local_offset: I64Array,
        sge_length: I64Array,
        nbytes: int,
        length_range: tuple[int, int] | None = None,
    ) -> Plan:
        """A plan from int64 arrays the planner just made for it and holds nowhere else,
        or read-only ones it shares (:func:`_counting`, :func:`_constant`); consistent by
        construction: made read-only in place, not copied or checked."""
        plan = object.__new__(cls)
        put = object.__setattr__
        put(plan, "op", op)
        put(plan, "limits", limits)
        for name, arr in (
            ("wr_remote_offset", wr_remote_offset),
            ("wr_length", wr_length),
            ("wr_sge_start", wr_sge_start),
            ("sge_local_offset", sge_local_offset),
            ("sge_length", sge_length),
        ):
            arr.setflags(write=False)
            put(plan, name, arr)
        put(plan, "nbytes", nbytes)
        put(plan, "_length_range", length_range)
        return plan

    def __repr__(self) -> str:
        return (
            f"<Plan op={self.op.value} wrs={self.num_wrs} sges={self.num_sges} "
            f"nbytes={self.nbytes}>"
        )


# --------------------------------------------------------------------------- planning


def _merge_sorted(a: I64Array, b: I64Array) -> tuple[I64Array, BoolArray, BoolArray]:
    """Union of two strictly increasing int64 arrays, with membership flags.

    Returns ``(u, in_a, in_b)``: ``u`` strictly increasing, ``in_a[k]`` true iff ``u[k]``
    is in ``a``, ``in_b[k]`` iff in ``b``. O(n) to O(n log n), no Python loop.
    """
    if b.size * 8 <= a.size:
        pos = np.searchsorted(a, b)
        both = np.insert(a, pos, b)
        from_a = np.insert(np.ones(a.size, dtype=bool), pos, np.zeros(b.size, dtype=bool))
    else:
        order, both = sort_offsets(np.concatenate((b, a)))
        from_a = order >= b.size
    # Equal values come in (b, a) pairs: keep the a copy and remember its twin.
    twin = both[1:] == both[:-1]
    keep = np.ones(both.size, dtype=bool)
    keep[:-1] = ~twin
    had_b = ~from_a
    had_b[1:] |= twin
    return both[keep], from_a[keep], had_b[keep]


def _ramp(base: I64Array, count: I64Array, step: int) -> I64Array:
    """Concatenation of ``base[i] + step * arange(count[i])`` over i, vectorized."""
    total = int(count.sum())
    first = np.cumsum(count) - count
    within = np.arange(total, dtype=np.int64) - np.repeat(first, count)
    return np.repeat(base, count) + within * np.int64(step)


def _locate(
    seg: Segments, cum: I64Array, is_end: BoolArray, starts: I64Array, want_index: bool
) -> tuple[I64Array, I64Array | None]:
    """Offset in ``seg`` of every piece starting at stream position ``starts[k]``.

    ``cum`` is the running total of ``seg.lengths`` and ``is_end[k]`` marks pieces that end
    one of ``seg``'s segments, so segment ``i`` holds the pieces up to its ``i``-th mark.
    Also returns each piece's segment index when ``want_index``.
    """
    if is_end.size == cum.size:  # every piece is a whole segment
        return seg.offsets, (np.arange(cum.size, dtype=np.int64) if want_index else None)
    counts = np.diff(np.flatnonzero(is_end), prepend=-1)
    off = np.repeat(seg.offsets - (cum - seg.lengths), counts)
    off += starts
    index = np.repeat(np.arange(cum.size, dtype=np.int64), counts) if want_index else None
    return off, index


def _pieces(
    loc: Segments, rem: Segments, want_index: bool
) -> tuple[I64Array, I64Array, I64Array, I64Array | None]:
    """Cut the stream at all boundaries of both sides.

    Returns ``(local_offset, remote_offset, length, remote_segment_index)`` per piece, in
    stream order; the index is None unless ``want_index``.
    """
    cl = np.cumsum(loc.lengths)
    cr = np.cumsum(rem.lengths)
    if cl.size == cr.size and np.array_equal(cl, cr):
        idx = np.arange(cl.size, dtype=np.int64) if want_index else None
        return loc.offsets, rem.offsets, loc.lengths, idx
    # One range on one side (a gather into it, or a scatter from it): the other side's
    # segments are the pieces, and the range is cut where they end.  What the general
    # cut below gives, without merging the boundaries.
    if cr.size == 1:
        idx = np.zeros(cl.size, dtype=np.int64) if want_index else None
        return loc.offsets, (cl - loc.lengths) + rem.offsets[0], loc.lengths, idx
    if cl.size == 1:
        idx = np.arange(cr.size, dtype=np.int64) if want_index else None
        return (cr - rem.lengths) + loc.offsets[0], rem.offsets, rem.lengths, idx
    ends, end_l, end_r = _merge_sorted(cl, cr)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1]
    l_off, _ = _locate(loc, cl, end_l, starts, False)
    r_off, r_idx = _locate(rem, cr, end_r, starts, want_index)
    return l_off, r_off, ends - starts, r_idx


def _greedy_run(q: list[int], sge: int, msg: int, out: list[int]) -> None:
    """Greedy WR starts for one run; ``q`` holds the run's local-piece boundaries.

    Invariant: ``q[j] <= x < q[j+1]``. A WR from ``x`` ends at the first of ``x + msg``
    and the end of its ``sge``-th piece.
    """
    n = len(q) - 1
    x, end, j = q[0], q[n], 0
    while x < end:
        out.append(x)
        jj = min(j + sge, n)
        if x + msg >= q[jj]:
            x, j = q[jj], jj
        else:
            x += msg
            if x >= q[j + 1]:
                j = bisect.bisect_right(q, x, j + 1, n) - 1


def _pack(q: I64Array, run_first: I64Array, sge: int, msg: int) -> I64Array:
    """Greedy WR start positions, in the byte space ``q`` of the sorted local pieces.

    ``q[j]`` is where local piece ``j`` starts (``q[-1]`` is the total) and ``run_first``
    lists the first piece of every remote run.
    """
    k = q.size - 1
    run_stop = np.empty_like(run_first)
    run_stop[:-1] = run_first[1:]
    run_stop[-1] = k
    n_pieces = run_stop - run_first

    # Class A: a run of <= S pieces never reaches the SGE limit: cut it every msg bytes.
    few = n_pieces <= sge
    # Class B: if no S consecutive pieces of a run exceed msg bytes, the byte limit never
    # binds: cut it every S pieces. Class C (the rest) needs the walk.
    if bool(few.all()) or int(np.diff(q).max()) * sge <= msg:
        small = ~few
    else:
        stop_of_piece = np.repeat(run_stop, n_pieces)
        window_end = np.minimum(np.arange(k, dtype=np.int64) + sge, stop_of_piece)
        window = q[window_end] - q[:-1]
        small = (np.maximum.reduceat(window, run_first) <= msg) & ~few
    mixed = ~(few | small)

    parts: list[I64Array] = []
    if bool(few.any()):
        run_bytes = q[run_stop[few]] - q[run_first[few]]
        parts.append(_ramp(q[run_first[few]], -(-run_bytes // msg), msg))
    if bool(small.any()):
        parts.append(q[_ramp(run_first[small], -(-n_pieces[small] // sge), sge)])
    if bool(mixed.any()):
        out: list[int] = []
        for a, b in zip(run_first[mixed].tolist(), run_stop[mixed].tolist(), strict=True):
            _greedy_run(q[a : b + 1].tolist(), sge, msg, out)
        parts.append(np.array(out, dtype=np.int64))
    return parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))


def _plan_one_range(loc: Segments, rem: Segments, op: Op, limits: DeviceLimits) -> Plan:
    """Fast path for one contiguous range on each side: cut every ``max_msg_sz`` bytes."""
    msg, total = limits.max_msg_sz, loc.nbytes
    n = -(-total // msg)
    step = np.arange(n, dtype=np.int64) * np.int64(msg)
    length = np.full(n, msg, dtype=np.int64)
    length[-1] = total - (n - 1) * msg
    return Plan(
        op=op,
        limits=limits,
        wr_remote_offset=step + rem.offsets[0],
        wr_length=length,
        wr_sge_start=np.arange(n + 1, dtype=np.int64),
        sge_local_offset=step + loc.offsets[0],
        sge_length=length,
    )


def _plan_separate_blocks(
    loc: Segments, rem: Segments, op: Op, limits: DeviceLimits
) -> Plan | None:
    """The plan of a block list whose blocks pair one to one, when no two remote blocks
    touch: one WR of one SGE per block, in remote order (a batch of messages).

    That is also what the general planner gives for it (no WR can span two blocks: each
    WR writes or reads one contiguous remote range), in a dozen array operations instead
    of the general planner's hundreds, which is what costs at a few dozen blocks.  None
    when the shortcut does not apply: block ``i`` of each side differs in length, a
    block is longer than a message may be, remote blocks touch or overlap, or, for a
    READ, local blocks overlap; the general planner then plans it (or says what is
    wrong).
    """
    n = loc.count
    if n < 2 or rem.count != n:
        return None
    shortest, longest = loc.length_range()
    if longest > limits.max_msg_sz:
        return None
    if shortest == longest:
        if rem.length_range() != (longest, longest):
            return None
        return _plan_equal_blocks(loc.offsets, rem.offsets, longest, rem.max_end(), op, limits)
    ln = loc.lengths
    if not np.array_equal(ln, rem.lengths):
        return None
    lo, ro = loc.offsets, rem.offsets
    if not bool((ro[1:] > ro[:-1]).all()):
        order, ro = sort_offsets(ro)
        lo, ln = lo[order], ln[order]
    gap = ro[1:] - ro[:-1]
    gap -= ln[:-1]
    if bool((gap < 0).any()):
        return None  # remote blocks overlap: the general path says so (or keeps order)
    if op is Op.READ:
        by_local, ls = sort_offsets(lo)
        ll = ln[by_local]
        if not bool((ls[1:] >= ls[:-1] + ll[:-1]).all()):
            return None  # the READ destination overlaps itself: the general path says so
    if bool((gap == 0).any()):
        # Remote blocks touch: one WR may take several.  These pieces, in remote order,
        # are what the general path's steps 1-3 make of such blocks (a pair of blocks
        # it merges on both sides is one it fuses again here in step 4).
        return _plan_pieces(lo, ro, ln, gap, None, op, limits)
    return Plan._fresh(op, limits, ro, ln, _counting(n), lo, ln, loc.nbytes)


def _plan_equal_blocks(
    lo: I64Array, ro: I64Array, size: int, end: int, op: Op, limits: DeviceLimits
) -> Plan | None:
    """:func:`_plan_separate_blocks` for blocks that are all ``size`` bytes (KV blocks),
    at local offsets ``lo`` and remote offsets ``ro``, touching remote blocks included:
    the lengths are one number, so the steps take the offsets alone.  Remote blocks
    already in ascending order are not sorted (the first difference says so); a run of
    touching remote blocks whose local blocks are apart is one WR, when no run exceeds
    the limits.  ``end``: the highest end of a remote block.  None when the shortcut
    does not apply (as there)."""
    n = ro.size
    # Descending somewhere among the first four (random order, nearly always): sorted
    # at once, without a pass to find out.
    head = ro[:4].tolist()
    if head == sorted(head):
        step = np.diff(ro)
        least = int(step.min())
    else:
        least = 0
    if least < size:
        if least > 0:
            return None  # ascending, but remote blocks overlap: the general path says so
        order, ro = sort_offsets(ro, end)
        lo = lo[order]
        step = np.diff(ro)
        if int(step.min()) < size:
            return None  # remote blocks overlap: the general path says so
    if op is Op.READ and int(np.diff(np.sort(lo)).min()) < size:
        return None  # the READ destination overlaps itself: the general path says so
    ln = _constant(n, size)
    breaks = np.flatnonzero(step != size)  # block k + 1 starts a run of touching blocks
    if breaks.size == n - 1:  # no two touch
        return Plan._fresh(op, limits, ro, ln, _counting(n), lo, ln, n * size, (size, size))
    # Remote blocks touch: a run of touching remote blocks is one WR of one SGE per
    # block, unless some of its local blocks continue each other too (then they are
    # one SGE: the general steps 4-5 fuse them) or the run exceeds a limit.
    follows = np.diff(lo)
    follows[breaks] = 0  # only within a run
    if bool((follows == size).any()):
        return _plan_pieces(lo, ro, ln, step - size, None, op, limits)
    bounds = np.empty(breaks.size + 2, dtype=np.int64)
    bounds[0] = 0
    np.add(breaks, 1, out=bounds[1:-1])
    bounds[-1] = n
    blocks = np.diff(bounds)
    most = int(blocks.max())
    if most > limits.sge_limit(op) or most * size > limits.max_msg_sz:
        return _plan_pieces(lo, ro, ln, step - size, None, op, limits)
    blocks *= size
    return Plan._fresh(op, limits, ro[bounds[:-1]], blocks, bounds, lo, ln, n * size, (size, size))


@functools.lru_cache(maxsize=16)
def _counting(n: int) -> I64Array:
    """``0, 1, .., n`` as a read-only int64 array, shared by every plan of ``n`` WRs of
    one SGE each (their ``wr_sge_start``): made once per count."""
    out = np.arange(n + 1, dtype=np.int64)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=64)
def _constant(n: int, value: int) -> I64Array:
    """``n`` times ``value`` as a read-only int64 array of stride 0 (a broadcast of one
    number): the lengths of a plan of ``n`` rows of ``value`` bytes, which take no memory
    and no writing, however many rows (kept per shape: made in microseconds, taken from
    here in less)."""
    out: I64Array = np.ndarray((n,), np.int64, np.array([value], np.int64), 0, (0,))
    out.setflags(write=False)
    return out


def _row_offsets(n: int, offset: int, stride: int) -> I64Array:
    """``offset + i * stride`` for ``i < n``, as int64 (one pass)."""
    if stride == 0:
        return np.full(n, offset, dtype=np.int64)
    return np.arange(offset, offset + n * stride, stride, dtype=np.int64)


def _plan_strided_rows(
    local: StridedDesc, remote: StridedDesc, op: Op, limits: DeviceLimits
) -> Plan | None:
    """:func:`_plan_separate_blocks` for two :class:`StridedDesc` of as many rows of one
    size (one KV layer, head by head or token by token), from the four numbers of each
    side instead of their segment arrays: one WR of one SGE per row, in remote order.
    None when that does not apply (the rows are longer than a message may be, remote
    rows touch or overlap, or the local rows of a READ overlap)."""
    n, size = local.count, local.size
    if n < 2 or remote.count != n or remote.size != size or size > limits.max_msg_sz:
        return None
    rs, ls = remote.stride, local.stride
    if abs(rs) <= size or (op is Op.READ and abs(ls) < size):
        return None
    ro = _row_offsets(n, remote.offset, rs)
    # The same rows on both sides (one cache layout on both engines): one array for both.
    lo = ro if (local.offset, ls) == (remote.offset, rs) else _row_offsets(n, local.offset, ls)
    if rs < 0:  # remote order: the last row first
        ro, lo = ro[::-1], lo[::-1]
    ln = _constant(n, size)
    return Plan._fresh(op, limits, ro, ln, _counting(n), lo, ln, n * size, (size, size))


def _plan_rows_into_range(
    local: StridedDesc, remote: ContiguousDesc, op: Op, limits: DeviceLimits
) -> Plan | None:
    """A :class:`StridedDesc` of ``n`` rows gathered into one contiguous remote range (a
    WRITE) or scattered from it (a READ), when every WR can take ``k`` whole rows: ``k =
    n`` if all rows fit one message and one WR's SGEs, else the SGE limit if that many
    rows fit one message.  WR ``w`` then has rows ``w*k ..`` as its SGEs, which is what
    the general planner makes of it, from the descriptors' numbers.  None otherwise (and
    for rows that are one contiguous range, or overlap as a READ's destination)."""
    n, size, ls = local.count, local.size, local.stride
    if n < 2 or remote.nbytes != n * size or ls == size or (op is Op.READ and abs(ls) < size):
        return None
    sge, msg = limits.sge_limit(op), limits.max_msg_sz
    if n * size <= msg and n <= sge:
        k = n
    elif sge * size <= msg:
        k = sge
    else:
        return None
    lo = _row_offsets(n, local.offset, ls)
    n_wr = -(-n // k)
    start = np.arange(n_wr + 1, dtype=np.int64) * np.int64(k)
    start[-1] = n
    ro = start[:-1] * np.int64(size)
    wr_len = np.diff(start) * np.int64(size)
    ro += np.int64(remote.offset)
    return Plan._fresh(
        op, limits, ro, wr_len, start, lo, _constant(n, size), n * size, (size, size)
    )


def plan_transfer(
    local: Descriptor,
    remote: Descriptor,
    op: Op,
    limits: DeviceLimits = DEFAULT_LIMITS,
    *,
    merge: bool = True,
) -> Plan:
    """Plan the work requests that move ``local``'s stream to/from ``remote``'s.

    ``local``/``remote`` are descriptors or :class:`Segments` with offsets in bytes relative
    to their registered regions. Stream byte ``p`` of ``local`` pairs with stream byte ``p``
    of ``remote``. WRITE copies local to remote, READ remote to local. The result uses the
    minimum number of WRs that any plan respecting ``limits`` can (module docstring); each
    WR has at most ``limits.sge_limit(op)`` SGEs and ``limits.max_msg_sz`` bytes.
    ``merge=False`` plans without fusing adjacent segments (a baseline for comparisons).

    Raises :class:`DescriptorError` if the totals differ, if the destination (remote for
    WRITE, local for READ) covers a byte twice, or if an argument is not of the right type.
    Region bounds and address alignment are separate checks (:func:`check_bounds`,
    :func:`check_alignment`).
    """
    if not isinstance(op, Op):
        raise DescriptorError(f"op must be Op.WRITE or Op.READ, got {op!r}")
    if not isinstance(limits, DeviceLimits):
        raise DescriptorError(f"limits must be DeviceLimits, got {type(limits).__name__}")
    if merge and type(local) is StridedDesc:  # one KV layer: from the descriptors' numbers
        rows = None
        if type(remote) is StridedDesc:
            rows = _plan_strided_rows(local, remote, op, limits)
        elif type(remote) is ContiguousDesc:
            rows = _plan_rows_into_range(local, remote, op, limits)
        if rows is not None:
            return rows
    loc0, rem0 = as_segments(local), as_segments(remote)
    if loc0.nbytes != rem0.nbytes:
        raise DescriptorError(
            f"local and remote totals differ: local nbytes={loc0.nbytes} in {loc0.count} "
            f"segments, remote nbytes={rem0.nbytes} in {rem0.count} segments"
        )
    if merge:
        quick = _plan_separate_blocks(loc0, rem0, op, limits)
        if quick is not None:
            return quick
    loc, rem = (loc0.merged(), rem0.merged()) if merge else (loc0, rem0)
    if loc.count == 1 and rem.count == 1:
        return _plan_one_range(loc, rem, op, limits)
    if op is Op.READ and loc.first_overlap() is not None:
        loc0.check_disjoint("local (the READ destination)")

    l_off, r_off, length, r_idx = _pieces(loc, rem, want_index=not merge)
    gap = r_off[1:] - (r_off[:-1] + length[:-1])
    if length.size > 1 and not bool((r_off[1:] >= r_off[:-1]).all()):
        order, s_r = sort_offsets(r_off)
        s_l, s_len = l_off[order], length[order]
        # Sorted by start, a range overlaps an earlier one iff it starts before its
        # predecessor ends.
        s_gap = s_r[1:] - (s_r[:-1] + s_len[:-1])
        if not bool((s_gap < 0).any()):
            l_off, r_off, length, gap = s_l, s_r, s_len, s_gap
            r_idx = None if r_idx is None else r_idx[order]
        elif op is Op.WRITE:
            rem0.check_disjoint("remote (the WRITE destination)")
        # else a READ whose source repeats bytes: the pieces stay in stream order (see
        # the module docstring), where a remote segment's pieces follow each other.
    elif op is Op.WRITE and bool((gap < 0).any()):
        rem0.check_disjoint("remote (the WRITE destination)")
    return _plan_pieces(l_off, r_off, length, gap, r_idx, op, limits)


def _plan_pieces(
    l_off: I64Array,
    r_off: I64Array,
    length: I64Array,
    gap: I64Array,
    r_idx: I64Array | None,
    op: Op,
    limits: DeviceLimits,
) -> Plan:
    """Steps 4 and 5 of :func:`plan_transfer`: the plan of the pieces ``l_off``,
    ``r_off``, ``length`` in the order they are planned in (``gap[k]``: remote bytes
    between the end of piece ``k`` and the start of piece ``k + 1``; ``r_idx``: each
    piece's remote segment, when runs must not cross segments, else None)."""
    # Fuse pieces that continue each other on both sides; mark where remote runs start.
    cont_r = gap == 0
    if r_idx is not None:
        cont_r &= r_idx[1:] == r_idx[:-1]
        join = None
    else:
        join = cont_r & (l_off[1:] == l_off[:-1] + length[:-1])
    if join is None or not bool(join.any()):
        g_len, g_l, g_r = length, l_off, r_off
        run_first = np.flatnonzero(np.concatenate(([True], ~cont_r)))
    else:
        first = np.flatnonzero(np.concatenate(([True], ~join)))
        g_len = np.add.reduceat(length, first)
        g_l, g_r = l_off[first], r_off[first]
        run_first = np.flatnonzero(np.concatenate(([True], ~cont_r))[first])
    k = g_len.size
    q = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(g_len, out=q[1:])
    bounds = np.empty(run_first.size + 1, dtype=np.int64)
    bounds[:-1] = run_first
    bounds[-1] = k
    run_bytes = np.diff(q[bounds])
    if (
        int(np.diff(bounds).max()) <= limits.sge_limit(op)
        and int(run_bytes.max()) <= limits.max_msg_sz
    ):
        # Every run fits one WR (blocks and the blocks that touch them, short of the
        # limits): what step 5 makes of it, without the cutting.
        return Plan._fresh(op, limits, g_r[run_first], run_bytes, bounds, g_l, g_len, int(q[-1]))

    wr_start = _pack(q, run_first, limits.sge_limit(op), limits.max_msg_sz)
    wr_length = np.diff(np.append(wr_start, q[-1]))
    at = np.searchsorted(q, wr_start)
    if bool((q[at] == wr_start).all()):
        # Every WR starts at a piece start: the pieces are the SGEs.
        sge_local, sge_length = g_l, g_len
        indptr = np.append(at, g_len.size)
        wr_remote = g_r[at]
    else:
        # Cut the pieces again at every WR start.
        sge_start, is_piece, is_wr = _merge_sorted(q[:-1], wr_start)
        piece = np.cumsum(is_piece) - 1
        sge_local = g_l[piece] + (sge_start - q[piece])
        sge_length = np.diff(np.append(sge_start, q[-1]))
        indptr = np.append(np.flatnonzero(is_wr), sge_start.size)
        wr_piece = piece[indptr[:-1]]
        wr_remote = g_r[wr_piece] + (wr_start - q[wr_piece])
    return Plan(
        op=op,
        limits=limits,
        wr_remote_offset=wr_remote,
        wr_length=wr_length,
        wr_sge_start=indptr,
        sge_local_offset=sge_local,
        sge_length=sge_length,
    )


# --------------------------------------------------------------------------- region checks


def check_bounds(segments: Descriptor, region_length: int, what: str = "remote") -> None:
    """Check that every byte of ``segments`` lies in ``[0, region_length)``.

    ``segments`` is a descriptor or :class:`Segments` with offsets in bytes relative to the
    region; ``region_length`` is the region's length in bytes. Raises
    :class:`hixl.errors.BoundsError` naming the first segment that reaches past the end,
    e.g. ``remote out of bounds: offset=4096 nbytes=8192 region_length=8192``; raises
    :class:`DescriptorError` for a negative or non-integer ``region_length``.
    """
    if isinstance(region_length, bool) or not isinstance(region_length, int | np.integer):
        raise DescriptorError(f"region_length must be an int, got {type(region_length).__name__}")
    limit = int(region_length)
    if limit < 0:
        raise DescriptorError(f"region_length must be >= 0, got {limit}")
    seg = as_segments(segments)
    if seg.max_end() <= limit:
        return
    bad = np.flatnonzero(seg.offsets > limit - seg.lengths)
    if bad.size:
        i = int(bad[0])
        raise BoundsError(
            f"{what} out of bounds: offset={int(seg.offsets[i])} "
            f"nbytes={int(seg.lengths[i])} region_length={limit}"
            + (f" (segment {i} of {seg.count})" if seg.count > 1 else "")
        )


def check_alignment(
    segments_or_desc: Descriptor,
    base_address: int,
    alignment: int | None,
    what: str = "remote",
) -> None:
    """Check that every element start ``base_address + offset`` is ``alignment``-aligned.

    For a strided descriptor the element starts are ``base + offset + i*stride``; for
    :class:`Segments` and block lists, every segment's start. ``base_address`` is the
    absolute address of the region (bytes); ``alignment`` is a power of two in bytes, and
    ``0`` or ``None`` turns the check off. Raises :class:`AlignmentError` naming the first
    misaligned element and its address; :class:`DescriptorError` for a bad ``alignment``
    or ``base_address``.
    """
    align = normalize_alignment(alignment)
    if align is None:
        return
    if isinstance(base_address, bool) or not isinstance(base_address, int | np.integer):
        raise DescriptorError(f"base_address must be an int, got {type(base_address).__name__}")
    base = int(base_address)
    if base < 0:
        raise DescriptorError(f"base_address must be >= 0, got {base}")
    if not isinstance(segments_or_desc, Segments) and not hasattr(
        segments_or_desc, "first_misaligned"
    ):
        raise DescriptorError(
            f"expected a descriptor or Segments, got {type(segments_or_desc).__name__}"
        )
    hit = segments_or_desc.first_misaligned(base, align)
    if hit is not None:
        i, addr = hit
        raise AlignmentError(
            f"{what} element {i} starts at address {addr:#x} (base_address={base:#x} + "
            f"offset={addr - base}), not a multiple of alignment={align} bytes "
            f"(misaligned by {addr % align})"
        )
