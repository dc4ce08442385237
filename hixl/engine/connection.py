"""One connection: an RC queue pair to a peer, its receive slots, send window and control socket.

A :class:`Connection` is owned by its engine and mutated only under the engine lock,
except where a method says otherwise.  It keeps three things behind methods:

* the *send window* (:class:`hixl.core.window.SendWindow`, pure bookkeeping): chunks
  waiting to be posted, chunks out, the slots in use, and the one poster at a time;
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
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from hixl.core import notify, wire
from hixl.core.states import ConnEvent, ConnState, next_state
from hixl.core.window import Batch, SendWindow
from hixl.core.wire import RemoteRegion
from hixl.errors import ConnectionFailed, HandshakeError, RegistrationError, StateError
from hixl.verbs import adapter as verbs

if TYPE_CHECKING:
    from hixl.engine.engine import Engine

__all__ = ["Connection", "MAX_OUTBOX", "RECV_SLOTS"]

RECV_SLOTS = 64  # receive buffers per connection, for notifications
MAX_OUTBOX = 1 << 20  # bytes of control messages a peer may leave unread before it fails

_QI = TypeVar("_QI", wire.Info, wire.Accept)


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
        self.window = SendWindow()  # what waits, what is out (engine lock)

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

    # -- send window (hixl.core.window; engine lock) ------------------------------------
    @property
    def poster(self) -> bool:
        """True while a batch of this connection is being posted."""
        return self.window.poster

    def take_batch(self, sq_depth: int) -> Batch | None:
        """The next batch to post (see :meth:`SendWindow.take_batch`); None unless READY."""
        if self.state is not ConnState.READY:
            return None
        return self.window.take_batch(sq_depth)

    def post_batch(self, batch: Batch) -> None:
        """Post a batch from :meth:`take_batch`; no engine lock needed (nor wanted).

        Raises :class:`HixlError` when the provider refuses.
        """
        self._qp.post_pieces(batch.pieces)

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
