"""Posting: who posts a lane's backlog, when, and the wake-ups that hand it over.

One :class:`Poster` per engine.  A caller that queued work reserves the next batch of an
idle lane under the engine lock and posts it outside (:meth:`Poster.start_post`,
:meth:`Poster.post`); otherwise the lane waits in :attr:`Poster.to_post` for the progress
thread (:meth:`Poster.post_pending`), or for a waiter that reaps and posts on its own
thread (:meth:`Poster.reap_inline`).  One poster per lane at a time (its window says
which); what callers queue while a batch is out goes with the next one (coalescing).

The poster talks back to its engine through :class:`PostingHost` and wakes the progress
thread through :class:`Waker`, two small protocols defined here, so this module imports
neither the engine nor the progress thread.  Every attribute is engine lock unless a
method says otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from hixl.core.states import ConnState
from hixl.core.window import Batch
from hixl.engine.connection import Lane, LaneRing
from hixl.engine.datapath import Planner
from hixl.engine.handles import TransferHandle
from hixl.errors import HixlError

__all__ = ["POLL_BATCH", "Poster", "PostingHost", "SendQueue", "Waker"]

POLL_BATCH = 64  # completions taken per poll of a CQ (a waiter's, the progress thread's)


class PostingHost(Protocol):
    """What a :class:`Poster` needs of its engine."""

    def fail(
        self,
        conn: object,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
    ) -> None:
        """Fail ``conn`` (lock held): flush it and fail its pending transfers."""


class SendQueue(Protocol):
    """The engine's send completion queue, as a waiter polls it."""

    def poll_rows(self, n: int) -> list[tuple[int, int, int, int]]: ...


class Waker(Protocol):
    """The progress thread, as a poster sees it."""

    @property
    def sleeping(self) -> bool: ...

    def wake(self) -> None: ...


class Poster:
    """The posting state of one engine: lanes waiting for the progress thread, posters
    at work, the wake-up due, and the counts :class:`Diagnostics` reports."""

    def __init__(
        self, lock: threading.RLock, sq_depth: int, planner: Planner, host: PostingHost
    ) -> None:
        self._lock = lock
        self.sq_depth = sq_depth
        self._planner = planner
        self._host = host
        self._waker: Waker = _NoWaker()
        # A waiter's own reap (reap_inline): the send CQ and what handles its rows, given
        # by attach(); read per call, so held here rather than asked of the host.
        self._send_cq: SendQueue | None = None
        self._reap_rows: Callable[[list[tuple[int, int, int, int]]], int] = _reap_nothing
        self.closed = False  # set by the engine's close(), under the lock
        # Lanes whose backlog the progress thread posts, whether it was woken for them,
        # and a wake-up asked for under the lock (sent once it is free, wake_if_due).
        self.to_post: dict[int, Lane] = {}
        self.post_wake = False
        self.wake_due = False
        self.posters = 0  # batches, direct posts and connections being made, out now
        self.post_cv = threading.Condition(lock)  # close() waits on it for posters
        # When a waiter last reaped send completions itself (monotonic); while that is
        # recent the progress thread does not arm the send CQ (see Progress).
        self.driven_at = 0.0
        self.send_posts = 0  # post_send calls for transfers, and the WRs they carried
        self.posted_wrs = 0
        self.slot_messages = 0  # single async requests through a lane's ring
        # Blocking single requests posted and polled by their caller (SinglePaths._solo),
        # and those on a direct lane (a lent channel's call; not in direct_posts).
        self.direct_posts = 0
        self.lane_posts = 0  # (counted without the lock: approximate under races)

    def attach(
        self,
        waker: Waker,
        send_cq: SendQueue,
        reap_rows: Callable[[list[tuple[int, int, int, int]]], int],
    ) -> None:
        """The progress thread, the send CQ and its reaper, once they exist."""
        self._waker = waker
        self._send_cq = send_cq
        self._reap_rows = reap_rows

    def close_ring_chunk(self, ring: LaneRing | None) -> None:
        """End ``ring``'s open chunk, if it has one, where its last message went (lock
        held): its stop, its signal groups (one per message) and the diagnostics' count,
        which its messages do not update one by one.  No message joins it afterwards."""
        chunk = ring.open if ring is not None else None
        if chunk is None:
            return
        assert ring is not None
        size = ring.written - ring.open_at
        chunk.stop = chunk.start + size
        chunk.groups = size
        self.slot_messages += size
        ring.open = None

    def start_post(self, lane: Lane, *, defer: bool) -> Batch | None:
        """Reserve the next batch of ``lane``'s backlog for this thread to post (lock held).

        None when a batch of the lane is already out (its poster takes the rest next),
        when nothing fits, or with ``defer``: then the progress thread posts, and what
        callers queue meanwhile goes out with it in one ``post_send`` (coalescing) while
        they go on running Python.  Blocking calls post to an idle queue pair themselves
        (one thread hand-off less), and so does a waiter that finds a lane waiting for
        the progress thread (:meth:`reap_inline`): two threads then post at once, each
        to its own lane.
        """
        window = lane.window
        if window.poster or not window.backlog:
            return None
        if defer:
            self.want_post(lane)
            return None
        chunk = window.head
        self.close_ring_chunk(lane.ring)  # none of it is taken while it may still grow
        try:
            batch = lane.take_batch(self.sq_depth)
        except HixlError as exc:
            culprit = chunk.handle if chunk is not None else None
            self._host.fail(lane.conn, f"post_send refused: {exc}", exc, culprit=culprit)
            return None
        if batch is not None:
            self.posters += 1
            self.send_posts += 1  # counted when reserved: completions may beat the post
            self.posted_wrs += sum(hi - lo for _, lo, hi in batch.pieces)
        return batch

    def start_posts(self, lanes: list[Lane], now: bool) -> tuple[Lane, Batch | None]:
        """After queueing a transfer's parts on ``lanes`` (lock held): reserve the first
        lane's batch for this thread when ``now`` and that lane is idle, and hand the
        others to the progress thread (or a waiter, see :meth:`reap_inline`)."""
        order = list(dict.fromkeys(lanes))
        lane = order[0]
        batch = self.start_post(lane, defer=not now or lane.window.in_flight > 0)
        for other in order[1:]:
            self.start_post(other, defer=True)
        return lane, batch

    def want_post(self, lane: Lane) -> None:
        """Have the progress thread post ``lane``'s backlog (lock held).

        An application thread sends the wake-up this may ask for (:meth:`wake`) once it
        has let go of the lock: sending is a system call, and it releases the GIL.
        """
        self.to_post[lane.qpn] = lane
        # A thread that is not sleeping sees to_post before it sleeps (Progress.step
        # looks again after saying it sleeps), so only a sleeping one needs the byte.
        if not self.post_wake and self._waker.sleeping:
            self.post_wake = True
            self.wake_due = True

    def post_or_wake(self, lane: Lane, batch: Batch | None) -> None:
        """After queueing (lock let go): send the wake-up the hand-over asked for, then
        post the batch this thread reserved.  Waking first lets the progress thread post
        the other lanes while this thread posts its own (on rxe a post does the sending)."""
        if self.wake_due:
            self.wake()
        if batch is not None:
            self.post(lane, batch)

    def wake(self) -> None:
        """Send the wake-up :meth:`want_post` asked for (lock not held)."""
        self.wake_due = False
        self._waker.wake()

    def wake_if_due(self) -> None:
        """Send the wake-up that work queued under the lock asked for (lock not held)."""
        if self.wake_due:
            self.wake()

    def post(self, lane: Lane, batch: Batch) -> None:
        """Post a reserved batch outside the lock, then settle it under the lock.

        The chains of chunks that went out whole go to the planner, to be pooled by a
        caller (the provider copied their WRs).  A refusal fails the connection.  What was queued
        meanwhile is left to the progress thread.
        """
        err: HixlError | None = None
        try:
            lane.post_batch(batch)
        except HixlError as exc:
            err = exc
        if batch.finished:
            self._planner.posted(batch.finished)  # pooled later, by a caller
        chunk = batch.finished[0] if batch.finished else None
        with self._lock:
            for done in batch.finished:
                ring = done.ring
                if ring is not None:  # the provider copied its slots: free again
                    ring.released += done.stop - done.start
            self.settle_locked(lane, err, chunk.handle if chunk is not None else None)
            self.release_poster()
        if self.wake_due:
            self.wake()

    def release_poster(self) -> None:
        """This thread's post (a batch, or a direct post and its wait) is over (lock
        held); :meth:`close` waits for the last one."""
        self.posters -= 1
        if self.closed and not self.posters:
            self.post_cv.notify_all()

    def settle_locked(
        self, lane: Lane, err: HixlError | None, culprit: TransferHandle | None
    ) -> None:
        """After a post to ``lane`` returned (lock held): end its batch, fail the
        connection if the provider refused it (``culprit``: the transfer that gets
        ``err``), or hand the backlog queued meanwhile to the progress thread.  The
        caller stops counting as a poster itself."""
        conn = lane.conn
        lane.window.end_batch()
        if err is not None:
            self._host.fail(conn, f"post_send failed: {err}", err, culprit=culprit)
        elif lane.window.backlog and conn.state is ConnState.READY:
            self.want_post(lane)
        if conn.state is ConnState.CLOSED:
            self.wake_due = True  # free it now that nobody posts to it

    def post_pending(self) -> bool:
        """Progress thread: post the lanes waiting for it; True if more waits.

        One lane at a time, oldest first, each taken under the lock just before its
        post: a waiter that looks meanwhile takes another (:meth:`reap_inline`), and
        the two posts run at once.  Lanes queued during this call wait for the next.
        """
        with self._lock:
            self.post_wake = False
            count = len(self.to_post)
        for _ in range(count):
            with self._lock:
                if not self.to_post:
                    break
                lane = self.to_post.pop(next(iter(self.to_post)))
                batch = self.start_post(lane, defer=False)
            if batch is not None:
                self.post(lane, batch)
        return bool(self.to_post)

    def reap_inline(self, now: float) -> bool:
        """A waiter reaps send completions itself (no hand-off); True: worth spinning on.

        Skips the reaping when the lock is busy (the progress thread is reaping, most
        likely).  A lane whose backlog waits for the progress thread is posted by the
        waiter itself, so two threads post at once.  Spinning stops paying once only a
        batch being posted is left: the completions the waiter wants then come after
        that post, and a spinning waiter only takes the CPU and the GIL the poster needs
        (on rxe the post itself does the sending).  ``now``: the waiter's clock reading
        (``time.monotonic()``), or 0.0 when it is about to sleep on its handle, and the
        progress thread is woken to watch the completion queue.
        """
        if not now:
            self.driven_at = 0.0
            # A progress thread that is not sleeping arms the send CQ before it sleeps
            # (Progress.step looks at driven_at again after saying it sleeps): only a
            # sleeping one needs the wake-up, a system call that wakes a thread.
            if self._waker.sleeping:
                self._waker.wake()
            return False
        self.driven_at = now
        if not self._lock.acquire(blocking=False):
            return True
        lane: Lane | None = None
        batch: Batch | None = None
        try:
            if self.closed or self._send_cq is None:
                return False
            self._reap_rows(self._send_cq.poll_rows(POLL_BATCH))
            if not self.to_post:
                return not self.posters
            # A lane waits for the progress thread: post it from here, beside whatever
            # that thread posts (on rxe the post does the sending, and two threads on
            # two lanes send twice as much).
            _, lane = self.to_post.popitem()
            if not self.to_post:
                # The wake-up sent for it (if any) finds nothing now: the next hand-over
                # must send its own, or the progress thread sleeps through it.
                self.post_wake = False
            batch = self.start_post(lane, defer=False)
        except HixlError:
            return False
        finally:
            self._lock.release()
            if self.wake_due:
                self.wake()
        if batch is not None:
            self.post(lane, batch)
        return True


class _NoWaker:
    """Until the progress thread exists: nobody sleeps, nobody is woken."""

    sleeping = False

    def wake(self) -> None:
        pass


def _reap_nothing(rows: list[tuple[int, int, int, int]]) -> int:
    return 0
