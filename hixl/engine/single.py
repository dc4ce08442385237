"""The single-request paths: one put or get, repeated without its checks and plan.

A put or get of one request is checked and planned once (:meth:`Planner.template
<hixl.engine.datapath.Planner.template>`); the same call again, or a pair of
:class:`~hixl.core.descriptors.ContiguousDesc` of the same sizes at other offsets, runs
from that :class:`~hixl.engine.datapath.Template` (see :meth:`SinglePaths.one`), by one
of three ways:

- a blocking request of one WR and one SGE on the connection's direct lane, as a
  :class:`~hixl.engine.channel.Channel` call (:meth:`SinglePaths._on_lane`), kept as a
  runner of its arguments for :meth:`Engine.put`/:meth:`Engine.get` (``repeat_put``,
  ``repeat_get``);
- another blocking request of one WR, posted and polled on the caller's thread when a
  lane is idle (:meth:`SinglePaths._solo`);
- an asynchronous request of one WR and one SGE, written into a slot of a lane's ring
  (:meth:`SinglePaths._ring_enqueuer`), kept as a runner of its arguments for
  :meth:`Engine.put_async`/:meth:`Engine.get_async` (``ring_put``, ``ring_get``).

Everything else is queued as a transfer (:class:`~hixl.engine.queueing.Queuer`).  The
paths talk back to the engine through :class:`SingleHost`, a protocol defined here, and
read only the tables they are given (the connections by peer, the pending handles).
Every attribute is engine lock unless a method says otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hixl.core import notify as _notify
from hixl.core.descriptors import ContiguousDesc, Descriptor
from hixl.core.states import ConnState
from hixl.core.window import Chunk
from hixl.core.wire import RemoteRegion
from hixl.engine.channel import LaneBusy
from hixl.engine.connection import Connection, Lane, LaneRing
from hixl.engine.datapath import Planner, Template, ranges_key
from hixl.engine.handles import (
    SPIN_S,
    GroupHandle,
    MemberHandle,
    TransferHandle,
    TransferRequest,
    TransferStatus,
)
from hixl.engine.posting import POLL_BATCH, Poster, SendQueue
from hixl.engine.queueing import Queuer
from hixl.engine.reaping import SendReaper, deadline_error
from hixl.engine.regions import Region
from hixl.errors import ArgumentError, HixlError, StateError
from hixl.verbs import adapter as verbs
from hixl.verbs.slot_ring import WR_BYTES, WR_SLOT

__all__ = ["RING_SLOTS", "TEMPLATES", "LentLane", "SingleHost", "SinglePaths"]

TEMPLATES = 1024  # single requests kept checked and planned (see SinglePaths.one)
RING_SLOTS = 256  # slots of a lane's ring of single messages (at most the queue's depth)
# SinglePaths._ring_runner's function: (peer, local, remote, local_desc, remote_desc,
# timeout) -> the handle, or None when the call is not the runner's or cannot go its way.
_RingRun = Callable[[str, Region, Any, Any, Any, float], TransferHandle | None]
# SinglePaths._ring_enqueuer's function: (sge_addr, remote_addr, timeout) -> the handle,
# or None when the template went stale.
_RingQueue = Callable[[int, int, float], TransferHandle | None]
# A blocking call kept for Engine.put/get: (arguments, run); run(timeout) is True once
# the call completed, False when it cannot run now.
_Repeat = tuple[tuple[Any, ...], Callable[[float], bool]]


class LentLane(Protocol):
    """A channel the engine lends itself for a template (:meth:`SingleHost.lent_channel`)."""

    def put(self, lo: Any, ro: Any, n: Any, *, timeout: float = ...) -> None: ...

    def get(self, lo: Any, ro: Any, n: Any, *, timeout: float = ...) -> None: ...

    def repeat_runner(
        self, opcode: int, lo: int, ro: int, n: int, remotes: tuple[RemoteRegion, ...]
    ) -> Callable[[float], bool]: ...


class SingleHost(Protocol):
    """What the single-request paths need of their engine."""

    def check_open(self) -> None:
        """Raise :class:`StateError` when the engine is closed or broken."""

    def fail(
        self,
        conn: Connection,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
    ) -> None:
        """Fail ``conn`` (lock held): flush it and fail its pending transfers."""

    def submit(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
        tkey: tuple[Any, ...] | None = None,
    ) -> TransferHandle:
        """The general path: check, plan, build and queue (keeping the template)."""
        ...

    def lent_channel(self, conn: Connection, local: Region, remote: RemoteRegion) -> LentLane:
        """A lent channel on ``conn``'s direct lane between the two regions."""
        ...


class SinglePaths:
    """The templates of one engine's single requests and the paths that repeat them."""

    def __init__(
        self,
        lock: threading.RLock,
        planner: Planner,
        poster: Poster,
        reaper: SendReaper,
        queuer: Queuer,
        send_cq: SendQueue,
        sq_depth: int,
        conns: dict[str, Connection],
        handles: set[TransferHandle],
        engine_id: str,
        host: SingleHost,
    ) -> None:
        self._lock = lock
        self._planner = planner
        self._poster = poster
        self._reaper = reaper
        self._queuer = queuer
        self._send_cq = send_cq
        self._sq_depth = sq_depth
        self._conns = conns  # the engine's connections by peer (read, never written)
        self._handles = handles  # the engine's pending transfers (lock held)
        self._engine_id = engine_id
        self._host = host
        self._templates: dict[tuple[Any, ...], Template] = {}
        self._last_template: tuple[tuple[Any, ...], Template] | None = None
        # The last blocking put and get that ran on a direct lane, as (arguments, run):
        # the same call again goes straight to ``run`` (see Channel.repeat_runner).
        self.repeat_put: _Repeat | None = None
        self.repeat_get: _Repeat | None = None
        # The last asynchronous put and get of two ContiguousDesc that went into a lane's
        # ring, as a function that queues a call of the same regions and sizes at any
        # offsets, or returns None (see _ring_runner).
        self.ring_put: _RingRun | None = None
        self.ring_get: _RingRun | None = None

    def keep(self, tkey: tuple[Any, ...], rkey: tuple[Any, ...] | None, t: Template) -> None:
        """Keep ``t`` under the call's key ``tkey`` and, for two ranges, under the key of
        the same sizes at any offsets ``rkey`` (see :meth:`one`); at most
        :data:`TEMPLATES`."""
        if len(self._templates) >= TEMPLATES - 1:
            self._templates.clear()
        self._templates[tkey] = t
        if rkey is not None:
            self._templates[rkey] = t

    def forget(self, conns: list[Connection]) -> None:
        """Drop the kept calls (templates and the fast paths made from them) to ``conns``,
        which are gone: a template holds its connection, and peers come and go (lock
        held)."""
        gone = {id(c) for c in conns}
        for key in [k for k, t in self._templates.items() if id(t.conn) in gone]:
            del self._templates[key]
        self._last_template = None
        self.repeat_put = self.repeat_get = None
        self.ring_put = self.ring_get = None

    def clear(self) -> None:
        """Forget every template and runner (the engine closed)."""
        self._templates.clear()
        self._last_template = None
        self.repeat_put = self.repeat_get = None
        self.ring_put = self.ring_get = None

    def submit(
        self,
        owner: object,
        connection: Callable[[str], Connection],
        peer: str,
        requests: Sequence[TransferRequest],
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
        tkey: tuple[Any, ...] | None = None,
    ) -> TransferHandle:
        """The general path: check, plan, build and queue a transfer of the engine
        ``owner`` (its regions are the local ones allowed); ``now``: post it on this thread
        when the queue pair is idle (a blocking call, which waits anyway).  ``tkey``: keep
        the single request's template under that key."""
        if timeout <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        if not requests and notify is None:
            raise ArgumentError("empty transfer: no requests and no notification")
        payload = _notify.encode(notify, notify_message) if notify is not None else None
        self._host.check_open()
        conn = connection(peer)
        conn.check_ready()
        # Validation, planning and building read only immutable values (regions' keys,
        # the peer's announced region tuple), so they run without the engine lock; the
        # progress thread keeps reaping completions meanwhile.
        built = [self._planner.build(owner, conn, req, i) for i, req in enumerate(requests)]
        if tkey is not None:
            t = self._planner.template(conn, requests[0], built[0])
            if t is not None:
                req = requests[0]
                # Also under the key of the same sizes at other offsets (see one).
                rkey = ranges_key(
                    peer, req.op, req.local, req.remote, req.local_desc, req.remote_desc
                )
                self.keep(tkey, rkey, t)
        reads = any(r.op == "read" for r in requests)
        return self._queuer.queue(conn, built, payload, reads, timeout, now)

    def one(
        self,
        op: str,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        local_desc: Descriptor | None,
        remote_desc: Descriptor | None,
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
    ) -> TransferHandle | None:
        """A single put or get.  One already checked with these very arguments on this
        connection is repeated from its :class:`~hixl.engine.datapath.Template` (no
        checks, no planning: what they depend on has not changed, see there).  A pair of
        :class:`ContiguousDesc` at new offsets reuses the template of the same sizes
        between the same regions; only the bounds and the alignment are checked.

        None (only with ``now``): the transfer was posted and has completed on this
        thread (:meth:`_solo`); otherwise its handle."""
        tkey: tuple[Any, ...] | None = (peer, op, local, remote, local_desc, remote_desc)
        last = self._last_template  # a loop repeats one call: compared by identity first
        t: Template | None
        if last is not None and last[0] == tkey:
            t = last[1]
            # Keep this call's objects: an equal but new descriptor per loop then costs
            # one dataclass comparison, not one per call.
            self._last_template = (tkey, last[1])
        else:
            try:
                t = self._templates.get(tkey)  # type: ignore[arg-type]
            except TypeError:  # an unhashable descriptor
                t, tkey = None, None
            if t is not None and tkey is not None:
                self._last_template = (tkey, t)
        if t is not None:
            la, ra = t.local_addr, t.remote_addr
        else:
            rkey = ranges_key(peer, op, local, remote, local_desc, remote_desc)
            t = self._templates.get(rkey) if rkey is not None else None
            if t is not None:
                where = self._planner.at_offsets(t, local_desc, remote_desc)  # type: ignore[arg-type]
                if where is None:
                    t = None  # planned as it is, which raises what is wrong
                else:
                    la, ra = where
        if t is not None:
            conn = t.conn
            if (
                conn.state is ConnState.READY
                and conn.remote_regions is t.remotes
                and not t.local.closed
                and self._conns.get(conn.peer) is conn
                and timeout > 0
                and not self._poster.closed
            ):
                if notify is None:
                    if now and t.num_wrs == 1:
                        if (
                            t.single is not None
                            and conn.channel is None
                            and conn.direct is not None
                            and self._on_lane(t, la, ra, timeout)
                        ):
                            if tkey is not None and (la, ra) == (t.local_addr, t.remote_addr):
                                self._remember_repeat(t, tkey)
                            return None
                        return self._solo(t, la, ra, timeout)
                    if t.single is not None and not now:
                        if (
                            type(local_desc) is ContiguousDesc
                            and type(remote_desc) is ContiguousDesc
                        ):
                            self._remember_ring(t, remote)
                        lo, _, ro = t.single
                        ring_handle = self._queue_ring(t, la + lo, ra + ro, timeout)
                        if ring_handle is not None:
                            return ring_handle
                        # The template went stale since the checks above: the general
                        # path below checks and plans the call again.
                    else:
                        return self._queuer.queue1(
                            conn, self._planner.rebuild(t, la, ra), timeout, now
                        )
                else:
                    payload = _notify.encode(notify, notify_message)
                    built = [self._planner.rebuild(t, la, ra)]
                    return self._queuer.queue(conn, built, payload, op == "read", timeout, now)
        req = TransferRequest(
            op=op, local=local, remote=remote, local_desc=local_desc, remote_desc=remote_desc
        )
        return self._host.submit(peer, [req], notify, notify_message, timeout, now=now, tkey=tkey)

    def _queue_ring(
        self, t: Template, sge_addr: int, remote_addr: int, timeout: float
    ) -> TransferHandle | None:
        """An asynchronous request of one WR and one SGE (``t`` placed so that its SGE
        starts at ``sge_addr`` and its remote range at ``remote_addr``), written into the
        next slot of a lane's ring (:class:`~hixl.verbs.slot_ring.SlotRing`) by ``t``'s
        enqueuing function (:meth:`_ring_enqueuer`, made on first use)."""
        return self._enqueuer_of(t)(sge_addr, remote_addr, timeout)

    def _enqueuer_of(self, t: Template) -> _RingQueue:
        """``t``'s enqueuing function, kept first in ``t.ring`` (made on first use)."""
        held = t.ring
        if not held:
            held.append(self._ring_enqueuer(t))
        return held[0]  # type: ignore[no-any-return]

    def _ring_enqueuer(self, t: Template) -> _RingQueue:
        """``t`` (one WR, one SGE) as a function ``(sge_addr, remote_addr, timeout)`` that
        writes it, so placed, into the next slot of one of its connection's lanes' rings
        (round robin) and returns the caller's :class:`MemberHandle`.  What the template
        fixes (its connection, regions, keys, opcode and size) is bound once here, not
        read per message.

        While the lane's last queued chunk is this ring's open one and none of it is
        taken for posting, the message joins it: one more WR, the group's byte count
        and earliest deadline, and its region if new.  Otherwise the message opens a
        chunk of its own (:meth:`_open_ring_chunk`).  With every slot waiting for its
        post, the request is queued as a chain of its own instead.  The poster posts the
        open chunk with the rest of the backlog and signals the batch's last WR; the
        slots are free again once that post returned (:meth:`_post`).

        The function returns None, with nothing queued, when the template is stale (the
        peer announced other regions, ``t``'s local region was deregistered, the
        connection was replaced): the caller takes the general path, which checks
        everything again.  These are checked under the lock, for :meth:`_ring_runner`'s
        calls, which check only their arguments; a closed engine or a connection that
        is not READY raises as the general path would.
        """
        poster, host, open_chunk = self._poster, self._host, self._open_ring_chunk
        planner, queuer = self._planner, self._queuer
        conn, local, remotes = t.conn, t.local, t.remotes
        mr = local.mr
        n, opcode, rkey, lkey = t.nbytes, t.opcode, t.rkey, t.lkey
        lo, _, ro = t.single  # type: ignore[misc]
        lock = self._lock
        ready = ConnState.READY
        pack = WR_SLOT.pack_into
        slots = min(RING_SLOTS, self._sq_depth)
        clock = time.monotonic
        member = MemberHandle

        def enqueue(sge_addr: int, remote_addr: int, timeout: float) -> TransferHandle | None:
            with lock:
                if poster.closed or conn.state is not ready:
                    host.check_open()
                    conn.check_ready()
                # MemoryRegion.closed is what Region.closed returns: no property call per
                # message.  A READY connection is the one indexed under its peer: it
                # becomes READY in the same locked step that indexes it (_adopt), only
                # from CONNECTING, and leaves READY before it is dropped from the index.
                if conn.remote_regions is not remotes or mr.closed:
                    return None
                lane = next(conn.lane_cycle)  # Connection.pick_lane, inline
                ring = lane.ring
                if ring is None:
                    ring = lane.ring = LaneRing(slots)
                written = ring.written
                cap = ring.capacity
                if written - ring.released < cap:
                    slot = written % cap
                    chunk = ring.open
                    # The open chunk is closed before any of it is taken for posting
                    # (Poster.start_post) and when another opens, so only a wrap (slot 0: a
                    # chunk is one range of the chain) or a chunk queued after it on the
                    # lane ends the joining here.  Its end, signal groups and count are
                    # set when it closes (Poster.close_ring_chunk), not per message.
                    if chunk is not None and slot and lane.window.last is chunk:
                        group = chunk.handle
                        k = written - ring.open_at
                        regions = chunk.regions
                        if regions[-1] is not local:  # type: ignore[index]
                            regions.append(local)  # type: ignore[union-attr]
                        # A member's deadline is its group's, the earliest of theirs.  A
                        # message with no shorter timeout than the group's shortest,
                        # queued later, has a later deadline: no clock reading for it.
                        if timeout < group.timeout:
                            group.timeout = timeout
                            deadline = clock() + timeout
                            if deadline < group.deadline:
                                group.deadline = deadline
                    else:
                        chunk = open_chunk(lane, ring, slot, local, timeout)
                        group = chunk.handle
                        k = 0
                    group.nbytes += n
                    group.num_wrs += 1
                    # SlotRing.write, inline (a call less per message): one unsignaled
                    # RDMA WR of one SGE in the slot.
                    pack(
                        ring.wr_mem,
                        slot * WR_BYTES,
                        chunk.first_id + k,
                        ring.links[slot],
                        ring.sge_lists[slot],
                        1,
                        opcode,
                        0,
                        0,
                        remote_addr,
                        rkey,
                        sge_addr,
                        n,
                        lkey,
                    )
                    ring.written = written + 1
                    handle = member(group, k, n)
                else:
                    handle = None
            if handle is None:  # every slot waits for its post: a chain of its own
                built = planner.rebuild(t, sge_addr - lo, remote_addr - ro)
                return queuer.queue1(conn, built, timeout, False)
            if poster.wake_due:
                poster.wake()
            return handle

        return enqueue

    def _open_ring_chunk(
        self, lane: Lane, ring: LaneRing, slot: int, local: Region, timeout: float
    ) -> Chunk:
        """A new open chunk of ``lane``'s ring starting at ``slot`` (lock held), tracked
        as one :class:`GroupHandle`, which reserves a block of ``wr_id``s (one per slot
        the chunk may grow to), so that whatever is queued after it on any lane has
        higher ids; the poster is asked for unless it will take it anyway."""
        self._poster.close_ring_chunk(ring)
        cap = ring.capacity
        group = GroupHandle(
            lane.conn.peer, time.monotonic() + timeout, self._poster.reap_inline, timeout
        )
        group.chunks_left = 1
        chunk = Chunk(ring.chain, slot, slot + 1, group, 1, self._queuer.next_wr)
        chunk.groups = 1
        chunk.regions = [local]
        chunk.ring = ring
        self._queuer.next_wr += cap
        ring.open = chunk
        ring.open_at = ring.written
        self._handles.add(group)
        window = lane.window
        window.queue1(chunk)
        # A message that joins this chunk later needs no asking: the chunk is then still
        # queued and not taken, so whoever posts it (asked here, or the poster at work
        # now) posts the joined slots with it.
        if not window.poster and lane.qpn not in self._poster.to_post:
            self._poster.want_post(lane)  # (once asked, the poster takes it with the rest)
        return chunk

    def _remember_ring(self, t: Template, remote: RemoteRegion | str) -> None:
        """Keep ``t`` (a template of two ranges, the peer's region named by ``remote``)
        for :meth:`put_async` or :meth:`get_async` of the same regions and sizes at any
        offsets."""
        enqueue = self._enqueuer_of(t)
        held = t.ring  # [enqueue, the remote argument, the runner]
        if len(held) < 3 or held[1] != remote:
            held[1:] = [remote, self._ring_runner(t, remote, enqueue)]
        if t.opcode == verbs.WR_RDMA_WRITE:
            self.ring_put = held[2]
        else:
            self.ring_get = held[2]

    def _ring_runner(
        self, t: Template, remote_arg: RemoteRegion | str, enqueue: _RingQueue
    ) -> _RingRun:
        """``t`` (one WR, one SGE, two ranges) into a lane's ring, as one function of a
        call's arguments: the handle when the call has ``t``'s local region, peer and
        sizes and ``remote_arg``; None, with nothing queued, when it has not, or when
        the template is stale, a range leaves its region or breaks the alignment policy,
        or the timeout is not > 0, and the caller takes the general path, which checks
        everything again and raises what is wrong.  The checks are those of :meth:`_one`
        for a template and of :meth:`Planner.at_offsets`: the call's own ones here, the
        template's in ``enqueue`` (:meth:`_ring_enqueuer`), under its lock."""
        conn, local, peer = t.conn, t.local, t.conn.peer
        remote = t.remote
        size = t.nbytes
        lo, _, ro = t.single  # type: ignore[misc]
        lbase, rbase = local.addr + lo, remote.addr + ro  # where the SGE and range start
        llen, rlen = local.length - size, remote.length - size
        align = self._planner.alignment or 0
        ready = ConnState.READY
        ranges = ContiguousDesc

        def run(
            peer_: str, local_: Region, remote_: Any, ldesc: Any, rdesc: Any, timeout: float
        ) -> TransferHandle | None:
            if (
                local_ is local
                and type(ldesc) is ranges
                and type(rdesc) is ranges
                and ldesc.nbytes == size
                and rdesc.nbytes == size
                and remote_ == remote_arg
                and peer_ == peer
            ):
                loff, roff = ldesc.offset, rdesc.offset
                if (
                    loff <= llen
                    and roff <= rlen
                    and not (align and (loff % align or roff % align))
                    and conn.state is ready  # else the general path finds its successor
                    and timeout > 0
                ):
                    return enqueue(lbase + loff, rbase + roff, timeout)
            return None

        return run

    def _solo(self, t: Template, la: int, ra: int, timeout: float) -> TransferHandle | None:
        """A blocking request of one WR (``t`` placed at ``la``/``ra``), posted and waited
        for on this thread when one of the connection's lanes is idle; None once it has
        completed (its error raised).  The common case of a blocking put or get: no
        hand-over, no handle to wait on, no batch, and the completion is polled here.

        The chunk goes through the lane's window like any other (:meth:`SendWindow.take_solo`),
        so whichever thread reaps its completion ends it, a connection failure fails it,
        and notifications queued meanwhile wait for it.  With no idle lane it is queued as
        usual and its handle returned.  Past ``timeout`` it fails with
        :class:`TransferTimeout` and, as any transfer past its deadline, fails the
        connection.  Counts as a poster until it returns, so :meth:`close` waits for it.
        """
        conn = t.conn
        b = self._planner.rebuild(t, la, ra)
        chain = b.chain
        start = time.monotonic()
        handle = TransferHandle(conn.peer, b.nbytes, 1, start + timeout)
        handle.chunks_left = 1
        chunk = Chunk(chain, 0, 1, handle, 1)
        with self._lock:
            if self._poster.closed or conn.state is not ConnState.READY:
                self._planner.give_back(b)
                self._host.check_open()
                conn.check_ready()
            wr_id = chunk.first_id = self._queuer.next_wr
            chunk.groups = 1
            for lane in conn.lanes:
                if lane.window.take_solo(chunk):
                    self._queuer.next_wr = wr_id + 1
                    self._poster.posters += 1
                    self._poster.direct_posts += 1  # also a post of one WR, see diagnostics
                    break
            else:
                lane = None
        if lane is None:  # every lane busy: queued behind their work, as usual
            return self._queuer.queue1(conn, b, timeout, True)
        chain.signal_one(wr_id)
        err: HixlError | None = None
        try:
            lane.qp.post_whole(chain)
        except HixlError as exc:
            err = exc
        self._planner.give_back(b)  # the provider has copied the WR
        self._await_solo(lane, err, handle, start)
        if handle.error is not None:
            raise handle.error
        return None

    def _remember_repeat(self, t: Template, tkey: tuple[Any, ...]) -> None:
        """Keep the blocking call ``tkey`` (peer, op, local, remote and the two
        descriptors), which just ran on the direct lane at its template's own offsets, so
        that :meth:`put` or :meth:`get` with the same arguments runs it again at once."""
        held = t.lane
        if len(held) < 2:
            _, dlo, dro, n, ch = held[0]
            held.append(
                ch.repeat_runner(t.opcode, t.local_addr + dlo, t.remote_addr + dro, n, t.remotes)
            )
        entry = (tkey[:1] + tkey[2:], held[1])
        if t.opcode == verbs.WR_RDMA_WRITE:
            self.repeat_put = entry
        else:
            self.repeat_get = entry

    def _on_lane(self, t: Template, la: int, ra: int, timeout: float) -> bool:
        """A blocking request of one WR and one SGE (``t`` placed at ``la``/``ra``) run on
        the connection's direct lane while no channel holds it: the path of a
        :class:`Channel` call, through a channel the engine keeps for the template (its
        regions and access were checked when the template was made; the call checks the
        offsets again, and the regions' lifetimes).  True once it completed (its error
        raised); False, with nothing posted, when another call has the lane."""
        held = t.lane
        if not held:
            ch = self._host.lent_channel(t.conn, t.local, t.remote)
            lo, n, ro = t.single  # type: ignore[misc]
            call = ch.put if t.opcode == verbs.WR_RDMA_WRITE else ch.get
            held.append((call, lo - t.local.addr, ro - t.remote.addr, n, ch))
        call, dlo, dro, n, _ = held[0]
        # Counted as it starts, as a direct post is (without the lock: approximate when
        # several threads put at once); taken back if the lane was not free.
        self._poster.lane_posts += 1
        try:
            call(la + dlo, ra + dro, n, timeout=timeout)
        except LaneBusy:
            self._poster.lane_posts -= 1
            return False
        return True

    def _await_solo(
        self, lane: Lane, err: HixlError | None, handle: TransferHandle, start: float
    ) -> None:
        """After :meth:`_solo`'s post returned (``err``: the provider refused it): settle
        the post, then reap the send CQ on this thread until ``handle`` finishes, spinning
        for :data:`SPIN_S`, then with sleeps of up to 1 ms between polls; then stop
        counting as a poster (also when a poll raises).  The queue is polled under the
        lock, as every reaper does (completions of one queue pair are handled in order).
        The first round settles the post and polls in one turn of the lock."""
        cq = self._send_cq
        lock = self._lock
        spin_until = start + SPIN_S
        nap = 0.00005
        settle = True
        released = False
        try:
            while True:
                with lock:
                    if settle:
                        settle = False
                        self._poster.settle_locked(lane, err, handle)
                    if self._poster.closed:
                        handle.finish(
                            StateError(
                                f"engine {self._engine_id} closed while the transfer was pending"
                            )
                        )
                        rows = None
                    else:
                        rows = cq.poll_rows(POLL_BATCH)
                        if rows:
                            self._reaper.reap_send(rows)
                    if handle.status is not TransferStatus.PENDING:
                        released = True
                        self._poster.release_poster()
                if self._poster.wake_due:  # the reap handed other lanes' backlog over
                    self._poster.wake()
                if released:
                    return
                now = time.monotonic()  # also when others' completions keep coming
                if now >= handle.deadline:
                    with lock:
                        self._host.fail(
                            lane.conn,
                            "a transfer timed out",
                            deadline_error(handle),
                            culprit=handle,
                        )
                elif not rows and now >= spin_until:
                    time.sleep(nap)
                    nap = min(nap * 2, 0.001)
        except BaseException:
            if not released:
                with lock:
                    self._poster.release_poster()
            raise
