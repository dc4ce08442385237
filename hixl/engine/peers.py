"""An engine's connections: the table, admission and adoption, failure and release, the
control messages, and the notifications received and their credits.

One :class:`Peers` per engine.  It is the host the handshake and the progress thread call
(:class:`~hixl.engine.handshake.HandshakeHost`, :class:`~hixl.engine.progress.ProgressHost`)
and what a :class:`~hixl.engine.connection.Connection` is made with.  Every method that
says "lock held" expects the engine lock; the others take it themselves.  A wake-up marked
due under the lock is sent after it is released (``Poster.wake_if_due``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from hixl.core import notify as _notify
from hixl.core import wire
from hixl.core.notify import Notification
from hixl.core.seal import IntegrityError, Opener, Sealer
from hixl.core.states import ConnEvent, ConnState
from hixl.core.window import Chunk
from hixl.core.wire import RemoteRegion
from hixl.engine.connection import Connection, Lane
from hixl.engine.handles import TransferHandle
from hixl.engine.handshake import (
    PROBE_S,
    Admission,
    Listener,
    client_handshake,
    error_frame,
    escape,
    printable,
)
from hixl.engine.inbox import Inbox
from hixl.engine.posting import POLL_BATCH, Poster
from hixl.engine.progress import Progress
from hixl.engine.reaping import SendReaper
from hixl.engine.regions import RegionTable
from hixl.errors import (
    ArgumentError,
    ConnectionFailed,
    HandshakeError,
    HixlError,
    RegistryUnavailable,
    StateError,
    TransferTimeout,
)
from hixl.verbs import adapter as verbs

if TYPE_CHECKING:
    from hixl.engine.datapath import NotifySlots
    from hixl.engine.names import Names

__all__ = ["Peers"]

log = logging.getLogger("hixl.engine")


class Peers:
    """The connections of one engine and everything that happens to them."""

    def __init__(
        self,
        engine_id: str,
        token: bytes | None,
        lock: threading.RLock,
        device: verbs.Device,
        *,
        qp_timeout: int,
        sq_depth: int,
        cqs: tuple[verbs.CompletionQueue, verbs.CompletionQueue],
        lanes: int,
        direct_lane: bool,
        max_peers: int,
        conns: dict[str, Connection],
        by_qpn: dict[int, Lane],
        handles: set[TransferHandle],
        inbox: Inbox,
        regions: RegionTable,
        notify_slots: NotifySlots,
        poster: Poster,
        reaper: SendReaper,
        forget: Callable[[list[Connection]], None],
    ) -> None:
        self.id = engine_id
        self.token = token
        self.lock = lock
        self.notify_cv = threading.Condition(lock)  # a notification arrived
        self.credit_cv = threading.Condition(lock)  # notification credits came back
        # What a Connection is made with (ConnectionHost).
        self.device = device
        self.qp_timeout = qp_timeout
        self.sq_depth = sq_depth
        self.send_cq, self.recv_cq = cqs
        self._lanes = lanes
        self._direct_lane = direct_lane
        self._max_peers = max_peers
        self.conns = conns  # by peer id
        self._by_qpn = by_qpn  # every lane made, connected or not
        self._handles = handles
        self.inbox = inbox
        self._regions = regions
        self._notify_slots = notify_slots
        self._poster = poster
        self._reaper = reaper
        self._forget = forget  # the single-request paths let go of gone connections
        self._outgoing: set[Connection] = set()  # connections with control output queued
        # Connections whose region changes wait for their pace (see Connection.regions_due),
        # and the earliest time one may go (the progress thread reads it without the lock).
        self._regions_waiting: set[Connection] = set()
        self.regions_due: float | None = None
        self._dead: list[Connection] = []  # dropped, resources released by the progress thread
        self.broken: str | None = None  # why the progress thread died, if it did
        self.progress: Progress | None = None
        self.incoming: Listener | None = None

    def attach(self, progress: Progress, incoming: Listener | None) -> None:
        """The progress thread and the listener, once they exist."""
        self.progress = progress
        self.incoming = incoming

    @property
    def _watcher(self) -> Progress:
        assert self.progress is not None
        return self.progress

    # -- state -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._poster.closed

    def check_open(self) -> None:
        if self._poster.closed:
            raise StateError(f"engine {self.id} is closed")
        if self.broken is not None:
            raise StateError(f"engine {self.id} is broken: {self.broken}")

    def has_pending(self) -> bool:
        return bool(self._handles)

    def died(self, exc: BaseException) -> None:
        """The progress thread is gone: fail everything pending, refuse new work."""
        with self.lock:
            self.broken = f"its progress thread died ({type(exc).__name__}: {exc})"
            self.finish_all(StateError(f"engine {self.id}: {self.broken}"))

    def finish_all(self, error: HixlError) -> None:
        """Fail every pending transfer and wake notification waiters (lock held)."""
        for h in list(self._handles):
            h.finish(error)
        self._handles.clear()
        self.notify_cv.notify_all()

    def open_messages(self) -> int:
        """Messages in the rings' open chunks, not counted yet (lock held)."""
        count = 0
        for conn in self.conns.values():
            for lane in conn.lanes:
                ring = lane.ring
                if ring is not None and ring.open is not None:
                    count += ring.written - ring.open_at
        return count

    def exposed(self) -> tuple[RemoteRegion, ...]:
        with self.lock:
            return self._regions.exposed()

    def announce(
        self, add: tuple[RemoteRegion, ...] = (), remove: tuple[RemoteRegion, ...] = ()
    ) -> None:
        """Queue one change of our exposed regions to every live peer (lock held).

        The change alone, merged with those not sent yet (see ``Connection.queue_regions``):
        its cost does not grow with the regions exposed.
        """
        for conn in list(self.conns.values()):
            if conn.state is ConnState.READY:
                self.queue_regions(conn, add, remove)

    def queue_regions(
        self, conn: Connection, add: tuple[RemoteRegion, ...], remove: tuple[RemoteRegion, ...]
    ) -> None:
        """Queue a change of our exposed regions for the progress thread (lock held)."""
        if not conn.queue_regions(add, remove):
            self.fail(conn, "peer left too many control messages unread")
            return
        self._outgoing.add(conn)
        self._poster.wake_due = True

    def queue_control(self, conn: Connection, data: bytes) -> None:
        """Queue a control message for the progress thread to send (lock held).

        The wake-up is only marked due: whoever let go of the lock last sends it
        (``Poster.wake_if_due``), since sending it is a system call.
        """
        if not conn.queue_control(data):
            self.fail(conn, "peer left too many control messages unread")
            return
        self._outgoing.add(conn)
        self._poster.wake_due = True

    # -- connecting --------------------------------------------------------------------------
    def connect(
        self, peer: str, timeout: float, address: str | None, names: Names | None
    ) -> Connection:
        """:meth:`Engine.connect` (see there)."""
        abort: Callable[[], str | None] | None = None
        if ":" not in peer and names is not None:
            name = peer
            try:
                ann, seen = names.resolve(peer)
            except RegistryUnavailable:
                # The registry is down: a live connection made by name carries on.
                known = names.engine_id(peer)
                live = self.conns.get(known) if known is not None else None
                if live is not None and live.state is ConnState.READY:
                    return live
                raise
            if seen is not None and (seen.instance != ann.instance or seen.engine != ann.engine):
                with self.lock:
                    stale = self.conns.get(seen.engine)
                    if stale is not None:
                        self.drop(stale, f"{peer} was restarted", send_bye=False)
                self._poster.wake_if_due()
            peer = ann.engine

            def abort() -> str | None:  # the name's process left the registry meanwhile
                return names.gone(name, ann.instance)

        try:
            host, port = wire.parse_engine_id(peer)
        except ValueError as exc:
            hint = "" if names is not None else " (names need Engine(registry=...))"
            raise ArgumentError(f"bad peer id {peer!r}: {exc}{hint}") from exc
        if port == 0:
            raise ArgumentError(f"peer {peer!r} does not listen (port 0)")
        if address is not None:
            try:
                host, port = wire.parse_engine_id(address)
            except ValueError as exc:
                raise ArgumentError(f"bad address {address!r}: {exc}") from exc
        with self.lock:
            old = self.conns.get(peer)
            if old is not None and old.state is ConnState.READY:
                return old
            if old is not None:
                self.drop(old, "replaced by a new connection", send_bye=False)
        self._poster.wake_if_due()
        deadline = time.monotonic() + timeout
        conn = client_handshake(self, peer, (host, port), self.token, deadline, abort)
        reason = None if abort is None else abort()
        if reason is not None:  # it left just before the connection went live: fail it
            with self.lock:
                self.fail(conn, reason)
            self._poster.wake_if_due()
            raise ConnectionFailed(f"connection to {peer} failed: {reason}")
        self._await_grant(conn, deadline, timeout)
        log.debug("connected to %r", conn)
        return conn

    def _await_grant(self, conn: Connection, deadline: float, timeout: float) -> None:
        """Wait for the peer's first CREDIT on a new connection.  The peer sends it once it
        has indexed the connection, so when :meth:`connect` returns the peer knows us and
        a notification can be sent at once.  On ``deadline`` the connection is failed and
        :class:`TransferTimeout` raised; the connection's own error if it fails meanwhile."""
        with self.lock:
            while conn.credit_grant == 0:
                self.check_open()
                conn.check_ready()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.credit_cv.wait(left)
            else:
                return
            reason = f"{conn.peer} did not confirm the connection within {timeout} s"
            self.fail(conn, reason)
        self._poster.wake_if_due()
        raise TransferTimeout(f"connect to {conn.peer}: {reason}")

    def connection(self, peer: str, names: Names | None) -> Connection:
        """:meth:`Engine.connection` (see there)."""
        conn = self.conns.get(peer)  # one dict lookup is atomic: no lock on the hot path
        if conn is None and names is not None:
            engine_id = names.engine_id(peer)
            if engine_id is not None:
                conn = self.conns.get(engine_id)
        if conn is None:
            with self.lock:
                known = sorted(self.conns)
            raise ConnectionFailed(f"not connected to {peer!r} (connected: {known})")
        return conn

    def _peer_count(self) -> int:
        """Connections that count against ``max_peers`` (lock held)."""
        claims = self.incoming.claims() if self.incoming is not None else set()
        return len(self.conns) + len(claims - set(self.conns))

    def new_connection(self, peer: str, *, outbound: bool) -> Connection:
        """An outgoing connection, within ``max_peers``."""
        with self.lock:
            self.check_open()
            if self._peer_count() >= self._max_peers:
                raise ConnectionFailed(
                    f"engine {self.id} already has {self._peer_count()} peers "
                    f"(max_peers={self._max_peers})"
                )
        return self._make_connection(peer, outbound)

    def _make_connection(self, peer: str, outbound: bool) -> Connection:
        """A connection's queue pairs, CQ and receive slots, made outside the lock (each
        is a system call) and then indexed under it; the engine's close waits for the
        making as it waits for a post (it counts as a poster).  :class:`StateError` once
        the engine is closed."""
        with self.lock:
            self.check_open()
            self._poster.posters += 1
        try:
            conn = Connection(self, peer, outbound, self._lanes, self._direct_lane)
        except BaseException:
            with self.lock:
                self._poster.release_poster()
            raise
        with self.lock:
            if not self._poster.closed:
                for lane in conn.all_lanes:
                    self._by_qpn[lane.qpn] = lane
                self._poster.release_poster()
                return conn
        conn.destroy()  # before close() goes on to close the device
        with self.lock:
            self._poster.release_poster()
        raise StateError(f"engine {self.id} is closed")

    def admit(self, peer: str, info: wire.Info, claims: set[str]) -> Admission:
        """Whether a proven client may connect as ``peer``; progress thread, never blocks.

        Checked before any queue pair exists or any key is sent: the engine is open,
        no other handshake holds the id, a READY connection under the id is probed
        (it keeps the id if it answers), and ``max_peers``.  On success the queue pair
        is made and connected to the client's.
        """
        with self.lock:
            if self._poster.closed or self.broken is not None:
                return Admission(code=wire.ErrorCode.BUSY, message=f"engine {self.id} is closing")
            if peer in claims:
                return Admission(
                    code=wire.ErrorCode.ALREADY_CONNECTED,
                    message=f"a handshake for {peer} is already under way with {self.id}",
                )
            old = self.conns.get(peer)
            if old is not None and old.state is ConnState.READY:
                since = time.monotonic() - old.pong_at
                if since < PROBE_S / 2:  # answered a probe just now: no new one
                    return Admission(
                        code=wire.ErrorCode.ALREADY_CONNECTED,
                        message=f"{peer} is already connected to {self.id} and answered a "
                        f"liveness probe {since:.2f} s ago; a connection keeps its id until "
                        "it fails or disconnects",
                    )
                self._start_probe(old)
                return Admission(probe=old)
            count = len(self.conns) - (old is not None) + len(claims - set(self.conns))
            if count >= self._max_peers:
                return Admission(
                    code=wire.ErrorCode.LIMIT,
                    message=f"engine {self.id} already has {count} peers "
                    f"(max_peers={self._max_peers})",
                )
            if old is not None:
                self.drop(old, f"replaced by a new connection from {peer}", send_bye=False)
        self._poster.wake_if_due()
        try:
            conn = self._make_connection(peer, outbound=False)
        except StateError:
            return Admission(code=wire.ErrorCode.BUSY, message=f"engine {self.id} is closing")
        except HixlError as exc:
            return Admission(code=wire.ErrorCode.INTERNAL, message=f"no queue pair: {exc}")
        try:
            conn.establish(info)
        except HixlError as exc:
            self.discard(conn)
            return Admission(code=wire.ErrorCode.INTERNAL, message=f"queue pair: {exc}")
        return Admission(conn=conn)

    def _start_probe(self, conn: Connection) -> None:
        """Ask a READY connection whether it is alive: PING on its control channel.

        One probe at a time per connection: while one is out (less than ``PROBE_S`` old),
        later claims of the id wait for its answer instead of sending another PING, so a
        stream of claims can neither flood the peer nor make its answer stale.
        """
        now = time.monotonic()
        if conn.probe_nonce is not None and now - conn.probe_started < PROBE_S:
            return
        nonce = wire.make_nonce()
        conn.probe_nonce = nonce
        conn.probe_started = now
        self.queue_control(conn, wire.encode(wire.Ping(nonce=nonce)))

    def probe_outcome(self, conn: Connection, expired: bool) -> str | None:
        """``"alive"``, ``"dead"`` or None (no answer yet) for a probe of ``conn``.

        Dead: the connection failed or closed meanwhile (its goodbye or EOF was read), or
        it did not answer before the probe's deadline, which fails it now.
        """
        with self.lock:
            if conn.state is not ConnState.READY:
                return "dead"
            if conn.pong_at >= conn.probe_started:
                return "alive"
            if not expired:
                return None
            self.fail(
                conn,
                "no answer to a liveness probe within the deadline, while a new handshake "
                "claimed its id",
            )
            return "dead"

    def discard(self, conn: Connection) -> None:
        """Forget a connection whose handshake did not finish."""
        with self.lock:
            for qpn in conn.qpns:
                self._by_qpn.pop(qpn, None)
        conn.destroy()

    def adopt(
        self,
        conn: Connection,
        sock: socket.socket,
        decoder: wire.Decoder,
        pending: list[wire.Message],
        session: tuple[Sealer, Opener],
    ) -> None:
        """Make a handshaken connection live: index it and watch its control socket.

        ``pending`` are control messages that arrived with the handshake's last one;
        ``session`` seals what we send from now on and opens what we receive.
        """
        with self.lock:
            self.check_open()
            old = self.conns.get(conn.peer)
            if old is not None and old is not conn:
                if old.state is ConnState.READY:
                    raise ConnectionFailed(f"{conn.peer} got connected meanwhile")
                self.drop(old, "replaced by a new connection", send_bye=False)
            conn.transition(ConnEvent.ESTABLISHED)
            conn.attach(sock, decoder, session)
            self.conns[conn.peer] = conn
            # Opened before the socket is watched: the progress thread opens the rest.
            msgs, problem = conn.open_control(pending)
            self._watcher.watch(conn)
            self._on_controls(conn, msgs, problem, eof=False)
            # Regions registered or released since the handshake carried ours were announced
            # only to live connections, which this one was not yet: tell the peer now.
            exposed = self._regions.exposed_map
            sent = {(r.rkey, r.addr): r for r in conn.sent_regions}
            added = tuple(r for k, r in exposed.items() if k not in sent)
            removed = tuple(r for k, r in sent.items() if k not in exposed)
            if added or removed:
                self.queue_regions(conn, added, removed)
            self.queue_control(conn, wire.encode(wire.Credit(notes=self.inbox.grant)))
        self._poster.wake_if_due()

    def peer_gone(self, engine_id: str, reason: str) -> None:
        """Registry watch thread: a peer reached by name left or restarted; fail it now."""
        with self.lock:
            conn = self.conns.get(engine_id)
            if conn is not None and not self._poster.closed:
                self.fail(conn, reason)
        self._poster.wake_if_due()

    # -- failing and releasing ---------------------------------------------------------------
    def fail(
        self,
        conn: Connection,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
        expected: bool = False,
        tell: tuple[wire.ErrorCode, str] | Literal["bye"] | None = "bye",
    ) -> None:
        """Mark ``conn`` failed: flush its queue pair and fail its pending transfers.

        Lock held.  The connection is FAILED before any handle finishes, so a caller
        woken by its handle already sees the state.  ``culprit`` (the transfer that caused
        the failure) gets ``error``; every other pending transfer gets
        :class:`ConnectionFailed` naming ``reason``.  ``expected`` (a peer's orderly
        goodbye) logs at INFO instead of WARNING.  The peer is told, so that it does not
        keep a connection we gave up: with ``tell="bye"`` a BYE naming ``reason``, with a
        ``(code, message)`` an ERROR, with None nothing (the peer left already).
        """
        if conn.state in (ConnState.FAILED, ConnState.CLOSED):
            if culprit is not None and error is not None:
                culprit.finish(error)
                self._handles.discard(culprit)
            return
        conn.transition(ConnEvent.FAIL)
        conn.failure = reason
        self.credit_cv.notify_all()  # senders waiting for its credits give up
        log.log(
            logging.INFO if expected else logging.WARNING,
            "connection to %s failed: %s",
            conn.peer,
            reason,
        )
        if tell is not None and conn.sock is not None:
            text = printable(f"connection failed at {self.id}: {reason}", 1000)
            if isinstance(tell, tuple):
                frame = error_frame(tell[0], text)
            else:
                frame = wire.encode(wire.Bye(reason=text))
            if conn.queue_control(frame):  # best effort: a peer that reads nothing is gone
                self._outgoing.add(conn)
                self._poster.wake_due = True  # sent once the lock is free (wake_if_due)
        if culprit is not None and error is not None:
            culprit.finish(error)
            self._handles.discard(culprit)
        try:
            conn.to_error()
        except HixlError as exc:
            log.debug("moving qp of %s to ERR failed: %s", conn.peer, exc)
        self._fail_pending(conn, ConnectionFailed(f"connection to {conn.peer} failed: {reason}"))

    def _fail_pending(self, conn: Connection, error: HixlError) -> None:
        for lane in conn.all_lanes:
            self._poster.close_ring_chunk(lane.ring)  # counted, and no message joins it now
        chunks = [c for lane in conn.all_lanes for c in lane.window.drain()]
        conn.held = 0
        for chunk in chunks:
            self.release_notify(chunk)
        for h in {c.handle for c in chunks}:
            if h is not None:
                h.finish(error)
                self._handles.discard(h)

    def release_notify(self, chunk: Chunk) -> None:
        if chunk.notify_slot is not None:
            self._notify_slots.release(chunk.notify_slot)
            chunk.notify_slot = None

    def drop(self, conn: Connection, reason: str, *, send_bye: bool) -> None:
        """Close ``conn`` for good and forget it (lock held).

        A goodbye is queued; the socket, queue pair and buffers are released by the
        progress thread (or by the engine's close), outside the lock.
        """
        if send_bye and conn.sock is not None and conn.state is ConnState.READY:
            conn.queue_control(wire.encode(wire.Bye(reason=printable(reason, 1000))))
        if conn.state is ConnState.READY:
            try:
                conn.to_error()
            except HixlError as exc:
                log.debug("moving qp of %s to ERR failed: %s", conn.peer, exc)
        self._fail_pending(conn, ConnectionFailed(f"connection to {conn.peer} closed: {reason}"))
        conn.transition(ConnEvent.CLOSE)
        self.credit_cv.notify_all()
        self.inbox.closed(conn.note_key)
        self._watcher.unwatch(conn)
        self._outgoing.discard(conn)
        self._regions_waiting.discard(conn)
        for qpn in conn.qpns:
            self._by_qpn.pop(qpn, None)
        if self.conns.get(conn.peer) is conn:
            del self.conns[conn.peer]
        self._dead.append(conn)
        self._poster.wake_due = True  # the progress thread frees it (sent once the lock is free)

    def disconnect(self, peer: str) -> None:
        """:meth:`Engine.disconnect` (see there)."""
        with self.lock:
            conn = self.conns.get(peer)
            if conn is not None:
                self.drop(conn, f"disconnected by {self.id}", send_bye=True)
        self._poster.wake_if_due()

    def drop_all(self) -> None:
        """The engine closes: say goodbye to every peer (lock held)."""
        for conn in list(self.conns.values()):
            self.drop(conn, "engine closed", send_bye=True)

    def wait_posters(self, seconds: float) -> None:
        """Wait up to ``seconds`` for threads still posting a batch to a queue pair about
        to go, or making a connection (the engine closes)."""
        with self.lock:
            until = time.monotonic() + seconds
            while (self._poster.posters or any(c.direct_busy for c in self._dead)) and (
                time.monotonic() < until
            ):
                self._poster.post_cv.wait(0.1)  # (a channel call ends without notifying: polled)

    def release_dead(self) -> None:
        """Send what dropped connections still have queued (best effort), then free them."""
        with self.lock:  # a connection with a batch being posted is freed after it
            dead = [c for c in self._dead if not c.poster]
            self._dead = [c for c in self._dead if c.poster]
        for conn in dead:
            try:
                conn.flush_control()
            except OSError as exc:
                log.debug("goodbye to %s not sent: %s", conn.peer, exc)
            conn.destroy()
        if dead:
            with self.lock:
                self._forget(dead)

    # -- notifications and credits -----------------------------------------------------------
    def take_notes(self) -> list[Notification]:
        """:meth:`Engine.notifications` (see there)."""
        with self.lock:
            notes = self.inbox.take_all(self._return_credits)
        self._poster.wake_if_due()  # the credits given back go out with the next round
        return notes

    def wait_note(self, name: str, timeout: float, peer: str | None) -> Notification:
        """:meth:`Engine.wait_notification` (see there)."""
        deadline = time.monotonic() + timeout
        found: Notification | None = None
        with self.notify_cv:
            while found is None:
                for note in self.inbox.notes:
                    if note.name == name and (peer is None or note.peer == peer):
                        owed = self.inbox.take(note)
                        if owed is not None:
                            self._return_credits(*owed)
                        found = note
                        break
                else:
                    if self._poster.closed or self.broken is not None:
                        self.check_open()
                        raise StateError(f"engine {self.id} is closed")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.notify_cv.wait(left)
        if found is not None:
            self._poster.wake_if_due()  # the credits given back go out with the next round
            return found
        raise TransferTimeout(
            f"no notification {name!r}{' from ' + peer if peer else ''} within {timeout} s"
        )

    def _return_credits(self, key: int, credits: int) -> None:
        """Give ``credits`` back to the connection ``key`` if it is live (lock held)."""
        for conn in self.conns.values():
            if conn.note_key == key:
                if conn.state is ConnState.READY and conn.sock is not None:
                    self.queue_control(conn, wire.encode(wire.Credit(notes=credits)))
                return

    def take_credit(self, conn: Connection, deadline: float, timeout: float) -> None:
        """Take one of ``conn``'s notification credits, waiting for the peer to grant one
        until ``deadline`` (lock held; the wait releases it).

        Raises :class:`TransferTimeout` naming the backlog (the connection stays up), or
        the connection's or engine's error if either fails meanwhile.
        """
        while conn.credits <= 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(
                    f"notification to {conn.peer} not sent within {timeout} s: no credit "
                    f"left; {conn.peer} has not taken the notifications sent before (its "
                    f"backlog: up to {conn.credit_grant or 'its grant of'} unread from us); "
                    "the connection stays up"
                )
            self.credit_cv.wait(left)
            self.check_open()
            conn.check_ready()
        conn.credits -= 1

    def _queue_note(self, conn: Connection, note: Notification) -> None:
        """Keep a received notification, or fail a sender past its credits (lock held)."""
        overrun = self.inbox.arrive(conn.note_key, note)
        if overrun is not None:
            reason = f"notification queue full at {self.id}: {overrun}; the sender is cut off"
            self.fail(conn, reason, tell=(wire.ErrorCode.OVERFLOW, reason))
            return
        self.notify_cv.notify_all()

    # -- the progress thread's calls (all but the socket reads run under the lock) -----------
    def reap_recv(self, wcs: list[verbs.Completion]) -> int:
        """Handle receive completions (notifications); return how many there were."""
        for wc in wcs:
            lane = self._by_qpn.get(wc.qp_num)
            if lane is None:
                continue
            conn = lane.conn
            # A successful receive is a notification the peer sent, whatever state the
            # connection is in now: a server-side connection is CONNECTING until the
            # handshake thread has read READY, and a peer that says goodbye right after
            # its last notification may be marked FAILED before this poll.  Only failed
            # receives (flushed ones included) are dropped.
            live = conn.state in (ConnState.READY, ConnState.CONNECTING)
            if not wc.ok:
                if live:
                    self.fail(conn, f"receive completion error {wc.status_name}")
                continue
            note = _notify.decode(conn.peer, conn.recv_slot(wc.wr_id, wc.byte_len))
            if live:
                try:
                    conn.post_recv(wc.wr_id)
                except HixlError as exc:
                    self.fail(conn, f"re-posting a receive failed: {exc}")
            if note is None:
                log.warning("dropped a malformed notification from %s", conn.peer)
                continue
            self._queue_note(conn, note)
        return len(wcs)

    def flush_outboxes(self) -> None:
        """Progress thread: send queued control messages, free dropped connections."""
        with self.lock:
            outgoing = list(self._outgoing)
            self._outgoing.clear()
            now = time.monotonic()
            waiting, self._regions_waiting = self._regions_waiting, set()
            self.regions_due = None
            for conn in {*outgoing, *waiting}:
                if conn.state is ConnState.CLOSED:
                    continue
                due = conn.regions_due()
                if due is None:
                    continue
                if due > now:  # over its pace: the changes wait, merging with later ones
                    self._regions_waiting.add(conn)
                    if self.regions_due is None or due < self.regions_due:
                        self.regions_due = due
                elif not conn.seal_regions():
                    self.fail(conn, "peer left too many control messages unread")
                elif conn not in outgoing:
                    outgoing.append(conn)
        for conn in outgoing:
            self.flush_control(conn)
        self.release_dead()

    def flush_control(self, conn: Connection) -> None:
        """Progress thread: write what the control socket takes now (outside the lock)."""
        try:
            conn.flush_control()
        except OSError as exc:
            with self.lock:
                self._watcher.unwatch(conn)
                self.fail(conn, f"control connection lost: {exc}", tell=None)
                self._let_go(conn, f"control connection lost: {exc}")
            return
        with self.lock:
            if conn.state is not ConnState.CLOSED and conn.sock is not None:
                self._watcher.watch(conn)  # write interest only while output is left

    def read_control(self, conn: Connection) -> None:
        """Read and handle what ``conn``'s peer sent on its control socket; never blocks.

        The bytes are decoded and each message's MAC and number checked outside the engine
        lock (this thread owns the decoder); only the handling takes the lock.
        """
        if conn.sock is None or conn.decoder is None:
            return
        try:
            data = conn.read_control()
        except OSError as exc:
            data = b""
            log.debug("control socket of %s: %s", conn.peer, printable(str(exc), 200))
        if data is None:
            return
        msgs, problem = conn.take_control(data) if data else ([], None)
        pause = conn.inflow.charge(len(data), len(msgs), time.monotonic())
        if pause > 0:  # over its budget: not read again until it is back
            self._watcher.pause(conn, pause)
        with self.lock:
            if conn.state is not ConnState.CLOSED:
                self._on_controls(conn, msgs, problem, eof=not data)
        self._poster.wake_if_due()

    def _on_controls(
        self,
        conn: Connection,
        msgs: list[wire.Message],
        problem: HandshakeError | None,
        *,
        eof: bool,
    ) -> None:
        """Handle opened control messages, then what ended the read (lock held).

        Consecutive ``REGIONS`` changes are applied together (one new tuple of the peer's
        regions for them all).
        """
        changes: list[wire.Regions] = []
        for msg in msgs:
            if isinstance(msg, wire.Regions):
                changes.append(msg)
                continue
            if changes:
                self._on_regions(conn, changes)
                changes = []
            self._on_control(conn, msg)
        if changes:
            self._on_regions(conn, changes)
        if problem is not None:
            self._watcher.unwatch(conn)
            if isinstance(problem, IntegrityError):
                what = f"control message integrity check failed: {problem}"
                code = wire.ErrorCode.INTEGRITY
            else:
                what = f"malformed control message: {problem}"
                code = wire.ErrorCode.MALFORMED
            self.fail(conn, what, tell=(code, what))
            self._let_go(conn, what)
        elif eof:
            self._peer_left(conn, "peer closed the control connection (process gone?)")

    def _peer_left(self, conn: Connection, reason: str, *, expected: bool = False) -> None:
        """The peer said goodbye, gave up or closed its socket (lock held): fail ``conn``
        and let it go if the peer connected to us."""
        self._watcher.unwatch(conn)
        self.fail(conn, reason, expected=expected, tell=None)
        self._let_go(conn, reason)

    def _let_go(self, conn: Connection, reason: str) -> None:
        """Release a failed connection the peer opened (lock held): its queue pairs, memory,
        socket and ``max_peers`` slot.  A connection we opened stays, FAILED, for the
        application to see, until it disconnects or connects again."""
        if not conn.outbound and conn.state is ConnState.FAILED:
            self.drop(conn, reason, send_bye=False)

    def _on_regions(self, conn: Connection, changes: list[wire.Regions]) -> None:
        try:
            conn.update_remote_regions(changes)
        except HandshakeError as exc:
            self._watcher.unwatch(conn)
            what = f"bad REGIONS update: {exc}"
            self.fail(conn, what, tell=(wire.ErrorCode.MALFORMED, what))
            self._let_go(conn, what)

    def _on_control(self, conn: Connection, msg: wire.Message) -> None:
        if isinstance(msg, wire.Ping):
            self.queue_control(conn, wire.encode(wire.Pong(nonce=msg.nonce)))
        elif isinstance(msg, wire.Credit):
            conn.credits += msg.notes
            conn.credit_grant = conn.credit_grant or msg.notes  # the first is the grant
            self.credit_cv.notify_all()
        elif isinstance(msg, wire.Pong):
            if msg.nonce == conn.probe_nonce:
                conn.pong_at = time.monotonic()
        elif isinstance(msg, wire.Bye):
            # Notifications the peer sent before its goodbye come first, and so do the
            # completions of our own sends that are already in the queue: a peer that
            # closes once it has our last notification says goodbye right after that
            # send completed here, maybe before this thread reaped it (same select round).
            self.reap_recv(self.recv_cq.poll(64))
            self._reaper.reap_send(self.send_cq.poll_rows(POLL_BATCH))
            self._peer_left(conn, f"peer said goodbye: {escape(msg.reason)}", expected=True)
        elif isinstance(msg, wire.Error):
            self._peer_left(conn, f"peer reported {msg.code}: {escape(msg.message)}")
        else:
            what = f"unexpected {type(msg).__name__} on the control channel"
            self.fail(conn, what, tell=(wire.ErrorCode.MALFORMED, what))
            self._let_go(conn, what)
