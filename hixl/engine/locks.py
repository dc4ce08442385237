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

``HIXL_DEBUG_LOCKS=1`` in the environment (read once, at import) keeps every engine lock
made from then on in a table of weak references, and makes :func:`assert_unlocked`
(called before every socket send and every wake-up byte) raise :class:`AssertionError`
when the calling thread owns one of them.  The locks stay plain
:class:`threading.RLock` objects: taking and releasing one costs the same either way,
and the check itself is one ``_is_owned()`` per live engine, paid only at a send or a
wake-up.  Off, :func:`assert_unlocked` costs one global read.  ``make test-rdma
DEBUG_LOCKS=1`` runs the RDMA tier with it on; the default tier turns it on for the
engines of ``tests/rdma/test_locking.py`` only.
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["DEBUG_LOCKS", "assert_unlocked", "engine_lock"]

DEBUG_LOCKS = os.environ.get("HIXL_DEBUG_LOCKS", "") == "1"

# The engine locks made while DEBUG_LOCKS was on (weak: a closed engine's goes with it).
_checked: set[weakref.ref[threading.RLock]] = set()


def engine_lock() -> threading.RLock:
    """A new engine lock (a reentrant :class:`threading.RLock`); under
    ``HIXL_DEBUG_LOCKS=1`` also one that :func:`assert_unlocked` checks."""
    lock = threading.RLock()
    if DEBUG_LOCKS:
        _checked.add(weakref.ref(lock, _checked.discard))
    return lock


def assert_unlocked(what: str) -> None:
    """Under ``HIXL_DEBUG_LOCKS=1``: raise if this thread holds an engine lock.

    Called before each system call that must never run under the lock (socket sends,
    the progress thread's wake-up byte); ``what`` names it in the message.
    """
    if DEBUG_LOCKS:
        for ref in tuple(_checked):  # a copy: other threads add and drop locks meanwhile
            lock = ref()
            if lock is not None and lock._is_owned():  # type: ignore[attr-defined]
                raise AssertionError(f"{what} with an engine lock held (HIXL_DEBUG_LOCKS=1)")
