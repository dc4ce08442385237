"""From transfer requests to work-request chains: checks, cached plans and chains, notifications.

A request is checked, planned (:mod:`hixl.core.plan`, cached per pair of descriptor
shapes, see :func:`hixl.core.shapes.place`) and written into a
:class:`~hixl.verbs.chain.SendChain` -- C arrays of ``ibv_send_wr``/``ibv_sge`` filled
by numpy, no Python object per work request.  Built
chains are reused: a chain whose WRs are all posted goes back to a pool keyed by the
shapes and the regions' addresses and keys, and the next request with the same layout
takes it and shifts its addresses to its own offsets (the engine rewrites its ``wr_id``s).

``build`` runs without the engine lock: it reads only immutable values (a region's
keys, the peer's announced region tuple) and the caches, whose dict and list
operations are atomic.  A chain taken from the pool belongs to one transfer until
:meth:`Planner.give_back`.  The poster does not pool the chains it posted itself: it
hands each batch's chunks over with one append (:meth:`Planner.posted`), and a thread
that finds the pool empty pools them, so that per-chain work is paid by the callers,
not by the thread that also does rxe's sending.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hixl.core import notify, wire
from hixl.core.descriptors import ContiguousDesc, Descriptor, StridedDesc, as_segments
from hixl.core.plan import (
    DeviceLimits,
    Op,
    Plan,
    check_alignment,
    check_bounds,
    plan_transfer,
)
from hixl.core.shapes import Placement, place, plan_shapes, shift_plan
from hixl.core.wire import RemoteRegion
from hixl.engine.regions import Access, Region
from hixl.errors import ArgumentError, RegistrationError, StateError
from hixl.verbs import adapter as verbs
from hixl.verbs.chain import ChainMemory, SendChain

if TYPE_CHECKING:
    from hixl.core.window import Chunk
    from hixl.engine.connection import Connection
    from hixl.engine.handles import TransferRequest

__all__ = [
    "Built",
    "NotifySlots",
    "PLAN_CACHE",
    "Planner",
    "Template",
    "chain_capacity",
    "ranges_key",
    "resolve_remote",
    "signal_interval",
]

PLAN_CACHE = 512  # planned (descriptor pair, region sizes) kept per engine
# Bytes of idle built chains kept per engine (ChainMemory.chain_bytes: WR and SGE arrays in
# their blocks): past it, the idle chains of the layouts pooled first are dropped.
CHAIN_CACHE_BYTES = 32 << 20
CHAIN_WRS_PER_KEY = 4096  # WRs of idle chains kept for one layout (at least 4 chains)
POSTED_BATCHES = 64  # posted batches whose chains wait to be pooled (older ones are dropped)
SIZED_KEYS = 64  # layouts remembered per chain size for refilling (older ones are dropped)
SIZED_SIZES = 256  # chain sizes indexed for refilling (the index starts over past this)
# Bytes of chain memory touched when the engine is made: room for the blank chain below
# (8192 WRs and SGEs: 1.1 MiB) and beside it one more chain of 1.5 MiB, e.g. a 32-layer
# KV request of 64 blocks with a quarter of the heads (4096 WRs, 65536 SGEs).
CHAIN_RESERVE = 4 << 20
CHAIN_BLANK = 8192  # WRs (and SGEs) of the chain formatted in that memory when the engine is made


def chain_capacity(count: int) -> int:
    """The WRs (or SGEs) of a chain pooled by its size alone for ``count`` of them: the
    next power of two (a chain's arrays take blocks of power-of-two sizes anyway, see
    :class:`ChainMemory`)."""
    return 1 << (count - 1).bit_length()


def signal_interval(sq_depth: int) -> int:
    """WRs per signaled group: an eighth of the send queue, 16 to 256.

    A completion frees its whole group's send-queue slots, so several groups must fit in
    the queue at once; fewer completions mean less Python per transfer.
    """
    return max(16, min(256, sq_depth // 8))


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a microsecond per request
class Built:
    """One request as a filled chain: its byte count and the key it goes back under."""

    chain: SendChain
    nbytes: int
    key: tuple[Any, ...] | None  # None: built for this request only (unhashable descriptors)
    bases: tuple[int, int]  # the local and remote addresses the chain's plan starts from
    # Cut over several lanes: one entry per part, popped as each part's post is handed
    # back; the part that pops True (the last) pools the chain.  None: one part.
    parts: list[bool] | None = None


@dataclass(slots=True, frozen=True)
class Template:
    """A checked single request, kept so that repeating it skips the checks and planning.

    Valid while ``conn`` is the peer's connection, the peer's announced regions are the
    very tuple ``remotes`` (any REGIONS change swaps it) and ``local`` is open: bounds,
    access and alignment depend only on the descriptors and the regions' immutable
    fields, so they still hold.  ``remote`` is the peer's region the request resolved
    to; a template of two :class:`~hixl.core.descriptors.ContiguousDesc` is also used at
    other offsets of the same regions (see :meth:`Planner.rebuild`), with the bounds and
    alignment checked per call.
    """

    conn: Connection
    remotes: tuple[RemoteRegion, ...]
    local: Region
    remote: RemoteRegion
    plan: Plan
    opcode: int
    key: tuple[Any, ...]
    local_addr: int
    remote_addr: int
    rkey: int
    lkey: int
    nbytes: int
    num_wrs: int
    # A plan of one WR of one SGE: (local offset, bytes, remote offset) from the bases,
    # for building its chain through cffi alone (:meth:`SendChain.single`); else None.
    single: tuple[int, int, int] | None = None
    # The engine's lent channel for repeating it blocking on the direct lane (made on
    # first use by SinglePaths._on_lane; a holder, since the template is frozen).
    lane: list[Any] = field(default_factory=list)
    # The engine's functions for its lane's ring, made on first use: [the one that queues
    # it at given addresses (SinglePaths._ring_enqueuer), and, once put_async/get_async kept it
    # (SinglePaths._remember_ring), the peer's region as named by the call and the runner for
    # calls of that form (SinglePaths._ring_runner)].
    ring: list[Any] = field(default_factory=list)


class Planner:
    """Checks requests against regions and policy, and turns them into work requests.

    The plan depends only on (op, the two descriptor shapes), and KV transfers repeat the
    same layout layer after layer and offset after offset, so each is planned once;
    bounds and alignment are checked per call.  Block lists that are not a strided shape
    are planned every time.
    """

    def __init__(self, limits: DeviceLimits, alignment: int | None) -> None:
        self.limits = limits
        self.alignment = alignment
        # New chains take their memory from here: touched once, when the engine is made,
        # and taken back when a chain is freed, so a first transfer pays no page faults.
        self.memory = ChainMemory(CHAIN_RESERVE)
        self._warm_up()
        # One chain formatted in that memory now (links, one SGE per WR, WRITE): the
        # first plan whose chain would take memory of that size class (more than half
        # as many WRs) takes it, cut to its size, instead of formatting a new chain
        # (see _chain_for).  A list: taken by one atomic pop.
        self._blank = [
            SendChain.blank(
                CHAIN_BLANK, CHAIN_BLANK, verbs.WR_RDMA_WRITE, self.memory, one_each=True
            )
        ]
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self._chains: dict[tuple[Any, ...], list[Built]] = {}  # idle chains by layout
        self._chain_bytes = 0  # bytes held by idle chains (approximate: no lock)
        # Layouts that were given idle chains, by the chains' (WR, SGE) capacity, newest
        # last: a request of a new layout refills an idle chain of its size instead of
        # allocating one (see _take_sized).  Entries may be stale (that pool emptied).
        self._sized: dict[tuple[int, int], deque[tuple[Any, ...]]] = {}
        self.chains_built = 0  # chains allocated for a plan (approximate: no lock)
        self.chains_refilled = 0  # idle chains of another layout refilled for a plan
        # Chunks of posted batches whose chains are not pooled yet (see posted()).
        self._posted: deque[list[Chunk]] = deque(maxlen=POSTED_BATCHES)

    def close(self) -> None:
        """Drop every cached plan and idle chain and give the chain memory back (its
        reserve as soon as no chain made in it is left).  For the engine's close, after
        its regions were closed: chains of closed regions are never pooled again."""
        self._posted.clear()
        self._chains.clear()
        self._sized.clear()
        self._plans.clear()
        self._blank.clear()
        self._chain_bytes = 0
        self.memory.close()

    def _warm_up(self) -> None:
        """Plan, build, refill and signal one small chain, then drop it: the first run
        of this code in a process costs several times a later one (numpy's and cffi's
        first calls), and the engine pays that here rather than in its first transfer."""
        desc = StridedDesc(offset=0, count=64, size=256, stride=320, alignment=None)
        plan = plan_transfer(desc, desc, Op.WRITE, self.limits)
        # A layer's plan of the blank chain's size: what it shares with every plan of
        # that many rows (their SGE starts, 0 .. n) is made now, not by the first layer.
        rows = StridedDesc(offset=0, count=CHAIN_BLANK, size=256, stride=320, alignment=None)
        plan_transfer(rows, rows, Op.WRITE, self.limits)
        kw: dict[str, Any] = {"opcode": verbs.WR_RDMA_WRITE, "local_addr": 0, "lkey": 0}
        chain = SendChain.for_plan(
            shift_plan(plan, 0, 0), remote_addr=0, rkey=0, memory=self.memory, **kw
        )
        chain.set_signals(1, 16)
        chain.fill_plan(plan, remote_addr=64, rkey=1, **kw)
        chain.shift(64, 64)

    def template(self, conn: Connection, req: TransferRequest, built: Built) -> Template | None:
        """What :meth:`rebuild` needs to repeat ``req`` (just built); None if not cacheable."""
        plan = self._plans.get(built.key[0]) if built.key is not None else None
        if plan is None or built.key is None:
            return None
        remote = resolve_remote(conn, req.remote, "")
        single = None
        if plan.num_wrs == 1 and plan.num_sges == 1:
            single = (
                int(plan.sge_local_offset[0]),
                int(plan.sge_length[0]),
                int(plan.wr_remote_offset[0]),
            )
        return Template(
            conn=conn,
            remotes=conn.remote_regions,
            local=req.local,
            remote=remote,
            plan=plan,
            opcode=verbs.WR_RDMA_WRITE if req.op == "write" else verbs.WR_RDMA_READ,
            key=built.key,
            local_addr=built.bases[0],
            remote_addr=built.bases[1],
            rkey=remote.rkey,
            lkey=req.local.lkey,
            nbytes=built.nbytes,
            num_wrs=built.chain.num_wrs,
            single=single,
        )

    def at_offsets(
        self, t: Template, ldesc: ContiguousDesc, rdesc: ContiguousDesc
    ) -> tuple[int, int] | None:
        """The local and remote addresses of ``t``'s plan moved to these ranges' offsets
        (``t`` is the template of two ranges of these sizes between the same regions, see
        :func:`ranges_key`), or None when a range leaves its region or breaks the
        alignment policy: the rules of :meth:`_placed` for a contiguous shape, in four
        comparisons.  None means: plan the request as it is, which raises what is wrong.
        """
        lo, ro, align = ldesc.offset, rdesc.offset, self.alignment
        if (
            lo + ldesc.nbytes <= t.local.length
            and ro + rdesc.nbytes <= t.remote.length
            and not (align and (lo % align or ro % align))
        ):
            return t.local.addr + lo, t.remote.addr + ro
        return None

    def rebuild(self, t: Template, local_addr: int, remote_addr: int) -> Built:
        """The chain of a :class:`Template`'s plan placed at ``local_addr`` and
        ``remote_addr`` (the template's own, or checked by the caller): a pooled chain,
        shifted, or one built anew."""
        idle = self._take_idle(t.key)
        if idle is not None:
            la, ra = idle.bases
            if la == local_addr and ra == remote_addr:
                return idle  # the very same request again
            idle.chain.shift(local_addr - la, remote_addr - ra)
            return Built(idle.chain, t.nbytes, t.key, (local_addr, remote_addr))
        one = t.single
        if one is not None:  # a twelfth of for_plan's cost: no numpy
            chain = SendChain.single(
                opcode=t.opcode,
                local_addr=local_addr + one[0],
                nbytes=one[1],
                lkey=t.local.lkey,
                remote_addr=remote_addr + one[2],
                rkey=t.rkey,
                regions=(t.local,),
            )
            return Built(chain, t.nbytes, t.key, (local_addr, remote_addr))
        chain = self._chain_for(
            t.plan, t.opcode, local_addr, t.local.lkey, remote_addr, t.rkey, t.local
        )
        return Built(chain, t.nbytes, t.key, (local_addr, remote_addr))

    def build(self, owner: object, conn: Connection, req: TransferRequest, index: int) -> Built:
        """The filled chain of one request; raises before anything is posted."""
        where = f"request {index}"
        if req.op not in ("write", "read"):
            raise ArgumentError(f"{where}: op must be 'write' or 'read', not {req.op!r}")
        op = Op.WRITE if req.op == "write" else Op.READ
        local = req.local
        if not isinstance(local, Region) or local.engine is not owner or local.closed:
            raise RegistrationError(
                f"{where}: local memory is not a region registered with this engine: {local!r}"
            )
        if op is Op.READ and not local.access & Access.LOCAL_WRITE:
            raise RegistrationError(
                f"{where}: get needs a local region with LOCAL_WRITE access; {local!r}"
            )
        remote = resolve_remote(conn, req.remote, where)
        need = wire.REMOTE_WRITE if op is Op.WRITE else wire.REMOTE_READ
        if not remote.access & need:
            verb = "writable" if op is Op.WRITE else "readable"
            raise RegistrationError(
                f"{where}: peer region {remote.name or hex(remote.addr)} "
                f"(length={remote.length}) is not remotely {verb}"
            )
        ldesc, rdesc = req.local_desc, req.remote_desc
        opcode = verbs.WR_RDMA_WRITE if op is Op.WRITE else verbs.WR_RDMA_READ
        placed = self._placed(ldesc, rdesc, op, opcode, local, remote, where)
        if placed is None:  # not a shape (block lists, Segments): planned as it is
            plan, pkey = self._cached(op, ldesc, rdesc, local, remote, where)
            lbase = rbase = 0
        else:
            plan, pkey, lbase, rbase = placed
        local_addr, remote_addr = local.addr + lbase, remote.addr + rbase
        key = None
        if pkey is not None:
            key = (pkey, local.addr, local.lkey, remote.addr, remote.rkey)
            idle = self._take_idle(key)
            if idle is not None and not local.closed:  # the chain's one region
                la, ra = idle.bases
                idle.chain.shift(local_addr - la, remote_addr - ra)
                return Built(idle.chain, plan.nbytes, key, (local_addr, remote_addr))
        chain = self._chain_for(
            plan, opcode, local_addr, local.lkey, remote_addr, remote.rkey, local, key is None
        )
        return Built(chain, plan.nbytes, key, (local_addr, remote_addr))

    def _chain_for(
        self,
        plan: Plan,
        opcode: int,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        local: Region,
        by_size: bool = False,
    ) -> SendChain:
        """``plan``'s chain when no idle chain of its layout is pooled: an idle chain of
        another layout with as many WRs and SGEs, filled anew (no allocation: a fill into
        memory in use costs well under half of a new chain's, see ``bench_build.py``),
        else the blank chain formatted when the engine was made, if it is still unused
        and the plan's chain would be of its size class, else a new chain.

        ``by_size``: the chain is pooled by its capacity alone when it comes back (a
        block list's, planned every time), so its capacity is rounded up to powers of
        two (:func:`chain_capacity`, the size class its memory takes anyway): block
        lists of one size merge a varying number of neighbours into their WRs, and a
        chain sized to one list's plan would rarely fit the next.  Such a chain holds
        more WRs and SGEs than a fill uses; a fill writes and links only its own.

        A refilled chain keeps its old ``wr_id``s and flags: every chain built here is
        signaled over its whole length (``set_signals``) before it is posted, which
        rewrites them (:meth:`hixl.engine.queueing.Queuer.queue`)."""
        kw: dict[str, Any] = {
            "opcode": opcode,
            "local_addr": local_addr,
            "lkey": lkey,
            "remote_addr": remote_addr,
            "rkey": rkey,
            "regions": (local,),
        }
        wrs, sges = plan.num_wrs, plan.num_sges
        if wrs > 1:
            if by_size:
                wrs, sges = chain_capacity(wrs), chain_capacity(sges)
            idle = self._take_sized((wrs, sges))
            if idle is not None:
                idle.chain.fill_plan(plan, keep_ids=True, **kw)
                self.chains_refilled += 1
                return idle.chain
            if self._blank and CHAIN_BLANK // 2 < wrs <= CHAIN_BLANK and sges <= CHAIN_BLANK:
                try:
                    chain = self._blank.pop()
                except IndexError:  # another thread took it
                    pass
                else:
                    chain.shrink(wrs, sges)
                    chain.fill_plan(plan, keep_ids=True, **kw)
                    self.chains_built += 1
                    return chain
            if by_size:
                chain = SendChain.blank(wrs, sges, opcode, self.memory)
                chain.fill_plan(plan, **kw)
                self.chains_built += 1
                return chain
        self.chains_built += 1
        return SendChain.for_plan(plan, memory=self.memory, **kw)

    def _take_sized(self, size: tuple[int, int]) -> Built | None:
        """An idle chain of capacity ``size`` (WRs, SGEs) of any layout, or None.  A
        layout's chains all have its plan's size (``for_plan`` sizes a chain to its plan,
        and a refill takes a chain of the same size), so the index holds layouts.  No
        lock: each pop is atomic, and a layout whose pool emptied is skipped."""
        keys = self._sized.get(size)
        if not keys and self._posted:
            self._reclaim()
            keys = self._sized.get(size)
        while keys:
            try:
                key = keys.pop()
            except IndexError:  # another thread took the last one
                return None
            idle = self._take_idle(key)
            if idle is not None:
                if self._chains.get(key):
                    keys.append(key)  # more of this layout left
                return idle
        return None

    def _placed(
        self,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        op: Op,
        opcode: int,
        local: Region,
        remote: RemoteRegion,
        where: str,
    ) -> tuple[Plan, tuple[Any, ...], int, int] | None:
        """Plan, cache key and the two base offsets of a request made of shapes.

        The plan of a shape is cached at offset 0 and shifted by the bases when the chain
        is filled, so a stream writing one layout at new offsets plans it once.  Bounds
        and alignment depend on the bases and are checked on every call (O(ndim)); when
        one fails, or on a cache miss, the request is planned as it is, which raises the
        same errors as ever.  None when a descriptor is not a shape.
        """
        llen, rlen = local.length, remote.length
        if ldesc is None:
            lp = None
        else:
            lp = place(ldesc)
            if lp is None:
                return None
        if rdesc is None:
            rp = None
        else:
            rp = place(rdesc)
            if rp is None:
                return None
        if lp is None:
            n = llen if rp is None else rp.nbytes
            lp = Placement(("contiguous", n), 0, n, n)
        if rp is None:
            rp = Placement(("contiguous", lp.nbytes), 0, lp.nbytes, lp.nbytes)
        key = (opcode, lp.shape, rp.shape)  # an int hashes faster than the Op enum
        plan = self._plans.get(key)
        align = self.alignment
        fits = (
            lp.nbytes > 0
            and lp.base + lp.span <= llen
            and rp.base + rp.span <= rlen
            and not (
                align
                and (
                    (ldesc is not None and ldesc.first_misaligned(0, align) is not None)
                    or (rdesc is not None and rdesc.first_misaligned(0, align) is not None)
                )
            )
        )
        if plan is None or not fits:
            if fits:
                # Bounds and alignment hold (above, in O(1)): plan the shapes at offset 0
                # (translation invariant, see place), without the checks per segment.
                plan = plan_shapes(lp.shape, rp.shape, op, self.limits)
            else:
                real = self._plan(ldesc, rdesc, op, llen, rlen, where)  # raises what is wrong
                plan = shift_plan(real, -lp.base, -rp.base)
            if len(self._plans) >= PLAN_CACHE:
                self._plans.clear()
            self._plans[key] = plan
        return plan, key, lp.base, rp.base

    def posted(self, chunks: list[Chunk]) -> None:
        """The chains of ``chunks`` (window chunks with a ``built``) were posted whole.

        One append, on the poster: the chains are pooled later by a thread that misses
        the pool.  Beyond :data:`POSTED_BATCHES` waiting batches the oldest are dropped
        (the pool is a cache; their chains are freed).
        """
        self._posted.append(chunks)

    def _reclaim(self) -> None:
        """Pool the chains of the posted batches handed over so far (no lock: each batch
        is popped by one thread)."""
        posted = self._posted
        while posted:
            try:
                chunks = posted.popleft()
            except IndexError:  # another thread took the last one
                return
            for chunk in chunks:
                built = chunk.built
                if built is not None:
                    chunk.built = None
                    parts = built.parts
                    if parts is not None:
                        try:
                            if not parts.pop():  # atomic: one thread pops the last part
                                continue
                        except IndexError:
                            continue
                        built.parts = None
                    self.give_back(built)

    def take(self, key: tuple[Any, ...]) -> Built | None:
        """An idle chain pooled under ``key`` (see :meth:`give_back`), or None."""
        return self._take_idle(key)

    def _take_idle(self, key: tuple[Any, ...]) -> Built | None:
        """An idle chain of the layout ``key`` from the pool (no lock: pops are atomic)."""
        pool = self._chains.get(key)
        if not pool:
            if not self._posted:
                return None
            self._reclaim()
            pool = self._chains.get(key)
            if not pool:
                return None
        try:
            idle = pool.pop()
        except IndexError:  # another thread took the last one
            return None
        self._chain_bytes -= ChainMemory.chain_bytes(idle.chain)
        return idle

    def _evict(self, room: int) -> None:
        """Drop the idle chains of the layouts pooled first until at most ``room`` bytes
        are held (all of them if another thread changes the pool meanwhile)."""
        chains = self._chains
        try:
            while self._chain_bytes > max(room, 0) and chains:
                for idle in chains.pop(next(iter(chains)), ()):
                    self._chain_bytes -= ChainMemory.chain_bytes(idle.chain)
            if not chains:  # the count is approximate (no lock): start it over when exact
                self._chain_bytes = 0
        except (RuntimeError, StopIteration, KeyError):  # changed under the iteration
            chains.clear()
            self._sized.clear()
            self._chain_bytes = 0

    def give_back(self, built: Built) -> None:
        """Return a chain whose WRs are all posted, for the next request with its layout."""
        key, chain = built.key, built.chain
        if key is None:
            # Built for one request (a block list, planned every time): kept by its size
            # alone, for the next request of that size to refill (see _take_sized).
            if chain.capacity < 2:
                return
            key = ("any", chain.capacity, chain.sge_capacity)
        for r in chain.regions:
            if r.closed:
                return
        capacity = chain.capacity
        nbytes = ChainMemory.chain_bytes(chain)
        if self._chain_bytes + nbytes > CHAIN_CACHE_BYTES:
            self._evict(CHAIN_CACHE_BYTES - nbytes)
        pool = self._chains.get(key)
        if pool is None:
            pool = self._chains[key] = []
        if len(pool) < max(4, CHAIN_WRS_PER_KEY // capacity):
            pool.append(built)
            self._chain_bytes += nbytes
            # Indexed when its pool gets its first idle chain, not on every return: a
            # layout streamed over and over would fill its size's index with itself.
            if capacity > 1 and len(pool) == 1:
                size = (capacity, chain.sge_capacity)
                keys = self._sized.get(size)
                if keys is None:
                    if len(self._sized) >= SIZED_SIZES:
                        self._sized.clear()  # an index, not the pool: rebuilt as chains return
                    keys = self._sized[size] = deque(maxlen=SIZED_KEYS)
                keys.append(key)

    def _cached(
        self,
        op: Op,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        local: Region,
        remote: RemoteRegion,
        where: str,
    ) -> tuple[Plan, tuple[Any, ...] | None]:
        """The plan and its cache key (None when the descriptors cannot be hashed)."""
        key: tuple[Any, ...] | None = (op, ldesc, rdesc, local.length, remote.length)
        try:
            cached = self._plans.get(key)  # type: ignore[arg-type]
        except TypeError:
            cached, key = None, None
        if cached is None:
            cached = self._plan(ldesc, rdesc, op, local.length, remote.length, where)
            if key is not None:
                if len(self._plans) >= PLAN_CACHE:
                    self._plans.clear()
                self._plans[key] = cached
        return cached, key

    def _plan(
        self,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        op: Op,
        local_len: int,
        remote_len: int,
        where: str,
    ) -> Plan:
        """Bounds, alignment and the plan of one request."""
        if ldesc is None and rdesc is None:
            ldesc = ContiguousDesc(offset=0, nbytes=local_len, alignment=None)
            rdesc = ldesc
        elif ldesc is None:
            assert rdesc is not None
            ldesc = ContiguousDesc(offset=0, nbytes=as_segments(rdesc).nbytes, alignment=None)
        elif rdesc is None:
            rdesc = ContiguousDesc(offset=0, nbytes=as_segments(ldesc).nbytes, alignment=None)
        check_bounds(ldesc, local_len, what=f"{where}: local")
        check_bounds(rdesc, remote_len, what=f"{where}: remote")
        if self.alignment:
            check_alignment(ldesc, 0, self.alignment, what=f"{where}: local")
            check_alignment(rdesc, 0, self.alignment, what=f"{where}: remote")
        return plan_transfer(ldesc, rdesc, op, self.limits)


def resolve_remote(conn: Connection, remote: RemoteRegion | str, where: str) -> RemoteRegion:
    if isinstance(remote, str):
        return conn.remote_region(remote)
    if isinstance(remote, RemoteRegion) and conn.exposes(remote):
        return remote
    raise RegistrationError(
        f"{where}: remote memory {remote!r} is not a region peer {conn.peer} exposes"
    )


_RANGES = object()  # first item of a ranges_key: no key of exact arguments starts with it


def ranges_key(
    peer: str, op: str, local: object, remote: object, ldesc: object, rdesc: object
) -> tuple[Any, ...] | None:
    """The key of the template a single put or get of two :class:`ContiguousDesc` shares
    with every other of the same sizes between the same regions (at any offsets), or
    None for other descriptors."""
    if type(ldesc) is ContiguousDesc and type(rdesc) is ContiguousDesc:
        return (_RANGES, peer, op, local, remote, ldesc.nbytes, rdesc.nbytes)
    return None


class NotifySlots:
    """Registered send buffers for outgoing notifications, one slot per notification in flight.

    One chain holds a SEND work request per slot, built once; a notification posts just
    its slot's WR (:meth:`take` sets the length).  ``take``/``release`` run under the
    engine lock.
    """

    def __init__(self, device: verbs.Device, count: int) -> None:
        self.count = count
        self._buf = np.zeros(count * notify.SLOT_BYTES, dtype=np.uint8)
        self._mr = device.register(self._buf.ctypes.data, self._buf.nbytes, 0, self._buf)
        self.chain = SendChain(count, count)
        slots = np.arange(count, dtype=np.int64)
        self.chain.fill(
            opcode=verbs.WR_SEND,
            remote_addr=np.zeros(count, dtype=np.uint64),
            rkey=0,
            sge_start=np.arange(count + 1, dtype=np.int64),
            sge_addr=self._mr.addr + slots * notify.SLOT_BYTES,
            sge_length=np.zeros(count, dtype=np.int64),
            lkey=self._mr.lkey,
        )
        self._free = list(range(count))

    def take(self, payload: bytes) -> int:
        """A slot holding ``payload``; its SEND is WR ``slot`` of :attr:`chain`."""
        if not self._free:
            raise StateError(f"{self.count} notifications already in flight")
        slot = self._free.pop()
        start = slot * notify.SLOT_BYTES
        self._buf[start : start + len(payload)] = np.frombuffer(payload, np.uint8)
        self.chain.head[slot].sg_list[0].length = len(payload)
        return slot

    def release(self, slot: int) -> None:
        if slot < self.count:  # (none are, once closed)
            self._free.append(slot)

    def close(self) -> None:
        """Give the buffers back (the device, and with it their region, is closed)."""
        self.count = 0
        self._free.clear()
        self._buf = np.zeros(0, dtype=np.uint8)
        self.chain = SendChain(1, 1)
