"""The :class:`Engine` facade: lifetime, registration, connections, transfers, notifications.

The parts live in their own modules (regions, connection, handshake, datapath, progress);
this class owns the tables that tie them together and the one lock that guards them.
The threading and locking rules are in the package docstring (:mod:`hixl.engine`).
"""

from __future__ import annotations

import logging
import secrets
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from hixl.core import notify, wire
from hixl.core.descriptors import Descriptor
from hixl.core.notify import Notification
from hixl.core.plan import DeviceLimits, Op
from hixl.core.seal import IntegrityError, Opener, Sealer
from hixl.core.states import ConnEvent, ConnState
from hixl.core.window import MAX_BATCHES, Chunk
from hixl.core.wire import RemoteRegion
from hixl.engine.channel import Channel
from hixl.engine.config import EngineConfig, is_loopback
from hixl.engine.connection import RECV_SLOTS, Connection, Lane
from hixl.engine.datapath import (
    Built,
    NotifySlots,
    Planner,
    ranges_key,
    resolve_remote,
    signal_interval,
)
from hixl.engine.handles import (
    TransferHandle,
    TransferRequest,
)
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
from hixl.engine.kv import KVBlocks, KVCache
from hixl.engine.locks import engine_lock
from hixl.engine.names import Names
from hixl.engine.posting import POLL_BATCH, Poster
from hixl.engine.progress import Progress
from hixl.engine.queueing import Queuer
from hixl.engine.reaping import SendReaper
from hixl.engine.regions import Access, Region, buffer_span
from hixl.engine.single import LentLane, SinglePaths
from hixl.errors import (
    ArgumentError,
    ConnectionFailed,
    HandshakeError,
    HixlError,
    RegistrationError,
    RegistryUnavailable,
    StateError,
    TransferTimeout,
)
from hixl.verbs import adapter as verbs
from hixl.verbs.adapter import gid_to_str
from hixl.verbs.chain import SendChain

if TYPE_CHECKING:
    from hixl.registry import Registry, Watch

__all__ = ["Diagnostics", "Engine"]

log = logging.getLogger("hixl.engine")

SEND_NOTIFY_SLOTS = 256  # notifications in flight per engine
#: Longest :meth:`Engine.channel` waits for a blocking put or get on the direct lane.
CHANNEL_WAIT_S = 60.0
# Room left in a handshake message for everything but the exposed regions, bytes.
_REGION_BYTES = wire.MAX_PAYLOAD - 4096


@dataclass(frozen=True, slots=True)
class Diagnostics:
    """A snapshot of an engine's internals, for monitoring and tests.

    ``progress_thread_id`` is the native id of the progress thread and
    ``progress_alive`` whether it runs; ``completion_events`` tells whether it sleeps
    on completion channels (True) or polls the CQs; ``pending_transfers`` counts
    transfers not finished yet; ``handshakes`` counts incoming handshakes under way and
    ``refused_busy`` the sockets answered ERROR(BUSY) so far; ``notifications`` counts
    notifications received and not taken yet.  ``send_posts`` counts the
    ``post_send`` calls made for transfers and notifications so far and
    ``posted_wrs`` the work requests they carried: many ``put_async`` calls issued
    while earlier ones are out go in one post (see :meth:`Engine.transfer_async`).
    ``direct_posts`` counts the blocking single requests among them that were posted
    and completed on the caller's thread (see :meth:`Engine.put`), and ``lane_posts``
    those of them that ran on a connection's direct lane.  ``slot_messages`` counts the
    asynchronous single requests written into a lane's ring of slots (see
    :meth:`Engine.put_async`); the messages queued together in one ring count as one
    pending transfer until they complete.  ``chains_built`` counts the work-request
    chains allocated for a transfer's plan (not a single message's) and
    ``chains_refilled`` the transfers of a new layout that took an idle chain of the
    same size from an earlier transfer and filled it anew instead (a repeated layout
    reuses its own chain and counts in neither).
    """

    progress_thread_id: int | None
    progress_alive: bool
    completion_events: bool
    pending_transfers: int
    peers: int
    regions: int
    handshakes: int = 0
    refused_busy: int = 0
    notifications: int = 0
    notifications_dropped: int = 0
    send_posts: int = 0
    posted_wrs: int = 0
    direct_posts: int = 0
    lane_posts: int = 0
    slot_messages: int = 0
    chains_built: int = 0
    chains_refilled: int = 0


class Engine:
    """A hixl transfer engine, named ``"ip:port"``.

    ``Engine("10.0.0.1:5000")`` listens on that address for peers; port 0
    means the engine only makes outgoing connections (its id then gets a
    random ``~suffix`` to stay unique).  ``device``/``port``/``gid_index``
    default to what ``hixl devices`` marks.  ``token`` (optional shared
    secret) makes both ends prove they know it before any region key is
    sent.  ``alignment`` is the policy for offsets inside regions (bytes, 0 to
    turn it off).  ``qp_timeout`` is the verbs ACK-timeout exponent, which
    bounds how long a silent peer takes to fail a transfer.  ``max_peers``
    caps connections, checked before a queue pair is made or any key sent.
    ``max_handshakes`` and ``max_handshakes_per_source`` cap incoming
    handshakes under way, in all and from one source (an IPv4 address, all of
    127.0.0.0/8 as one, or an IPv6 /64; over either, a
    client is answered ERROR(BUSY) and asks again); ``handshake_timeout``
    bounds a whole handshake, each of its steps has a shorter deadline.
    ``max_notifications_per_peer`` and ``max_notifications`` bound
    notifications received and not yet taken, from one peer and in all: each
    connection is granted ``min(max_notifications_per_peer, max_notifications //
    max_peers)`` credits, a sender out of credits waits for the application here
    to take some (its call fails with TransferTimeout at its deadline; nothing
    else fails), and at the total the departed peer holding the most loses its oldest
    (see :mod:`hixl.engine.inbox`).  ``completion_events=False`` makes the progress thread
    poll the CQs instead of sleeping on completion channels (a test hook).
    ``lanes`` is how many queue pairs a connection sends its work over (as many as both
    ends allow); ``direct_lane`` makes each connection one more, with a completion queue of
    its own, for a :meth:`channel` (connected when the peer made as many queue pairs).
    ``gil_switch_interval`` (seconds) is for an application that asks for it: it lowers
    the interpreter's GIL switch interval (:func:`sys.setswitchinterval`, 5 ms by
    default) for the whole process when that is longer, so the thread that posts and
    reaps gets the GIL back sooner while the application thread runs Python.  The
    default, None, leaves the process's interval alone.

    A client whose id names a listening ``ip:port`` must connect from that ip, so that
    nobody takes the id of an engine not connected yet (the client side binds its socket
    to its id's address); ``trust_peer_hosts=True`` lifts that for peers behind NAT or a
    proxy, whose connections come from another address than their id names.

    Without a token any client that reaches the port learns the rkeys of
    every remotely accessible region, so an engine that listens on an address
    other than loopback (``0.0.0.0`` included) needs a token, or
    ``insecure=True`` to run open on purpose (it then logs a WARNING once).

    ``registry`` (a URL such as ``"etcd://10.0.0.1:2379"`` or ``"memory://NAME"``, or a
    :class:`hixl.registry.Registry` the caller shares) lets :meth:`connect` take peer
    names; with ``name`` the engine also announces itself there (``role``, its id, the
    device's GID and MTU, ``capacity``) under a lease that ends with the engine. Without a
    registry nothing is needed: peers are ``"ip:port"`` as always.

    Raises :class:`ArgumentError` for a bad id, an empty token, a limit below 1
    or a non-loopback listening address with neither a token nor ``insecure=True``,
    :class:`DeviceError` when no device is usable, :class:`OSError` when the
    address cannot be bound, :class:`~hixl.errors.RegistryUnavailable`
    naming the registry when it does not answer.
    """

    def __init__(
        self,
        engine_id: str = "127.0.0.1:0",
        *,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        token: bytes | str | None = None,
        alignment: int | None = 64,
        send_queue_depth: int = 512,
        lanes: int = 2,
        direct_lane: bool = True,
        handshake_timeout: float = 10.0,
        qp_timeout: int = 14,
        max_peers: int = 64,
        max_handshakes: int = 256,
        max_handshakes_per_source: int = 32,
        max_notifications_per_peer: int = 1024,
        max_notifications: int = 16384,
        completion_events: bool = True,
        gil_switch_interval: float | None = None,
        name: str | None = None,
        registry: str | Registry | None = None,
        role: str = "engine",
        capacity: int = 0,
        trust_peer_hosts: bool = False,
        insecure: bool = False,
    ) -> None:
        self._closed = True  # until fully built, so __del__ stays quiet on failure
        cfg = EngineConfig.check(
            engine_id,
            token=token,
            lanes=lanes,
            direct_lane=direct_lane,
            handshake_timeout=handshake_timeout,
            max_peers=max_peers,
            max_handshakes=max_handshakes,
            max_handshakes_per_source=max_handshakes_per_source,
            max_notifications_per_peer=max_notifications_per_peer,
            max_notifications=max_notifications,
            gil_switch_interval=gil_switch_interval,
            name=name,
            has_registry=registry is not None,
            insecure=insecure,
        )
        host, tcp_port = cfg.host, cfg.tcp_port
        self._lanes = cfg.lanes
        self._direct_lane = cfg.direct_lane
        if gil_switch_interval is not None and sys.getswitchinterval() > gil_switch_interval:
            sys.setswitchinterval(gil_switch_interval)  # asked for by name (see above)
        self._names: Names | None = None
        self._token = cfg.token
        if registry is not None:
            # Before the device, so that an unreachable registry fails before it is opened.
            self._names = Names(registry, self._peer_gone)
        self._handshake_timeout = handshake_timeout
        self._max_notes_per_peer = max_notifications_per_peer
        self._max_notes = max_notifications
        self.qp_timeout = qp_timeout
        self._max_peers = max_peers
        self._lock = engine_lock()
        self._notify_cv = threading.Condition(self._lock)
        self._credit_cv = threading.Condition(self._lock)  # notification credits came back
        try:
            self._dev = verbs.open_device(device, port, gid_index)
        except BaseException:
            if self._names is not None:
                self._names.close()
            raise
        try:
            caps = self._dev.caps
            self.sq_depth = max(32, min(send_queue_depth, caps.max_qp_wr))
            self._every = signal_interval(self.sq_depth)
            self.limits = DeviceLimits(
                max_sge=caps.max_sge,
                max_sge_rd=caps.max_sge_rd,
                max_msg_sz=min(caps.max_msg_sz, 0xFFFF_FFFF),
            )
            # Signaled WRs of every lane of every peer (group ends, and batch ends, of
            # which a window lets at most MAX_BATCHES be out), plus room for one
            # connection's flushed WRs (a failed queue pair completes every outstanding
            # WR, signaled or not).
            per_lane = self.sq_depth // self._every + MAX_BATCHES
            cq_depth = (max_peers * per_lane + self.sq_depth) * lanes
            self.send_cq = self._dev.create_cq(cq_depth, events=completion_events)
            self.recv_cq = self._dev.create_cq(
                max_peers * RECV_SLOTS + 16, events=completion_events
            )
            self._notify_slots = NotifySlots(self._dev, SEND_NOTIFY_SLOTS)
            listener: socket.socket | None = None
            if tcp_port:
                listener = socket.create_server((host, tcp_port), backlog=1024)
                listener.setblocking(False)
                self.id = engine_id
            else:
                self.id = f"{host}:0~{secrets.token_hex(4)}"
        except BaseException:
            self._dev.close()
            if self._names is not None:
                self._names.close()
            raise
        self._listener = listener
        self._planner = Planner(self.limits, alignment or None)
        # register_kv, put_blocks, get_blocks.  A weak host: the parts hold no strong reference
        # back, so an engine dropped without close() is still collected (and warns).
        self._kv = KVBlocks(weakref.proxy(self), self._planner.memory)
        self._regions: dict[tuple[int, int], Region] = {}
        self._conns: dict[str, Connection] = {}
        self._by_qpn: dict[int, Lane] = {}  # every lane made, connected or not
        self._handles: set[TransferHandle] = set()
        # Unread notifications and the credits that bound them (see hixl.engine.inbox).
        self._inbox = Inbox(max_notifications_per_peer, max_notifications, max_peers)
        # What peers see: every remotely accessible region, by (rkey, addr), in
        # registration order, and the bytes they take in a handshake message.
        self._exposed_map: dict[tuple[int, int], RemoteRegion] = {}
        self._exposed_bytes = 0
        # Posting: lanes waiting for the progress thread, posters at work, the wake-up due.
        self._parts = parts = _Host(self)
        self._poster = Poster(self._lock, self.sq_depth, self._planner, parts)
        self._reaper = SendReaper(self._by_qpn, self._handles, self._poster, parts)
        self._queuer = Queuer(
            self._lock, self._poster, self._planner, self._handles, self._notify_slots,
            self._every, parts,
        )  # fmt: skip
        self._singles = SinglePaths(
            self._lock, self._planner, self._poster, self._reaper, self._queuer, self.send_cq,
            self.sq_depth, self._conns, self._handles, self.id, parts,
        )  # fmt: skip
        self._outgoing: set[Connection] = set()  # connections with control output queued
        self._dead: list[Connection] = []  # dropped, resources released by the progress thread
        self._broken: str | None = None  # why the progress thread died, if it did
        self._progress = Progress(
            self,
            listener,
            (self.send_cq, self.recv_cq),
            completion_events,
            self._poster,
            self._reaper,
        )
        self._poster.attach(self._progress, self.send_cq, self._reaper.reap_send)
        self._incoming: Listener | None = None
        if listener is not None:
            self._incoming = Listener(
                self,
                listener,
                register=self._progress.register,
                unregister=self._progress.unregister,
                max_handshakes=max_handshakes,
                max_per_source=max_handshakes_per_source,
                timeout=handshake_timeout,
                trust_hosts=trust_peer_hosts,
            )
        self._closed = False
        self._progress.start()
        if listener is not None and self._token is None and not is_loopback(host):
            log.warning(
                "engine %s listens on a non-loopback address without a token: any client "
                "that reaches the port gets the rkeys of every remotely accessible region; "
                "give every engine Engine(token=...) (see 'hixl token') and use a private "
                "fabric",
                self.id,
            )
        if name is not None and self._names is not None:
            try:
                self._names.announce(
                    name, role, self.id, gid_to_str(self._dev.gid), self._dev.active_mtu, capacity
                )
            except BaseException:
                self.close()
                raise
        log.debug("engine %s up on %r", self.id, self._dev)

    # -- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Engine id={getattr(self, 'id', '?')} peers={len(getattr(self, '_conns', {}))}"
            f" regions={len(getattr(self, '_regions', {}))} {state}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def device(self) -> verbs.Device:
        return self._dev

    @property
    def alignment(self) -> int | None:
        """The offset alignment policy in bytes, or None when off."""
        return self._planner.alignment

    def diagnostics(self) -> Diagnostics:
        """A snapshot of the progress thread and tables (see :class:`Diagnostics`)."""
        thread, poster = self._progress.thread, self._poster
        with self._lock:
            return Diagnostics(
                progress_thread_id=thread.native_id,
                progress_alive=thread.is_alive(),
                completion_events=self._progress.events,
                pending_transfers=len(self._handles),
                peers=len(self._conns),
                regions=len(self._regions),
                handshakes=self._incoming.pending if self._incoming is not None else 0,
                refused_busy=self._incoming.refused_busy if self._incoming is not None else 0,
                notifications=len(self._inbox),
                notifications_dropped=self._inbox.dropped,
                send_posts=poster.send_posts + poster.direct_posts + poster.lane_posts,
                posted_wrs=poster.posted_wrs + poster.direct_posts + poster.lane_posts,
                direct_posts=poster.direct_posts + poster.lane_posts,
                lane_posts=poster.lane_posts,
                slot_messages=self._poster.slot_messages + self._open_messages(),
                chains_built=self._planner.chains_built,
                chains_refilled=self._planner.chains_refilled,
            )

    def _open_messages(self) -> int:
        """Messages in the rings' open chunks, not counted yet (lock held)."""
        count = 0
        for conn in self._conns.values():
            for lane in conn.lanes:
                ring = lane.ring
                if ring is not None and ring.open is not None:
                    count += ring.written - ring.open_at
        return count

    def close(self) -> None:
        """Fail pending transfers, say goodbye to peers, release every resource.  Idempotent.

        An engine with a name leaves its registry first (peers watching see it go at once).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._poster.closed = True
            names, self._names = self._names, None
        if names is not None:
            names.close()
        with self._lock:
            for conn in list(self._conns.values()):
                self._drop(conn, "engine closed", send_bye=True)
            for h in list(self._handles):
                h.finish(StateError(f"engine {self.id} closed while the transfer was pending"))
            self._handles.clear()
            self._notify_cv.notify_all()
        self._poster.wake_if_due()
        self._progress.stop()
        with self._lock:  # a thread still posting a batch to a queue pair about to go
            until = time.monotonic() + 10.0
            while (self._poster.posters or any(c.direct_busy for c in self._dead)) and (
                time.monotonic() < until
            ):
                self._poster.post_cv.wait(0.1)  # (a channel call ends without notifying: polled)
        if self._incoming is not None:
            self._incoming.close()  # the progress thread is gone: nobody else touches it
        if self._listener is not None:
            self._listener.close()
        self._release_dead()
        self._progress.close()
        self._regions.clear()
        self._singles.clear()
        self._dev.close()
        with self._lock:
            self._notify_slots.close()
        self._planner.close()
        log.debug("engine %s closed", self.id)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"engine {self.id} is closed")
        if self._broken is not None:
            raise StateError(f"engine {self.id} is broken: {self._broken}")

    def _progress_died(self, exc: BaseException) -> None:
        """The progress thread is gone: fail everything pending, refuse new work."""
        with self._lock:
            self._broken = f"its progress thread died ({type(exc).__name__}: {exc})"
            err = StateError(f"engine {self.id}: {self._broken}")
            for h in list(self._handles):
                h.finish(err)
            self._handles.clear()
            self._notify_cv.notify_all()

    # -- memory --------------------------------------------------------------------------
    def register(
        self, buffer: object, *, access: Access = Access.LOCAL_WRITE, name: str = ""
    ) -> Region:
        """Register ``buffer`` for transfers; return its :class:`Region`.

        ``buffer`` is anything with the buffer protocol (bytearray, mmap,
        numpy array...), a CPU torch tensor, or an ``(address, nbytes)``
        tuple (the caller keeps that memory alive).  It must be contiguous.
        A read-only buffer needs ``access=Access.NONE`` (it can only be a put
        source).  ``name`` lets peers find the region.  Registering the same
        memory again with the same access returns the same region.  Peers are
        told about a remotely accessible region by the progress thread; this
        call never waits for them.

        Raises :class:`RegistrationError` for an unsupported, empty or
        read-only-but-writable request or an access clash, and
        :class:`VerbsError` when the device refuses.
        """
        self._check_open()
        access = Access(access)
        if access & Access.REMOTE_WRITE:
            access |= Access.LOCAL_WRITE
        addr, length, owner, readonly = buffer_span(buffer)
        if length <= 0:
            raise RegistrationError(f"cannot register an empty buffer (nbytes={length})")
        if readonly and access & (Access.LOCAL_WRITE | Access.REMOTE_WRITE):
            raise RegistrationError(
                f"buffer at {addr:#x} (nbytes={length}) is read-only; "
                f"register it with access=Access.NONE or REMOTE_READ, "
                f"not {access!r}"
            )
        if len(name) > 128 or not all(c.isprintable() for c in name):
            raise ArgumentError(f"region name must be <= 128 printable characters: {name!r}")
        with self._lock:
            existing = self._regions.get((addr, length))
            if existing is not None:
                if existing.access != access or existing.name != name:
                    raise RegistrationError(
                        f"memory addr={addr:#x} nbytes={length} is already registered with "
                        f"access={existing.access!r} name={existing.name!r}; deregister first"
                    )
                return existing
            exposing = bool(access & (Access.REMOTE_READ | Access.REMOTE_WRITE))
            if exposing and len(self._exposed_map) >= wire.MAX_REGIONS:
                raise RegistrationError(
                    f"engine {self.id} already exposes {len(self._exposed_map)} regions to "
                    f"peers, the most a handshake carries (MAX_REGIONS={wire.MAX_REGIONS}); "
                    "deregister one, or register this one without remote access"
                )
            mr = self._dev.register(addr, length, int(access), owner)
            region = Region(self, mr, access, name)
            remote = region.remote
            if remote is not None:
                size = wire.region_size(remote)
                if self._exposed_bytes + size > _REGION_BYTES:
                    mr.close()
                    raise RegistrationError(
                        f"engine {self.id} exposes regions taking {self._exposed_bytes} bytes "
                        f"in a handshake message; this one ({size} bytes, name of "
                        f"{len(name)} characters) would pass the {_REGION_BYTES}-byte limit: "
                        "use shorter names or fewer regions"
                    )
                self._exposed_map[(remote.rkey, remote.addr)] = remote
                self._exposed_bytes += size
                self._announce(add=(remote,))
            self._regions[(addr, length)] = region
        self._poster.wake_if_due()
        log.debug("registered %r", region)
        return region

    def deregister(self, region: Region) -> None:
        """Release ``region``; peers are told it is gone.  Idempotent."""
        with self._lock:
            if self._regions.get((region.addr, region.length)) is not region:
                return
            del self._regions[(region.addr, region.length)]
            remote = region.remote
            region.mr.close()
            if remote is not None:
                del self._exposed_map[(remote.rkey, remote.addr)]
                self._exposed_bytes -= wire.region_size(remote)
                if not self._closed:
                    self._announce(remove=(remote,))
        self._poster.wake_if_due()

    @property
    def regions(self) -> list[Region]:
        """Regions currently registered."""
        with self._lock:
            return list(self._regions.values())

    def find_region(self, addr: int, nbytes: int) -> Region:
        """The local region holding ``[addr, addr + nbytes)``.

        Raises :class:`RegistrationError` when no registered region holds it.
        """
        with self._lock:
            for r in self._regions.values():
                if r.addr <= addr and addr + nbytes <= r.addr + r.length:
                    return r
        raise RegistrationError(
            f"local memory not registered: addr={addr:#x} "
            f"nbytes={nbytes} is in no registered region"
        )

    def _exposed(self) -> tuple[RemoteRegion, ...]:
        with self._lock:
            return tuple(self._exposed_map.values())

    def _announce(
        self, add: tuple[RemoteRegion, ...] = (), remove: tuple[RemoteRegion, ...] = ()
    ) -> None:
        """Queue one change of our exposed regions to every live peer (caller holds the lock).

        One message of the change alone: its cost does not grow with the regions exposed.
        """
        msg = wire.encode(wire.Regions(add=add, remove=remove))
        for conn in list(self._conns.values()):
            if conn.state is ConnState.READY:
                self._queue_control(conn, msg)

    def _queue_control(self, conn: Connection, data: bytes) -> None:
        """Queue a control message for the progress thread to send (caller holds the lock).

        The wake-up is only marked due: whoever let go of the lock last sends it
        (``Poster.wake_if_due``), since sending it is a system call.
        """
        if not conn.queue_control(data):
            self._fail(conn, "peer left too many control messages unread")
            return
        self._outgoing.add(conn)
        self._poster.wake_due = True

    # -- connections ---------------------------------------------------------------------
    def connect(
        self, peer: str, timeout: float = 10.0, *, address: str | None = None
    ) -> Connection:
        """Connect to the engine listening at ``peer`` (``"ip:port"``, or a name).

        The engine that answers must call itself ``peer`` (or, for a name, the id the
        registry gives): one that names another id is refused with
        :class:`AuthenticationError`, so a relay at another address gets nothing.
        ``address`` (``"host:port"``) is where to dial when that is not ``peer``'s own
        address (a port forward or tunnel); the answer must still name ``peer``.

        A name (no ``:``) is resolved through the engine's registry each time; the
        returned connection is then also found under that name (``put("decode-1", ...)``).
        If the name now belongs to another process than the one connected before (a
        restart), the old connection is closed and replaced; while the registry cannot be
        reached, a ready connection made earlier by that name is returned as it is.

        Returns the existing connection when one is ready.  Raises only
        :class:`~hixl.HixlError` subclasses: :class:`ConnectionFailed` when nothing
        answers, the connection breaks or the peer refuses (ALREADY_CONNECTED, LIMIT such
        as its ``max_peers``, or BUSY until ``timeout``; the peer's reason is in the
        message), :class:`AuthenticationError` when a proof does not match (the message
        says which side lacks the token), :class:`HandshakeError` when the peer answers
        something malformed, :class:`TransferTimeout` after ``timeout`` s; for a name,
        :class:`~hixl.errors.NameNotFound` or :class:`~hixl.errors.RegistryUnavailable`
        (naming the registry), and :class:`ConnectionFailed` as soon as the engine's
        registry watch sees the name leave (its lease expired: the host is gone) or taken
        by a new process while the connect is under way, rather than after ``timeout``.
        """
        self._check_open()
        names = self._names
        abort: Callable[[], str | None] | None = None
        if ":" not in peer and names is not None:
            name = peer
            try:
                ann, seen = names.resolve(peer)
            except RegistryUnavailable:
                # The registry is down: a live connection made by name carries on.
                known = names.engine_id(peer)
                live = self._conns.get(known) if known is not None else None
                if live is not None and live.state is ConnState.READY:
                    return live
                raise
            if seen is not None and (seen.instance != ann.instance or seen.engine != ann.engine):
                with self._lock:
                    stale = self._conns.get(seen.engine)
                    if stale is not None:
                        self._drop(stale, f"{peer} was restarted", send_bye=False)
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
        with self._lock:
            old = self._conns.get(peer)
            if old is not None and old.state is ConnState.READY:
                return old
            if old is not None:
                self._drop(old, "replaced by a new connection", send_bye=False)
        self._poster.wake_if_due()
        deadline = time.monotonic() + timeout
        conn = client_handshake(self, peer, (host, port), self._token, deadline, abort)
        reason = None if abort is None else abort()
        if reason is not None:  # it left just before the connection went live: fail it
            with self._lock:
                self._fail(conn, reason)
            self._poster.wake_if_due()
            raise ConnectionFailed(f"connection to {peer} failed: {reason}")
        log.debug("connected to %r", conn)
        return conn

    def _peer_count(self) -> int:
        """Connections that count against ``max_peers`` (caller holds the lock)."""
        claims = self._incoming.claims() if self._incoming is not None else set()
        return len(self._conns) + len(claims - set(self._conns))

    def _new_connection(self, peer: str, *, outbound: bool) -> Connection:
        """An outgoing connection, within ``max_peers``."""
        with self._lock:
            self._check_open()
            if self._peer_count() >= self._max_peers:
                raise ConnectionFailed(
                    f"engine {self.id} already has {self._peer_count()} peers "
                    f"(max_peers={self._max_peers})"
                )
        return self._make_connection(peer, outbound)

    def _make_connection(self, peer: str, outbound: bool) -> Connection:
        """A connection's queue pairs, CQ and receive slots, made outside the lock (each
        is a system call) and then indexed under it; :meth:`close` waits for the making
        as it waits for a post (it counts as a poster).  :class:`StateError` once the
        engine is closed."""
        with self._lock:
            self._check_open()
            self._poster.posters += 1
        try:
            conn = Connection(self, peer, outbound, self._lanes, self._direct_lane)
        except BaseException:
            with self._lock:
                self._poster.release_poster()
            raise
        with self._lock:
            if not self._closed:
                for lane in conn.all_lanes:
                    self._by_qpn[lane.qpn] = lane
                self._poster.release_poster()
                return conn
        conn.destroy()  # before close() goes on to close the device
        with self._lock:
            self._poster.release_poster()
        raise StateError(f"engine {self.id} is closed")

    def _admit(self, peer: str, info: wire.Info, claims: set[str]) -> Admission:
        """Whether a proven client may connect as ``peer``; progress thread, never blocks.

        Checked before any queue pair exists or any key is sent: the engine is open,
        no other handshake holds the id, a READY connection under the id is probed
        (it keeps the id if it answers), and ``max_peers``.  On success the queue pair
        is made and connected to the client's.
        """
        with self._lock:
            if self._closed or self._broken is not None:
                return Admission(code=wire.ErrorCode.BUSY, message=f"engine {self.id} is closing")
            if peer in claims:
                return Admission(
                    code=wire.ErrorCode.ALREADY_CONNECTED,
                    message=f"a handshake for {peer} is already under way with {self.id}",
                )
            old = self._conns.get(peer)
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
            count = len(self._conns) - (old is not None) + len(claims - set(self._conns))
            if count >= self._max_peers:
                return Admission(
                    code=wire.ErrorCode.LIMIT,
                    message=f"engine {self.id} already has {count} peers "
                    f"(max_peers={self._max_peers})",
                )
            if old is not None:
                self._drop(old, f"replaced by a new connection from {peer}", send_bye=False)
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
            self._discard(conn)
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
        self._queue_control(conn, wire.encode(wire.Ping(nonce=nonce)))

    def _probe_outcome(self, conn: Connection, expired: bool) -> str | None:
        """``"alive"``, ``"dead"`` or None (no answer yet) for a probe of ``conn``.

        Dead: the connection failed or closed meanwhile (its goodbye or EOF was read), or
        it did not answer before the probe's deadline, which fails it now.
        """
        with self._lock:
            if conn.state is not ConnState.READY:
                return "dead"
            if conn.pong_at >= conn.probe_started:
                return "alive"
            if not expired:
                return None
            self._fail(
                conn,
                "no answer to a liveness probe within the deadline, while a new handshake "
                "claimed its id",
            )
            return "dead"

    def _discard(self, conn: Connection) -> None:
        """Forget a connection whose handshake did not finish."""
        with self._lock:
            for qpn in conn.qpns:
                self._by_qpn.pop(qpn, None)
        conn.destroy()

    def _adopt(
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
        with self._lock:
            self._check_open()
            old = self._conns.get(conn.peer)
            if old is not None and old is not conn:
                if old.state is ConnState.READY:
                    raise ConnectionFailed(f"{conn.peer} got connected meanwhile")
                self._drop(old, "replaced by a new connection", send_bye=False)
            conn.transition(ConnEvent.ESTABLISHED)
            conn.attach(sock, decoder, session)
            self._conns[conn.peer] = conn
            # Opened before the socket is watched: the progress thread opens the rest.
            msgs, problem = conn.open_control(pending)
            self._progress.watch(conn)
            self._on_controls(conn, msgs, problem, eof=False)
            # Regions registered or released since the handshake carried ours were announced
            # only to live connections, which this one was not yet: tell the peer now.
            sent = {(r.rkey, r.addr): r for r in conn.sent_regions}
            added = tuple(r for k, r in self._exposed_map.items() if k not in sent)
            removed = tuple(r for k, r in sent.items() if k not in self._exposed_map)
            if added or removed:
                self._queue_control(conn, wire.encode(wire.Regions(add=added, remove=removed)))
            self._queue_control(conn, wire.encode(wire.Credit(notes=self._inbox.grant)))
        self._poster.wake_if_due()

    def disconnect(self, peer: str) -> None:
        """Close the connection to ``peer``; its pending transfers fail.  Unknown peers: no-op."""
        with self._lock:
            conn = self._conns.get(peer)
            if conn is not None:
                self._drop(conn, f"disconnected by {self.id}", send_bye=True)
        self._poster.wake_if_due()

    def connection(self, peer: str) -> Connection:
        """The connection to ``peer``; :class:`ConnectionFailed` if there is none."""
        conn = self._conns.get(peer)  # one dict lookup is atomic: no lock on the hot path
        if conn is None and self._names is not None:
            engine_id = self._names.engine_id(peer)
            if engine_id is not None:
                conn = self._conns.get(engine_id)
        if conn is None:
            with self._lock:
                known = sorted(self._conns)
            raise ConnectionFailed(f"not connected to {peer!r} (connected: {known})")
        return conn

    def _peer_gone(self, engine_id: str, reason: str) -> None:
        """Registry watch thread: a peer reached by name left or restarted; fail it now."""
        with self._lock:
            conn = self._conns.get(engine_id)
            if conn is not None and not self._closed:
                self._fail(conn, reason)
        self._poster.wake_if_due()

    @property
    def registry(self) -> Registry | None:
        """The registry this engine uses, or None."""
        names = self._names
        return None if names is None else names.registry

    def set_capacity(self, capacity: int) -> None:
        """Announce a new capacity (free KV blocks for a decode worker) under this
        engine's name; :class:`StateError` for an engine without a name."""
        names = self._names
        if names is None:
            raise StateError(f"engine {self.id} has no registry")
        names.set_capacity(capacity)

    def watch(self) -> Watch:
        """A :class:`hixl.registry.Watch` on this engine's registry: the live view of every
        announced engine and the joins, leaves and capacity changes from now on."""
        registry = self.registry
        if registry is None:
            raise StateError(f"engine {self.id} has no registry (Engine(registry=...))")
        return registry.watch()

    @property
    def peers(self) -> list[str]:
        """Ids of peers with a connection in any state but closed."""
        with self._lock:
            return list(self._conns)

    def _fail(
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

        Caller holds the lock.  The connection is FAILED before any handle finishes, so
        a caller woken by its handle already sees the state.  ``culprit`` (the transfer
        that caused the failure) gets ``error``; every other pending transfer gets
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
        self._credit_cv.notify_all()  # senders waiting for its credits give up
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
            self._release_notify(chunk)
        for h in {c.handle for c in chunks}:
            if h is not None:
                h.finish(error)
                self._handles.discard(h)

    def _drop(self, conn: Connection, reason: str, *, send_bye: bool) -> None:
        """Close ``conn`` for good and forget it (caller holds the lock).

        A goodbye is queued; the socket, queue pair and buffers are released by the
        progress thread (or by :meth:`close`), outside the lock.
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
        self._credit_cv.notify_all()
        self._inbox.closed(conn.note_key)
        self._progress.unwatch(conn)
        self._outgoing.discard(conn)
        for qpn in conn.qpns:
            self._by_qpn.pop(qpn, None)
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]
        self._dead.append(conn)
        self._poster.wake_due = True  # the progress thread frees it (sent once the lock is free)

    def _release_dead(self) -> None:
        """Send what dropped connections still have queued (best effort), then free them."""
        with self._lock:  # a connection with a batch being posted is freed after it
            dead = [c for c in self._dead if not c.poster]
            self._dead = [c for c in self._dead if c.poster]
        for conn in dead:
            try:
                conn.flush_control()
            except OSError as exc:
                log.debug("goodbye to %s not sent: %s", conn.peer, exc)
            conn.destroy()
        if dead:
            with self._lock:
                self._singles.forget(dead)

    # -- transfers -----------------------------------------------------------------------
    def put(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA WRITE ``local_desc`` of ``local`` into ``remote_desc`` of the peer's ``remote``.

        Blocks until the data has landed (and the notification, if any, was
        delivered), or raises: :class:`BoundsError`, :class:`RegistrationError`,
        :class:`AlignmentError`, :class:`DescriptorError` before posting;
        :class:`CompletionError`, :class:`ConnectionFailed` or
        :class:`TransferTimeout` (after ``timeout`` seconds) after it.

        A repeated put of one work request (a contiguous range, say) is posted by this
        thread, which then polls for its completion itself: no hand-over to the progress
        thread, no handle (``Diagnostics.direct_posts`` counts them).  It goes on the
        connection's direct lane as a :class:`Channel` call would, while no channel is
        open and no other call is on that lane, else on an idle queue pair.  Otherwise
        it is queued like :meth:`put_async` and waited for.
        """
        again = self._singles.repeat_put  # the same call as the last one on the lane: no lookup
        if (
            again is not None
            and notify is None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._singles.one(
            "write",
            peer,
            local,
            remote,
            local_desc,
            remote_desc,
            notify,
            notify_message,
            timeout,
            now=True,
        )
        if handle is not None:  # None: posted and completed on this thread (see SinglePaths._solo)
            handle.wait()

    def get(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        timeout: float = 30.0,
    ) -> None:
        """RDMA READ the peer's ``remote_desc`` of ``remote`` into ``local_desc`` of ``local``.

        Errors, and the direct post of a repeated single work request, as for
        :meth:`put`.  ``local`` needs ``Access.LOCAL_WRITE``.
        """
        again = self._singles.repeat_get
        if (
            again is not None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._singles.one(
            "read", peer, local, remote, local_desc, remote_desc, None, b"", timeout, now=True
        )
        if handle is not None:
            handle.wait()

    def put_async(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a put (see :meth:`put`); return its :class:`TransferHandle`.

        A put of one work request of one SGE (a contiguous range of up to one message,
        after its first call has checked and planned it) is written straight into a
        slot of a ring of work requests kept per queue pair, and joins the messages
        queued there before it and not posted yet: the poster sends them as one range
        with one completion (``Diagnostics.slot_messages`` counts them).  The returned
        handle is done when that group is; when one of the group's requests fails, the
        ones before it are done, it fails with its own status and the later ones with
        the connection.
        """
        again = self._singles.ring_put  # the last ring template's call: no lookup if it matches
        if again is not None and notify is None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._singles.one(
            "write",
            peer,
            local,
            remote,
            local_desc,
            remote_desc,
            notify,
            notify_message,
            timeout,
            now=False,
        )
        assert handle is not None  # only a blocking call finishes on its own thread
        return handle

    def get_async(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a get (see :meth:`get`); return its :class:`TransferHandle`.

        A get of one work request of one SGE goes through a ring of slots as a put does
        (see :meth:`put_async`)."""
        again = self._singles.ring_get
        if again is not None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._singles.one(
            "read", peer, local, remote, local_desc, remote_desc, None, b"", timeout, now=False
        )
        assert handle is not None
        return handle

    def transfer(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        *,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """Run a batch of requests to one peer as one transfer; block until done."""
        self._submit(peer, requests, notify, notify_message, timeout, now=True).wait()

    def transfer_async(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        *,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Validate and plan every request, then post them all; return one handle.

        Nothing is posted unless every request is valid.  With ``notify``,
        the peer receives a :class:`Notification` once all the data has
        landed.  ``timeout`` (seconds) is the transfer's deadline: after it,
        the transfer fails with :class:`TransferTimeout` and the connection is
        marked failed (its requests cannot be recalled otherwise).

        The work requests are posted by the progress thread, together with whatever
        else was queued meanwhile (one ``post_send`` for many calls), so this returns
        without waiting for the provider; the blocking calls post an idle queue pair
        themselves.
        """
        return self._submit(peer, requests, notify, notify_message, timeout, now=False)

    # -- KV caches (hixl.engine.kv) ------------------------------------------------------
    def register_kv(
        self,
        name: str,
        tensors: object,
        *,
        block_axis: int = 0,
        heads_axis: int | None = None,
        access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE,
    ) -> KVCache:
        """Register a KV cache: ``tensors`` (numpy arrays or CPU torch tensors, one or more
        per layer) whose ``block_axis`` indexes blocks; ``heads_axis`` names the KV-heads
        axis where head ranges are wanted.  Each storage span is registered once; peers
        find the cache by ``name`` and learn its geometry.  Raises
        :class:`RegistrationError` (also for a name in use) or :class:`ArgumentError`."""
        self._check_open()
        return self._kv.register(
            name, tensors, block_axis=block_axis, heads_axis=heads_axis, access=access
        )

    def remote_kv_caches(self, peer: str) -> tuple[str, ...]:
        """Names of the KV caches ``peer`` announces now, sorted (see docs/api.md)."""
        return self._kv.announced(peer)

    def put_blocks(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA WRITE blocks ``local_blocks[i]`` of ``kv`` into blocks ``remote_blocks[i]``
        of the peer's cache ``remote_name``, for every tensor (or the indices ``tensors``,
        paired with the same indices there or with ``remote_tensors``), narrowed to head
        ranges ``heads``/``remote_heads``; block until done.  The
        notification, if any, arrives after all the data.  Errors before posting:
        :class:`DescriptorError` (a mismatch of the caches, a bad or repeated destination
        block id), :class:`RegistrationError`; after: as :meth:`put`, naming the request
        and the blocks not known to have landed.  See docs/api.md."""
        self._blocks(
            Op.WRITE, True, peer, kv, remote_name, local_blocks, remote_blocks, tensors, heads,
            remote_heads, remote_tensors, notify, notify_message, timeout,
        ).wait()  # fmt: skip

    def get_blocks(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA READ the peer's blocks ``remote_blocks[i]`` into ``local_blocks[i]`` of
        ``kv``; as :meth:`put_blocks` otherwise (the notification follows the reads)."""
        self._blocks(
            Op.READ, True, peer, kv, remote_name, local_blocks, remote_blocks, tensors, heads,
            remote_heads, remote_tensors, notify, notify_message, timeout,
        ).wait()  # fmt: skip

    def put_blocks_async(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a :meth:`put_blocks`; return its handle."""
        return self._blocks(
            Op.WRITE, False, peer, kv, remote_name, local_blocks, remote_blocks, tensors, heads,
            remote_heads, remote_tensors, notify, notify_message, timeout,
        )  # fmt: skip

    def get_blocks_async(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a :meth:`get_blocks`; return its handle."""
        return self._blocks(
            Op.READ, False, peer, kv, remote_name, local_blocks, remote_blocks, tensors, heads,
            remote_heads, remote_tensors, notify, notify_message, timeout,
        )  # fmt: skip

    def _blocks(
        self,
        op: Op,
        now: bool,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        tensors: Sequence[int] | range | None,
        heads: tuple[int, int] | None,
        remote_heads: tuple[int, int] | None,
        remote_tensors: Sequence[int] | range | None,
        notify: str | None,
        notify_message: bytes,
        timeout: float,
    ) -> TransferHandle:
        """The one path of the four block calls: the KV part checks and plans, the
        engine queues (``now``: a blocking call, posted on this thread when it can)."""
        return self._kv.transfer(
            op, peer, kv, remote_name, local_blocks, remote_blocks, tensors=tensors,
            heads=heads, remote_heads=remote_heads, remote_tensors=remote_tensors,
            notify=notify, notify_message=notify_message, timeout=timeout, now=now,
        )  # fmt: skip

    def _queue_chain(
        self,
        conn: Connection,
        chain: SendChain,
        nbytes: int,
        key: tuple[Any, ...],
        notify: str | None,
        notify_message: bytes,
        reads: bool,
        timeout: float,
        now: bool,
    ) -> tuple[TransferHandle, list[Chunk]]:
        """Queue a filled chain as one transfer (pooled under ``key`` once posted); return
        its handle and the chunks its WRs went out in (their ``done`` counts what has
        completed, see :class:`~hixl.core.window.Chunk`)."""
        payload = _notify.encode(notify, notify_message) if notify is not None else None
        built = Built(chain, nbytes, key, (0, 0))
        parts: list[Chunk] = []
        return self._queuer.queue(conn, [built], payload, reads, timeout, now, parts), parts

    def _idle_chain(self, key: tuple[Any, ...]) -> SendChain | None:
        idle = self._planner.take(key)
        return None if idle is None else idle.chain

    def _submit(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
        tkey: tuple[Any, ...] | None = None,
    ) -> TransferHandle:
        """Check, plan, build and queue a transfer; ``now``: post it on this thread when
        the queue pair is idle (a blocking call, which waits anyway).  ``tkey``: keep the
        single request's template under that key."""
        if timeout <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        if not requests and notify is None:
            raise ArgumentError("empty transfer: no requests and no notification")
        payload = _notify.encode(notify, notify_message) if notify is not None else None
        self._check_open()
        conn = self.connection(peer)
        conn.check_ready()
        # Validation, planning and building read only immutable values (regions' keys,
        # the peer's announced region tuple), so they run without the engine lock; the
        # progress thread keeps reaping completions meanwhile.
        built = [self._planner.build(self, conn, req, i) for i, req in enumerate(requests)]
        if tkey is not None:
            t = self._planner.template(conn, requests[0], built[0])
            if t is not None:
                req = requests[0]
                # Also under the key of the same sizes at other offsets (see SinglePaths.one).
                rkey = ranges_key(
                    peer, req.op, req.local, req.remote, req.local_desc, req.remote_desc
                )
                self._singles.keep(tkey, rkey, t)
        reads = any(r.op == "read" for r in requests)
        return self._queuer.queue(conn, built, payload, reads, timeout, now)

    def channel(self, peer: str, local: Region, remote: RemoteRegion | str) -> Channel:
        """A :class:`~hixl.engine.channel.Channel` to ``peer``: blocking puts and gets of
        one contiguous range per call between ``local`` and the peer's ``remote`` (a
        :class:`RemoteRegion` or its name), at close to the device's latency.

        The regions, their keys and the connection are checked here once; each call
        then checks its offsets and length (bounds, alignment, message size) and that no
        region was closed or withdrawn, posts one work request and polls for its
        completion on the calling thread.  The channel holds the connection's direct
        lane until it is closed: one channel per connection at a time.

        Raises :class:`RegistrationError` for a local region not of this engine (or
        closed) or a remote region the peer does not expose, :class:`ConnectionFailed` /
        :class:`StateError` for a connection that is not ready, and :class:`StateError`
        when the connection has no direct lane (the peer made fewer queue pairs, or
        ``direct_lane=False``) or another channel holds it.
        """
        self._check_open()
        conn = self.connection(peer)
        if not isinstance(local, Region) or local.engine is not self or local.closed:
            raise RegistrationError(
                f"local memory is not a region registered with this engine: {local!r}"
            )
        rem = resolve_remote(conn, remote, "channel")
        with self._lock:
            self._check_open()
            conn.check_ready()
            if conn.direct is None:
                raise StateError(
                    f"connection to {peer} has no direct lane for a channel: "
                    + (
                        "this engine was made with direct_lane=False"
                        if not self._direct_lane
                        else "the peer made fewer queue pairs (a smaller lanes= or "
                        "direct_lane=False)"
                    )
                )
            if conn.channel is not None:
                raise StateError(
                    f"connection to {peer} already has an open channel {conn.channel!r}; "
                    "close it first (one channel per connection)"
                )
            ch = self._new_channel(conn, local, rem, lent=False)
            conn.channel = ch
        # A blocking put or get of this engine's may be finishing on the lane (see
        # _on_lane); from here on none starts there.  Wait for it, without the lock.
        deadline = time.monotonic() + CHANNEL_WAIT_S
        nap = 0.00005
        while not conn.direct_token:
            if time.monotonic() >= deadline or conn.state is not ConnState.READY:
                with self._lock:
                    if conn.channel is ch:
                        conn.channel = None
                conn.check_ready()
                raise StateError(
                    f"the direct lane to {peer} stayed busy for {CHANNEL_WAIT_S} s "
                    "(a blocking put or get on it did not end)"
                )
            time.sleep(nap)
            nap = min(nap * 2, 0.001)
        return ch

    def _new_channel(
        self, conn: Connection, local: Region, remote: RemoteRegion, *, lent: bool
    ) -> Channel:
        return Channel(
            self._parts, conn, local, remote, self._poster, lock=self._lock, conns=self._conns,
            max_msg_sz=self.limits.max_msg_sz, alignment=self.alignment, lent=lent,
        )  # fmt: skip

    def notify(self, peer: str, name: str, message: bytes = b"", timeout: float = 10.0) -> None:
        """Send a notification to ``peer`` alone (after everything posted before it)."""
        self.transfer(peer, [], notify=name, notify_message=message, timeout=timeout)

    def _release_notify(self, chunk: Chunk) -> None:
        if chunk.notify_slot is not None:
            self._notify_slots.release(chunk.notify_slot)
            chunk.notify_slot = None

    # -- posting ---------------------------------------------------------------------------
    def _has_pending(self) -> bool:
        return bool(self._handles)

    # -- notifications -------------------------------------------------------------------
    def notifications(self) -> list[Notification]:
        """Take every notification received so far (oldest first)."""
        with self._lock:
            notes = self._inbox.take_all(self._return_credits)
        self._poster.wake_if_due()  # the credits given back go out with the next round
        return notes

    def wait_notification(self, name: str, timeout: float, peer: str | None = None) -> Notification:
        """Wait up to ``timeout`` s for a notification called ``name`` (from ``peer``).

        The matching notification is taken out of the queue; others stay.  ``peer`` is
        matched against the id the sender's connection proved in its handshake.
        Raises :class:`TransferTimeout` when none arrives in time, :class:`StateError`
        when the engine is closed (or closes while waiting).
        """
        deadline = time.monotonic() + timeout
        found: Notification | None = None
        with self._notify_cv:
            while found is None:
                for note in self._inbox.notes:
                    if note.name == name and (peer is None or note.peer == peer):
                        owed = self._inbox.take(note)
                        if owed is not None:
                            self._return_credits(*owed)
                        found = note
                        break
                else:
                    if self._closed or self._broken is not None:
                        self._check_open()
                        raise StateError(f"engine {self.id} is closed")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._notify_cv.wait(left)
        if found is not None:
            self._poster.wake_if_due()  # the credits given back go out with the next round
            return found
        raise TransferTimeout(
            f"no notification {name!r}{' from ' + peer if peer else ''} within {timeout} s"
        )

    def _return_credits(self, key: int, credits: int) -> None:
        """Give ``credits`` back to the connection ``key`` if it is live (lock held)."""
        for conn in self._conns.values():
            if conn.note_key == key:
                if conn.state is ConnState.READY and conn.sock is not None:
                    self._queue_control(conn, wire.encode(wire.Credit(notes=credits)))
                return

    def _take_credit(self, conn: Connection, deadline: float, timeout: float) -> None:
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
            self._credit_cv.wait(left)
            self._check_open()
            conn.check_ready()
        conn.credits -= 1

    def _queue_note(self, conn: Connection, note: Notification) -> None:
        """Keep a received notification, or fail a sender past its credits (lock held)."""
        overrun = self._inbox.arrive(conn.note_key, note)
        if overrun is not None:
            reason = f"notification queue full at {self.id}: {overrun}; the sender is cut off"
            self._fail(conn, reason, tell=(wire.ErrorCode.OVERFLOW, reason))
            return
        self._notify_cv.notify_all()

    # -- progress thread callbacks (all but the socket reads run under the lock) -----------
    def _reap_recv(self, wcs: list[verbs.Completion]) -> int:
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
                    self._fail(conn, f"receive completion error {wc.status_name}")
                continue
            note = _notify.decode(conn.peer, conn.recv_slot(wc.wr_id, wc.byte_len))
            if live:
                try:
                    conn.post_recv(wc.wr_id)
                except HixlError as exc:
                    self._fail(conn, f"re-posting a receive failed: {exc}")
            if note is None:
                log.warning("dropped a malformed notification from %s", conn.peer)
                continue
            self._queue_note(conn, note)
        return len(wcs)

    def _flush_outboxes(self) -> None:
        """Progress thread: send queued control messages, free dropped connections."""
        with self._lock:
            outgoing = list(self._outgoing)
            self._outgoing.clear()
        for conn in outgoing:
            self._flush_control(conn)
        self._release_dead()

    def _flush_control(self, conn: Connection) -> None:
        """Progress thread: write what the control socket takes now (outside the lock)."""
        try:
            conn.flush_control()
        except OSError as exc:
            with self._lock:
                self._progress.unwatch(conn)
                self._fail(conn, f"control connection lost: {exc}", tell=None)
                self._let_go(conn, f"control connection lost: {exc}")
            return
        with self._lock:
            if conn.state is not ConnState.CLOSED and conn.sock is not None:
                self._progress.watch(conn)  # write interest only while output is left

    def _read_control(self, conn: Connection) -> None:
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
            self._progress.pause(conn, pause)
        with self._lock:
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
        """Handle opened control messages, then what ended the read (lock held)."""
        for msg in msgs:
            self._on_control(conn, msg)
        if problem is not None:
            self._progress.unwatch(conn)
            if isinstance(problem, IntegrityError):
                what = f"control message integrity check failed: {problem}"
                code = wire.ErrorCode.INTEGRITY
            else:
                what = f"malformed control message: {problem}"
                code = wire.ErrorCode.MALFORMED
            self._fail(conn, what, tell=(code, what))
            self._let_go(conn, what)
        elif eof:
            self._peer_left(conn, "peer closed the control connection (process gone?)")

    def _peer_left(self, conn: Connection, reason: str, *, expected: bool = False) -> None:
        """The peer said goodbye, gave up or closed its socket (lock held): fail ``conn``
        and let it go if the peer connected to us."""
        self._progress.unwatch(conn)
        self._fail(conn, reason, expected=expected, tell=None)
        self._let_go(conn, reason)

    def _let_go(self, conn: Connection, reason: str) -> None:
        """Release a failed connection the peer opened (lock held): its queue pairs, memory,
        socket and ``max_peers`` slot.  A connection we opened stays, FAILED, for the
        application to see, until it disconnects or connects again."""
        if not conn.outbound and conn.state is ConnState.FAILED:
            self._drop(conn, reason, send_bye=False)

    def _on_control(self, conn: Connection, msg: wire.Message) -> None:
        if isinstance(msg, wire.Regions):
            try:
                conn.update_remote_regions(msg.add, msg.remove)
            except HandshakeError as exc:
                self._progress.unwatch(conn)
                what = f"bad REGIONS update: {exc}"
                self._fail(conn, what, tell=(wire.ErrorCode.MALFORMED, what))
                self._let_go(conn, what)
        elif isinstance(msg, wire.Ping):
            self._queue_control(conn, wire.encode(wire.Pong(nonce=msg.nonce)))
        elif isinstance(msg, wire.Credit):
            conn.credits += msg.notes
            conn.credit_grant = conn.credit_grant or msg.notes  # the first is the grant
            self._credit_cv.notify_all()
        elif isinstance(msg, wire.Pong):
            if msg.nonce == conn.probe_nonce:
                conn.pong_at = time.monotonic()
        elif isinstance(msg, wire.Bye):
            # Notifications the peer sent before its goodbye come first, and so do the
            # completions of our own sends that are already in the queue: a peer that
            # closes once it has our last notification says goodbye right after that
            # send completed here, maybe before this thread reaped it (same select round).
            self._reap_recv(self.recv_cq.poll(64))
            self._reaper.reap_send(self.send_cq.poll_rows(POLL_BATCH))
            self._peer_left(conn, f"peer said goodbye: {escape(msg.reason)}", expected=True)
        elif isinstance(msg, wire.Error):
            self._peer_left(conn, f"peer reported {msg.code}: {escape(msg.message)}")
        else:
            what = f"unexpected {type(msg).__name__} on the control channel"
            self._fail(conn, what, tell=(wire.ErrorCode.MALFORMED, what))
            self._let_go(conn, what)


class _Host:
    """The engine as its parts see it (:class:`~hixl.engine.posting.PostingHost`,
    :class:`~hixl.engine.reaping.ReapingHost`, :class:`~hixl.engine.queueing.QueueHost`,
    :class:`~hixl.engine.single.SingleHost`).

    It holds the engine by a weak proxy: the poster lives as long as the engine, and an
    engine the application forgets to close must still be collected (and warn).
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine: Engine = cast("Engine", weakref.proxy(engine))

    def fail(
        self,
        conn: object,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
    ) -> None:
        assert isinstance(conn, Connection)
        self._engine._fail(conn, reason, error, culprit=culprit)

    def release_notify(self, chunk: Chunk) -> None:
        self._engine._release_notify(chunk)

    def connection_of(self, peer: str) -> Connection | None:
        return self._engine._conns.get(peer)

    def check_open(self) -> None:
        self._engine._check_open()

    def take_credit(self, conn: Connection, deadline: float, timeout: float) -> None:
        self._engine._take_credit(conn, deadline, timeout)

    def submit(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
        tkey: tuple[Any, ...] | None = None,
    ) -> TransferHandle:
        return self._engine._submit(
            peer, requests, notify, notify_message, timeout, now=now, tkey=tkey
        )

    def lent_channel(self, conn: Connection, local: Region, remote: RemoteRegion) -> LentLane:
        return self._engine._new_channel(conn, local, remote, lent=True)


_notify = notify  # the module, under a name the ``notify`` parameters do not shadow
