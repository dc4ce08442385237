"""KV caches in blocks: the geometry of a cache's tensors and the plan of a request.

Theory of operation
-------------------
An inference server holds its KV cache as tensors (one or more per layer), each with a
*block axis*: index ``j`` along it is block ``j`` of that tensor. A request owns a list of
block ids; moving it means moving the same blocks of every tensor (or of a chosen subset),
from one engine's cache into another's, block ``local[i]`` paired with ``remote[i]``.

A tensor is described by :class:`TensorGeometry`: dtype (name and itemsize), shape and
byte strides, where it starts in its registered region, its block axis and optionally its
KV-heads axis. A block is the sub-array with the block axis fixed; a *head range*
``(start, stop)`` narrows the heads axis of that sub-array. The bytes of a block are
streamed in C order of the sub-array's remaining axes (the *block shape*), so two caches
pair byte for byte whenever their block shapes (after head selection) and dtypes are equal,
whatever their strides: FlashAttention's ``(2, num_blocks, ...)`` pairs with FlashInfer's
``(num_blocks, 2, ...)``, a head range of 8 heads pairs with a cache of 2.

:func:`block_pattern` reduces a block (with a head range) to the offsets of its maximal
contiguous pieces relative to block 0, all of one size; block ``j``'s pieces are those
plus ``j * block_stride``. :func:`plan_blocks` turns two patterns and two block lists into
a :class:`~hixl.core.plan.Plan` whose offsets are relative to each tensor's element 0:
the planner fuses what is adjacent on both sides (runs of consecutive blocks whose pieces
touch), so a run of blocks moves in as few work requests as the device limits allow.
Tensors of one geometry share a plan: :func:`plan_request` plans each distinct pair of
patterns once and lays the plans of all tensors out as one chain of work requests
(:class:`RequestPlan`), with each WR's remote key index and each SGE's local key index.
The chain goes block run by block run, all tensors of a run together, so the WRs that
have completed when a request fails carry whole blocks: :func:`landed_blocks` says which.
:func:`check_alignment` applies an engine's alignment policy to where blocks start.

:class:`KVGeometry` is what a peer learns about a cache (its regions' lengths and every
tensor's geometry), as a small JSON document that :meth:`KVGeometry.from_bytes` parses as
untrusted input. :func:`pair_tensors` checks two caches against each other before anything
is posted and names the first mismatch (``tensor 3: dtype float16 vs bfloat16``).

This module is pure: no I/O, no clock, no pyverbs. Sizes and offsets are in bytes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hixl.core.descriptors import INT64_MAX, Segments, fold_dims
from hixl.core.plan import DEFAULT_LIMITS, DeviceLimits, Op, Plan, plan_transfer
from hixl.core.segments import _int
from hixl.errors import AlignmentError, DescriptorError

__all__ = [
    "BlockPattern",
    "KVGeometry",
    "MAX_DIMS",
    "MAX_TENSORS",
    "RequestPlan",
    "TensorGeometry",
    "TensorGroup",
    "Tile",
    "block_ids",
    "block_pattern",
    "check_alignment",
    "landed_blocks",
    "pair_tensors",
    "plan_blocks",
    "plan_groups",
    "plan_request",
    "runs",
    "tensor_groups",
]

I64Array = npt.NDArray[np.int64]

#: Most dimensions a KV tensor may have.
MAX_DIMS = 8
#: Most tensors one cache may hold (a region each at most; the engine's own limits apply).
MAX_TENSORS = 1024
#: Longest dtype name accepted from a peer.
_MAX_DTYPE = 32
#: Version of the geometry document.
_GEOMETRY_VERSION = 1


def _ints(where: str, values: object, lo: int) -> tuple[int, ...]:
    if not isinstance(values, list | tuple):
        raise DescriptorError(f"{where} must be a list of integers, got {type(values).__name__}")
    return tuple(_int(f"{where}[{i}]", v, lo) for i, v in enumerate(values))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorGeometry:
    """One KV tensor as its engine registered it (and as its peers learn it).

    ``dtype`` is the element type's name (``"float16"``, ``"bfloat16"``, ``"uint8"``...)
    and ``itemsize`` its bytes; ``shape`` the extents; ``strides`` the byte steps per axis
    (>= 0); ``offset`` the bytes from the start of region ``region`` (an index into the
    cache's regions) to element 0; ``block_axis`` the axis whose index is the block id;
    ``heads_axis`` the KV-heads axis, where head ranges are wanted (``None``: none).

    Raises :class:`DescriptorError` for bad axes or extents, negative strides, and
    tensors whose elements overlap (two blocks must never share a byte).
    """

    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    region: int = 0
    block_axis: int = 0
    heads_axis: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.dtype, str)
            or not 0 < len(self.dtype) <= _MAX_DTYPE
            or not self.dtype.isascii()
            or not self.dtype.isprintable()
        ):
            raise DescriptorError(f"dtype must be a short printable name, got {self.dtype!r}")
        _set = object.__setattr__
        _set(self, "itemsize", _int("itemsize", self.itemsize, 1, 64))
        shape = _ints("shape", list(self.shape), 1)
        strides = _ints("strides", list(self.strides), 0)
        if not 1 <= len(shape) <= MAX_DIMS or len(strides) != len(shape):
            raise DescriptorError(
                f"shape {shape} and strides {strides} must have the same 1..{MAX_DIMS} dims"
            )
        _set(self, "shape", shape)
        _set(self, "strides", strides)
        _set(self, "offset", _int("offset", self.offset, 0))
        _set(self, "region", _int("region", self.region, 0, MAX_TENSORS))
        ndim = len(shape)
        block_axis = _int("block_axis", self.block_axis, -ndim, ndim - 1) % ndim
        _set(self, "block_axis", block_axis)
        if self.heads_axis is not None:
            heads = _int("heads_axis", self.heads_axis, -ndim, ndim - 1) % ndim
            if heads == block_axis:
                raise DescriptorError(f"heads_axis and block_axis are both axis {heads}")
            _set(self, "heads_axis", heads)
        if self.end > INT64_MAX:
            raise DescriptorError(f"tensor overflows int64: ends at {self.end}")
        # Distinct indices must reach distinct bytes (else two blocks, or two bytes of
        # one destination block, would share memory): sorted by stride, each axis must
        # step over everything the faster axes span.
        span = self.itemsize
        for n, s in sorted(zip(shape, strides, strict=True), key=lambda d: d[1]):
            if n == 1:
                continue
            if s < span:
                raise DescriptorError(
                    f"tensor elements overlap: shape {shape} strides {strides} (an axis of "
                    f"stride {s} steps inside the {span} bytes the faster axes span)"
                )
            span += (n - 1) * s

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_blocks(self) -> int:
        """Extent of the block axis."""
        return self.shape[self.block_axis]

    @property
    def num_heads(self) -> int | None:
        """Extent of the heads axis, or None without one."""
        return None if self.heads_axis is None else self.shape[self.heads_axis]

    @property
    def block_stride(self) -> int:
        """Bytes from block ``j`` to block ``j + 1``."""
        return self.strides[self.block_axis]

    @property
    def block_bytes(self) -> int:
        """Data bytes of one block (all heads)."""
        return self.itemsize * math.prod(self.shape) // self.num_blocks

    @property
    def end(self) -> int:
        """One past the last byte, from the start of the region."""
        return (
            self.offset
            + sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
            + self.itemsize
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "itemsize": self.itemsize,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "offset": self.offset,
            "region": self.region,
            "block_axis": self.block_axis,
            "heads_axis": self.heads_axis,
            "block_bytes": self.block_bytes,
        }

    @classmethod
    def from_json(cls, where: str, obj: object) -> TensorGeometry:
        keys = ("dtype", "itemsize", "shape", "strides", "offset", "region", "block_axis")
        extra = ("heads_axis", "block_bytes")
        if not isinstance(obj, dict) or set(obj) != {*keys, *extra}:
            raise DescriptorError(f"{where}: expected an object with keys {keys + extra}")
        try:
            geom = cls(
                dtype=obj["dtype"],
                itemsize=obj["itemsize"],
                shape=_ints(f"{where}.shape", obj["shape"], 1),
                strides=_ints(f"{where}.strides", obj["strides"], 0),
                offset=obj["offset"],
                region=obj["region"],
                block_axis=obj["block_axis"],
                heads_axis=obj["heads_axis"],
            )
        except DescriptorError as exc:
            raise DescriptorError(f"{where}: {exc}") from None
        if obj["block_bytes"] != geom.block_bytes:
            raise DescriptorError(
                f"{where}: block_bytes={obj['block_bytes']!r} but its shape makes "
                f"{geom.block_bytes} bytes per block"
            )
        return geom


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGeometry:
    """A cache as its peers see it: ``region_lengths[k]`` is the byte length of region
    ``k`` and ``tensors[i]`` the geometry of tensor ``i``. Raises :class:`DescriptorError`
    when a tensor names a missing region or reaches past its end."""

    region_lengths: tuple[int, ...]
    tensors: tuple[TensorGeometry, ...]

    def __post_init__(self) -> None:
        lengths = _ints("region_lengths", list(self.region_lengths), 1)
        object.__setattr__(self, "region_lengths", lengths)
        if not 1 <= len(self.tensors) <= MAX_TENSORS:
            raise DescriptorError(f"a cache has 1..{MAX_TENSORS} tensors, got {len(self.tensors)}")
        for i, t in enumerate(self.tensors):
            if not isinstance(t, TensorGeometry):
                raise DescriptorError(f"tensor {i} is a {type(t).__name__}, not a TensorGeometry")
            if t.region >= len(lengths):
                raise DescriptorError(f"tensor {i} names region {t.region} of {len(lengths)}")
            if t.end > lengths[t.region]:
                raise DescriptorError(
                    f"tensor {i} ends at byte {t.end} of region {t.region}, which has "
                    f"{lengths[t.region]} bytes"
                )

    def to_bytes(self) -> bytes:
        """The geometry document (UTF-8 JSON)."""
        doc = {
            "version": _GEOMETRY_VERSION,
            "regions": list(self.region_lengths),
            "tensors": [t.to_json() for t in self.tensors],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVGeometry:
        """Parse a peer's geometry document (untrusted): :class:`DescriptorError` names
        the first bad field."""
        try:
            doc = json.loads(data.rstrip(b"\0").decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise DescriptorError(f"KV geometry is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != {"version", "regions", "tensors"}:
            raise DescriptorError("KV geometry: expected keys version, regions, tensors")
        if doc["version"] != _GEOMETRY_VERSION:
            raise DescriptorError(
                f"KV geometry version {doc['version']!r}, this side speaks {_GEOMETRY_VERSION}"
            )
        tensors = doc["tensors"]
        if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
            raise DescriptorError(f"KV geometry: tensors must be a list of <= {MAX_TENSORS}")
        return cls(
            region_lengths=_ints("regions", doc["regions"], 1),
            tensors=tuple(
                TensorGeometry.from_json(f"tensor {i}", t) for i, t in enumerate(tensors)
            ),
        )


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True, slots=True, eq=False)
class BlockPattern:
    """The pieces of one block (with a head range) of a tensor.

    ``shape`` is the block shape streamed (C order of the non-block axes, the heads axis
    narrowed); ``offsets`` the start of each maximal contiguous piece relative to element 0
    of block 0, in stream order (read-only int64), each ``size`` bytes long;
    ``block_stride`` the bytes from one block to the next; ``nbytes`` the block's bytes.
    """

    shape: tuple[int, ...]
    offsets: I64Array
    size: int
    block_stride: int
    nbytes: int

    @property
    def key(self) -> tuple[Any, ...]:
        """A hashable value equal for equal patterns."""
        return (self.offsets.tobytes(), self.size, self.block_stride)


def _heads(where: str, heads: object, num_heads: int) -> tuple[int, int]:
    if not isinstance(heads, tuple | list) or len(heads) != 2:
        raise DescriptorError(f"{where} must be a (start, stop) pair, got {heads!r}")
    start = _int(f"{where} start", heads[0], 0)
    stop = _int(f"{where} stop", heads[1], 0)
    if not 0 <= start < stop <= num_heads:
        raise DescriptorError(
            f"{where}={(start, stop)} is not a non-empty range inside [0, {num_heads}) heads"
        )
    return start, stop


def block_pattern(geom: TensorGeometry, heads: tuple[int, int] | None = None) -> BlockPattern:
    """The pieces of a block of ``geom``, narrowed to ``heads`` (a ``(start, stop)`` range
    along its heads axis; None: all heads). Cached per (geometry, range). Raises
    :class:`DescriptorError` for a head range without a heads axis or outside it."""
    if heads is not None:
        if geom.heads_axis is None:
            raise DescriptorError(
                f"a head range {tuple(heads)} needs a heads_axis; this tensor has none "
                f"(shape {geom.shape})"
            )
        heads = _heads("heads", heads, geom.shape[geom.heads_axis])
        if heads == (0, geom.shape[geom.heads_axis]):
            heads = None
    # Keyed by what shapes a block only: tensors of one layout share one pattern object
    # (and so one cached plan, see _run_plan), wherever they sit.
    return _pattern(
        geom.itemsize, geom.shape, geom.strides, geom.block_axis, geom.heads_axis, heads
    )


@functools.lru_cache(maxsize=256)
def _pattern(
    itemsize: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    block_axis: int,
    heads_axis: int | None,
    heads: tuple[int, int] | None,
) -> BlockPattern:
    base = 0
    dims: list[tuple[int, int]] = []
    for axis, (n, s) in enumerate(zip(shape, strides, strict=True)):
        if axis == block_axis:
            continue
        if axis == heads_axis and heads is not None:
            base += heads[0] * s
            n = heads[1] - heads[0]
        dims.append((n, s))
    dims_shape = tuple(n for n, _ in dims)
    live, size = fold_dims(dims, itemsize)  # the fewest, largest pieces
    offs = np.array([base], dtype=np.int64)
    for n, s in live:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64) * np.int64(s)).ravel()
    offs.setflags(write=False)
    nbytes = itemsize * math.prod(dims_shape)
    return BlockPattern(dims_shape, offs, size, strides[block_axis], nbytes)


def check_alignment(geometry: KVGeometry, alignment: int | None, where: str = "") -> None:
    """Apply an engine's alignment policy to a cache's blocks: every block must start on a
    multiple of ``alignment`` bytes from the start of its region, so each tensor's start
    (``offset``) and, with more than one block, its block stride must be multiples of it.
    The pieces inside a block (its K and V planes, token rows, a head range) follow the
    tensor's own layout and are not checked. ``None`` (the policy off) checks nothing.
    Raises :class:`AlignmentError` naming the first tensor that breaks the policy;
    ``where`` prefixes the message."""
    if not alignment:
        return
    for i, t in enumerate(geometry.tensors):
        if t.offset % alignment:
            what = f"starts at offset {t.offset} in its region"
        elif t.num_blocks > 1 and t.block_stride % alignment:
            what = f"has a block stride of {t.block_stride} bytes"
        else:
            continue
        raise AlignmentError(
            f"{where}tensor {i} {what}, not a multiple of the alignment policy {alignment} "
            "bytes: its blocks would start off the policy (Engine(alignment=None) turns the "
            "check off)"
        )


def block_ids(where: str, ids: object, num_blocks: int) -> I64Array:
    """``ids`` as a 1-D int64 array of block ids in ``[0, num_blocks)``; raises
    :class:`DescriptorError` naming the first bad entry."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise DescriptorError(f"{where} must be integers: {exc}") from None
    if arr.ndim != 1 or arr.size == 0 or (arr.dtype.kind not in "iu"):
        raise DescriptorError(
            f"{where} must be a non-empty 1-D list of integers, got shape {arr.shape} "
            f"dtype {arr.dtype}"
        )
    if arr.min() < 0 or arr.max() >= num_blocks:
        i = int(((arr < 0) | (arr >= num_blocks)).nonzero()[0][0])
        raise DescriptorError(f"{where}[{i}]={int(arr[i])} is outside [0, {num_blocks}) blocks")
    return arr.astype(np.int64, copy=False)


def check_unique(where: str, ids: I64Array) -> None:
    """Raise :class:`DescriptorError` when a destination block id repeats."""
    if ids.size < 2:
        return
    order = ids.argsort(kind="stable")
    s = ids[order]
    dup = (s[1:] == s[:-1]).nonzero()[0]
    if dup.size:
        k = int(dup[0])
        i, j = sorted((int(order[k]), int(order[k + 1])))
        raise DescriptorError(
            f"{where} repeats destination block {int(s[k])} ({where}[{i}] and {where}[{j}]): "
            "its bytes would be written twice"
        )


def _segments(p: BlockPattern, ids: I64Array) -> Segments:
    offs = (ids[:, None] * np.int64(p.block_stride) + p.offsets[None, :]).ravel()
    return Segments._trusted(offs, np.full(offs.size, p.size, np.int64), p.nbytes * ids.size)


def plan_blocks(
    local: BlockPattern,
    local_ids: I64Array,
    remote: BlockPattern,
    remote_ids: I64Array,
    op: Op,
    limits: DeviceLimits = DEFAULT_LIMITS,
) -> Plan:
    """The work requests moving blocks ``local_ids[i]`` <-> ``remote_ids[i]`` of one
    tensor pair, offsets relative to each tensor's element 0, from the general planner
    (fewest WRs over the whole list). The block lists are checked by the caller
    (:func:`block_ids`, :func:`check_unique`); the patterns must stream as many bytes per
    block (:func:`pair_tensors`)."""
    if local.nbytes != remote.nbytes:
        raise DescriptorError(
            f"blocks differ in size: local {local.nbytes} bytes, remote {remote.nbytes}"
        )
    return plan_transfer(_segments(local, local_ids), _segments(remote, remote_ids), op, limits)


def runs(local_ids: I64Array, remote_ids: I64Array) -> tuple[I64Array, I64Array]:
    """``(start, length)`` of the maximal runs of pairs whose ids both go up by one."""
    n = local_ids.size
    # Plain array methods and operators: a request calls this once, and numpy's
    # function wrappers (diff, append, flatnonzero) cost more than the work at this size.
    breaks = np.empty(n, np.bool_)
    breaks[0] = True
    np.not_equal(local_ids[1:] - local_ids[:-1], 1, out=breaks[1:])
    breaks[1:] |= (remote_ids[1:] - remote_ids[:-1]) != 1
    start = breaks.nonzero()[0].astype(np.int64, copy=False)
    length = np.empty_like(start)
    length[:-1] = start[1:] - start[:-1]
    length[-1] = n - start[-1]
    return start, length


@functools.lru_cache(maxsize=512)
def _run_plan(
    local: BlockPattern, remote: BlockPattern, length: int, op: Op, limits: DeviceLimits
) -> Plan:
    ids = np.arange(length, dtype=np.int64)
    return plan_blocks(local, ids, remote, ids, op, limits)


@dataclass(frozen=True, slots=True, eq=False)
class Tile:
    """One plan laid out ``n`` times: copy ``i`` has its local offsets shifted to
    ``local_base[i]`` and its remote offsets to ``remote_base[i]`` (absolute addresses),
    with keys ``local_key[i]``/``remote_key[i]``. All arrays are int64 of length ``n``.

    The plan moves a run of ``run_length`` blocks of one tensor pair (``remote_pattern``
    is the remote tensor's block). Copies go run by run, each run's tensors together:
    copy ``i`` moves the run that starts at position ``positions[i // tensors]`` of the
    request's block lists, of its ``i % tensors``-th tensor (``tensors = n //
    positions.size``). Tiles made by hand may leave ``positions`` out; the request's
    landed blocks are then unknown."""

    plan: Plan
    local_base: I64Array
    remote_base: I64Array
    local_key: I64Array
    remote_key: I64Array
    positions: I64Array | None = None
    run_length: int = 1
    remote_pattern: BlockPattern | None = None

    @property
    def copies(self) -> int:
        return int(self.local_base.size)


@dataclass(frozen=True, slots=True, eq=False)
class RequestPlan:
    """A request's work requests over many tensors: its tiles, in order, make one chain
    (WRs of tile 0's copies first). ``lengths`` is the shortest and longest SGE length."""

    tiles: tuple[Tile, ...]
    num_wrs: int
    num_sges: int
    nbytes: int
    lengths: tuple[int, int]

    def arrays(self) -> tuple[I64Array, I64Array, I64Array, I64Array, I64Array, I64Array]:
        """The chain in CSR form: ``(wr_remote, wr_key, sge_start, sge_addr, sge_length,
        sge_key)``, addresses absolute (what :meth:`SendChain.fill_tiles` writes)."""
        wr_remote, wr_key, starts, sge_addr, sge_length, sge_key = [], [], [], [], [], []
        base = 0
        for t in self.tiles:
            p, n = t.plan, t.copies
            wr_remote.append((t.remote_base[:, None] + p.wr_remote_offset[None, :]).ravel())
            wr_key.append(np.repeat(t.remote_key, p.num_wrs))
            first = np.arange(n, dtype=np.int64)[:, None] * p.num_sges + p.wr_sge_start[None, :-1]
            starts.append((first + base).ravel())
            sge_addr.append((t.local_base[:, None] + p.sge_local_offset[None, :]).ravel())
            sge_length.append(np.tile(p.sge_length, n))
            sge_key.append(np.repeat(t.local_key, p.num_sges))
            base += n * p.num_sges
        starts.append(np.array([base], dtype=np.int64))
        return (
            np.concatenate(wr_remote),
            np.concatenate(wr_key),
            np.concatenate(starts),
            np.concatenate(sge_addr),
            np.concatenate(sge_length),
            np.concatenate(sge_key),
        )


def plan_request(
    items: Sequence[tuple[BlockPattern, BlockPattern, int, int, int, int]],
    local_ids: I64Array,
    remote_ids: I64Array,
    op: Op,
    limits: DeviceLimits = DEFAULT_LIMITS,
) -> RequestPlan:
    """The tiles of a request: ``items`` are ``(local pattern, remote pattern, local
    element-0 address, remote element-0 address, local key, remote key)``, one per
    tensor.

    The block pairs are cut into runs (:func:`runs`: both ids go up by one), and a run of
    ``L`` blocks is planned as one piece (so consecutive blocks fuse into longer work
    requests wherever both sides are contiguous across them); the plan of ``L`` blocks
    of a pair of patterns is made once and cached, and laid out for every run of that
    length of every tensor with those patterns. Pairs that are not consecutive on both
    sides are never fused.

    The chain goes run by run (all tensors of a run, then the next run; runs of one
    length together), so a request that fails part way has whole blocks behind it
    (:func:`landed_blocks`)."""
    return plan_groups(tensor_groups(items), local_ids, remote_ids, op, limits)


#: Run counts whose key arrays a :class:`TensorGroup` keeps (requests often repeat a count).
_KEYS_KEPT = 4


class TensorGroup:
    """The tensors of a request that share a pair of block patterns: their element-0
    addresses and keys on both sides (int64 arrays, one entry per tensor, in request
    order).  Made by :func:`tensor_groups`; it keeps the key arrays of a tile of ``m``
    runs (each key once per run) for the next request with as many runs."""

    __slots__ = ("local", "remote", "local_base", "remote_base", "local_key", "remote_key",
                 "_keys")  # fmt: skip

    def __init__(self, local: BlockPattern, remote: BlockPattern, rows: I64Array) -> None:
        self.local, self.remote = local, remote
        self.local_base, self.remote_base, self.local_key, self.remote_key = (
            np.ascontiguousarray(c) for c in rows.T
        )
        self._keys: dict[int, tuple[I64Array, I64Array]] = {}

    def keys(self, runs: int) -> tuple[I64Array, I64Array]:
        """The local and remote key of every copy of a tile of ``runs`` runs (read-only)."""
        known = self._keys.get(runs)
        if known is None:
            lk = np.tile(self.local_key, runs)
            rk = np.tile(self.remote_key, runs)
            lk.setflags(write=False)
            rk.setflags(write=False)
            if len(self._keys) >= _KEYS_KEPT:
                self._keys.clear()
            known = self._keys[runs] = (lk, rk)
        return known


def tensor_groups(
    items: Sequence[tuple[BlockPattern, BlockPattern, int, int, int, int]],
) -> list[TensorGroup]:
    """``items`` (as :func:`plan_request` takes them) grouped by their pair of patterns,
    in order of first appearance: what a request's tiles are made of, the same for every
    request between the same tensors (so a caller may keep it)."""
    members: dict[tuple[int, int], list[int]] = {}
    for k, (lp, rp, *_) in enumerate(items):
        members.setdefault((id(lp), id(rp)), []).append(k)
    out = []
    for ks in members.values():
        rows = np.array([items[k][2:6] for k in ks], dtype=np.int64).reshape(len(ks), 4)
        out.append(TensorGroup(items[ks[0]][0], items[ks[0]][1], rows))
    return out


def plan_groups(
    groups: Sequence[TensorGroup],
    local_ids: I64Array,
    remote_ids: I64Array,
    op: Op,
    limits: DeviceLimits = DEFAULT_LIMITS,
) -> RequestPlan:
    """:func:`plan_request` from the request's :func:`tensor_groups`."""
    start, length = runs(local_ids, remote_ids)
    by_length: dict[int, I64Array | None] = {}
    if start.size == local_ids.size:  # no two pairs in a run: all of length 1
        by_length[1] = None  # every run
        lstart, rstart = local_ids, remote_ids
    else:
        lstart, rstart = local_ids[start], remote_ids[start]
        for L in sorted(set(length.tolist())):  # few lengths (np.unique imports numpy.ma)
            by_length[L] = (length == L).nonzero()[0]
    tiles = []
    num_wrs = num_sges = nbytes = 0
    shortest, longest = INT64_MAX, 0
    for g in groups:
        lp, rp = g.local, g.remote
        lstride, rstride = np.int64(lp.block_stride), np.int64(rp.block_stride)
        for L, which in by_length.items():
            p = _run_plan(lp, rp, L, op, limits)
            if which is None:
                lo, ro, positions = lstart * lstride, rstart * rstride, start
            else:
                lo, ro, positions = lstart[which] * lstride, rstart[which] * rstride, start[which]
            m = lo.size
            lk, rk = g.keys(m)
            tiles.append(
                Tile(
                    p,
                    np.add.outer(lo, g.local_base).ravel(),
                    np.add.outer(ro, g.remote_base).ravel(),
                    lk,
                    rk,
                    positions,
                    L,
                    rp,
                )
            )
            copies = lk.size
            num_wrs += copies * p.num_wrs
            num_sges += copies * p.num_sges
            nbytes += copies * p.nbytes
            lo_len, hi_len = p.sge_length_range
            shortest, longest = min(shortest, lo_len), max(longest, hi_len)
    return RequestPlan(tuple(tiles), num_wrs, num_sges, nbytes, (shortest, longest))


def _wr_blocks(plan: Plan, remote: BlockPattern, length: int) -> tuple[I64Array, I64Array]:
    """For each WR of ``plan`` (a run of ``length`` blocks): the first and last block of
    the run (0-based) whose bytes it carries, found from its remote range."""
    pieces = remote.offsets.size
    starts = (
        np.arange(length, dtype=np.int64)[:, None] * np.int64(remote.block_stride)
        + remote.offsets[None, :]
    ).ravel()
    owner = np.repeat(np.arange(length, dtype=np.int64), pieces)
    order = np.argsort(starts, kind="stable")
    starts, owner = starts[order], owner[order]
    first = np.searchsorted(starts, plan.wr_remote_offset, side="right") - 1
    last = np.searchsorted(starts, plan.wr_remote_offset + plan.wr_length - 1, side="right") - 1
    lo = np.empty(plan.num_wrs, np.int64)
    hi = np.empty(plan.num_wrs, np.int64)
    for w in range(plan.num_wrs):
        span = owner[first[w] : last[w] + 1]
        lo[w], hi[w] = span.min(), span.max()
    return lo, hi


def landed_blocks(
    plan: RequestPlan, done: npt.NDArray[np.bool_], num_pairs: int
) -> npt.NDArray[np.bool_]:
    """Which of a request's ``num_pairs`` block pairs have all their bytes moved, given
    ``done[w]``: WR ``w`` of the request's chain has completed. A pair is landed when
    every WR carrying any of its bytes, of every tensor, is done. Raises
    :class:`DescriptorError` for a ``done`` of the wrong size or a plan whose tiles do not
    record their runs."""
    if done.shape != (plan.num_wrs,):
        raise DescriptorError(f"done has shape {done.shape} for a chain of {plan.num_wrs} WRs")
    marks = np.zeros(num_pairs + 1, np.int64)  # +1 where a tainted range starts, -1 past it
    base = 0
    for t in plan.tiles:
        p, n = t.plan, t.copies
        size = n * p.num_wrs
        missing = ~done[base : base + size].reshape(n, p.num_wrs)
        base += size
        if not missing.any():
            continue
        if t.positions is None or t.remote_pattern is None:
            raise DescriptorError("a tile without its runs cannot tell which blocks landed")
        copy, wr = np.nonzero(missing)
        lo, hi = _wr_blocks(p, t.remote_pattern, t.run_length)
        run = t.positions[copy // (n // t.positions.size)]
        np.add.at(marks, run + lo[wr], 1)
        np.add.at(marks, run + hi[wr] + 1, -1)
    landed: npt.NDArray[np.bool_] = np.cumsum(marks[:-1]) == 0
    return landed


def pair_tensors(
    local: KVGeometry,
    remote: KVGeometry,
    tensors: Sequence[int] | range | None,
    heads: tuple[int, int] | None,
    remote_heads: tuple[int, int] | None,
    remote_tensors: Sequence[int] | range | None = None,
) -> list[tuple[int, int, BlockPattern, BlockPattern]]:
    """The tensor pairs to move, ``(local index, remote index, local pattern, remote
    pattern)``: ``tensors`` are indices into the local cache (None: all), paired with the
    same indices of the remote cache, or with ``remote_tensors`` (as many, in order: a
    layer range of one cache into another range of the other). Raises
    :class:`DescriptorError` naming the first mismatch: tensor count, dtype, block shape
    (with the head ranges) or a bad or repeated index."""
    if tensors is None:
        if remote_tensors is not None:
            raise DescriptorError("remote_tensors= needs tensors= (the local side of each pair)")
        if len(local.tensors) != len(remote.tensors):
            raise DescriptorError(
                f"caches hold {len(local.tensors)} tensors here and {len(remote.tensors)} "
                "on the peer: pass tensors= to choose which to move"
            )
        chosen: Sequence[int] = range(len(local.tensors))
    else:
        chosen = tensors
        if len(chosen) == 0:
            raise DescriptorError("tensors= is empty: nothing to move")
    theirs: Sequence[int] = chosen if remote_tensors is None else remote_tensors
    if len(theirs) != len(chosen):
        raise DescriptorError(
            f"tensors= lists {len(chosen)} tensors and remote_tensors= {len(theirs)}: they pair"
        )
    out = []
    seen: set[int] = set()
    seen_remote: set[int] = set()
    for i, j in zip(chosen, theirs, strict=True):
        idx = _int("tensor index", i, 0)
        rdx = _int("remote tensor index", j, 0)
        if idx >= len(local.tensors) or rdx >= len(remote.tensors):
            raise DescriptorError(
                f"tensor {idx} (peer's {rdx}) is outside the caches ({len(local.tensors)} "
                f"tensors here, {len(remote.tensors)} on the peer)"
            )
        if idx in seen or rdx in seen_remote:
            raise DescriptorError(f"tensor {idx} (peer's {rdx}) is listed twice")
        seen.add(idx)
        seen_remote.add(rdx)
        name = f"tensor {idx}" if idx == rdx else f"tensor {idx} (peer's tensor {rdx})"
        lt, rt = local.tensors[idx], remote.tensors[rdx]
        if lt.dtype != rt.dtype or lt.itemsize != rt.itemsize:
            raise DescriptorError(f"{name}: dtype {lt.dtype} vs {rt.dtype} (here vs the peer)")
        try:
            lp = block_pattern(lt, heads)
        except DescriptorError as exc:
            raise DescriptorError(f"{name} here: {exc}") from None
        try:
            rp = block_pattern(rt, remote_heads)
        except DescriptorError as exc:
            raise DescriptorError(f"{name} on the peer: {exc}") from None
        if lp.shape != rp.shape:
            lh = f" heads {heads}" if heads is not None else ""
            rh = f" heads {remote_heads}" if remote_heads is not None else ""
            raise DescriptorError(
                f"{name}: block shape {lp.shape}{lh} vs {rp.shape}{rh} (here vs the "
                f"peer; whole shapes {lt.shape} block_axis {lt.block_axis} vs {rt.shape} "
                f"block_axis {rt.block_axis})"
            )
        out.append((idx, rdx, lp, rp))
    return out
