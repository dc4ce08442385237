"""The transfer engine: registered memory, connections, one-sided put/get, notifications.

Modules
-------
``engine``      the :class:`Engine` facade: builds the parts, delegates each public call
``transfers``   the engine's data calls (put, get, batches, KV blocks, notifications)
``host``        :class:`~hixl.engine.host.Parts`: the host protocol of every part, in one
``peers``       the connection table: admission, adoption, failure, control messages, credits
``regions``     :class:`Access`, :class:`Region`, the region table, what a buffer is
``connection``  one peer: queue pair, send window, receive slots, control channel
``handshake``   the connection handshake, client and server side
``datapath``    requests to work requests: checks, cached plans, notification buffers
``progress``    the progress thread: completions, control traffic, deadlines, listener
``handles``     :class:`TransferRequest`, :class:`TransferHandle`, :class:`TransferStatus`
``channel``     :class:`Channel`: one thread's blocking puts/gets on a connection's direct lane
``kv``          :class:`KVCache`: register_kv and put_blocks/get_blocks (a request's KV blocks)

Theory of operation
-------------------
An engine owns one verbs device (PD), one send CQ and one receive CQ shared by all its
connections, and one progress thread.  A connection is one RC queue pair plus the TCP
socket its handshake ran on, which stays open as the control channel (region updates,
goodbyes) and tells at once when the peer process dies (EOF).

``put``/``get`` plan the transfer with the pure core (:mod:`hixl.core.plan`), check local
and remote bounds, access and alignment *before* anything is posted, and queue the work
requests in the connection's backlog.  One thread at a time per connection (its
*poster*: the progress thread, or a blocking call on an idle queue pair) reserves what
the send queue has room for under the lock -- many transfers' chunks at once -- and posts
it with one ``post_send`` outside the lock; only the batch's last chunk is signaled, as an
RC queue completes in order.  A
notification is a SEND posted right after a transfer's data on the same queue pair, so
the target sees it only when every byte before it has landed.

The first completion error on a connection fails the transfer that owns it with
:class:`~hixl.errors.CompletionError`, moves the queue pair to ERR (flushing the rest, so
no late DMA touches user memory) and marks the connection FAILED; its other transfers
fail with :class:`~hixl.errors.ConnectionFailed`.  A transfer past its deadline does the
same with :class:`~hixl.errors.TransferTimeout`.  Other connections are not affected.

Threads and locks
-----------------
Threads: application threads (any number) and the progress thread (one per engine).
Incoming handshakes need no thread: the progress thread drives each on a non-blocking
socket (:class:`~hixl.engine.handshake.Listener`); ``connect`` runs the client side in
the calling thread.

The engine lock (an RLock made by :func:`hixl.engine.locks.engine_lock`, shared by every
part of one engine; ``Peers.notify_cv`` is a condition on it) guards the engine's tables
and every connection's bookkeeping: the region table, the connection tables (by peer id
and by QPN), the set of pending handles, the notification queue, the
notification send slots and per-peer counts, the exposed-region index, each connection's
state, send window (including its *poster* flag, which lets one thread at a time post
a reserved batch, so chunks go out in order), control outbox and probe fields.  Held for
dictionary updates, counters, reserving a batch and state moves.  **Never held across
socket I/O, a sleep, a wait on another thread, or a system call on the data path**:
``ibv_post_send`` of a batch, arming a CQ and reading its channel, and making a
connection's queue pairs run without it (the condition's own wait releases it).  The few
system calls that stay under it (``ibv_reg_mr``/``ibv_dereg_mr``, ``ibv_modify_qp`` to
ERR, re-posting a receive, ``ibv_poll_cq`` of the shared CQs, ``epoll_ctl``) are listed
with their reasons in :mod:`hixl.engine.locks`, which also holds the
``HIXL_DEBUG_LOCKS=1`` switch that checks the rule.
Control messages (REGIONS, BYE) are queued in the connection's outbox under the lock and
written by the progress thread with non-blocking sends; a peer that leaves more than
``MAX_OUTBOX`` bytes unread fails.  Handshakes run on their own sockets without the lock
and take it only to admit (limits, probe, queue pair), index or adopt a connection.  The
listener's own tables (handshakes under way, per-source counts) belong to the progress
thread alone and need no lock.

Handles are finished under the engine lock.  ``handles._handle_lock`` only lets two
waiters of one handle make a single Event; it is taken alone, never with another lock
held.  A waiter that makes the Event reads the status again afterwards: ``finish`` writes
the status before it reads the Event, so one of the two sees the other.

Lock order: ``hixl.compat`` locks, then the engine lock.  Nothing takes them in another
order.  The wake-up byte that hands a backlog to the progress thread is sent after the
lock is let go (``Poster.wake_if_due``).

Lock-free reads, each a single atomic operation on an immutable value under the GIL:
``Engine.connection()`` (one dict lookup), a connection's ``remote_regions`` (a tuple
swapped whole), a region's keys, and ``TransferHandle.status``.  Planning and building
work requests use only these, so they run outside the lock while the progress thread
keeps reaping completions.

An unexpected exception in a progress round is logged at WARNING and the loop goes on;
one that escapes the loop kills it, and then every pending transfer fails with a
:class:`~hixl.errors.StateError` saying so, as does every later call.

Lifetimes
---------
``Engine.close()`` fails every pending transfer, says goodbye to every peer, stops the
listener and the progress thread, and closes all verbs objects (QPs, MRs, CQs, PD,
context).  It may be called twice; an engine collected while open warns with
``ResourceWarning``.
"""

from hixl.core.notify import Notification
from hixl.core.states import ConnState
from hixl.core.wire import RemoteRegion
from hixl.engine.channel import Channel
from hixl.engine.connection import Connection
from hixl.engine.engine import Diagnostics, Engine
from hixl.engine.handles import TransferHandle, TransferRequest, TransferStatus
from hixl.engine.kv import BlocksHandle, KVCache
from hixl.engine.regions import Access, Region

__all__ = [
    "Access",
    "BlocksHandle",
    "Channel",
    "Connection",
    "ConnState",
    "Diagnostics",
    "Engine",
    "KVCache",
    "Notification",
    "Region",
    "RemoteRegion",
    "TransferHandle",
    "TransferRequest",
    "TransferStatus",
]
