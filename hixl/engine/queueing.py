"""Queueing a transfer: work-request ids, signal groups, lanes, and the hand-over to posting.

The :class:`Queuer` takes built requests (:class:`~hixl.engine.datapath.Built`) and,
under the engine lock, gives them their ``wr_id`` block in queue order (completions are
matched to transfers by it), cuts a long chain into signal groups spread over the
connection's lanes (:func:`spread`), places a notification behind the data, and either
reserves the batch for the calling thread to post or hands the lane to the progress
thread (:class:`~hixl.engine.posting.Poster`).  It talks back to the engine through
:class:`QueueHost`, a protocol defined here.  Every attribute is engine lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from hixl.core.states import ConnState
from hixl.core.window import Chunk
from hixl.engine.connection import Connection, Lane
from hixl.engine.datapath import Built, NotifySlots, Planner
from hixl.engine.handles import TransferHandle
from hixl.engine.posting import Poster
from hixl.errors import HixlError

__all__ = ["SPREAD_BYTES", "QueueHost", "Queuer", "every_for", "spread"]

log = logging.getLogger("hixl.engine")

#: A request of a few WRs but at least this many bytes is signalled in smaller groups,
#: so that it is cut over the lanes like a long one (see spread).
SPREAD_BYTES = 128 * 1024


class QueueHost(Protocol):
    """What a :class:`Queuer` needs of its engine."""

    def check_open(self) -> None:
        """Raise :class:`StateError` when the engine is closed or broken."""

    def take_credit(self, conn: Connection, deadline: float, timeout: float) -> None:
        """Take one of ``conn``'s notification credits, waiting until ``deadline`` (lock
        held; the wait releases it)."""


class Queuer:
    """One engine's queueing: the next ``wr_id`` and the step that queues a transfer."""

    def __init__(
        self,
        lock: threading.RLock,
        poster: Poster,
        planner: Planner,
        handles: set[TransferHandle],
        notify_slots: NotifySlots,
        every: int,
        host: QueueHost,
    ) -> None:
        self._lock = lock
        self._poster = poster
        self._planner = planner
        self._handles = handles  # the engine's pending transfers
        self._notify_slots = notify_slots
        self._every = every  # WRs per signal group (signal_interval of the queue depth)
        self._host = host
        # The next wr_id (engine lock): taken in queue order, one per signal group, a
        # block per ring chunk; completions are matched to chunks by it.
        self.next_wr = 1

    def queue(
        self,
        conn: Connection,
        built: list[Built],
        payload: bytes | None,
        reads: bool,
        timeout: float,
        now: bool,
        parts: list[Chunk] | None = None,
    ) -> TransferHandle:
        """Queue built requests (and a notification) as one transfer; post or hand over.
        ``parts``, if given, receives the chunks of the requests' WRs (ids assigned)."""
        if len(built) == 1 and payload is None:
            return self.queue1(conn, built[0], timeout, now, parts)
        now_s = time.monotonic()
        nbytes = sum(b.nbytes for b in built)
        num_wrs = sum(b.chain.num_wrs for b in built)
        handle = TransferHandle(
            conn.peer, nbytes, num_wrs, now_s + timeout, self._poster.reap_inline
        )
        every = self._every
        chunks = []
        for b in built:
            chunk = Chunk(b.chain, 0, b.chain.num_wrs, handle, every)
            chunk.built = b
            chunks.append(chunk)
        with self._lock:  # ids are taken in queue order: completions rely on it
            try:
                self._host.check_open()
                conn.check_ready()
                if payload is not None:  # may wait (lock released): before any id is taken
                    self._host.take_credit(conn, handle.deadline, timeout)
            except HixlError:
                for b in built:
                    self._planner.give_back(b)
                raise
            placed: list[tuple[Lane, Chunk]] = []
            for chunk in chunks:
                chunk.first_id = self.next_wr
                chunk.every = every_for(conn, chunk.size, chunk.built.nbytes, every)
                chunk.groups = chunk.chain.set_signals(self.next_wr, chunk.every)
                self.next_wr += chunk.groups
                placed += spread(chunk, conn)
            for lane, part in placed:
                lane.window.queue1(part)
            if parts is not None:
                parts.extend(part for _, part in placed)
            handle.chunks_left = len(placed) + (payload is not None)
            first = conn.lanes[0]  # where the notifications go, after the data
            if payload is not None:
                slot = self._notify_slots.take(payload)
                chunk = Chunk(self._notify_slots.chain, slot, slot + 1, handle, 1, self.next_wr)
                chunk.notify_slot = slot
                # Work queued before it on other lanes must complete first: only then has
                # its data landed (lanes complete in any order among themselves).
                if conn.behind(chunk.first_id):
                    chunk.held = True
                    conn.held += 1
                    # A channel call ends without the lock: it clears its busy mark, then
                    # looks at ``held``.  Looking at the lanes again after counting the
                    # hold means one of the two sides sees the other (see Channel._end).
                    if not conn.behind(chunk.first_id):
                        chunk.held = False
                        conn.held -= 1
                chunk.groups = chunk.chain.set_signals(self.next_wr, 1, slot, slot + 1)
                # After READs the SEND is fenced: it starts only once they have completed,
                # so the peer is told "done" after its memory was read, not before.
                if reads:
                    chunk.chain.fence(slot)
                log.debug(
                    "notification %r to %s posted%s",
                    payload.partition(b"\0")[0].decode(),
                    conn.peer,
                    " fenced" if reads else "",
                )
                self.next_wr += 1
                first.window.queue1(chunk)
                placed.append((first, chunk))
            self._handles.add(handle)
            lane, batch = self._poster.start_posts([lane for lane, _ in placed], now)
        self._poster.post_or_wake(lane, batch)
        return handle

    def queue1(
        self,
        conn: Connection,
        b: Built,
        timeout: float,
        now: bool,
        parts: list[Chunk] | None = None,
    ) -> TransferHandle:
        """:meth:`queue` for the common case, one request and no notification."""
        now_s = time.monotonic()
        chain = b.chain
        n = chain.num_wrs
        handle = TransferHandle(conn.peer, b.nbytes, n, now_s + timeout, self._poster.reap_inline)
        handle.chunks_left = 1
        chunk = Chunk(chain, 0, n, handle, self._every)
        chunk.built = b
        with self._lock:  # ids are taken in queue order: completions rely on it
            if self._poster.closed or conn.state is not ConnState.READY:
                self._planner.give_back(b)
                self._host.check_open()
                conn.check_ready()
            chunk.first_id = first = self.next_wr
            if n == 1:
                chain.signal_one(first)
                chunk.groups = 1
            else:
                chunk.every = every_for(conn, n, b.nbytes, chunk.every)
                chunk.groups = chain.set_signals(first, chunk.every)
            self.next_wr = first + chunk.groups
            self._handles.add(handle)
            if chunk.groups > 1 and len(conn.lanes) > 1:  # a long chain: over every lane
                pieces = spread(chunk, conn)
                handle.chunks_left = len(pieces)
                for lane, part in pieces:
                    lane.window.queue1(part)
                if parts is not None:
                    parts.extend(part for _, part in pieces)
                lane, batch = self._poster.start_posts([lane for lane, _ in pieces], now)
            else:
                if parts is not None:
                    parts.append(chunk)
                lane = conn.pick_lane()
                window = lane.window
                window.queue1(chunk)
                if window.poster:
                    return handle  # the batch being posted takes it next
                if now and not window.in_flight:
                    batch = self._poster.start_post(lane, defer=False)
                else:  # hand it to the progress thread (see Poster.start_post)
                    self._poster.want_post(lane)
                    batch = None
        self._poster.post_or_wake(lane, batch)
        return handle


def every_for(conn: Connection, n: int, nbytes: int, every: int) -> int:
    """The signal group size for a request of ``n`` WRs and ``nbytes``: ``every``, or for
    a request of one group's WRs or fewer that carries :data:`SPREAD_BYTES` or more, a
    group per lane (two WRs of 1 MiB then go out on two lanes at once)."""
    k = len(conn.lanes)
    if k > 1 and 1 < n <= every and nbytes >= SPREAD_BYTES:
        return -(-n // k)
    return every


def spread(chunk: Chunk, conn: Connection) -> list[tuple[Lane, Chunk]]:
    """``chunk`` (ids assigned) cut at signal-group boundaries into a part per lane, as
    even as the groups allow, each paired with its lane (lock held).

    A part completes under the ids of its own groups, as a whole chunk would.  The parts
    share the chain and its :class:`Built`: whichever part's post is handed back last
    returns the chain to the pool (``Built.parts``).  A chunk of one group, or a
    connection of one lane, stays whole on the next lane of the round robin.
    """
    lanes = conn.lanes
    k = min(len(lanes), chunk.groups)
    if k < 2:
        return [(conn.pick_lane(), chunk)]
    per, extra = divmod(chunk.groups, k)
    every, start = chunk.every, chunk.start
    parts: list[tuple[Lane, Chunk]] = []
    g = 0
    for i in range(k):
        n = per + (i < extra)
        part = Chunk(
            chunk.chain,
            start + g * every,
            min(chunk.stop, start + (g + n) * every),
            chunk.handle,
            every,
            chunk.first_id + g,
        )
        part.groups = n
        part.built = chunk.built
        parts.append((conn.pick_lane(), part))
        g += n
    if chunk.built is not None:
        chunk.built.parts = [True] + [False] * (k - 1)  # popped once per part posted
    return parts
