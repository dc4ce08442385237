"""The engine lock, and a debug switch that checks what runs outside it.

Every engine has one reentrant lock (:func:`engine_lock`), made by the engine and given
to each of its parts.  It guards bookkeeping: the region table
(:class:`~hixl.engine.regions.RegionTable`), the connection tables by id and by QPN, the
notification queue and credits (:class:`~hixl.engine.peers.Peers`), pending handles, the
posting state (:class:`~hixl.engine.posting.Poster`), kept templates
(:class:`~hixl.engine.single.SinglePaths`), and each connection's state, send windows
and control outbox.  Order: a ``hixl.compat`` lock, then the engine lock;
``handles._handle_lock`` is taken alone.

Never under it: a socket send or receive (control messages are queued in an outbox and
sent by the progress thread), the progress thread's wake-up byte (marked due under the
lock and sent by whoever lets go of it, ``Poster.wake_if_due``), ``ibv_post_send``,
arming a CQ or reading its channel, making a connection's queue pairs, CQ, receive MR
and receive slots (made first, then indexed under the lock), a sleep, a wait on another
thread (a condition's ``wait`` releases it).

The system calls that do run under it, each for a reason:

- ``ibv_reg_mr`` (``RegionTable.add``): the same memory registered twice at once must
  give one region, so the table is checked and filled in one step with the key it holds.
- ``ibv_dereg_mr`` (``RegionTable.remove``): the key leaves the region table and the
  exposed set in the same step as it stops working, so no lookup under the lock finds a
  dead key.
- ``ibv_modify_qp`` to ERR (``Peers.fail``, ``Peers.drop``): the state moves to
  FAILED/CLOSED and the queue pair stops in one step, so a batch reserved under the lock
  before it is flushed and none is reserved after it.
- ``ibv_post_recv`` (``Peers.reap_recv``, a notification slot re-posted after its
  completion): the slot is decoded and handed back in the same step as its completion
  is reaped, in order.
- ``ibv_poll_cq`` of the shared CQs (progress rounds, ``Poster.reap_inline``, ``Peers``
  on a peer's BYE): completions are matched to windows and handles in queue order (rxe
  polls in user space).
- ``epoll_ctl`` (``Progress.watch``/``unwatch``/``pause``, called by ``Peers``): a
  connection's socket leaves the selector in the same step as the connection closes, so
  the progress thread never selects on a closed one.

``HIXL_DEBUG_LOCKS=1`` in the environment (read once, at import) makes every engine
lock a :class:`CheckedRLock`, which counts per thread how many engine locks it holds,
and makes :func:`assert_unlocked` (called before every socket send and every wake-up
byte) raise :class:`AssertionError` when the calling thread holds one.  Off, an engine
lock is a plain :class:`threading.RLock` and :func:`assert_unlocked` costs one global
read.  ``make test-rdma DEBUG_LOCKS=1`` runs the RDMA tier with it on; the default
tier turns it on for the engines of ``tests/rdma/test_locking.py`` only.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

__all__ = ["DEBUG_LOCKS", "CheckedRLock", "assert_unlocked", "engine_lock"]

DEBUG_LOCKS = os.environ.get("HIXL_DEBUG_LOCKS", "") == "1"

_held = threading.local()  # .count: engine locks this thread holds (CheckedRLock only)


def _count() -> int:
    count: int = getattr(_held, "count", 0)
    return count


class CheckedRLock:
    """A reentrant lock that knows its owner and tells :func:`assert_unlocked` about it.

    It offers what :class:`threading.Condition` uses of a lock (``_is_owned``,
    ``_release_save``, ``_acquire_restore``), so a condition built on it waits with the
    lock fully released, as one on an ``RLock`` does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner, self._depth = me, 1
        _held.count = _count() + 1
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("cannot release an engine lock this thread does not hold")
        self._depth -= 1
        if not self._depth:
            self._owner = None
            _held.count = _count() - 1
            self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def held(self) -> bool:
        """Whether the calling thread holds this lock."""
        return self._owner == threading.get_ident()

    # What threading.Condition calls on its lock.
    def _is_owned(self) -> bool:
        return self.held()

    def _release_save(self) -> Any:
        depth = self._depth
        self._owner, self._depth = None, 0
        _held.count = _count() - 1
        self._lock.release()
        return depth

    def _acquire_restore(self, depth: Any) -> None:
        self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), int(depth)
        _held.count = _count() + 1


def engine_lock() -> threading.RLock:
    """A new engine lock: checked under ``HIXL_DEBUG_LOCKS=1``, else a plain RLock.

    Typed as an RLock: a :class:`CheckedRLock` offers all of it that the engine and
    :class:`threading.Condition` use.
    """
    return cast(threading.RLock, CheckedRLock()) if DEBUG_LOCKS else threading.RLock()


def assert_unlocked(what: str) -> None:
    """Under ``HIXL_DEBUG_LOCKS=1``: raise if this thread holds an engine lock.

    Called before each system call that must never run under the lock (socket sends,
    the progress thread's wake-up byte); ``what`` names it in the message.
    """
    if DEBUG_LOCKS and _count():
        raise AssertionError(f"{what} with an engine lock held (HIXL_DEBUG_LOCKS=1)")
