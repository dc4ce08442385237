"""One connection: an RC queue pair to a peer, its receive slots, send window and control socket.

A :class:`Connection` is owned by its engine and mutated only under the engine lock,
except where a method says otherwise.  It keeps three things behind methods:

* the *send window*: chunks (ranges of a work-request chain, one per request or
  notification) waiting for send-queue room (backlog), and chunks with work requests
  posted and not all completed (sent), with the send-queue slots they use.  A chunk's
  WRs form signal groups; since an RC queue completes in order, a group's completion
  frees every slot up to it, and belongs to the oldest chunk still sent;
* the *receive slots*: buffers posted for notifications, one :data:`notify.SLOT_BYTES`
  each;
* the *control channel*: the TCP socket the handshake ran on, its decoder, and an outbox
  of encoded control messages.  Messages are queued under the engine lock and written by
  the progress thread with non-blocking sends, so no caller ever blocks on a peer that
  stops reading; an outbox that grows past :data:`MAX_OUTBOX` fails the connection.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from hixl.core import notify, wire
from hixl.core.states import ConnEvent, ConnState, next_state
from hixl.core.wire import RemoteRegion
from hixl.errors import ConnectionFailed, HandshakeError, RegistrationError, StateError
from hixl.verbs import adapter as verbs
from hixl.verbs.chain import SendChain

if TYPE_CHECKING:
    from hixl.engine.datapath import Built
    from hixl.engine.engine import Engine
    from hixl.engine.handles import TransferHandle

__all__ = ["Batch", "Chunk", "Connection", "MAX_OUTBOX", "RECV_SLOTS"]

RECV_SLOTS = 64  # receive buffers per connection, for notifications
MAX_OUTBOX = 1 << 20  # bytes of control messages a peer may leave unread before it fails

_QI = TypeVar("_QI", wire.Info, wire.Accept)


@dataclass(slots=True, eq=False)
class Batch:
    """Ranges of chains posted together, and the chunks that are all posted with them."""

    pieces: list[tuple[SendChain, int, int]]
    finished: list[Chunk]


@dataclass(slots=True, eq=False)
class Chunk:
    """WRs ``start .. stop-1`` of ``chain``, in signal groups of ``every``.

    Group ``g`` completes under ``wr_id = first_id + g``.  ``posted``/``done`` count the
    chunk's WRs posted and completed so far.  ``built`` (a request's chain) goes back to
    the planner's pool once every WR is posted.
    """

    chain: SendChain
    start: int
    stop: int
    handle: TransferHandle | None
    every: int = 1
    first_id: int = 0
    groups: int = 0
    posted: int = 0
    done: int = 0
    notify_slot: int | None = None
    built: Built | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start


class Connection:
    """An RC queue pair to one peer, plus the TCP control socket.

    Read-only for users: ``peer``, ``state``, ``mtu``, ``remote_regions``, ``failure``.
    Transfers go through the :class:`Engine`.
    """

    def __init__(self, engine: Engine, peer: str, outbound: bool) -> None:
        self.peer = peer
        self.outbound = outbound
        self.state = ConnState.CONNECTING
        self.failure: str | None = None
        self.mtu = 0
        self.sent_regions: tuple[RemoteRegion, ...] = ()  # what our handshake message carried
        self._remote: tuple[RemoteRegion, ...] = ()
        self._remote_map: dict[tuple[int, int], RemoteRegion] = {}  # by (rkey, addr)
        # Liveness probe (engine lock): the nonce of our last PING, when it went out, and
        # when a PONG with that nonce came back.
        self.probe_nonce: bytes | None = None
        self.probe_started = 0.0
        self.pong_at = -1.0
        self._dev = engine.device
        self._qp_timeout = engine.qp_timeout
        self._qp = self._dev.create_rc_qp(
            engine.send_cq, engine.recv_cq, engine.sq_depth, RECV_SLOTS, self._dev.caps.max_sge, 1
        )
        self.qpn = self._qp.qpn
        self.psn = secrets.randbits(24)
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
        self._outbox = bytearray()
        self._backlog: deque[Chunk] = deque()  # not all posted; the head may be partly
        self._sent: deque[Chunk] = deque()  # some WRs posted, not all completed; in order
        self._sq_used = 0
        self.poster = False  # a batch is being posted, outside the engine lock

    # -- what users read -----------------------------------------------------------------
    @property
    def remote_regions(self) -> tuple[RemoteRegion, ...]:
        """The regions the peer exposes to us (its latest announcement)."""
        return self._remote

    def remote_region(self, name: str) -> RemoteRegion:
        """The peer's region registered under ``name``; :class:`RegistrationError` if none."""
        found = [r for r in self._remote if r.name == name]
        if len(found) != 1:
            names = sorted({r.name for r in self._remote if r.name})
            what = "no" if not found else f"{len(found)}"
            raise RegistrationError(
                f"peer {self.peer} has {what} region named {name!r} (named regions: {names})"
            )
        return found[0]

    def find_remote(self, addr: int, nbytes: int) -> RemoteRegion:
        """The peer region holding ``[addr, addr + nbytes)``.

        Raises :class:`RegistrationError` when no region the peer exposes holds it.
        """
        for r in self._remote:
            if r.addr <= addr and addr + nbytes <= r.addr + r.length:
                return r
        raise RegistrationError(
            f"remote memory not registered: addr={addr:#x} nbytes={nbytes} is in no region "
            f"peer {self.peer} exposes ({len(self._remote)} regions)"
        )

    def exposes(self, region: RemoteRegion) -> bool:
        """True when ``region`` is one the peer currently exposes."""
        return self._remote_map.get((region.rkey, region.addr)) == region

    def set_remote_regions(self, regions: tuple[RemoteRegion, ...]) -> None:
        """The peer's regions as its handshake announced them (one tuple swap)."""
        self._remote_map = {(r.rkey, r.addr): r for r in regions}
        self._remote = tuple(self._remote_map.values())

    def update_remote_regions(
        self, add: tuple[RemoteRegion, ...], remove: tuple[RemoteRegion, ...]
    ) -> None:
        """Apply a peer's REGIONS change: ``remove`` first, then ``add`` (engine lock).

        Readers see the old or the new tuple, never a mix.  Raises :class:`HandshakeError`
        when the peer would expose more than :data:`wire.MAX_REGIONS` regions.
        """
        for r in remove:
            self._remote_map.pop((r.rkey, r.addr), None)
        for r in add:
            self._remote_map[(r.rkey, r.addr)] = r
        if len(self._remote_map) > wire.MAX_REGIONS:
            raise HandshakeError(
                f"peer {self.peer} would expose {len(self._remote_map)} regions "
                f"(at most {wire.MAX_REGIONS})"
            )
        self._remote = tuple(self._remote_map.values())

    def __repr__(self) -> str:
        return (
            f"<Connection peer={self.peer} qpn={self.qpn:#x} state={self.state.name} "
            f"mtu={self.mtu} regions={len(self._remote)}>"
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
            qpn=self.qpn,
            psn=self.psn,
            gid=self._dev.gid,
            mtu=self._dev.active_mtu,
            max_sge=self._dev.caps.max_sge,
            recv_slots=RECV_SLOTS,
            recv_slot_size=notify.SLOT_BYTES,
            regions=regions,
        )

    def establish(self, remote: wire.QpInfo) -> None:
        """Bring the queue pair to RTS against the peer's half of the handshake."""
        self.mtu = min(self._dev.active_mtu, remote.mtu)
        self._qp.connect(
            remote.qpn,
            remote.psn,
            self.psn,
            remote.gid,
            self.mtu,
            timeout=self._qp_timeout,
            retry_cnt=7,  # rxe reads 7 as "retry until the transfer deadline"
            rnr_retry=7,
        )
        self.set_remote_regions(remote.regions)

    def attach(self, sock: socket.socket, decoder: wire.Decoder) -> None:
        """Keep the handshake socket as the control channel (non-blocking from now on)."""
        sock.setblocking(False)
        self.sock = sock
        self.decoder = decoder

    # -- control channel -----------------------------------------------------------------
    def queue_control(self, data: bytes) -> bool:
        """Queue an encoded control message; False when the peer has left too much unread."""
        if len(self._outbox) + len(data) > MAX_OUTBOX:
            return False
        self._outbox += data
        return True

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
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return
        del self._outbox[:sent]

    def read_control(self) -> bytes | None:
        """What the peer sent, b"" at EOF, None when nothing is there.  Never blocks."""
        assert self.sock is not None
        try:
            return self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return None

    # -- send window ---------------------------------------------------------------------
    def queue(self, chunks: list[Chunk]) -> None:
        self._backlog.extend(chunks)

    @property
    def posting(self) -> Chunk | None:
        """The chunk the next post starts with (the head of the backlog)."""
        return self._backlog[0] if self._backlog else None

    @property
    def backlog(self) -> bool:
        """True when some chunk still has WRs to post."""
        return bool(self._backlog)

    @property
    def in_flight(self) -> int:
        """WRs posted (or being posted) and not yet completed."""
        return self._sq_used

    def take_batch(self, sq_depth: int) -> Batch | None:
        """Reserve what the send queue has room for, as one post; None if nothing fits.

        Caller holds the engine lock and no other batch of this connection is out
        (:attr:`poster` is False); this sets :attr:`poster` until :meth:`end_batch`.
        The WRs count as posted from here on (a completion may be reaped before the
        post returns).  Every chunk but the batch's last that goes out whole is posted
        unsignaled: an RC queue completes in order, so the last one's completion stands
        for all of them.  Raises :class:`RegistrationError` (and reserves nothing) when a
        chunk's chain refers to a closed region.
        """
        assert not self.poster
        room = sq_depth - self._sq_used
        if room <= 0 or not self._backlog or self.state is not ConnState.READY:
            return None
        # Chunks up to the first whose chain refers to a closed region: that one is
        # refused when it reaches the head (it is the culprit then).
        count = 0
        for chunk in self._backlog:
            if chunk.posted == 0:
                try:
                    chunk.chain.check_regions()
                except RegistrationError:
                    if count == 0:
                        raise
                    break
            count += 1
            room -= chunk.size - chunk.posted
            if room <= 0:
                break
        room = sq_depth - self._sq_used
        pieces: list[tuple[SendChain, int, int]] = []
        finished: list[Chunk] = []
        whole: Chunk | None = None  # the previous chunk, when it went into this batch whole
        while count and room > 0:
            count -= 1
            chunk = self._backlog[0]
            lo = chunk.start + chunk.posted
            hi = min(chunk.stop, lo + room)
            if whole is not None:
                whole.chain.unsignal(whole.stop - 1)
            whole = chunk if lo == chunk.start and hi == chunk.stop else None
            pieces.append((chunk.chain, lo, hi))
            if not chunk.posted:
                self._sent.append(chunk)
            k = hi - lo
            chunk.posted += k
            self._sq_used += k
            room -= k
            if chunk.posted == chunk.size:
                self._backlog.popleft()
                finished.append(chunk)
        self.poster = True
        return Batch(pieces, finished)

    def post_batch(self, batch: Batch) -> None:
        """Post a batch from :meth:`take_batch`; no engine lock needed (nor wanted).

        Raises :class:`HixlError` when the provider refuses.
        """
        self._qp.post_pieces(batch.pieces)

    def end_batch(self) -> None:
        """The batch's post returned (engine lock held again)."""
        self.poster = False

    def completed(self, wr_id: int) -> list[tuple[Chunk, bool]]:
        """The chunks a signaled completion ends or advances, oldest first.

        Every chunk sent before the one ``wr_id`` belongs to is complete (an RC queue
        completes in order; such chunks were posted unsignaled); the owner is complete
        up to its group.  Empty for a completion of a chunk already forgotten (flushed
        after a failure).
        """
        out: list[tuple[Chunk, bool]] = []
        sent = self._sent
        while sent:
            chunk = sent[0]
            g = wr_id - chunk.first_id
            if g < 0:
                break
            if g >= chunk.groups:
                if chunk.posted < chunk.size:
                    break  # not all posted: the completion is not of a later chunk
                self._sq_used -= chunk.size - chunk.done
                chunk.done = chunk.size
                sent.popleft()
                out.append((chunk, True))
                continue
            upto = min(chunk.size, (g + 1) * chunk.every)
            self._sq_used -= upto - chunk.done
            chunk.done = upto
            if upto == chunk.size:
                sent.popleft()
                out.append((chunk, True))
            else:
                out.append((chunk, False))
            break
        return out

    def drain(self) -> list[Chunk]:
        """Forget every queued and sent chunk (the queue pair is in ERR or gone)."""
        chunks = list(self._sent) + [c for c in self._backlog if not c.posted]
        self._sent.clear()
        self._backlog.clear()
        self._sq_used = 0
        return chunks

    @property
    def pending(self) -> int:
        """Chunks queued or sent."""
        return len(self._sent) + sum(1 for c in self._backlog if not c.posted)

    # -- verbs ---------------------------------------------------------------------------
    def post_recv(self, slot: int) -> None:
        base = self._recv_mr.addr + slot * notify.SLOT_BYTES
        self._qp.post_recv(slot, [(base, notify.SLOT_BYTES, self._recv_mr.lkey)])

    def recv_slot(self, slot: int, nbytes: int) -> bytes:
        """The bytes a receive completion put in ``slot``."""
        start = slot * notify.SLOT_BYTES
        return bytes(self._recv_buf[start : start + min(nbytes, notify.SLOT_BYTES)])

    def to_error(self) -> None:
        """Move the queue pair to ERR: everything still queued is flushed, no late DMA."""
        self._qp.to_error()

    def destroy(self) -> None:
        self._qp.close()
        self._recv_mr.close()
        if getattr(self, "sock", None) is not None:
            assert self.sock is not None
            with contextlib.suppress(OSError):
                self.sock.close()
