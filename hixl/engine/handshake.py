"""The connection handshake: client side on a blocking socket, server side in the selector.

The messages, their order and the proofs are :mod:`hixl.core.handshake` (sans-I/O); this
module moves the bytes.

Client (:func:`client_handshake`): runs in the thread that called ``Engine.connect`` on a
blocking socket with the caller's deadline. Every ``OSError`` becomes a
:class:`~hixl.errors.ConnectionFailed`, a timeout a :class:`~hixl.errors.TransferTimeout`.
A server that answers ``ERROR(BUSY)`` is asked again after a short pause until the deadline.
With an ``abort`` check (``connect`` by name passes one: "has this name's process left the
registry?") the socket waits in slices of :data:`ABORT_POLL_S` and the handshake gives up with
``ConnectionFailed`` as soon as the check names a reason, instead of waiting out the deadline
on a host that is gone.

Server (:class:`Listener`): no thread per handshake. The progress thread accepts, and each
handshake is a small state machine (:class:`Incoming`) on a non-blocking socket in the
progress thread's selector, so an idle socket costs a file descriptor and a few hundred
bytes, never a thread or a slot others wait for. Each step has its own short deadline
(the first frame within :data:`FIRST_FRAME_S` of accept, the next ones within
:data:`STEP_S`) inside the engine's ``handshake_timeout``; a late step is answered with
ERROR(TIMEOUT) and closed. There are at most ``max_handshakes`` at once and
``max_handshakes_per_source`` from one source, and the bytes they buffer before the client
has proved itself are bounded, :data:`MAX_PENDING_BYTES` in all and
:data:`MAX_PENDING_BYTES_PER_SOURCE` from one source.  A connection over a limit waits,
unread, for a slot of its own (up to ``max_handshakes`` of them wait, each at most
:data:`WAIT_S`), and is answered ERROR(BUSY) and closed if none frees in time or the
waiting room is full, so a client always hears why.  Waiting rather than an instant
refusal keeps a client that dials again at once from making the listener accept and
refuse in a loop ahead of everyone else in the listen queue. A source is an IPv4 address,
except that all of 127.0.0.0/8 is one, or an IPv6 /64
(:func:`hixl.core.handshake.source_key`): one host can take many addresses.

A client whose listening id names another IP address than the one its connection comes
from is refused with ERROR(AUTH) (unless the engine trusts peer hosts: NAT, proxies);
the client binds its socket to its id's address to match.

Nothing that depends on the token, no queue pair and no rkey exists before the client's
INFO has passed its proof check and the engine has admitted the peer (``max_peers``, and
no live connection under the same id). A READY connection keeps its id: a handshake
claiming it is refused with ERROR(ALREADY_CONNECTED), unless the old connection is already
FAILED or CLOSED or does not answer a PING within :data:`PROBE_S` (a peer that died without
a word). The probe is a control message like any other; nothing waits for it under a lock.

Socket I/O here never runs under the engine lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hixl.core import wire
from hixl.core.handshake import (
    ClientHandshake,
    ServerHandshake,
    claim_mismatch,
    source_for,
    source_key,
)
from hixl.engine.locks import assert_unlocked
from hixl.errors import (
    AuthenticationError,
    ConnectionFailed,
    HandshakeError,
    HixlError,
    TransferTimeout,
)

if TYPE_CHECKING:
    from hixl.core.seal import Opener, Sealer
    from hixl.core.wire import RemoteRegion
    from hixl.engine.connection import Connection

__all__ = [
    "FIRST_FRAME_S",
    "PROBE_S",
    "STEP_S",
    "Admission",
    "Channel",
    "HandshakeHost",
    "Incoming",
    "Listener",
    "client_handshake",
    "escape",
    "printable",
]

log = logging.getLogger("hixl.engine")

FIRST_FRAME_S = 1.0  # the client's HELLO must arrive this soon after accept, seconds
STEP_S = 3.0  # each later step (INFO after CHALLENGE, READY after ACCEPT), seconds
PROBE_S = 2.0  # a live connection must answer a PING this soon to keep its id, seconds
BUSY_RETRY_S = 0.05  # first pause before a client asks a BUSY server again, seconds
ACCEPTS_PER_ROUND = 64  # connections taken from the listen queue per progress round
#: Longest a connection over a handshake limit waits for a slot before ERROR(BUSY), seconds.
WAIT_S = 2.0
MAX_PENDING_BYTES = 32 << 20  # bytes buffered by all unfinished handshakes together
# ... and by those from one source (see source_key): a quarter, so that one source's
# sockets cannot hold the whole budget; 8 INFO frames of the largest size.
MAX_PENDING_BYTES_PER_SOURCE = MAX_PENDING_BYTES // 4
HELLO_MAX_PAYLOAD = 4096  # a HELLO is small: a first frame announcing more is refused
ABORT_POLL_S = 0.1  # how often a client handshake with an abort check looks at it, seconds

Abort = Callable[[], str | None]
"""A client handshake's abort check: a reason to give up now, or None to go on."""


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with anything the wire refuses replaced."""
    return "".join(c if c.isprintable() or c in "\t\n" else "?" for c in text[:limit])


def escape(text: str, limit: int = 300) -> str:
    """Peer text made safe for one log line: anything not printable (newlines too)
    backslash-escaped, cut to ``limit`` characters."""
    cut = text[:limit]
    out = cut if cut.isprintable() else cut.encode("unicode_escape").decode("ascii")
    return out + ("..." if len(text) > limit else "")


def error_frame(code: wire.ErrorCode, message: str) -> bytes:
    return wire.encode(wire.Error(code=code, message=printable(message, 1000)))


# --------------------------------------------------------------------------- client side


class Channel:
    """Blocking framed messaging over the handshake socket, with deadlines (and an optional
    abort check, looked at every :data:`ABORT_POLL_S` while a receive waits)."""

    def __init__(self, sock: socket.socket, peer: str, abort: Abort | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.abort = abort
        self.decoder = wire.Decoder(max_payload=wire.MAX_PAYLOAD)
        self.pending: deque[wire.Message] = deque()

    def send(self, msg: wire.Message, deadline: float) -> None:
        _check_abort(self.abort, self.peer)
        self._timeout(deadline, whole=True)
        assert_unlocked(f"a handshake message to {self.peer}")
        try:
            self.sock.sendall(wire.encode(msg))
        except TimeoutError as exc:
            raise TransferTimeout(f"handshake with {self.peer}: send timed out") from exc
        except OSError as exc:
            raise ConnectionFailed(f"handshake with {self.peer}: {exc.strerror or exc}") from exc

    def _timeout(self, deadline: float, *, whole: bool = False) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"handshake with {self.peer} exceeded its deadline")
        self.sock.settimeout(left if whole or self.abort is None else min(left, ABORT_POLL_S))

    def recv(self, deadline: float) -> wire.Message:
        while not self.pending:
            _check_abort(self.abort, self.peer)
            self._timeout(deadline)
            try:
                data = self.sock.recv(65536)
            except TimeoutError as exc:
                if self.abort is not None and time.monotonic() < deadline:
                    continue  # one slice passed: look at the abort check again
                raise TransferTimeout(f"handshake with {self.peer}: no answer in time") from exc
            except OSError as exc:
                raise ConnectionFailed(
                    f"handshake with {self.peer}: {exc.strerror or exc}"
                ) from exc
            if not data:
                self.decoder.eof()
                raise ConnectionFailed(f"{self.peer} closed the connection during the handshake")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.popleft()

    def expect(self, kind: type[Any], deadline: float) -> Any:
        msg = self.recv(deadline)
        if isinstance(msg, wire.Error):
            text = f"{self.peer} refused the handshake: {msg.code}: {msg.message}"
            if msg.code is wire.ErrorCode.AUTH:
                raise AuthenticationError(text)
            if msg.code is wire.ErrorCode.BUSY:
                raise _Busy(text)
            raise ConnectionFailed(text)
        return wire.expect(msg, kind)


def _check_abort(abort: Abort | None, peer: str) -> None:
    reason = None if abort is None else abort()
    if reason is not None:
        raise ConnectionFailed(f"connect to {peer} given up: {reason}")


class HandshakeHost(Protocol):
    """What both sides of a handshake need of their engine (its connection table)."""

    @property
    def id(self) -> str: ...

    @property
    def token(self) -> bytes | None: ...

    @property
    def closed(self) -> bool: ...

    def exposed(self) -> tuple[RemoteRegion, ...]:
        """The regions a handshake tells the peer about."""
        ...

    def new_connection(self, peer: str, *, outbound: bool) -> Connection:
        """A connection not connected yet, within ``max_peers``."""
        ...

    def admit(self, peer: str, info: wire.Info, claims: set[str]) -> Admission:
        """Whether a proven client may connect as ``peer`` (progress thread)."""
        ...

    def adopt(
        self,
        conn: Connection,
        sock: socket.socket,
        decoder: wire.Decoder,
        pending: list[wire.Message],
        session: tuple[Sealer, Opener],
    ) -> None:
        """Make a handshaken connection live."""
        ...

    def discard(self, conn: Connection) -> None:
        """Forget a connection whose handshake did not finish."""
        ...

    def probe_outcome(self, conn: Connection, expired: bool) -> str | None:
        """``"alive"``, ``"dead"`` or None (no answer yet) for a probe of ``conn``."""
        ...


class _Busy(ConnectionFailed):
    """The server had too many handshakes at once; asking again later may work."""


def client_handshake(
    engine: HandshakeHost,
    peer: str,
    address: tuple[str, int],
    token: bytes | None,
    deadline: float,
    abort: Abort | None = None,
) -> Connection:
    """Connect to ``address`` and run the client side; return the adopted connection.

    A server that answers ERROR(BUSY) is asked again after a pause (doubling from
    :data:`BUSY_RETRY_S`) until ``deadline``. ``abort`` is looked at while the TCP connect
    and each receive wait (every :data:`ABORT_POLL_S`): when it returns a reason, the
    handshake ends with :class:`ConnectionFailed` naming it.
    """
    pause = BUSY_RETRY_S
    while True:
        try:
            return _client_attempt(engine, peer, address, token, deadline, abort)
        except _Busy as exc:
            if time.monotonic() + pause >= deadline:
                raise ConnectionFailed(f"{exc} (asked until the connect deadline)") from None
            _check_abort(abort, peer)
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


def _dial(
    peer: str,
    address: tuple[str, int],
    deadline: float,
    abort: Abort | None,
    source: str | None = None,
) -> socket.socket:
    """A connected TCP socket to ``address`` (blocking mode), within ``deadline``, bound
    to the local address ``source`` when given."""
    left = deadline - time.monotonic()
    if abort is None:
        try:
            return socket.create_connection(
                address,
                timeout=max(0.01, left),
                source_address=None if source is None else (source, 0),
            )
        except TimeoutError as exc:
            raise TransferTimeout(f"connect to {peer}: no answer within the deadline") from exc
        except OSError as exc:
            raise ConnectionFailed(f"connect to {peer}: {exc.strerror or exc}") from exc
    try:
        infos = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectionFailed(f"connect to {peer}: {exc.strerror or exc}") from exc
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:  # like create_connection, one at a time
        sock = socket.socket(family, kind, proto)
        try:
            if source is not None:
                sock.bind((source, 0))
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
            while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                _check_abort(abort, peer)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"connect to {peer}: no answer within the deadline")
                _, writable, _ = select.select([], [sock], [], min(left, ABORT_POLL_S))
                if writable:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                sock.setblocking(True)
                return sock
            last = OSError(err, os.strerror(err))
        except BaseException:
            sock.close()
            raise
        sock.close()
    raise ConnectionFailed(f"connect to {peer}: {last.strerror if last else 'no address'}")


def _client_attempt(
    engine: HandshakeHost,
    peer: str,
    address: tuple[str, int],
    token: bytes | None,
    deadline: float,
    abort: Abort | None,
) -> Connection:
    sock = _dial(peer, address, deadline, abort, source_for(engine.id, address[0]))
    conn: Connection | None = None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chan = Channel(sock, peer, abort)
        hs = ClientHandshake(engine.id, token, peer=peer, expect_id=peer)
        chan.send(hs.hello, deadline)
        hs.on_challenge(chan.expect(wire.Challenge, deadline))
        conn = engine.new_connection(peer, outbound=True)
        chan.send(hs.info(conn.local_info(wire.Info, b"", engine.exposed())), deadline)
        conn.establish(hs.on_accept(chan.expect(wire.Accept, deadline)))
        chan.send(hs.ready(), deadline)
        chan.decoder.limit(wire.CONTROL_MAX_PAYLOAD)  # from here on, the control channel's
        engine.adopt(conn, chan.sock, chan.decoder, list(chan.pending), hs.session())
        return conn
    except BaseException:
        if conn is not None:
            engine.discard(conn)
        with contextlib.suppress(OSError):
            sock.close()
        raise


# --------------------------------------------------------------------------- server side


class Admission:
    """The engine's answer to a proven INFO: go ahead, refuse, or probe the old holder."""

    __slots__ = ("code", "conn", "message", "probe")

    def __init__(
        self,
        *,
        conn: Connection | None = None,
        code: wire.ErrorCode | None = None,
        message: str = "",
        probe: Connection | None = None,
    ) -> None:
        self.conn = conn
        self.code = code
        self.message = message
        self.probe = probe


class Incoming:
    """One server-side handshake in progress.  Progress thread only."""

    __slots__ = (
        "accepted_at",
        "conn",
        "decoder",
        "deadline",
        "expect",
        "hs",
        "info",
        "key",
        "outbox",
        "probe",
        "sock",
        "source",
        "total_deadline",
    )

    def __init__(self, sock: socket.socket, source: str, hs: ServerHandshake, now: float):
        self.sock = sock
        self.source = source
        self.key = source_key(source)  # what per-source limits count it under
        self.hs = hs
        self.decoder = wire.Decoder(max_payload=HELLO_MAX_PAYLOAD)
        self.outbox = bytearray()
        self.accepted_at = now
        self.deadline = now + FIRST_FRAME_S
        self.total_deadline = now
        self.expect = "HELLO"
        self.conn: Connection | None = None  # made once the engine admitted the peer
        self.info: wire.Info | None = None
        self.probe: tuple[Connection, float] | None = None  # (old connection, deadline)

    @property
    def peer(self) -> str:
        return self.hs.peer or self.source

    def __repr__(self) -> str:
        return f"<Incoming from={self.source} peer={self.hs.peer} expect={self.expect}>"


class Listener:
    """Accepts connections and drives their server-side handshakes.  Progress thread only.

    ``register(sock, data, mask)`` / ``unregister(sock)`` put a socket in the progress
    thread's selector (``data`` is the :class:`Incoming`).
    """

    def __init__(
        self,
        engine: HandshakeHost,
        sock: socket.socket,
        *,
        register: Callable[[socket.socket, object, int], None],
        unregister: Callable[[socket.socket], None],
        max_handshakes: int,
        max_per_source: int,
        timeout: float,
        trust_hosts: bool = False,
    ) -> None:
        self._engine = engine
        self._sock = sock
        self._register = register
        self._unregister = unregister
        self.max_handshakes = max_handshakes
        self.max_per_source = max_per_source
        # Whether a client's id may name another host than its connection's source.
        self.trust_hosts = trust_hosts
        self._timeout = timeout
        self._pending: dict[socket.socket, Incoming] = {}
        self._per_source: dict[str, int] = {}  # source key -> handshakes under way
        self._claimed: set[str] = set()  # ids of admitted peers not READY yet
        self._buffered = 0
        self._buffered_by: dict[str, int] = {}  # source key -> bytes its handshakes hold
        self.refused_busy = 0  # sockets answered ERROR(BUSY), for diagnostics
        # Accepted connections over a limit, oldest first, waiting for a slot (not read):
        # (socket, source, source key, give up at).  At most max_handshakes of them.
        self._waiting: deque[tuple[socket.socket, str, str, float]] = deque()

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        return len(self._pending)

    @property
    def waiting(self) -> int:
        """Connections over a limit waiting for a handshake slot."""
        return len(self._waiting)

    def claims(self) -> set[str]:
        """Ids of peers admitted and not yet READY (their ids are taken).

        Any thread: the copy is one C-level operation, atomic under the GIL.
        """
        return set(self._claimed)

    # -- accepting -------------------------------------------------------------------------
    def accept(self) -> None:
        """Take what waits in the listen queue (a bounded number per round)."""
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("accept: %s", exc)
                return
            self._take(sock, str(addr[0]))

    def _take(self, sock: socket.socket, source: str) -> None:
        sock.setblocking(False)
        if self._engine.closed:
            _close(sock)
            return
        key = source_key(source)
        if self._room(key):
            self._start(sock, source, key)
        elif len(self._waiting) < self.max_handshakes:
            # Held, not refused at once: a refused client that dials again at once would
            # have the listener accept and refuse in a loop, ahead of everyone in the
            # listen queue.  Held, it waits for a slot of its own source.
            self._waiting.append((sock, source, key, time.monotonic() + WAIT_S))
        else:
            self.refused_busy += 1
            _refuse_now(
                sock, wire.ErrorCode.BUSY, f"engine {self._engine.id} is busy: {self._busy(key)}"
            )

    def _room(self, key: str) -> bool:
        """Whether a handshake from source ``key`` may start now."""
        return (
            len(self._pending) < self.max_handshakes
            and self._per_source.get(key, 0) < self.max_per_source
            and self._buffered <= MAX_PENDING_BYTES
            and self._buffered_by.get(key, 0) <= MAX_PENDING_BYTES_PER_SOURCE
        )

    def _busy(self, key: str) -> str:
        """Which limit keeps a handshake from source ``key`` from starting."""
        if len(self._pending) >= self.max_handshakes:
            return (
                f"{len(self._pending)} handshakes under way (max_handshakes={self.max_handshakes})"
            )
        if self._per_source.get(key, 0) >= self.max_per_source:
            return (
                f"{self._per_source[key]} handshakes from {_named(key)} under way "
                f"(max_handshakes_per_source={self.max_per_source})"
            )
        if self._buffered > MAX_PENDING_BYTES:
            return f"handshakes hold {self._buffered} bytes (at most {MAX_PENDING_BYTES})"
        return self._over_source(key)

    def _start(self, sock: socket.socket, source: str, key: str) -> None:
        with contextlib.suppress(OSError):  # only for the sockets kept: refusals are cheap
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        now = time.monotonic()
        inc = Incoming(sock, source, ServerHandshake(self._engine.id, self._engine.token), now)
        inc.total_deadline = now + self._timeout
        self._pending[sock] = inc
        self._per_source[key] = self._per_source.get(key, 0) + 1
        self._register(sock, inc, selectors.EVENT_READ)

    def _promote(self, now: float) -> None:
        """Start the waiting connections that have a slot now, oldest first; refuse those
        that waited :data:`WAIT_S`."""
        while self._waiting and self._waiting[0][3] <= now:
            sock, _, key, _ = self._waiting.popleft()
            self.refused_busy += 1
            _refuse_now(
                sock,
                wire.ErrorCode.BUSY,
                f"engine {self._engine.id} is busy: {self._busy(key)}; waited {WAIT_S} s",
            )
        if not self._waiting or len(self._pending) >= self.max_handshakes:
            return
        left: deque[tuple[socket.socket, str, str, float]] = deque()
        for entry in self._waiting:
            if self._room(entry[2]):
                self._start(entry[0], entry[1], entry[2])
            else:
                left.append(entry)
        self._waiting = left

    # -- events ----------------------------------------------------------------------------
    def on_event(self, inc: Incoming, mask: int) -> None:
        """The selector reported ``inc``'s socket readable and/or writable."""
        if inc.sock not in self._pending:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(inc)
        if mask & selectors.EVENT_READ and inc.sock in self._pending:
            self._read(inc)

    def _read(self, inc: Incoming) -> None:
        try:
            data = inc.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(inc, f"socket error: {exc}")
            return
        if not data:
            self._finish(inc, f"closed by {inc.peer} while {inc.expect} was expected")
            return
        before = inc.decoder.buffered
        try:
            msgs = inc.decoder.feed(data)
        except HandshakeError as exc:
            self._refuse(inc, inc.decoder.error_code or wire.ErrorCode.MALFORMED, str(exc))
            return
        finally:
            self._hold(inc, inc.decoder.buffered - before)
        if inc.decoder.buffered:
            busy = None
            if self._buffered > MAX_PENDING_BYTES:
                busy = (
                    f"handshakes under way hold {self._buffered} bytes "
                    f"(at most {MAX_PENDING_BYTES})"
                )
            elif self._buffered_by.get(inc.key, 0) > MAX_PENDING_BYTES_PER_SOURCE:
                busy = self._over_source(inc.key)
            if busy is not None:
                self._refuse(inc, wire.ErrorCode.BUSY, f"{busy}; try again")
                return
        for i, msg in enumerate(msgs):
            if inc.sock not in self._pending:
                return
            if inc.expect == "READY" and isinstance(msg, wire.Ready):
                self._ready(inc, msg, msgs[i + 1 :])
                return
            self._step(inc, msg)

    def _step(self, inc: Incoming, msg: wire.Message) -> None:
        if isinstance(msg, wire.Error):
            self._finish(inc, f"{inc.peer} gave up: {msg.code}: {escape(msg.message)}")
            return
        try:
            if inc.expect == "HELLO":
                challenge = inc.hs.on_hello(wire.expect(msg, wire.Hello))
                if inc.decoder.buffered:
                    raise HandshakeError("the client sent more before it had the CHALLENGE")
                # INFO carries the client's regions: up to a full frame from now on.
                inc.decoder = wire.Decoder(max_payload=wire.MAX_PAYLOAD)
                inc.expect, inc.deadline = "INFO", self._step_deadline(inc)
                self._send(inc, wire.encode(challenge))
            elif inc.expect == "INFO":
                inc.info = inc.hs.on_info(wire.expect(msg, wire.Info))
                problem = None if self.trust_hosts else claim_mismatch(inc.peer, inc.source)
                if problem is not None:
                    self._refuse(inc, wire.ErrorCode.AUTH, problem)
                    return
                self._admit(inc)
            else:
                raise HandshakeError(f"expected {inc.expect}, got {msg.TYPE.name}")
        except AuthenticationError as exc:
            self._refuse(inc, wire.ErrorCode.AUTH, str(exc))
        except HandshakeError as exc:
            self._refuse(inc, wire.ErrorCode.MALFORMED, str(exc))

    def _admit(self, inc: Incoming) -> None:
        """The client proved itself: ask the engine whether it may connect, then ACCEPT."""
        assert inc.info is not None
        verdict = self._engine.admit(inc.hs.peer or "", inc.info, self.claims())
        if verdict.probe is not None:
            inc.expect, inc.probe = "PROBE", (verdict.probe, time.monotonic() + PROBE_S)
            return
        if verdict.conn is None:
            assert verdict.code is not None
            self._refuse(inc, verdict.code, verdict.message)
            return
        inc.conn = verdict.conn
        self._claimed.add(inc.peer)
        try:
            accept = inc.hs.accept(inc.conn.local_info(wire.Accept, b"", self._engine.exposed()))
            frame = wire.encode(accept)
        except HixlError as exc:
            self._refuse(inc, wire.ErrorCode.INTERNAL, f"could not answer: {exc}")
            return
        try:
            # From READY on, the control channel's frames: each one a short step.
            inc.decoder.limit(wire.CONTROL_MAX_PAYLOAD)
        except HandshakeError as exc:
            self._refuse(inc, wire.ErrorCode.MALFORMED, str(exc))
            return
        inc.expect, inc.deadline = "READY", self._step_deadline(inc)
        self._send(inc, frame)

    def _ready(self, inc: Incoming, msg: wire.Ready, rest: list[wire.Message]) -> None:
        assert inc.conn is not None
        try:
            inc.hs.on_ready(msg)
        except HandshakeError as exc:
            self._refuse(inc, wire.ErrorCode.MALFORMED, str(exc))
            return
        if inc.outbox:  # the client answered an ACCEPT it cannot have read in full
            self._refuse(inc, wire.ErrorCode.MALFORMED, "READY before the whole ACCEPT")
            return
        self._forget(inc)
        conn, inc.conn = inc.conn, None
        try:
            self._engine.adopt(conn, inc.sock, inc.decoder, rest, inc.hs.session())
        except HixlError as exc:
            log.info("handshake from %s: not adopted: %s", inc.peer, exc)
            self._engine.discard(conn)
            _close(inc.sock)
            return
        log.debug("accepted %r from %s", conn, inc.source)

    # -- deadlines and probes ----------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Refuse late handshakes; settle liveness probes; start or refuse the waiting
        connections.  Called every progress round."""
        for inc in list(self._pending.values()):
            if inc.probe is not None:
                self._settle_probe(inc, now)
            elif now >= inc.deadline or now >= inc.total_deadline:
                waited = now - inc.accepted_at
                self._refuse(
                    inc,
                    wire.ErrorCode.TIMEOUT,
                    f"no {inc.expect} from {inc.peer} in time ({waited:.1f} s after accept; "
                    f"first frame within {FIRST_FRAME_S} s, each step within {STEP_S} s, "
                    f"all within handshake_timeout={self._timeout} s)",
                )
        self._promote(now)

    def _settle_probe(self, inc: Incoming, now: float) -> None:
        assert inc.probe is not None
        old, deadline = inc.probe
        outcome = self._engine.probe_outcome(old, now >= deadline)
        if outcome is None:
            return  # no answer yet, and time is left
        inc.probe = None
        if outcome == "alive":
            self._refuse(
                inc,
                wire.ErrorCode.ALREADY_CONNECTED,
                f"{inc.peer} is already connected to {self._engine.id} and answers; "
                "a connection keeps its id until it fails or disconnects",
            )
            return
        inc.expect = "INFO"
        self._admit(inc)

    def _step_deadline(self, inc: Incoming) -> float:
        return min(time.monotonic() + STEP_S, inc.total_deadline)

    # -- output and endings --------------------------------------------------------------
    def _send(self, inc: Incoming, data: bytes) -> None:
        inc.outbox += data
        self._flush(inc)

    def _flush(self, inc: Incoming) -> None:
        assert_unlocked(f"a handshake message to {inc.source}")
        while inc.outbox:
            try:
                sent = inc.sock.send(bytes(inc.outbox[:262144]))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._finish(inc, f"socket error: {exc}")
                return
            del inc.outbox[:sent]
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if inc.outbox else 0)
        self._register(inc.sock, inc, mask)

    def _refuse(self, inc: Incoming, code: wire.ErrorCode, message: str) -> None:
        """Tell the client why (best effort, never blocks), then close."""
        log.info("handshake from %s (%s) refused: %s: %s", inc.peer, inc.source, code, message)
        assert_unlocked(f"a refusal to {inc.source}")
        with contextlib.suppress(OSError):
            inc.sock.send(error_frame(code, message))
        self._finish(inc, None)

    def _finish(self, inc: Incoming, why: str | None) -> None:
        if why is not None:
            log.info("handshake from %s (%s) ended: %s", inc.peer, inc.source, why)
        self._forget(inc)
        if inc.conn is not None:
            self._engine.discard(inc.conn)
            inc.conn = None
        _close(inc.sock)

    def _forget(self, inc: Incoming) -> None:
        if self._pending.pop(inc.sock, None) is None:
            return
        if inc.conn is not None:
            self._claimed.discard(inc.peer)
        self._hold(inc, -inc.decoder.buffered)
        left = self._per_source.get(inc.key, 1) - 1
        if left:
            self._per_source[inc.key] = left
        else:
            self._per_source.pop(inc.key, None)
        self._unregister(inc.sock)
        if self._waiting:
            self._promote(time.monotonic())

    def _hold(self, inc: Incoming, change: int) -> None:
        """Count ``change`` more bytes buffered by ``inc``'s handshake."""
        if not change:
            return
        self._buffered += change
        held = self._buffered_by.get(inc.key, 0) + change
        if held > 0:
            self._buffered_by[inc.key] = held
        else:
            self._buffered_by.pop(inc.key, None)

    def _over_source(self, key: str) -> str:
        return (
            f"handshakes from {_named(key)} hold {self._buffered_by.get(key, 0)} bytes "
            f"(at most {MAX_PENDING_BYTES_PER_SOURCE} from one source)"
        )

    def close(self) -> None:
        """Close every unfinished handshake and waiting connection (the engine is closing)."""
        waiting, self._waiting = self._waiting, deque()
        for sock, *_ in waiting:
            _close(sock)
        for inc in list(self._pending.values()):
            self._finish(inc, None)


def _named(key: str) -> str:
    """A source key as a message names it."""
    return key if "/" not in key else f"{key} (counted as one source)"


def _refuse_now(sock: socket.socket, code: wire.ErrorCode, message: str) -> None:
    assert_unlocked("a refusal")
    with contextlib.suppress(OSError):
        sock.send(error_frame(code, message))
    _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
