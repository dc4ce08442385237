"""Chains of send work requests in C memory, written by numpy.

Theory of operation
-------------------
A :class:`SendChain` owns two C arrays made by cffi: ``struct ibv_send_wr[W]``
and ``struct ibv_sge[S]``.  Both are also seen as numpy structured arrays
(:data:`WR_DTYPE`, :data:`SGE_DTYPE`, laid out with cffi's own offsets) over
the same bytes, so filling a chain from a :class:`~hixl.core.plan.Plan` is a
handful of vectorized assignments -- there is no Python object per work
request or per scatter/gather entry.

Layout of a chain holding ``n`` WRs and ``m`` SGEs::

    wrs[i].next    = &wrs[i + 1]          (set once, when the memory is made)
    wrs[n-1].next  = NULL                 (the terminator moves with n)
    wrs[i].sg_list = &sges[start[i]]      (start = the plan's wr_sge_start)
    wrs[i].num_sge = start[i+1] - start[i]

Signalling (:meth:`SendChain.set_signals`): the WRs are cut into groups of
``every`` consecutive requests; the last WR of each group (and the chain's last)
is signaled, and every WR of group ``g`` carries ``wr_id = first_id + g``.  Since
an RC send queue completes in order, one completion frees a whole group, and a WR
that fails mid-group completes (signaled or not) under the id of its own group,
so its error status reaches the transfer that owns it.

A chain is posted piecewise by :meth:`hixl.verbs.adapter.QueuePair.post_chain`, which
cuts the link after the last WR it posts and restores it afterwards.  The
provider copies WRs into its send queue during ``post_send``, so the chain's
memory may be rewritten as soon as that call returns.  A chain must not be
refilled or re-signalled while some of its WRs still wait to be posted.

This module imports no verbs library (cffi's ``ffi`` only allocates memory and
knows the layouts), so chains can be built and checked on any machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from hixl.errors import ArgumentError, DescriptorError, RegistrationError
from hixl.verbs._ffi import address, ffi
from hixl.verbs.chain_memory import ChainMemory
from hixl.verbs.structs import (
    SEND_FENCE,
    SEND_SIGNALED,
    SGE_DTYPE,
    WC_DTYPE,
    WR_BYTES,
    WR_DTYPE,
)

__all__ = [
    "ChainMemory",
    "SEND_FENCE",
    "SEND_SIGNALED",
    "SGE_DTYPE",
    "WC_DTYPE",
    "WR_DTYPE",
    "SendChain",
    "WR_BYTES",
]

#: ``ibv_sge.length`` is 32 bits.
_MAX_SGE_LEN = 0xFFFF_FFFF
_U64 = 0xFFFF_FFFF_FFFF_FFFF
_WR_SIZE = WR_DTYPE.itemsize
_SGE_SIZE = SGE_DTYPE.itemsize
#: Two adjacent 64-bit words copied as raw bytes (:meth:`SendChain.fill`).
_PAIR = np.dtype((np.void, 16))
_LINK_PAIR_AT = 8  # next, then sg_list (checked below)
_SG_PAIR_AT = 16  # sg_list, then num_sge and opcode
_RDMA_PAIR_AT = 40  # wr.rdma.remote_addr, then wr.rdma.rkey
_RADDR_WORD = _RDMA_PAIR_AT // 8
_RKEY_WORD = _RADDR_WORD + 1
#: One whole ``struct ibv_send_wr`` as raw bytes (:meth:`SendChain._format`).
_RECORD = np.dtype((np.void, _WR_SIZE))
#: :attr:`SendChain._flags` when no WR has a flag set (the empty signal pattern).
_NO_FLAGS = (0, 0, 1)
#: cffi's allocator without the memset: for memory whose every byte is written next.
_UNCLEARED = ffi.new_allocator(should_clear_after_alloc=False)
# The C types a chain is made of, parsed once here: cffi parses a type named by a string
# the first time it meets it, which would otherwise cost the first chain about 1.5 ms.
_WR_ARRAY = ffi.typeof("struct ibv_send_wr[]")
_SGE_ARRAY = ffi.typeof("struct ibv_sge[]")
_WR_PTR = ffi.typeof("struct ibv_send_wr *")
_SGE_PTR = ffi.typeof("struct ibv_sge *")


def _as_u64(arr: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """``arr``'s int64 or uint64 values as uint64 (a view, the same bits), else cast."""
    if arr.dtype == np.int64:
        return arr.view(np.uint64)
    if arr.dtype == np.uint64:
        return arr
    return arr.astype(np.uint64)


def _add_u64(values: npt.NDArray[Any], base: np.uint64, out: npt.NDArray[np.uint64]) -> None:
    """``out[:] = values + base`` modulo 2**64: int64 and uint64 values with no cast (an
    int64 seen as uint64 has the same bits, and so has the sum), so that numpy needs no
    casting buffer, which would be a fresh temporary for every call."""
    np.add(_as_u64(values), base, out=out)


class _TileWords(NamedTuple):
    """What :meth:`SendChain.fill_tiles` writes the same for every copy of a plan, for one
    opcode: each WR's ``sg_list`` offset from its copy's first SGE, its ``num_sge |
    opcode << 32`` word, and the SGE lengths as unsigned words."""

    plan: Any  # the plan itself: the cache is keyed by its id, and checks it is the same
    sg_offset: npt.NDArray[np.uint64]
    counts: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint64]


#: :class:`_TileWords` by ``(id(plan), opcode)``; plans are immutable, and a request's
#: plans are reused from the planner's own cache, so a few hundred entries hold them all.
_TILE_WORDS: dict[tuple[int, int], _TileWords] = {}
#: ``arange(copies) * num_sges * SGE size`` by ``(copies, num_sges)``.
_COPY_STEPS: dict[tuple[int, int], npt.NDArray[np.uint64]] = {}
_CACHE_MAX = 256


def _tile_words(plan: Any, opcode: int) -> _TileWords:
    """The :class:`_TileWords` of ``plan`` (made once); raises :class:`DescriptorError`
    for an SGE length that does not fit its C field."""
    key = (id(plan), opcode)
    known = _TILE_WORDS.get(key)
    if known is not None and known.plan is plan:
        return known
    lo, hi = plan.sge_length_range
    if hi > _MAX_SGE_LEN or lo < 0:
        raise DescriptorError(f"SGE lengths must lie in 0..{_MAX_SGE_LEN}, got {lo}..{hi}")
    start = plan.wr_sge_start
    words = _TileWords(
        plan,
        _frozen(start[:-1].astype(np.uint64) * np.uint64(_SGE_SIZE)),
        _frozen(np.diff(start).astype(np.uint64) | np.uint64((opcode & 0xFFFF_FFFF) << 32)),
        _frozen(plan.sge_length.astype(np.uint64)),
    )
    if len(_TILE_WORDS) >= _CACHE_MAX:
        _TILE_WORDS.clear()
    _TILE_WORDS[key] = words
    return words


def _copy_steps(copies: int, num_sges: int) -> npt.NDArray[np.uint64]:
    """Byte offsets of each copy's first SGE from the tile's first (made once per shape)."""
    key = (copies, num_sges)
    steps = _COPY_STEPS.get(key)
    if steps is None:
        steps = _frozen(np.arange(copies, dtype=np.uint64) * np.uint64(num_sges * _SGE_SIZE))
        if len(_COPY_STEPS) >= _CACHE_MAX:
            _COPY_STEPS.clear()
        _COPY_STEPS[key] = steps
    return steps


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.setflags(write=False)
    return a


class SendChain:
    """``capacity`` send WRs and ``sge_capacity`` SGEs in C memory, linked by ``next``.

    ``wrs``/``sges`` are numpy views of the first ``num_wrs``/``num_sges``
    entries (writable; they alias the C memory, and are meant for reading: a fill
    leaves alone what it knows to hold its value already, ``sg_list``/``num_sge``/
    ``opcode`` as its last fill wrote them and ``wr_id``/``send_flags`` that no signal
    call set, so a write to those through a view may outlive the next fill; addresses,
    lengths and keys are always rewritten).  :attr:`head` is the
    ``struct ibv_send_wr *`` of the first WR.  ``regions`` are the memory
    regions the SGEs and remote addresses point into: posting refuses a chain
    whose regions were closed.
    """

    __slots__ = (
        "_flags",
        "_dirty",
        "_group_cache",
        "_head0",
        "_rdma0",
        "_sge0",
        "_sge_addr",
        "_sge_mem",
        "_sge_q",
        "_sges",
        "_wr_mem",
        "_one_each",
        "_one_each_op",
        "_pair_views",
        "_rkey",
        "_rkey_n",
        "_wr_q",
        "_wr_raddr",
        "_wrs",
        "capacity",
        "head",
        "num_sges",
        "num_wrs",
        "regions",
        "sge_base",
        "sge_capacity",
        "wr_base",
    )

    def __init__(self, capacity: int, sge_capacity: int) -> None:
        if capacity < 1 or sge_capacity < 1:
            raise ArgumentError(
                f"a chain needs room for >= 1 WR and >= 1 SGE, got capacity={capacity} "
                f"sge_capacity={sge_capacity}"
            )
        self._make(capacity, sge_capacity, ffi.new)  # zeroed
        if capacity > 1:
            # Every WR links to the next once and for all; only the terminator moves.
            links = self._words()[0][:, 1]
            first = self.wr_base + _WR_SIZE
            links[:] = np.arange(first, first + capacity * _WR_SIZE, _WR_SIZE, dtype=np.uint64)
            links[-1] = 0

    def _make(self, capacity: int, sge_capacity: int, new: Any) -> None:
        """Allocate the C memory with ``new`` (cffi's, zeroed, or :data:`_UNCLEARED`) and
        set the bookkeeping; nothing is linked yet."""
        self.capacity = capacity
        self.sge_capacity = sge_capacity
        self._wr_mem = new(_WR_ARRAY, capacity)
        self._sge_mem = new(_SGE_ARRAY, sge_capacity)
        self.head = ffi.cast(_WR_PTR, self._wr_mem)  # memory owned by _wr_mem
        self._head0 = self.head[0]
        self._rdma0 = self._head0.wr.rdma
        self._sge0 = ffi.cast(_SGE_PTR, self._sge_mem)[0]
        self.wr_base = address(self._wr_mem)
        self.sge_base = address(self._sge_mem)
        # The numpy views are made on first use (:meth:`_views`): a chain of one WR
        # filled through cffi (:meth:`single`) never needs them.
        self._wrs: npt.NDArray[Any] | None = None
        self._sges: npt.NDArray[Any] | None = None
        self._sge_addr: npt.NDArray[Any] | None = None
        self._wr_raddr: npt.NDArray[Any] | None = None
        self._wr_q: npt.NDArray[np.uint64] | None = None
        self._sge_q: npt.NDArray[np.uint64] | None = None
        self._pair_views: tuple[npt.NDArray[Any], npt.NDArray[Any]] | None = None
        # Words 2-3 of WRs 0 .. _one_each-1 point each at its own SGE (sg_list = &sges[i],
        # num_sge = 1) with opcode word _one_each_op: a fill of that form skips them.
        # Whatever else writes sg_list, num_sge or opcode resets _one_each to 0.
        self._one_each = 0
        self._one_each_op = 0
        # WRs _dirty and up have wr_id, send_flags and imm_data 0 (zeroed memory, or a fill
        # since): fill() clears only the WRs below.  Every method here that writes them
        # raises it to past the last WR it wrote.
        self._dirty = 0
        # Word 6 (wr.rdma.rkey and the padding after it) of WRs 0 .. _rkey_n-1 holds _rkey:
        # a fill with that key writes only the remote addresses.  Whatever else writes the
        # key resets _rkey_n to 0.
        self._rkey_n = 0
        self._rkey = 0
        self.num_wrs = 0
        self.num_sges = 0
        self.regions: tuple[Any, ...] = ()
        self._group_cache: tuple[int, int, npt.NDArray[np.uint64]] | None = None
        # None, or (start, stop, every): every WR's send_flags and imm_data are 0 but the
        # signaled WRs of that set_signals pattern (_NO_FLAGS: none).  A fill then clears
        # only those, and set_signals writes only its signaled WRs.  The memory is zeroed
        # or formatted right after this.
        self._flags: tuple[int, int, int] | None = _NO_FLAGS

    @classmethod
    def single(
        cls,
        *,
        opcode: int,
        local_addr: int,
        nbytes: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        regions: tuple[Any, ...] = (),
    ) -> SendChain:
        """A chain of one RDMA WR of one SGE, written through cffi (no numpy): what a
        contiguous put or get of up to one message is.  Unsignaled, ``wr_id`` 0, as
        :meth:`fill` leaves a chain.  The caller checks the values (the planner's
        template did); cffi still refuses one that does not fit its C field."""
        chain = cls(1, 1)
        sge = chain._sge0
        sge.addr = local_addr
        sge.length = nbytes
        sge.lkey = lkey
        w = chain._head0
        w.sg_list = chain._sge_mem
        w.num_sge = 1
        w.opcode = opcode
        rdma = chain._rdma0
        rdma.remote_addr = remote_addr
        rdma.rkey = rkey
        chain.num_wrs = chain.num_sges = 1
        chain.regions = regions
        return chain

    def _wr_buffer(self) -> Any:
        """The C memory of the chain's :attr:`capacity` WRs (its array may be longer,
        see :meth:`shrink`)."""
        return ffi.buffer(self._wr_mem, self.capacity * _WR_SIZE)

    def _sge_buffer(self) -> Any:
        """The C memory of the chain's :attr:`sge_capacity` SGEs."""
        return ffi.buffer(self._sge_mem, self.sge_capacity * _SGE_SIZE)

    def shrink(self, capacity: int, sge_capacity: int) -> None:
        """Use only the first ``capacity`` WRs and ``sge_capacity`` SGEs from now on, as
        if the chain had been made that size: a blank chain made in advance (see
        :meth:`blank`) becomes the chain of a plan of that size.  Its memory stays
        allocated whole until the chain is freed.  Only for a chain not filled yet."""
        if self.num_wrs or not (
            1 <= capacity <= self.capacity and 1 <= sge_capacity <= self.sge_capacity
        ):
            raise ArgumentError(
                f"shrink to {capacity} WRs and {sge_capacity} SGEs: a chain of "
                f"{self.capacity} and {self.sge_capacity} not filled yet can shrink to "
                "1 or more of each, at most its own"
            )
        if capacity == self.capacity and sge_capacity == self.sge_capacity:
            return  # its own size: nothing to cut
        self.capacity, self.sge_capacity = capacity, sge_capacity
        self._one_each = min(self._one_each, capacity)
        self._rkey_n = min(self._rkey_n, capacity)
        self._dirty = min(self._dirty, capacity)
        self._group_cache = None
        # The views made so far, cut to the new size (the same memory).
        if self._wrs is not None and self._sges is not None:
            self._wrs, self._sges = self._wrs[:capacity], self._sges[:sge_capacity]
            self._sge_addr = self._sges["addr"]
            self._wr_raddr = self._wrs["remote_addr"]
        if self._wr_q is not None and self._sge_q is not None:
            self._wr_q, self._sge_q = self._wr_q[:capacity], self._sge_q[:sge_capacity]
        if self._pair_views is not None:
            a, b = self._pair_views
            self._pair_views = (a[:capacity], b[:capacity])

    def _views(
        self,
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
        """The numpy views of the C memory: WRs, SGEs, SGE addresses, remote addresses."""
        wrs, sges = self._wrs, self._sges
        if wrs is None or sges is None:
            wrs = self._wrs = np.frombuffer(self._wr_buffer(), WR_DTYPE)
            sges = self._sges = np.frombuffer(self._sge_buffer(), SGE_DTYPE)
            self._sge_addr = sges["addr"]
            self._wr_raddr = wrs["remote_addr"]
        assert self._sge_addr is not None and self._wr_raddr is not None
        return wrs, sges, self._sge_addr, self._wr_raddr

    def _words(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The C memory as 64-bit words, one row per WR and per SGE (see :meth:`fill`)."""
        q, sq = self._wr_q, self._sge_q
        if q is None or sq is None:
            q = self._wr_q = np.frombuffer(self._wr_buffer(), np.uint64).reshape(
                self.capacity, _WR_SIZE // 8
            )
            sq = self._sge_q = np.frombuffer(self._sge_buffer(), np.uint64).reshape(
                self.sge_capacity, _SGE_SIZE // 8
            )
        return q, sq

    def _pairs(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Words 2-3 and 5-6 of every WR as one 16-byte element each (see :meth:`fill`)."""
        pairs = self._pair_views
        if pairs is None:
            buf = self._wr_buffer()
            pairs = self._pair_views = (
                np.ndarray((self.capacity,), _PAIR, buf, _SG_PAIR_AT, (_WR_SIZE,)),
                np.ndarray((self.capacity,), _PAIR, buf, _RDMA_PAIR_AT, (_WR_SIZE,)),
            )
        return pairs

    def __repr__(self) -> str:
        return (
            f"<SendChain wrs={self.num_wrs}/{self.capacity} "
            f"sges={self.num_sges}/{self.sge_capacity}>"
        )

    @property
    def wrs(self) -> npt.NDArray[Any]:
        """The filled WRs as a structured array (a view of the C memory)."""
        return self._views()[0][: self.num_wrs]

    @property
    def sges(self) -> npt.NDArray[Any]:
        """The filled SGEs as a structured array (a view of the C memory)."""
        return self._views()[1][: self.num_sges]

    def wr_address(self, index: int) -> int:
        """Address of WR ``index`` (what ``bad_wr`` points to when posting stops there)."""
        return self.wr_base + _WR_SIZE * index

    def fill(
        self,
        *,
        opcode: int,
        remote_addr: npt.ArrayLike,
        rkey: int,
        sge_start: npt.ArrayLike,
        sge_addr: npt.ArrayLike,
        sge_length: npt.ArrayLike,
        lkey: int,
        regions: tuple[Any, ...] = (),
    ) -> None:
        """Write a chain of RDMA WRs in CSR form (absolute addresses, in bytes).

        WR ``i`` targets ``remote_addr[i]`` with ``rkey`` and gathers (or scatters
        into) SGEs ``sge_start[i] .. sge_start[i+1]-1`` of ``sge_addr``/``sge_length``
        with ``lkey``.  All WRs start unsignaled with ``wr_id`` 0: see
        :meth:`set_signals`.  Raises :class:`ArgumentError` when the chain is too
        small and :class:`DescriptorError` when the arrays disagree or a value does
        not fit its C field.  The arrays must not be views of this chain's own memory
        (:attr:`wrs`, :attr:`sges`): the fill writes that memory as it goes.
        """
        start = np.asarray(sge_start, dtype=np.int64)
        raddr = np.asarray(remote_addr)
        saddr = np.asarray(sge_addr)
        slen = np.asarray(sge_length)
        n, m = int(raddr.size), int(saddr.size)
        if (
            start.size != n + 1
            or slen.size != m
            or (n and (int(start[0]) != 0 or int(start[-1]) != m))
        ):
            raise DescriptorError(
                f"chain arrays disagree: {n} WRs, {start.size} sge_start entries (want {n + 1}, "
                f"from 0 to {m}), {m} SGE addresses, {slen.size} SGE lengths"
            )
        lengths = (int(slen.min()), int(slen.max())) if m else (0, 0)
        self._write(opcode, raddr, 0, rkey, start, False, saddr, 0, slen, lengths, lkey, regions)

    def fill_plan(
        self,
        plan: Any,
        *,
        opcode: int,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        regions: tuple[Any, ...] = (),
        keep_ids: bool = False,
    ) -> None:
        """Fill from a :class:`hixl.core.plan.Plan` whose offsets are relative to the
        local region at ``local_addr`` and the remote one at ``remote_addr``.

        ``keep_ids``: leave every WR's ``wr_id`` and flags as they are instead of
        clearing them (one pass over the WRs fewer), for a caller that calls
        :meth:`set_signals` over the whole chain before it is posted, which rewrites
        them all."""
        self._write(
            opcode,
            plan.wr_remote_offset,
            remote_addr,
            rkey,
            plan.wr_sge_start,
            # A plan's WRs each have >= 1 SGE, so as many SGEs as WRs means one each.
            plan.num_sges == plan.num_wrs,
            plan.sge_local_offset,
            local_addr,
            plan.sge_length,
            plan.sge_length_range,
            lkey,
            regions,
            keep_ids,
        )

    def _begin(
        self, n: int, keep_ids: bool = False
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Start a fill of ``n`` WRs: restore the old terminator's link, mark the chain
        half-written, and clear ``wr_id`` and the flags where a signal call set them
        (``keep_ids``: leave them; :attr:`_dirty` and :attr:`_flags` still say where
        they are set, for :meth:`set_signals` and the next fill)."""
        q, sq = self._words()
        old = self.num_wrs
        if old and old != n:
            q[old - 1, 1] = self.wr_address(old) if old < self.capacity else 0
        self.num_wrs = self.num_sges = 0  # half-written: not postable until the end
        dirty = self._dirty
        if dirty and not keep_ids:
            w = q[:dirty]
            w[:, 0] = 0
            marks = self._flags
            if marks is None:
                w[:, 4] = 0
            elif marks != _NO_FLAGS:  # only the signaled WRs of a known pattern
                first, stop, every = marks
                flagged = q[first:stop, 4]
                flagged[every - 1 :: every] = 0
                flagged[-1] = 0
            self._dirty = 0
            self._flags = _NO_FLAGS
        return q, sq

    def fill_tiles(self, opcode: int, tiles: Sequence[Any], regions: tuple[Any, ...] = ()) -> None:
        """Fill from :class:`hixl.core.kvblocks.Tile` s: each is a plan laid out at several
        places, copy ``i`` at ``local_base[i]``/``remote_base[i]`` (absolute addresses)
        with its own keys ``local_key[i]``/``remote_key[i]``; the tiles' WRs follow each
        other in order.  Every word is written straight into the chain's memory by
        broadcasting a plan's rows against its copies' bases (no array per WR or SGE in
        between).  Raises :class:`ArgumentError` when the chain is too small and
        :class:`DescriptorError` for a key or length that does not fit its C field."""
        n = sum(t.copies * t.plan.num_wrs for t in tiles)
        m = sum(t.copies * t.plan.num_sges for t in tiles)
        if n < 1:
            raise DescriptorError("a chain needs at least one work request, got 0")
        if n > self.capacity or m > self.sge_capacity:
            raise ArgumentError(
                f"chain too small: {n} WRs and {m} SGEs into capacity={self.capacity} "
                f"sge_capacity={self.sge_capacity}"
            )
        words = []
        for t in tiles:
            words.append(_tile_words(t.plan, opcode))
            # one pass for both: a negative key has its high bits set too
            if ((t.remote_key | t.local_key) >> 32).any():
                bad = t.remote_key if (t.remote_key >> 32).any() else t.local_key
                name = "remote" if bad is t.remote_key else "local"
                raise DescriptorError(f"{name} keys must be 32-bit")
        q, sq = self._begin(n)
        w0 = s0 = 0
        for t, tw in zip(tiles, words, strict=True):
            p, c = t.plan, t.copies
            nw, ns = p.num_wrs, p.num_sges
            wr = q[w0 : w0 + c * nw]
            # sg_list = &sges[s0 + i*ns + start[j]]; num_sge | opcode << 32
            first = _copy_steps(c, ns) + np.uint64(self.sge_base + s0 * _SGE_SIZE)
            np.add(first[:, None], tw.sg_offset[None, :], out=wr[:, 2].reshape(c, nw))
            wr[:, 3].reshape(c, nw)[:] = tw.counts
            np.add(
                t.remote_base[:, None],
                p.wr_remote_offset[None, :],
                out=wr[:, _RADDR_WORD].reshape(c, nw),
                casting="unsafe",
            )
            wr[:, _RKEY_WORD].reshape(c, nw)[:] = t.remote_key[:, None]  # keys checked above
            sg = sq[s0 : s0 + c * ns]
            np.add(
                t.local_base[:, None],
                p.sge_local_offset[None, :],
                out=sg[:, 0].reshape(c, ns),
                casting="unsafe",
            )
            # length | lkey << 32; a key below 2**32 shifted as int64 has the same bits
            shifted = (t.local_key << 32).view(np.uint64)
            np.bitwise_or(tw.lengths[None, :], shifted[:, None], out=sg[:, 1].reshape(c, ns))
            w0 += c * nw
            s0 += c * ns
        self._one_each = 0
        self._rkey_n = 0
        q[n - 1, 1] = 0
        self.num_wrs, self.num_sges = n, m
        self.regions = regions

    def _write(
        self,
        opcode: int,
        raddr: npt.NDArray[Any],
        rbase: int,
        rkey: int,
        start: npt.NDArray[np.int64],
        one_each: bool,
        saddr: npt.NDArray[Any],
        sbase: int,
        slen: npt.NDArray[Any],
        lengths: tuple[int, int],
        lkey: int,
        regions: tuple[Any, ...],
        keep_ids: bool = False,
    ) -> None:
        """:meth:`fill` with the addresses as offsets from ``rbase``/``sbase`` and
        ``start`` consistent with them; ``one_each``: WR ``i`` has SGE ``i`` alone;
        ``lengths``: the shortest and longest of ``slen``; ``keep_ids``: see
        :meth:`fill_plan`."""
        n, m = int(raddr.size), int(saddr.size)
        if n < 1:
            raise DescriptorError("a chain needs at least one work request, got 0")
        if n > self.capacity or m > self.sge_capacity:
            raise ArgumentError(
                f"chain too small: {n} WRs and {m} SGEs into capacity={self.capacity} "
                f"sge_capacity={self.sge_capacity}"
            )
        shortest, longest = lengths
        if longest > _MAX_SGE_LEN or shortest < 0:
            raise DescriptorError(
                f"SGE lengths must lie in 0..{_MAX_SGE_LEN}, got {shortest}..{longest}"
            )
        if not (0 <= rkey <= 0xFFFF_FFFF and 0 <= lkey <= 0xFFFF_FFFF):
            raise DescriptorError(f"keys must be 32-bit: rkey={rkey:#x} lkey={lkey:#x}")
        q, sq = self._begin(n, keep_ids)
        # Strided passes over the WRs (one cache line per WR each, whatever the width
        # written): words 2-3 (sg_list; num_sge | opcode << 32) and words 5-6
        # (wr.rdma.remote_addr; wr.rdma.rkey and the union's padding after it), each pair
        # stored as one 16-byte element from a contiguous (n, 2) array worked out first.
        # That array is the chain's own SGE memory (room for n SGEs of 16 bytes, written
        # with the SGEs right after): touched already, so no fresh temporary and no page
        # faults.  Words 0 (wr_id) and 4 (send_flags | imm_data) only when a signal was
        # set since the last fill (word 4 only at the signaled WRs when the flags are a
        # known pattern), words 2-3 not when they hold one SGE per WR for this opcode
        # already, word 6 not when every WR holds the key already (then the remote
        # addresses go straight into their column).  An SGE is two words: addr,
        # length | lkey << 32.  int64 offsets are added as uint64 (the same bits, so the
        # same sums modulo 2**64): no cast, so no casting buffers.  The word offsets are
        # checked at import.
        sg_words, rdma_words = self._pairs()
        # (A chain with WRs of no SGE may have fewer SGEs than WRs: then a temporary.)
        pair = sq[:n] if n <= self.sge_capacity else np.empty((n, 2), np.uint64)
        op_word = (opcode & 0xFFFF_FFFF) << 32
        if not one_each:
            ustart = _as_u64(start)
            np.multiply(ustart[:-1], np.uint64(_SGE_SIZE), out=pair[:, 0])
            pair[:, 0] += np.uint64(self.sge_base)
            np.subtract(ustart[1:], ustart[:-1], out=pair[:, 1])
            if op_word:
                pair[:, 1] |= np.uint64(op_word)
            sg_words[:n] = pair.view(_PAIR).reshape(n)
            self._one_each = 0
        elif self._one_each < n or self._one_each_op != op_word:
            sb = self.sge_base
            pair[:, 0] = np.arange(sb, sb + n * _SGE_SIZE, _SGE_SIZE, dtype=np.uint64)
            pair[:, 1] = op_word | 1
            sg_words[:n] = pair.view(_PAIR).reshape(n)
            self._one_each, self._one_each_op = n, op_word
        rb = np.uint64(rbase & _U64)
        if self._rkey == rkey and self._rkey_n >= n:  # the keys are in place
            _add_u64(raddr, rb, q[:n, _RADDR_WORD])
        else:
            _add_u64(raddr, rb, pair[:, 0])
            pair[:, 1] = rkey
            rdma_words[:n] = pair.view(_PAIR).reshape(n)
            self._rkey_n = max(self._rkey_n, n) if self._rkey == rkey else n
            self._rkey = rkey
        s = sq[:m]
        _add_u64(saddr, np.uint64(sbase & _U64), s[:, 0])
        if shortest == longest:  # one length (a layer's rows): one store per SGE, no read
            s[:, 1] = shortest | lkey << 32
        else:
            np.bitwise_or(_as_u64(slen), np.uint64(lkey << 32), out=s[:, 1])
        q[n - 1, 1] = 0
        self.num_wrs, self.num_sges = n, m
        self.regions = regions

    @classmethod
    def for_plan(
        cls,
        plan: Any,
        *,
        opcode: int,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        regions: tuple[Any, ...] = (),
        memory: ChainMemory | None = None,
    ) -> SendChain:
        """A new chain sized for ``plan`` and filled from it (see :meth:`fill_plan`).

        It reads exactly as ``SendChain(plan.num_wrs, plan.num_sges)`` filled by
        :meth:`fill_plan`, but its memory is written once instead of zeroed first: see
        :meth:`_format`.  ``memory``: where its arrays come from (default: the C heap)."""
        chain = cls.__new__(cls)
        new = _UNCLEARED if memory is None else memory.allocator
        chain._make(max(plan.num_wrs, 1), max(plan.num_sges, 1), new)
        chain._format(opcode, rkey, plan.num_sges == plan.num_wrs)
        chain.fill_plan(
            plan,
            opcode=opcode,
            local_addr=local_addr,
            lkey=lkey,
            remote_addr=remote_addr,
            rkey=rkey,
            regions=regions,
        )
        return chain

    @classmethod
    def blank(
        cls,
        capacity: int,
        sge_capacity: int,
        opcode: int = 0,
        memory: ChainMemory | None = None,
        one_each: bool = False,
    ) -> SendChain:
        """A new chain of this capacity, its WRs formatted and linked and nothing filled:
        what :meth:`fill_tiles` and :meth:`fill_plan` write into (its memory is written
        once, not zeroed first; see :meth:`_format`).  ``memory``: where its arrays come
        from (default: the C heap).  ``one_each``: WR ``i`` points at SGE ``i`` alone
        with ``opcode`` (needs ``sge_capacity >= capacity``), so that a fill from a plan
        of one SGE per WR with that opcode leaves those words alone."""
        if capacity < 1 or sge_capacity < 1:
            raise ArgumentError(
                f"a chain needs room for >= 1 WR and >= 1 SGE, got capacity={capacity} "
                f"sge_capacity={sge_capacity}"
            )
        chain = cls.__new__(cls)
        chain._make(capacity, sge_capacity, _UNCLEARED if memory is None else memory.allocator)
        chain._format(opcode, 0, one_each)
        if one_each:  # made for fill_plan: its numpy views too
            chain._words()
            chain._pairs()
        return chain

    def _format(self, opcode: int, rkey: int, one_each: bool) -> None:
        """Write every byte of every WR of memory fresh from :data:`_UNCLEARED`, in two
        passes: one contiguous store of a prototype WR (zeros; ``rkey``; and, when
        ``one_each``, one SGE and ``opcode``), then the words that differ per WR --
        ``next`` and, when ``one_each``, ``sg_list = &sges[i]``.  What a fill then writes
        besides is the remote addresses (one column) and the SGEs: three passes over the
        WRs, where ``__init__``'s path and a first fill make four (a memset, the links,
        the two pairs).  The SGE memory is left as it came: a fill writes the SGEs it
        uses."""
        cap = self.capacity
        one_each = one_each and self.sge_capacity >= cap
        op_word = (opcode & 0xFFFF_FFFF) << 32
        rkey &= 0xFFFF_FFFF  # a bad key is refused by the fill that follows
        proto = np.zeros(_WR_SIZE // 8, np.uint64)
        proto[_RKEY_WORD] = rkey
        if one_each:
            proto[_SG_PAIR_AT // 8 + 1] = op_word | 1
        buf = ffi.buffer(self._wr_mem)
        np.frombuffer(buf, _RECORD)[:] = proto.view(_RECORD)[0]
        pair = np.empty((cap, 2), np.uint64)
        first = self.wr_base + _WR_SIZE
        pair[:, 0] = np.arange(first, first + cap * _WR_SIZE, _WR_SIZE, dtype=np.uint64)
        pair[-1, 0] = 0
        if one_each:
            sb = self.sge_base
            pair[:, 1] = np.arange(sb, sb + cap * _SGE_SIZE, _SGE_SIZE, dtype=np.uint64)
            self._one_each, self._one_each_op = cap, op_word
        else:
            pair[:, 1] = 0
        links = np.ndarray((cap,), _PAIR, buf, _LINK_PAIR_AT, (_WR_SIZE,))
        links[:] = pair.view(_PAIR).reshape(cap)
        self._rkey_n, self._rkey = cap, rkey

    def shift(self, local_by: int, remote_by: int) -> None:
        """Move every SGE address by ``local_by`` and every remote address by ``remote_by``
        bytes (either may be negative): the same layout at other offsets of the same
        regions.  The caller checks that the moved chain stays inside its regions."""
        if local_by:
            if self.num_sges == 1:  # one SGE: cheaper through cffi than numpy
                sge = self._sge_mem[0]
                sge.addr = (sge.addr + local_by) & _U64
            else:
                addr = self._views()[2][: self.num_sges]
                np.add(addr, np.uint64(local_by & _U64), out=addr)
        if remote_by:
            if self.num_wrs == 1:
                rdma = self._wr_mem[0].wr.rdma
                rdma.remote_addr = (rdma.remote_addr + remote_by) & _U64
            else:
                raddr = self._views()[3][: self.num_wrs]
                np.add(raddr, np.uint64(remote_by & _U64), out=raddr)

    def set_signals(
        self, first_id: int, every: int, start: int = 0, stop: int | None = None
    ) -> int:
        """Cut WRs ``start .. stop-1`` into groups of ``every``; signal each group's last WR.

        Every WR of group ``g`` gets ``wr_id = first_id + g``.  Returns the number of
        groups, ``ceil((stop - start) / every)``.  Only these two fields change, so a
        chain built once is reused by calling this again with new ids.
        """
        n = self.num_wrs
        stop = n if stop is None else stop
        if not 0 <= start < stop <= n:
            raise ArgumentError(f"set_signals: WRs {start}..{stop} outside the chain's 0..{n}")
        if every < 1:
            raise ArgumentError(f"signal interval must be >= 1 WR, got {every}")
        m = stop - start
        if first_id < 0 or first_id + (m - 1) // every > 0xFFFF_FFFF_FFFF_FFFF:
            raise ArgumentError(f"wr_id {first_id} does not fit 64 bits for {m} WRs")
        dirty = self._dirty
        self._dirty = max(dirty, stop)
        marks = self._flags
        if m == 1:  # a single WR (notifications): no arrays needed
            w1 = self.head[start]
            w1.wr_id, w1.send_flags = first_id, SEND_SIGNALED
            self._flags = (start, stop, 1) if marks in (_NO_FLAGS, (start, stop, 1)) else None
            return 1
        cache = self._group_cache
        if cache is None or cache[0] != m or cache[1] != every:
            cache = (m, every, np.arange(m, dtype=np.uint64) // np.uint64(every))
            self._group_cache = cache
        w = self._views()[0][start:stop]
        np.add(cache[2], np.uint64(first_id), out=w["wr_id"])
        if marks != (start, stop, every):  # a reused chain keeps its flags
            flags = w["send_flags"]
            if marks != _NO_FLAGS:
                flags[:] = 0
            flags[every - 1 :: every] = SEND_SIGNALED
            flags[m - 1] = SEND_SIGNALED
            # Known everywhere only when no WR outside the range can hold a flag.
            known = (
                marks == _NO_FLAGS
                or (start == 0 and stop >= dirty)
                or (marks is not None and start <= marks[0] and marks[1] <= stop)
            )
            self._flags = (start, stop, every) if known else None
        return (m + every - 1) // every

    def signal_one(self, wr_id: int) -> None:
        """:meth:`set_signals` for a chain of one WR: signaled, under ``wr_id``."""
        if self.num_wrs != 1:
            raise ArgumentError(f"signal_one on a chain of {self.num_wrs} WRs")
        w = self._head0
        w.wr_id = wr_id
        w.send_flags = SEND_SIGNALED
        self._flags = (0, 1, 1) if self._flags in (_NO_FLAGS, (0, 1, 1)) else None
        self._dirty = max(self._dirty, 1)

    def place_one(self, local_addr: int, nbytes: int, remote_addr: int) -> None:
        """Point a filled chain of one WR and one SGE at new addresses and a new length.

        Three stores into the C structs (no numpy): the hot path of a
        :class:`~hixl.engine.channel.Channel`, whose caller has checked the values.
        """
        if self.num_wrs != 1 or self.num_sges != 1:
            raise ArgumentError(
                f"place_one on a chain of {self.num_wrs} WRs and {self.num_sges} SGEs"
            )
        sge = self._sge0
        sge.addr = local_addr
        sge.length = nbytes
        self._rdma0.remote_addr = remote_addr

    def unsignal(self, index: int) -> None:
        """Post WR ``index`` unsignaled: a later signaled WR's completion stands for it.

        Used when several transfers go out in one post: only the last is signaled.
        Call after :meth:`set_signals`, which rewrites the flags.
        """
        if not 0 <= index < self.num_wrs:
            raise ArgumentError(f"unsignal: WR {index} outside the chain's 0..{self.num_wrs}")
        self.head[index].send_flags &= ~SEND_SIGNALED
        self._flags = None
        self._dirty = max(self._dirty, index + 1)

    def signal(self, index: int) -> None:
        """Post WR ``index`` signaled (its ``wr_id`` unchanged): where a batch ends."""
        if not 0 <= index < self.num_wrs:
            raise ArgumentError(f"signal: WR {index} outside the chain's 0..{self.num_wrs}")
        self.head[index].send_flags |= SEND_SIGNALED
        self._flags = None
        self._dirty = max(self._dirty, index + 1)

    def fence(self, index: int) -> None:
        """Make WR ``index`` wait for every earlier READ to complete (``IBV_SEND_FENCE``).

        Call after :meth:`set_signals`, which rewrites the flags.
        """
        if not 0 <= index < self.num_wrs:
            raise ArgumentError(f"fence: WR {index} outside the chain's 0..{self.num_wrs}")
        self.head[index].send_flags |= SEND_FENCE
        self._flags = None
        self._dirty = max(self._dirty, index + 1)

    def check_regions(self) -> None:
        """Raise :class:`RegistrationError` when a region the chain uses was closed."""
        for region in self.regions:
            if region.closed:
                raise RegistrationError(
                    f"work request chain refers to a closed memory region {region!r}; "
                    "it cannot be posted"
                )


_WR_FIELDS = WR_DTYPE.fields
assert _WR_FIELDS is not None
if (
    _WR_FIELDS["next"][1] != _LINK_PAIR_AT
    or _WR_FIELDS["sg_list"][1] != _SG_PAIR_AT
    or _WR_FIELDS["remote_addr"][1] != _RDMA_PAIR_AT
):  # pragma: no cover - a libibverbs ABI change
    raise ImportError("struct ibv_send_wr: next, sg_list or wr.rdma not where SendChain writes")
# SendChain.fill writes 64-bit words: a little-endian machine, the SGE's length and
# lkey in its second word.
_SGE_FIELDS = SGE_DTYPE.fields
assert _SGE_FIELDS is not None
if sys.byteorder != "little" or (
    _SGE_FIELDS["addr"][1],
    _SGE_FIELDS["length"][1],
    _SGE_FIELDS["lkey"][1],
    _SGE_SIZE,
) != (0, 8, 12, 16):  # pragma: no cover - a libibverbs ABI change
    raise ImportError("struct ibv_sge is not laid out as addr, length, lkey in 16 bytes")
del _WR_FIELDS, _SGE_FIELDS
