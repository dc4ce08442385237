"""One connection: RC queue pairs (lanes) to a peer, receive slots, send windows and control socket.

A :class:`Connection` is owned by its engine and mutated only under the engine lock,
except where a method says otherwise.  It keeps three things behind methods:

* its *lanes* (:class:`Lane`): one RC queue pair each, connected to the peer's lane of
  the same index, each with its *send window* (:class:`hixl.core.window.SendWindow`,
  pure bookkeeping): chunks waiting to be posted, chunks out, the slots in use, and the
  one poster at a time.  Lanes let two threads post to one peer at once (on rxe the
  post does the sending); work on one lane completes in order, across lanes in any
  order.  Lane 0 carries the notifications;
* the *receive slots*: buffers posted on lane 0 for notifications, one
  :data:`notify.SLOT_BYTES` each;
* its *direct lane*, when both ends made one more queue pair than their lanes: a queue
  pair with a completion queue of its own, reserved for a :class:`~hixl.engine.channel.Channel`
  (one caller thread posts one work request and polls that queue itself: no window, no
  progress thread, no engine lock around the wait);
* the *control channel*: the TCP socket the handshake ran on, its decoder, the session's
  :class:`~hixl.core.seal.Sealer` and :class:`~hixl.core.seal.Opener`, and an outbox of
  sealed control messages.  Messages are sealed and queued under the engine lock (so their
  numbers follow the outbox order) and written by the progress thread with non-blocking
  sends, so no caller ever blocks on a peer that stops reading; an outbox that grows past
  :data:`MAX_OUTBOX` fails the connection.  Changes of our exposed regions wait unsealed
  until the progress thread next flushes (later when the connection is over
  :data:`REGIONS_FRAMES_PER_S`), or another message is queued after them: the changes
  made meanwhile go out merged, as one ``REGIONS`` change (one per region, the last one
  made), which leaves the peer where the changes one by one would.  Received
  bytes are decoded and opened by the progress thread alone, outside the engine lock
  (:meth:`Connection.take_control`).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Protocol, TypeVar

import numpy as np

from hixl.core import notify, wire
from hixl.core.ratelimit import Budget
from hixl.core.seal import Opener, Sealer
from hixl.core.states import ConnEvent, ConnState, next_state
from hixl.core.window import Batch, Chunk, SendWindow
from hixl.core.wire import RemoteRegion
from hixl.engine.locks import assert_unlocked
from hixl.errors import ConnectionFailed, HandshakeError, HixlError, RegistrationError, StateError
from hixl.verbs import adapter as verbs
from hixl.verbs.slot_ring import SlotRing

__all__ = [
    "Connection",
    "ConnectionHost",
    "Lane",
    "LaneRing",
    "MAX_OUTBOX",
    "MAX_REMOTE_END",
    "RECV_SLOTS",
]

RECV_SLOTS = 64  # receive buffers per connection, for notifications
DIRECT_SQ_DEPTH = 2  # send slots of the direct lane: a channel has one request out at a time
DIRECT_CQ_DEPTH = 4  # its completion queue: that request's completion, or its flush
MAX_OUTBOX = 1 << 20  # bytes of control messages a peer may leave unread before it fails
#: A peer's region must end at or below this address (the wire allows up to 2**64).
MAX_REMOTE_END = 1 << 63
#: What one peer's control messages may cost per second (a burst of one second's worth):
#: past it, its socket is not read until the budget is back, and TCP slows the peer down.
CONTROL_BYTES_PER_S = 1 << 20
CONTROL_MSGS_PER_S = 2000
#: ... and the share of the progress thread its control messages may take (CPU seconds per
#: second, decoding, MAC checks and handling): one flooding peer leaves most of the thread
#: to the others' handshakes and messages on any host, however slow its Python.  A peer's
#: own registrations fit in it: their changes go out merged (see queue_regions) and are
#: applied together.
CONTROL_WORK_PER_S = 0.05
#: REGIONS frames a connection sends per second (a burst of one second's worth): past it,
#: region changes wait and go out merged when the next may go.  A burst of registrations
#: then costs the peer a few frames a second, each carrying many changes, where a frame
#: each would take the peer's control budget (CONTROL_WORK_PER_S) on a slow host.
REGIONS_FRAMES_PER_S = 10
#: Bytes taken from a control socket per read: about one frame of the largest size, so a
#: read never hands the progress thread more than one such frame to decode.
CONTROL_READ = wire.CONTROL_MAX_PAYLOAD + wire.SEAL_OVERHEAD

_QI = TypeVar("_QI", wire.Info, wire.Accept)
_KEYS = itertools.count(1)  # Connection.note_key


class ConnectionHost(Protocol):
    """What a :class:`Connection` needs of its engine to make its queue pairs."""

    @property
    def device(self) -> verbs.Device: ...

    @property
    def qp_timeout(self) -> int: ...

    @property
    def sq_depth(self) -> int: ...

    @property
    def send_cq(self) -> verbs.CompletionQueue: ...

    @property
    def recv_cq(self) -> verbs.CompletionQueue: ...


class LaneRing(SlotRing):
    """A lane's ring of single messages (see :meth:`hixl.engine.single.SinglePaths._ring_enqueuer`):
    a :class:`~hixl.verbs.slot_ring.SlotRing` and what the engine knows of its slots.

    ``written`` slots were written so far and ``released`` of them went out (their post
    returned), so ``written - released`` slots are taken; slot ``written % capacity`` is
    the next.  ``open`` is the chunk the last message went into, which the next one
    joins while the window lets it grow; it holds the messages from ``open_at`` to
    ``written``, and its end is set when it closes (``Poster.close_ring_chunk``).
    Engine lock.
    """

    __slots__ = ("open", "open_at", "released", "written")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.written = 0
        self.released = 0
        self.open: Chunk | None = None
        self.open_at = 0


class Lane:
    """One queue pair of a connection and its send window (engine lock, except posting)."""

    __slots__ = ("conn", "index", "psn", "qp", "qpn", "ring", "window")

    def __init__(self, conn: Connection, index: int, qp: verbs.QueuePair) -> None:
        self.conn = conn
        self.index = index
        self.qp = qp
        self.qpn = qp.qpn
        self.psn = secrets.randbits(24)
        self.window = SendWindow()  # what waits, what is out (engine lock)
        self.ring: LaneRing | None = None  # single messages' slots, made on first use

    def __repr__(self) -> str:
        return f"<Lane {self.index} of {self.conn.peer} qpn={self.qpn:#x}>"

    def take_batch(self, sq_depth: int) -> Batch | None:
        """The next batch to post (see :meth:`SendWindow.take_batch`); None unless READY."""
        if self.conn.state is not ConnState.READY:
            return None
        return self.window.take_batch(sq_depth)

    def post_batch(self, batch: Batch) -> None:
        """Post a batch from :meth:`take_batch`; no engine lock needed (nor wanted).

        Raises :class:`HixlError` when the provider refuses.
        """
        self.qp.post_pieces(batch.pieces)


class Connection:
    """RC queue pairs (lanes) to one peer, plus the TCP control socket.

    Read-only for users: ``peer``, ``state``, ``mtu``, ``remote_regions``, ``failure``,
    ``lanes`` (the connected queue pairs: as many as both engines' ``lanes`` allow),
    ``direct`` (the direct lane for a :class:`~hixl.engine.channel.Channel`, or None) and
    ``direct_busy`` (True while a channel call is under way on it).
    Transfers go through the :class:`Engine`.
    """

    def __init__(
        self,
        engine: ConnectionHost,
        peer: str,
        outbound: bool,
        lanes: int = 1,
        direct: bool = False,
    ) -> None:
        self.peer = peer
        self.outbound = outbound
        self.state = ConnState.CONNECTING
        self.failure: str | None = None
        self.mtu = 0
        self.sent_regions: tuple[RemoteRegion, ...] = ()  # what our handshake message carried
        # The regions the peer exposes to us (its latest announcement), read without the lock:
        # a whole tuple swapped in one store.  Set only by set/update_remote_regions.
        self.remote_regions: tuple[RemoteRegion, ...] = ()
        self._remote_map: dict[tuple[int, int], RemoteRegion] = {}  # by (rkey, addr)
        # Liveness probe (engine lock): the nonce of our last PING, when it went out, and
        # when a PONG with that nonce came back.
        # Notification flow control (engine lock, see hixl.engine.inbox): this
        # connection's key in the receiving inbox, the credits the peer has granted us and
        # not used, and its first grant (for error messages).
        self.note_key = next(_KEYS)
        self.credits = 0
        self.credit_grant = 0
        self.probe_nonce: bytes | None = None
        self.probe_started = 0.0
        self.pong_at = -1.0
        self._dev = engine.device
        self._qp_timeout = engine.qp_timeout
        # Every lane's queue pair exists from here; establish() connects as many as the
        # peer has and leaves the rest unused (closed with the connection).
        self._all: list[Lane] = []
        self.lanes: tuple[Lane, ...] = ()
        # Round robin over the lanes for single requests: next(lane_cycle) (a C call,
        # no Python frame per message); made again whenever ``lanes`` is set.
        self.lane_cycle: Iterator[Lane] = itertools.cycle(self.lanes)
        self.held = 0  # notifications waiting for the other lanes (see Queuer.queue)
        # The direct lane (see Channel): the QP made after the lanes, on a CQ of its own;
        # connected when the peer made one too.  ``direct_busy``: a channel's call is
        # under way on it (written by that call without the engine lock; read under it:
        # notifications queued meanwhile wait for the call, see behind(), and the
        # connection's queue pairs are not freed under it, see poster).
        self.direct: Lane | None = None
        self.direct_cq: verbs.CompletionQueue | None = None
        self.direct_busy = False
        self.channel: object | None = None  # the Channel holding the direct lane
        # One call at a time on the direct lane: a channel's call, or a blocking single
        # put/get of the engine's while no channel is open, pops this (atomic) for its
        # duration and appends it back (see Channel).
        self.direct_token: list[None] = [None]
        sq, max_sge = engine.sq_depth, self._dev.caps.max_sge
        for i in range(lanes):
            try:
                qp = self._dev.create_rc_qp(
                    engine.send_cq, engine.recv_cq, sq, RECV_SLOTS if i == 0 else 1, max_sge, 1
                )
            except BaseException:
                for lane in self._all:
                    lane.qp.close()
                raise
            self._all.append(Lane(self, i, qp))
        if direct:
            try:
                self.direct_cq = self._dev.create_cq(DIRECT_CQ_DEPTH)
                qp = self._dev.create_rc_qp(
                    self.direct_cq, engine.recv_cq, DIRECT_SQ_DEPTH, 1, 1, 1
                )
            except BaseException:
                for lane in self._all:
                    lane.qp.close()
                if self.direct_cq is not None:
                    self.direct_cq.close()
                raise
            self._all.append(Lane(self, lanes, qp))
        self._made_direct = direct
        self.lanes = (self._all[0],)
        self.lane_cycle = itertools.cycle(self.lanes)
        self._recv_buf = np.zeros(RECV_SLOTS * notify.SLOT_BYTES, dtype=np.uint8)
        self._recv_mr = self._dev.register(
            self._recv_buf.ctypes.data,
            self._recv_buf.nbytes,
            verbs.ACCESS_LOCAL_WRITE,
            self._recv_buf,
        )
        try:
            for slot in range(RECV_SLOTS):
                self.post_recv(slot)
        except BaseException:
            self.destroy()
            raise
        self.sock: socket.socket | None = None
        self.decoder: wire.Decoder | None = None
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.inflow = Budget(
            CONTROL_BYTES_PER_S, CONTROL_MSGS_PER_S, time.monotonic(), CONTROL_WORK_PER_S
        )
        self._outbox = bytearray()
        self._regions_out = wire.RegionChanges()  # not sealed yet (engine lock)
        # Frames only: a bytes rate no sender reaches.
        self._regions_pace = Budget(float(1 << 62), REGIONS_FRAMES_PER_S, time.monotonic())
        self._regions_at = 0.0  # when the next REGIONS frame may go (monotonic)

    # -- what users read -----------------------------------------------------------------
    @property
    def qpn(self) -> int:
        """Lane 0's QP number (the one the peer's notifications arrive on)."""
        return self._all[0].qpn

    @property
    def all_lanes(self) -> tuple[Lane, ...]:
        """Every lane made, the unused ones (beyond what the peer has) included."""
        return tuple(self._all)

    @property
    def qpns(self) -> tuple[int, ...]:
        """The QP numbers of every lane made, connected or not."""
        return tuple(lane.qpn for lane in self._all)

    def remote_region(self, name: str) -> RemoteRegion:
        """The peer's region registered under ``name``; :class:`RegistrationError` if none."""
        found = [r for r in self.remote_regions if r.name == name]
        if len(found) != 1:
            names = sorted({r.name for r in self.remote_regions if r.name})
            what = "no" if not found else f"{len(found)}"
            raise RegistrationError(
                f"peer {self.peer} has {what} region named {name!r} (named regions: {names})"
            )
        return found[0]

    def find_remote(self, addr: int, nbytes: int) -> RemoteRegion:
        """The peer region holding ``[addr, addr + nbytes)``.

        Raises :class:`RegistrationError` when no region the peer exposes holds it.
        """
        for r in self.remote_regions:
            if r.addr <= addr and addr + nbytes <= r.addr + r.length:
                return r
        raise RegistrationError(
            f"remote memory not registered: addr={addr:#x} nbytes={nbytes} is in no region "
            f"peer {self.peer} exposes ({len(self.remote_regions)} regions)"
        )

    def exposes(self, region: RemoteRegion) -> bool:
        """True when ``region`` is one the peer currently exposes."""
        return self._remote_map.get((region.rkey, region.addr)) == region

    def set_remote_regions(self, regions: tuple[RemoteRegion, ...]) -> None:
        """The peer's regions as its handshake announced them (one tuple swap).

        Raises :class:`HandshakeError` for a region this engine cannot address (see
        :data:`MAX_REMOTE_END`).
        """
        self._check_reachable(regions)
        self._remote_map = {(r.rkey, r.addr): r for r in regions}
        self.remote_regions = tuple(self._remote_map.values())

    def update_remote_regions(self, changes: list[wire.Regions]) -> None:
        """Apply a peer's REGIONS changes in order, each ``remove`` first, then ``add``
        (engine lock).

        Readers see the old tuple or the one after every change, never a mix: one copy of
        the map and one new tuple for the lot, whatever their number.  Raises
        :class:`HandshakeError` (and changes nothing) when after any change the peer would
        expose more than :data:`wire.MAX_REGIONS` regions, or one this engine cannot
        address.
        """
        new = dict(self._remote_map)
        for change in changes:
            self._check_reachable(change.add)
            for r in change.remove:
                new.pop((r.rkey, r.addr), None)
            for r in change.add:
                new[(r.rkey, r.addr)] = r
            if len(new) > wire.MAX_REGIONS:
                raise HandshakeError(
                    f"peer {self.peer} would expose {len(new)} regions (at most {wire.MAX_REGIONS})"
                )
        self._remote_map = new
        self.remote_regions = tuple(new.values())

    def _check_reachable(self, regions: tuple[RemoteRegion, ...]) -> None:
        for r in regions:
            if r.end > MAX_REMOTE_END:
                raise HandshakeError(
                    f"peer {self.peer} announces region {r.name!r} at addr={r.addr:#x} "
                    f"length={r.length} ending at {r.end:#x}, past {MAX_REMOTE_END:#x} "
                    "(2**63): no user-space address is that high, and transfers address "
                    "remote memory with signed 64-bit offsets"
                )

    def __repr__(self) -> str:
        return (
            f"<Connection peer={self.peer} qpn={self.qpn:#x} state={self.state.name} "
            f"mtu={self.mtu} regions={len(self.remote_regions)}>"
        )

    # -- state ---------------------------------------------------------------------------
    def transition(self, event: ConnEvent) -> None:
        self.state = next_state(self.state, event, f"connection to {self.peer}")

    def check_ready(self) -> None:
        if self.state is ConnState.READY:
            return
        if self.state is ConnState.FAILED:
            raise ConnectionFailed(
                f"connection to {self.peer} has failed: {self.failure}; "
                "disconnect and connect again"
            )
        raise StateError(f"connection to {self.peer} is {self.state.name}")

    # -- handshake -----------------------------------------------------------------------
    def local_info(self, cls: type[_QI], proof: bytes, regions: tuple[RemoteRegion, ...]) -> _QI:
        """Our half of the handshake: queue pair, GID, MTU, slots and exposed regions."""
        self.sent_regions = regions
        return cls(
            proof=proof,
            qpn=self._all[0].qpn,
            psn=self._all[0].psn,
            gid=self._dev.gid,
            mtu=self._dev.active_mtu,
            max_sge=self._dev.caps.max_sge,
            recv_slots=RECV_SLOTS,
            recv_slot_size=notify.SLOT_BYTES,
            regions=regions,
            lanes=wire.pack_lanes((lane.qpn, lane.psn) for lane in self._all[1:]),
            direct=int(self._made_direct),
        )

    def establish(self, remote: wire.QpInfo) -> None:
        """Bring the lanes to RTS against the peer's half of the handshake.

        As many ordinary lanes as both ends made are connected, each to the peer's of the
        same index, and the two direct lanes to each other when both ends made one; the
        other queue pairs stay unused.  So the direct lane never carries the
        connection's ordinary work, on either side.
        """
        self.mtu = min(self._dev.active_mtu, remote.mtu)
        ours = self._all[:-1] if self._made_direct else self._all
        theirs = remote.ordinary_lanes()
        k = min(len(ours), len(theirs))
        pairs = list(zip(ours[:k], theirs[:k], strict=True))
        their_direct = remote.direct_lane()
        if self._made_direct and their_direct is not None:
            pairs.append((self._all[-1], their_direct))
        for lane, (qpn, psn) in pairs:
            lane.qp.connect(
                qpn,
                psn,
                lane.psn,
                remote.gid,
                self.mtu,
                timeout=self._qp_timeout,
                retry_cnt=7,  # rxe reads 7 as "retry until the transfer deadline"
                rnr_retry=7,
            )
        if self._made_direct and their_direct is not None:
            self.direct = self._all[-1]
        self.lanes = tuple(ours[:k])
        self.lane_cycle = itertools.cycle(self.lanes)
        self.set_remote_regions(remote.regions)

    def attach(
        self, sock: socket.socket, decoder: wire.Decoder, session: tuple[Sealer, Opener]
    ) -> None:
        """Keep the handshake socket as the control channel (non-blocking from now on),
        with the session's sealer and opener."""
        sock.setblocking(False)
        self.sock = sock
        self.decoder = decoder
        self.sealer, self.opener = session

    # -- control channel -----------------------------------------------------------------
    def queue_control(self, data: bytes) -> bool:
        """Seal and queue an encoded control message after the region changes waiting
        (engine lock); False when the peer has left too much unread (then the message is
        not queued)."""
        return self.seal_regions() and self._seal(data)

    def queue_regions(
        self, add: tuple[RemoteRegion, ...], remove: tuple[RemoteRegion, ...]
    ) -> bool:
        """Queue a change of our exposed regions, ``remove`` first, then ``add`` (engine
        lock).  It merges with the changes not sealed yet and is sealed by
        :meth:`seal_regions`; False when the peer has left too much unread."""
        if self.sealer is None:
            return False
        if len(self._regions_out) >= wire.MAX_REGIONS and not self.seal_regions():
            return False  # what waits stays at most one handshake's worth of regions
        self._regions_out.note(add, remove)
        return True

    def seal_regions(self) -> bool:
        """Seal the waiting region changes into the outbox as one change, in as many
        frames as it needs (engine lock); False when the peer has left too much unread."""
        if not self._regions_out:
            return True
        add, remove = self._regions_out.take()
        frames = wire.regions_frames(add, remove)
        now = time.monotonic()
        self._regions_at = now + self._regions_pace.charge(0, len(frames), now)
        return all(self._seal(frame) for frame in frames)

    def regions_due(self) -> float | None:
        """When the waiting region changes may be sealed (monotonic; maybe past), or None
        when none wait (engine lock)."""
        return self._regions_at if self._regions_out else None

    def _seal(self, data: bytes) -> bool:
        if self.sealer is None or len(self._outbox) + len(data) + wire.SEAL_OVERHEAD > MAX_OUTBOX:
            return False
        self._outbox += self.sealer.seal(data)
        return True

    def take_control(self, data: bytes) -> tuple[list[wire.Message], HandshakeError | None]:
        """Decode and open what the peer sent: the messages in order, and the error that
        stopped the decoding (a malformed frame, a failed MAC or sequence check), if any.

        Progress thread only (or the adopting thread before the socket is watched); needs
        no engine lock: the decoder and opener are this connection's alone.
        """
        assert self.decoder is not None and self.opener is not None
        out: list[wire.Message] = []
        try:
            for msg in self.decoder.feed(data):
                out.append(self.opener.open(msg))
        except HandshakeError as exc:
            return out, exc
        return out, None

    def open_control(
        self, msgs: list[wire.Message]
    ) -> tuple[list[wire.Message], HandshakeError | None]:
        """:meth:`take_control` for messages already decoded (those that came with the
        handshake's last message)."""
        assert self.opener is not None
        out: list[wire.Message] = []
        try:
            for msg in msgs:
                out.append(self.opener.open(msg))
        except HandshakeError as exc:
            return out, exc
        return out, None

    @property
    def wants_write(self) -> bool:
        return bool(self._outbox)

    def flush_control(self) -> None:
        """Write what the socket takes now, without blocking.  Progress thread only.

        Raises :class:`OSError` when the socket is gone.
        """
        if not self._outbox or self.sock is None:
            return
        # A copy: send() releases the GIL, and a bytearray with a live export cannot grow
        # when another thread queues a message meanwhile.  Only this thread removes bytes.
        data = bytes(self._outbox[:65536])
        assert_unlocked(f"a control message to {self.peer}")
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return
        del self._outbox[:sent]

    def read_control(self) -> bytes | None:
        """What the peer sent, b"" at EOF, None when nothing is there.  Never blocks."""
        assert self.sock is not None
        try:
            return self.sock.recv(CONTROL_READ)
        except (BlockingIOError, InterruptedError):
            return None

    # -- send windows (hixl.core.window; engine lock) -----------------------------------
    @property
    def poster(self) -> bool:
        """True while a batch of one of this connection's lanes, or a channel's request on
        its direct lane, is being posted or waited for."""
        return self.direct_busy or any(lane.window.poster for lane in self.lanes)

    def pick_lane(self) -> Lane:
        """The lane for the next single request: round robin."""
        return next(self.lane_cycle)

    def behind(self, first_id: int) -> bool:
        """True while a lane other than 0 has work queued before ``first_id`` unfinished,
        or a channel's call is under way on the direct lane (it started before whatever
        asks)."""
        if self.direct_busy:
            return True
        for lane in self.lanes[1:]:
            oldest = lane.window.oldest_id
            if oldest is not None and oldest < first_id:
                return True
        return False

    def release_held(self) -> bool:
        """Clear the hold of lane 0's notifications that no other lane is behind any
        more; True when one was released (lane 0 has something to post)."""
        released = False
        for chunk in self._all[0].window.waiting():
            if chunk.held and not self.behind(chunk.first_id):
                chunk.held = False
                self.held -= 1
                released = True
        return released

    # -- verbs ---------------------------------------------------------------------------
    def post_recv(self, slot: int) -> None:
        base = self._recv_mr.addr + slot * notify.SLOT_BYTES
        self._all[0].qp.post_recv(slot, [(base, notify.SLOT_BYTES, self._recv_mr.lkey)])

    def recv_slot(self, slot: int, nbytes: int) -> bytes:
        """The bytes a receive completion put in ``slot``."""
        start = slot * notify.SLOT_BYTES
        return bytes(self._recv_buf[start : start + min(nbytes, notify.SLOT_BYTES)])

    def to_error(self) -> None:
        """Move the lanes to ERR: everything still queued is flushed, no late DMA.

        Raises the first lane's :class:`HixlError` after trying every lane.
        """
        first: HixlError | None = None
        lanes = self.lanes if self.direct is None else (*self.lanes, self.direct)
        for lane in lanes:
            try:
                lane.qp.to_error()
            except HixlError as exc:
                first = first or exc
        if first is not None:
            raise first

    def destroy(self) -> None:
        for lane in self._all:
            lane.qp.close()
        if self.direct_cq is not None:
            self.direct_cq.close()  # after its queue pair
        self._recv_mr.close()
        self._recv_buf = np.zeros(0, dtype=np.uint8)  # not kept until the object goes
        if getattr(self, "sock", None) is not None:
            assert self.sock is not None
            with contextlib.suppress(OSError):
                self.sock.close()
