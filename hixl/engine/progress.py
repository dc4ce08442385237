"""The progress thread: completions, control traffic, deadlines and the listener.

One thread per engine sleeps in a selector on the completion channels' descriptors,
the listening socket, every unfinished handshake's socket, every connection's control
socket and a wake-up socket pair, so
it releases the GIL while idle and wakes at once for a completion, a peer's message,
an incoming connection or a control message to send.  It wakes every 20 ms while
transfers are pending (deadlines) and every 100 ms otherwise.  Where completion
channels are not available it polls the CQs with a back-off of up to 2 ms instead.

Each round: poll the CQs that may hold something (arming the drained ones, then
polling once more for what completed before the arming), expire transfers past their
deadline, post what callers left queued (:meth:`Poster.post_pending`), then wait.
The send CQ is not armed while nothing is pending, nor while a waiter has reaped it
within :data:`DRIVEN_S` (``Poster.driven_at``): the waiter gets its completions without
an event, a channel read and a re-arm on this thread, and this thread looks again after
:data:`DRIVEN_S`.
Socket reads and writes, arming a CQ, reading its channel and posting happen outside
the engine lock (each is a system call on rxe); reaping takes it.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from hixl.core.states import ConnState
from hixl.engine.handshake import Incoming, Listener
from hixl.engine.locks import assert_unlocked
from hixl.engine.posting import POLL_BATCH
from hixl.errors import HixlError
from hixl.verbs import adapter as verbs

if TYPE_CHECKING:
    from hixl.engine.connection import Connection
    from hixl.engine.posting import Poster
    from hixl.engine.reaping import SendReaper

__all__ = ["Progress", "ProgressHost"]

log = logging.getLogger("hixl.engine")

IDLE_MAX = 0.002  # longest sleep when the thread has to poll, seconds
SLEEP_PENDING = 0.02  # with completion events: longest sleep while transfers are pending
SLEEP_IDLE = 0.1  # ... and with nothing pending
SWEEP_EVERY = 0.05  # how often unfinished handshakes are checked against their deadlines
#: Seconds after a waiter last reaped the send CQ on its own thread during which the
#: progress thread does not arm that CQ (no event per completion for it to handle); it
#: looks again after this long.
DRIVEN_S = 0.002
_WAKE = object()  # selector key data of the socket that wakes the thread
_LISTENER = object()


class ProgressHost(Protocol):
    """What the progress thread calls on its engine's side (the connection table).

    The thread holds it only weakly between rounds, so an engine the application forgets
    to close is still collected (and warns, and closes).
    """

    @property
    def id(self) -> str: ...

    @property
    def lock(self) -> AbstractContextManager[bool]: ...

    @property
    def closed(self) -> bool: ...

    @property
    def incoming(self) -> Listener | None: ...

    @property
    def regions_due(self) -> float | None:
        """When region changes held back by their pace may go (see flush_outboxes)."""
        ...

    def has_pending(self) -> bool: ...

    def reap_recv(self, wcs: list[verbs.Completion]) -> int: ...

    def flush_outboxes(self) -> None: ...

    def flush_control(self, conn: Connection) -> None: ...

    def read_control(self, conn: Connection) -> None: ...

    def died(self, exc: BaseException) -> None: ...


class Progress:
    """The selector, wake-up pair and thread of one engine."""

    def __init__(
        self,
        engine: ProgressHost,
        listener: socket.socket | None,
        cqs: tuple[verbs.CompletionQueue, verbs.CompletionQueue],
        events: bool,
        poster: Poster,
        reaper: SendReaper,
    ) -> None:
        self._poster = poster
        self._reaper = reaper
        self._selector = selectors.DefaultSelector()
        self._listener = listener
        if listener is not None:
            self._selector.register(listener, selectors.EVENT_READ, _LISTENER)
        self.send_cq, self.recv_cq = cqs
        # Completion events wake the thread (no polling while idle) where the device's
        # completion channels could be opened; otherwise it polls with a back-off.
        self.events = events and all(cq.fd is not None for cq in cqs)
        self._armed: set[verbs.CompletionQueue] = set()
        self._left_to_callers = False  # the last round left the send CQ unarmed to callers
        if self.events:
            for cq in cqs:
                assert cq.fd is not None
                self._selector.register(cq.fd, selectors.EVENT_READ, cq)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._stop = threading.Event()
        # Control sockets not read until then (monotonic), see pause().
        self._paused: dict[Connection, float] = {}
        self.sleeping = False  # in select(), or about to be
        self._next_expiry_check = 0.0
        self._next_sweep = 0.0
        # The thread holds this and the host only weakly between rounds (see ProgressHost).
        self.thread = threading.Thread(
            target=_loop,
            args=(weakref.ref(self), weakref.ref(engine), self._stop),
            name=f"hixl-progress-{engine.id}",
            daemon=True,
        )

    def start(self) -> None:
        self.thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Make the thread run a round now.  Any thread without the engine lock (the
        send is a system call); never blocks."""
        assert_unlocked("the progress thread's wake-up byte")
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def watch(self, conn: Connection) -> None:
        """Watch ``conn``'s control socket (for reading unless paused, and writing while it
        has output)."""
        assert conn.sock is not None
        read = 0 if conn in self._paused else selectors.EVENT_READ
        mask = read | (selectors.EVENT_WRITE if conn.wants_write else 0)
        if not mask:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            return
        try:
            self._selector.modify(conn.sock, mask, conn)
        except KeyError:
            self._selector.register(conn.sock, mask, conn)

    def unwatch(self, conn: Connection) -> None:
        self._paused.pop(conn, None)
        if conn.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)

    def pause(self, conn: Connection, seconds: float) -> None:
        """Stop reading ``conn``'s control socket for ``seconds`` (its peer went over its
        budget, see ``Connection.inflow``).  Progress thread only."""
        until = time.monotonic() + seconds
        self._paused[conn] = max(until, self._paused.get(conn, until))
        if conn.sock is not None:
            self.watch(conn)

    def _charge_work(self, conn: Connection, work: float) -> None:
        """Charge ``conn``'s budget with the CPU seconds its messages just took on this
        thread; past its share its socket is not read until the share is back."""
        if conn.sock is None or conn.state is ConnState.CLOSED:
            return
        pause = conn.inflow.charge(0, 0, time.monotonic(), work)
        if pause > 0:
            self.pause(conn, pause)

    def _resume(self, engine: ProgressHost, now: float) -> float | None:
        """Read again the sockets whose pause is over; the next pause's end, if any."""
        later = None
        for conn, until in list(self._paused.items()):
            if until > now:
                later = until if later is None else min(later, until)
                continue
            del self._paused[conn]
            with engine.lock:
                if conn.sock is not None and conn.state is not ConnState.CLOSED:
                    self.watch(conn)
        return later

    def register(self, sock: socket.socket, data: object, mask: int) -> None:
        """Watch ``sock`` for ``mask`` with ``data`` as its key data (a handshake)."""
        try:
            self._selector.modify(sock, mask, data)
        except KeyError:
            self._selector.register(sock, mask, data)

    def unregister(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def stop(self) -> None:
        """Stop the thread and wait for it (unless called from it)."""
        self._stop.set()
        self.wake()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout=10)

    def close(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- one round -------------------------------------------------------------------------
    def step(self, engine: ProgressHost, idle: float) -> bool:
        """One round; True when there was work to do.

        With completion events the thread sleeps in the selector until a completion,
        control traffic or the next deadline check; ``idle`` (the polling back-off)
        only matters without them.
        """
        busy = False
        # One clock reading per round (in a VM without a usable TSC each is a system
        # call); the expiry check and the sweep may see it a reap late.
        now = time.monotonic()
        try:
            if self.events:
                if engine.closed:
                    return False
                busy = self._poll_events(engine, now)  # takes the lock to reap, not to arm
            with engine.lock:
                if engine.closed:
                    return False
                if not self.events:
                    busy |= self._reaper.reap_send(self.send_cq.poll_rows(POLL_BATCH)) == POLL_BATCH
                    busy |= engine.reap_recv(self.recv_cq.poll(POLL_BATCH)) == POLL_BATCH
                if now >= self._next_expiry_check:
                    self._reaper.expire(now)
                    self._next_expiry_check = now + 0.01
                if busy:
                    timeout = 0.0
                elif self._left_to_callers:
                    timeout = DRIVEN_S
                elif self.events:
                    timeout = SLEEP_PENDING if engine.has_pending() else SLEEP_IDLE
                else:
                    timeout = idle
            poster = self._poster
            if poster.to_post and poster.post_pending():  # outside the lock
                timeout = 0.0  # more was queued meanwhile: post it after the next reap
            incoming = engine.incoming
            if (
                incoming is not None
                and (incoming.pending or incoming.waiting)
                and now >= self._next_sweep
            ):
                incoming.sweep(now)  # handshake deadlines and liveness probes
                self._next_sweep = now + SWEEP_EVERY
            if self._paused:
                later = self._resume(engine, now)
                if later is not None:
                    timeout = min(timeout, max(0.0, later - now))
            due = engine.regions_due
            if due is not None:
                if due <= now:
                    engine.flush_outboxes()  # seals the region changes now due, sends them
                else:
                    timeout = min(timeout, due - now)
            # Control messages queued under the lock during this round (answers, region
            # updates, connections dropped) are sent once it is free: wake this thread's
            # own selector rather than sleep on them.
            poster.wake_if_due()
            self.sleeping = True  # from here, callers wake this thread for posting
            if poster.to_post:
                timeout = 0.0
            elif (
                self.events
                and not poster.driven_at
                and self.send_cq not in self._armed
                and engine.has_pending()
            ):
                # A waiter went to sleep since the poll above left the send CQ unarmed;
                # it did not wake this thread (Poster.reap_inline): arm the CQ now.
                timeout = 0.0
            try:
                events = self._selector.select(timeout=timeout)
            finally:
                self.sleeping = False
            # Handshakes and everything else first, peers' control messages last: a
            # handshake step that became ready with a flood's read is not put behind it.
            events.sort(key=_control_last)
            for key, mask in events:
                data = key.data
                if data is _LISTENER:
                    if incoming is not None:
                        incoming.accept()
                elif isinstance(data, Incoming):
                    if incoming is not None:
                        incoming.on_event(data, mask)
                elif data is _WAKE:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    engine.flush_outboxes()
                elif isinstance(data, verbs.CompletionQueue):
                    # The channel is this thread's alone: no engine lock for the read
                    # and the acknowledgement (two system calls).
                    if data.take_event():
                        self._armed.discard(data)
                    busy = True
                else:
                    if mask & selectors.EVENT_WRITE:
                        engine.flush_control(data)
                    if mask & selectors.EVENT_READ:
                        started = time.thread_time()
                        engine.read_control(data)
                        self._charge_work(data, time.thread_time() - started)
                    busy = True
        except HixlError as exc:
            log.warning("progress loop: %s", exc)
        except (OSError, ValueError, KeyError) as exc:
            if not self._stop.is_set():
                log.warning("progress loop: unexpected %s: %s", type(exc).__name__, exc)
        return busy

    def _poll_events(self, engine: ProgressHost, now: float) -> bool:
        """Poll the CQs that may hold something, arm the drained ones.  True if more is queued.

        An armed CQ whose event has not fired holds nothing new, so it is skipped.  A CQ
        that a poll drains (fewer than a full batch) is armed at once and polled once more,
        for what completed before the arming; after that the thread may sleep.
        """
        busy = False
        send = self.send_cq
        self._left_to_callers = False
        reapers = ((send, self._reap_send), (self.recv_cq, self._reap_recv))
        for cq, reap in reapers:
            if cq in self._armed:
                continue
            if reap(engine) == POLL_BATCH:
                busy = True  # maybe more queued: poll again before arming
                continue
            if cq is send and not engine.has_pending():
                # Nothing pending: no event wanted.  A transfer started from now on either
                # wakes this thread (posting is handed over) or is waited on by a caller
                # that reaps its own completion and wakes this thread before it sleeps.
                continue
            if cq is send and now - self._poster.driven_at < DRIVEN_S:
                # A waiter is reaping on its own thread: no event for this thread; look
                # again in DRIVEN_S.  A waiter about to sleep clears driven_at and wakes
                # this thread, which then arms.
                self._left_to_callers = True
                continue
            cq.arm()  # a system call on rxe: outside the engine lock
            self._armed.add(cq)
            if reap(engine) == POLL_BATCH:
                self._armed.discard(cq)  # more may be queued from before the arming
                busy = True
        return busy

    def _reap_send(self, engine: ProgressHost) -> int:
        with engine.lock:
            return (
                0 if engine.closed else self._reaper.reap_send(self.send_cq.poll_rows(POLL_BATCH))
            )

    def _reap_recv(self, engine: ProgressHost) -> int:
        with engine.lock:
            return 0 if engine.closed else engine.reap_recv(self.recv_cq.poll(POLL_BATCH))


def _control_last(event: tuple[selectors.SelectorKey, int]) -> bool:
    data = event[0].data
    return not (
        data is _LISTENER or data is _WAKE or isinstance(data, (Incoming, verbs.CompletionQueue))
    )


def _loop(
    progress_ref: weakref.ref[Progress],
    engine_ref: weakref.ref[ProgressHost],
    stop: threading.Event,
) -> None:
    """Body of an engine's progress thread: rounds with an idle back-off of up to 2 ms.

    An exception that escapes a round kills the loop: every pending transfer then fails
    with an error that says so, rather than waiting for a thread that is gone.
    """
    idle = 0.0
    while not stop.is_set():
        progress, engine = progress_ref(), engine_ref()
        if progress is None or engine is None:
            return
        try:
            busy = progress.step(engine, idle)
        except BaseException as exc:
            log.exception("progress thread of %s died", engine.id)
            engine.died(exc)
            return
        del progress, engine
        idle = 0.0 if busy else min(IDLE_MAX, idle * 2 + 0.00005)
