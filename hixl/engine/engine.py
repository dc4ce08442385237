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
from hixl.core.descriptors import ContiguousDesc, Descriptor
from hixl.core.notify import Notification
from hixl.core.plan import DeviceLimits, Op
from hixl.core.seal import IntegrityError, Opener, Sealer
from hixl.core.states import ConnEvent, ConnState
from hixl.core.window import MAX_BATCHES, Chunk
from hixl.core.wire import RemoteRegion
from hixl.engine.channel import Channel, LaneBusy
from hixl.engine.config import EngineConfig, is_loopback
from hixl.engine.connection import RECV_SLOTS, Connection, Lane
from hixl.engine.datapath import (
    Built,
    LaneRing,
    NotifySlots,
    Planner,
    Template,
    ranges_key,
    resolve_remote,
    signal_interval,
)
from hixl.engine.handles import (
    SPIN_S,
    GroupHandle,
    MemberHandle,
    TransferHandle,
    TransferRequest,
    TransferStatus,
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
from hixl.engine.reaping import SendReaper, deadline_error
from hixl.engine.regions import Access, Region, buffer_span
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
from hixl.verbs.chain import WR_BYTES, WR_SLOT, SendChain

if TYPE_CHECKING:
    from hixl.registry import Registry, Watch

__all__ = ["Diagnostics", "Engine"]

log = logging.getLogger("hixl.engine")

SEND_NOTIFY_SLOTS = 256  # notifications in flight per engine
TEMPLATES = 1024  # single requests kept checked and planned (see Engine._one)
RING_SLOTS = 256  # slots of a lane's ring of single messages (at most the queue's depth)
#: Longest :meth:`Engine.channel` waits for a blocking put or get on the direct lane.
CHANNEL_WAIT_S = 60.0
#: A request of a few WRs but at least this many bytes is signalled in smaller groups,
#: so that it is cut over the lanes like a long one (see _spread).
SPREAD_BYTES = 128 * 1024
# Room left in a handshake message for everything but the exposed regions, bytes.
_REGION_BYTES = wire.MAX_PAYLOAD - 4096
# Engine._ring_runner's function: (peer, local, remote, local_desc, remote_desc, timeout)
# -> the handle, or None when the call is not the runner's or cannot go its way.
_RingRun = Callable[[str, Region, Any, Any, Any, float], TransferHandle | None]
# Engine._ring_enqueuer's function: (sge_addr, remote_addr, timeout) -> the handle, or
# None when the template went stale.
_RingQueue = Callable[[int, int, float], TransferHandle | None]


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
    handshakes under way, in all and from one IP address (over either, a
    client is answered ERROR(BUSY) and asks again); ``handshake_timeout``
    bounds a whole handshake, each of its steps has a shorter deadline.
    ``max_notifications_per_peer`` and ``max_notifications`` bound
    notifications received and not yet taken, from one peer and in all: each
    connection is granted ``min(max_notifications_per_peer, max_notifications //
    max_peers)`` credits, a sender out of credits waits for the application here
    to take some (its call fails with TransferTimeout at its deadline; nothing
    else fails), and at the total the peer holding the most loses its oldest
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
    every remotely accessible region; an engine listening on an address
    other than loopback without one logs a WARNING once.

    ``registry`` (a URL such as ``"etcd://10.0.0.1:2379"`` or ``"memory://NAME"``, or a
    :class:`hixl.registry.Registry` the caller shares) lets :meth:`connect` take peer
    names; with ``name`` the engine also announces itself there (``role``, its id, the
    device's GID and MTU, ``capacity``) under a lease that ends with the engine. Without a
    registry nothing is needed: peers are ``"ip:port"`` as always.

    Raises :class:`ArgumentError` for a bad id, an empty token or a limit
    below 1, :class:`DeviceError` when no device is usable, :class:`OSError`
    when the address cannot be bound, :class:`~hixl.errors.RegistryUnavailable`
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
        self._templates: dict[tuple[Any, ...], Template] = {}
        self._last_template: tuple[tuple[Any, ...], Template] | None = None
        # The last blocking put and get that ran on a direct lane, as (arguments, run):
        # the same call again goes straight to ``run`` (see Channel.repeat_runner).
        self._repeat_put: tuple[tuple[Any, ...], Callable[[float], bool]] | None = None
        self._repeat_get: tuple[tuple[Any, ...], Callable[[float], bool]] | None = None
        # The last asynchronous put and get of two ContiguousDesc that went into a lane's
        # ring, as a function that queues a call of the same regions and sizes at any
        # offsets, or returns None (see _ring_runner).
        self._ring_put: _RingRun | None = None
        self._ring_get: _RingRun | None = None
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
        self._next_wr = 1
        # Posting: lanes waiting for the progress thread, posters at work, the wake-up due.
        parts = _Host(self)
        self._poster = Poster(self._lock, self.sq_depth, self._planner, parts)
        self._reaper = SendReaper(self._by_qpn, self._handles, self._poster, parts)
        self._direct_posts = 0  # blocking single requests posted by their caller
        self._lane_posts = 0  # and on a direct lane (see _on_lane; not in _direct_posts)
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
        thread = self._progress.thread
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
                send_posts=self._poster.send_posts + self._direct_posts + self._lane_posts,
                posted_wrs=self._poster.posted_wrs + self._direct_posts + self._lane_posts,
                direct_posts=self._direct_posts + self._lane_posts,
                lane_posts=self._lane_posts,
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
        self._templates.clear()
        self._last_template = None
        self._repeat_put = self._repeat_get = None
        self._ring_put = self._ring_get = None
        self._dev.close()
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
        (:meth:`_wake_if_due`), since sending it is a system call.
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
        again = self._repeat_put  # the same call as the last one on the lane: no lookup
        if (
            again is not None
            and notify is None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._one(
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
        if handle is not None:  # None: posted and completed on this thread (see _solo)
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
        again = self._repeat_get
        if (
            again is not None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._one(
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
        again = self._ring_put  # the last ring template's call: no lookup if it matches
        if again is not None and notify is None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._one(
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
        again = self._ring_get
        if again is not None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._one(
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
    ) -> TransferHandle:
        """Queue a filled chain as one transfer (pooled under ``key`` once posted)."""
        payload = _notify.encode(notify, notify_message) if notify is not None else None
        built = Built(chain, nbytes, key, (0, 0))
        return self._queue(conn, [built], payload, reads, timeout, now)

    def _idle_chain(self, key: tuple[Any, ...]) -> SendChain | None:
        idle = self._planner.take(key)
        return None if idle is None else idle.chain

    def _one(
        self,
        op: str,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        local_desc: Descriptor | None,
        remote_desc: Descriptor | None,
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
    ) -> TransferHandle | None:
        """A single put or get.  One already checked with these very arguments on this
        connection is repeated from its :class:`~hixl.engine.datapath.Template` (no
        checks, no planning: what they depend on has not changed, see there).  A pair of
        :class:`ContiguousDesc` at new offsets reuses the template of the same sizes
        between the same regions; only the bounds and the alignment are checked.

        None (only with ``now``): the transfer was posted and has completed on this
        thread (:meth:`_solo`); otherwise its handle."""
        tkey: tuple[Any, ...] | None = (peer, op, local, remote, local_desc, remote_desc)
        last = self._last_template  # a loop repeats one call: compared by identity first
        t: Template | None
        if last is not None and last[0] == tkey:
            t = last[1]
            # Keep this call's objects: an equal but new descriptor per loop then costs
            # one dataclass comparison, not one per call.
            self._last_template = (tkey, last[1])
        else:
            try:
                t = self._templates.get(tkey)  # type: ignore[arg-type]
            except TypeError:  # an unhashable descriptor
                t, tkey = None, None
            if t is not None and tkey is not None:
                self._last_template = (tkey, t)
        if t is not None:
            la, ra = t.local_addr, t.remote_addr
        else:
            rkey = ranges_key(peer, op, local, remote, local_desc, remote_desc)
            t = self._templates.get(rkey) if rkey is not None else None
            if t is not None:
                where = self._planner.at_offsets(t, local_desc, remote_desc)  # type: ignore[arg-type]
                if where is None:
                    t = None  # planned as it is, which raises what is wrong
                else:
                    la, ra = where
        if t is not None:
            conn = t.conn
            if (
                conn.state is ConnState.READY
                and conn.remote_regions is t.remotes
                and not t.local.closed
                and self._conns.get(conn.peer) is conn
                and timeout > 0
                and not self._closed
            ):
                if notify is None:
                    if now and t.num_wrs == 1:
                        if (
                            t.single is not None
                            and conn.channel is None
                            and conn.direct is not None
                            and self._on_lane(t, la, ra, timeout)
                        ):
                            if tkey is not None and (la, ra) == (t.local_addr, t.remote_addr):
                                self._remember_repeat(t, tkey)
                            return None
                        return self._solo(t, la, ra, timeout)
                    if t.single is not None and not now:
                        if (
                            type(local_desc) is ContiguousDesc
                            and type(remote_desc) is ContiguousDesc
                        ):
                            self._remember_ring(t, remote)
                        lo, _, ro = t.single
                        ring_handle = self._queue_ring(t, la + lo, ra + ro, timeout)
                        if ring_handle is not None:
                            return ring_handle
                        # The template went stale since the checks above: the general
                        # path below checks and plans the call again.
                    else:
                        return self._queue1(conn, self._planner.rebuild(t, la, ra), timeout, now)
                else:
                    payload = _notify.encode(notify, notify_message)
                    built = [self._planner.rebuild(t, la, ra)]
                    return self._queue(conn, built, payload, op == "read", timeout, now)
        req = TransferRequest(
            op=op, local=local, remote=remote, local_desc=local_desc, remote_desc=remote_desc
        )
        return self._submit(peer, [req], notify, notify_message, timeout, now=now, tkey=tkey)

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
                # Also under the key of the same sizes at other offsets (see _one).
                rkey = ranges_key(
                    peer, req.op, req.local, req.remote, req.local_desc, req.remote_desc
                )
                if len(self._templates) >= TEMPLATES - 1:
                    self._templates.clear()
                self._templates[tkey] = t
                if rkey is not None:
                    self._templates[rkey] = t
        reads = any(r.op == "read" for r in requests)
        return self._queue(conn, built, payload, reads, timeout, now)

    def _queue(
        self,
        conn: Connection,
        built: list[Built],
        payload: bytes | None,
        reads: bool,
        timeout: float,
        now: bool,
    ) -> TransferHandle:
        """Queue built requests (and a notification) as one transfer; post or hand over."""
        if len(built) == 1 and payload is None:
            return self._queue1(conn, built[0], timeout, now)
        now_s = time.monotonic()
        nbytes = sum(b.nbytes for b in built)
        num_wrs = sum(b.chain.num_wrs for b in built)
        handle = TransferHandle(
            conn.peer, nbytes, num_wrs, now_s + timeout, self._poster.reap_inline
        )
        every = self._every
        chunks = []
        for b in built:
            chunk = Chunk(b.chain, 0, b.chain.num_wrs, handle, every)
            chunk.built = b
            chunks.append(chunk)
        with self._lock:  # ids are taken in queue order: completions rely on it
            try:
                self._check_open()
                conn.check_ready()
                if payload is not None:  # may wait (lock released): before any id is taken
                    self._take_credit(conn, handle.deadline, timeout)
            except HixlError:
                for b in built:
                    self._planner.give_back(b)
                raise
            placed: list[tuple[Lane, Chunk]] = []
            for chunk in chunks:
                chunk.first_id = self._next_wr
                chunk.every = _every_for(conn, chunk.size, chunk.built.nbytes, every)
                chunk.groups = chunk.chain.set_signals(self._next_wr, chunk.every)
                self._next_wr += chunk.groups
                placed += _spread(chunk, conn)
            for lane, part in placed:
                lane.window.queue1(part)
            handle.chunks_left = len(placed) + (payload is not None)
            first = conn.lanes[0]  # where the notifications go, after the data
            if payload is not None:
                slot = self._notify_slots.take(payload)
                chunk = Chunk(self._notify_slots.chain, slot, slot + 1, handle, 1, self._next_wr)
                chunk.notify_slot = slot
                # Work queued before it on other lanes must complete first: only then has
                # its data landed (lanes complete in any order among themselves).
                if conn.behind(chunk.first_id):
                    chunk.held = True
                    conn.held += 1
                    # A channel call ends without the lock: it clears its busy mark, then
                    # looks at ``held``.  Looking at the lanes again after counting the
                    # hold means one of the two sides sees the other (see Channel._end).
                    if not conn.behind(chunk.first_id):
                        chunk.held = False
                        conn.held -= 1
                chunk.groups = chunk.chain.set_signals(self._next_wr, 1, slot, slot + 1)
                # After READs the SEND is fenced: it starts only once they have completed,
                # so the peer is told "done" after its memory was read, not before.
                if reads:
                    chunk.chain.fence(slot)
                log.debug(
                    "notification %r to %s posted%s",
                    payload.partition(b"\0")[0].decode(),
                    conn.peer,
                    " fenced" if reads else "",
                )
                self._next_wr += 1
                first.window.queue1(chunk)
                placed.append((first, chunk))
            self._handles.add(handle)
            lane, batch = self._poster.start_posts([lane for lane, _ in placed], now)
        self._poster.post_or_wake(lane, batch)
        return handle

    def _queue1(self, conn: Connection, b: Built, timeout: float, now: bool) -> TransferHandle:
        """:meth:`_queue` for the common case, one request and no notification."""
        now_s = time.monotonic()
        chain = b.chain
        n = chain.num_wrs
        handle = TransferHandle(conn.peer, b.nbytes, n, now_s + timeout, self._poster.reap_inline)
        handle.chunks_left = 1
        chunk = Chunk(chain, 0, n, handle, self._every)
        chunk.built = b
        with self._lock:  # ids are taken in queue order: completions rely on it
            if self._closed or conn.state is not ConnState.READY:
                self._planner.give_back(b)
                self._check_open()
                conn.check_ready()
            chunk.first_id = first = self._next_wr
            if n == 1:
                chain.signal_one(first)
                chunk.groups = 1
            else:
                chunk.every = _every_for(conn, n, b.nbytes, chunk.every)
                chunk.groups = chain.set_signals(first, chunk.every)
            self._next_wr = first + chunk.groups
            self._handles.add(handle)
            if chunk.groups > 1 and len(conn.lanes) > 1:  # a long chain: over every lane
                parts = _spread(chunk, conn)
                handle.chunks_left = len(parts)
                for lane, part in parts:
                    lane.window.queue1(part)
                lane, batch = self._poster.start_posts([lane for lane, _ in parts], now)
            else:
                lane = conn.pick_lane()
                window = lane.window
                window.queue1(chunk)
                if window.poster:
                    return handle  # the batch being posted takes it next
                if now and not window.in_flight:
                    batch = self._poster.start_post(lane, defer=False)
                else:  # hand it to the progress thread (see Poster.start_post)
                    self._poster.want_post(lane)
                    batch = None
        self._poster.post_or_wake(lane, batch)
        return handle

    def _queue_ring(
        self, t: Template, sge_addr: int, remote_addr: int, timeout: float
    ) -> TransferHandle | None:
        """An asynchronous request of one WR and one SGE (``t`` placed so that its SGE
        starts at ``sge_addr`` and its remote range at ``remote_addr``), written into the
        next slot of a lane's ring (:class:`~hixl.verbs.chain.SlotRing`) by ``t``'s
        enqueuing function (:meth:`_ring_enqueuer`, made on first use)."""
        return self._enqueuer_of(t)(sge_addr, remote_addr, timeout)

    def _enqueuer_of(self, t: Template) -> _RingQueue:
        """``t``'s enqueuing function, kept first in ``t.ring`` (made on first use)."""
        held = t.ring
        if not held:
            held.append(self._ring_enqueuer(t))
        return held[0]  # type: ignore[no-any-return]

    def _ring_enqueuer(self, t: Template) -> _RingQueue:
        """``t`` (one WR, one SGE) as a function ``(sge_addr, remote_addr, timeout)`` that
        writes it, so placed, into the next slot of one of its connection's lanes' rings
        (round robin) and returns the caller's :class:`MemberHandle`.  What the template
        fixes (its connection, regions, keys, opcode and size) is bound once here, not
        read per message.

        While the lane's last queued chunk is this ring's open one and none of it is
        taken for posting, the message joins it: one more WR, the group's byte count
        and earliest deadline, and its region if new.  Otherwise the message opens a
        chunk of its own (:meth:`_open_ring_chunk`).  With every slot waiting for its
        post, the request is queued as a chain of its own instead.  The poster posts the
        open chunk with the rest of the backlog and signals the batch's last WR; the
        slots are free again once that post returned (:meth:`_post`).

        The function returns None, with nothing queued, when the template is stale (the
        peer announced other regions, ``t``'s local region was deregistered, the
        connection was replaced): the caller takes the general path, which checks
        everything again.  These are checked under the lock, for :meth:`_ring_runner`'s
        calls, which check only their arguments; a closed engine or a connection that
        is not READY raises as the general path would.
        """
        engine, poster = self, self._poster
        conn, local, remotes = t.conn, t.local, t.remotes
        mr = local.mr
        n, opcode, rkey, lkey = t.nbytes, t.opcode, t.rkey, t.lkey
        lo, _, ro = t.single  # type: ignore[misc]
        lock = self._lock
        ready = ConnState.READY
        pack = WR_SLOT.pack_into
        slots = min(RING_SLOTS, self.sq_depth)
        clock = time.monotonic
        member = MemberHandle

        def enqueue(sge_addr: int, remote_addr: int, timeout: float) -> TransferHandle | None:
            with lock:
                if engine._closed or conn.state is not ready:
                    engine._check_open()
                    conn.check_ready()
                # MemoryRegion.closed is what Region.closed returns: no property call per
                # message.  A READY connection is the one indexed under its peer: it
                # becomes READY in the same locked step that indexes it (_adopt), only
                # from CONNECTING, and leaves READY before it is dropped from the index.
                if conn.remote_regions is not remotes or mr.closed:
                    return None
                lane = next(conn.lane_cycle)  # Connection.pick_lane, inline
                ring = lane.ring
                if ring is None:
                    ring = lane.ring = LaneRing(slots)
                written = ring.written
                cap = ring.capacity
                if written - ring.released < cap:
                    slot = written % cap
                    chunk = ring.open
                    # The open chunk is closed before any of it is taken for posting
                    # (Poster.start_post) and when another opens, so only a wrap (slot 0: a
                    # chunk is one range of the chain) or a chunk queued after it on the
                    # lane ends the joining here.  Its end, signal groups and count are
                    # set when it closes (Poster.close_ring_chunk), not per message.
                    if chunk is not None and slot and lane.window.last is chunk:
                        group = chunk.handle
                        k = written - ring.open_at
                        regions = chunk.regions
                        if regions[-1] is not local:  # type: ignore[index]
                            regions.append(local)  # type: ignore[union-attr]
                        # A member's deadline is its group's, the earliest of theirs.  A
                        # message with no shorter timeout than the group's shortest,
                        # queued later, has a later deadline: no clock reading for it.
                        if timeout < group.timeout:
                            group.timeout = timeout
                            deadline = clock() + timeout
                            if deadline < group.deadline:
                                group.deadline = deadline
                    else:
                        chunk = engine._open_ring_chunk(lane, ring, slot, local, timeout)
                        group = chunk.handle
                        k = 0
                    group.nbytes += n
                    group.num_wrs += 1
                    # SlotRing.write, inline (a call less per message): one unsignaled
                    # RDMA WR of one SGE in the slot.
                    pack(
                        ring.wr_mem,
                        slot * WR_BYTES,
                        chunk.first_id + k,
                        ring.links[slot],
                        ring.sge_lists[slot],
                        1,
                        opcode,
                        0,
                        0,
                        remote_addr,
                        rkey,
                        sge_addr,
                        n,
                        lkey,
                    )
                    ring.written = written + 1
                    handle = member(group, k, n)
                else:
                    handle = None
            if handle is None:  # every slot waits for its post: a chain of its own
                built = engine._planner.rebuild(t, sge_addr - lo, remote_addr - ro)
                return engine._queue1(conn, built, timeout, False)
            if poster.wake_due:
                poster.wake()
            return handle

        return enqueue

    def _open_ring_chunk(
        self, lane: Lane, ring: LaneRing, slot: int, local: Region, timeout: float
    ) -> Chunk:
        """A new open chunk of ``lane``'s ring starting at ``slot`` (lock held), tracked
        as one :class:`GroupHandle`, which reserves a block of ``wr_id``s (one per slot
        the chunk may grow to), so that whatever is queued after it on any lane has
        higher ids; the poster is asked for unless it will take it anyway."""
        self._poster.close_ring_chunk(ring)
        cap = ring.capacity
        group = GroupHandle(
            lane.conn.peer, time.monotonic() + timeout, self._poster.reap_inline, timeout
        )
        group.chunks_left = 1
        chunk = Chunk(ring.chain, slot, slot + 1, group, 1, self._next_wr)
        chunk.groups = 1
        chunk.regions = [local]
        chunk.ring = ring
        self._next_wr += cap
        ring.open = chunk
        ring.open_at = ring.written
        self._handles.add(group)
        window = lane.window
        window.queue1(chunk)
        # A message that joins this chunk later needs no asking: the chunk is then still
        # queued and not taken, so whoever posts it (asked here, or the poster at work
        # now) posts the joined slots with it.
        if not window.poster and lane.qpn not in self._poster.to_post:
            self._poster.want_post(lane)  # (once asked, the poster takes it with the rest)
        return chunk

    def _remember_ring(self, t: Template, remote: RemoteRegion | str) -> None:
        """Keep ``t`` (a template of two ranges, the peer's region named by ``remote``)
        for :meth:`put_async` or :meth:`get_async` of the same regions and sizes at any
        offsets."""
        enqueue = self._enqueuer_of(t)
        held = t.ring  # [enqueue, the remote argument, the runner]
        if len(held) < 3 or held[1] != remote:
            held[1:] = [remote, self._ring_runner(t, remote, enqueue)]
        if t.opcode == verbs.WR_RDMA_WRITE:
            self._ring_put = held[2]
        else:
            self._ring_get = held[2]

    def _ring_runner(
        self, t: Template, remote_arg: RemoteRegion | str, enqueue: _RingQueue
    ) -> _RingRun:
        """``t`` (one WR, one SGE, two ranges) into a lane's ring, as one function of a
        call's arguments: the handle when the call has ``t``'s local region, peer and
        sizes and ``remote_arg``; None, with nothing queued, when it has not, or when
        the template is stale, a range leaves its region or breaks the alignment policy,
        or the timeout is not > 0, and the caller takes the general path, which checks
        everything again and raises what is wrong.  The checks are those of :meth:`_one`
        for a template and of :meth:`Planner.at_offsets`: the call's own ones here, the
        template's in ``enqueue`` (:meth:`_ring_enqueuer`), under its lock."""
        conn, local, peer = t.conn, t.local, t.conn.peer
        remote = t.remote
        size = t.nbytes
        lo, _, ro = t.single  # type: ignore[misc]
        lbase, rbase = local.addr + lo, remote.addr + ro  # where the SGE and range start
        llen, rlen = local.length - size, remote.length - size
        align = self._planner.alignment or 0
        ready = ConnState.READY
        ranges = ContiguousDesc

        def run(
            peer_: str, local_: Region, remote_: Any, ldesc: Any, rdesc: Any, timeout: float
        ) -> TransferHandle | None:
            if (
                local_ is local
                and type(ldesc) is ranges
                and type(rdesc) is ranges
                and ldesc.nbytes == size
                and rdesc.nbytes == size
                and remote_ == remote_arg
                and peer_ == peer
            ):
                loff, roff = ldesc.offset, rdesc.offset
                if (
                    loff <= llen
                    and roff <= rlen
                    and not (align and (loff % align or roff % align))
                    and conn.state is ready  # else the general path finds its successor
                    and timeout > 0
                ):
                    return enqueue(lbase + loff, rbase + roff, timeout)
            return None

        return run

    def _solo(self, t: Template, la: int, ra: int, timeout: float) -> TransferHandle | None:
        """A blocking request of one WR (``t`` placed at ``la``/``ra``), posted and waited
        for on this thread when one of the connection's lanes is idle; None once it has
        completed (its error raised).  The common case of a blocking put or get: no
        hand-over, no handle to wait on, no batch, and the completion is polled here.

        The chunk goes through the lane's window like any other (:meth:`SendWindow.take_solo`),
        so whichever thread reaps its completion ends it, a connection failure fails it,
        and notifications queued meanwhile wait for it.  With no idle lane it is queued as
        usual and its handle returned.  Past ``timeout`` it fails with
        :class:`TransferTimeout` and, as any transfer past its deadline, fails the
        connection.  Counts as a poster until it returns, so :meth:`close` waits for it.
        """
        conn = t.conn
        b = self._planner.rebuild(t, la, ra)
        chain = b.chain
        start = time.monotonic()
        handle = TransferHandle(conn.peer, b.nbytes, 1, start + timeout)
        handle.chunks_left = 1
        chunk = Chunk(chain, 0, 1, handle, 1)
        with self._lock:
            if self._closed or conn.state is not ConnState.READY:
                self._planner.give_back(b)
                self._check_open()
                conn.check_ready()
            wr_id = chunk.first_id = self._next_wr
            chunk.groups = 1
            for lane in conn.lanes:
                if lane.window.take_solo(chunk):
                    self._next_wr = wr_id + 1
                    self._poster.posters += 1
                    self._direct_posts += 1  # also a post of one WR, see diagnostics
                    break
            else:
                lane = None
        if lane is None:  # every lane busy: queued behind their work, as usual
            return self._queue1(conn, b, timeout, True)
        chain.signal_one(wr_id)
        err: HixlError | None = None
        try:
            lane.qp.post_whole(chain)
        except HixlError as exc:
            err = exc
        self._planner.give_back(b)  # the provider has copied the WR
        self._await_solo(lane, err, handle, start)
        if handle.error is not None:
            raise handle.error
        return None

    def _remember_repeat(self, t: Template, tkey: tuple[Any, ...]) -> None:
        """Keep the blocking call ``tkey`` (peer, op, local, remote and the two
        descriptors), which just ran on the direct lane at its template's own offsets, so
        that :meth:`put` or :meth:`get` with the same arguments runs it again at once."""
        held = t.lane
        if len(held) < 2:
            _, dlo, dro, n, ch = held[0]
            held.append(
                ch.repeat_runner(t.opcode, t.local_addr + dlo, t.remote_addr + dro, n, t.remotes)
            )
        entry = (tkey[:1] + tkey[2:], held[1])
        if t.opcode == verbs.WR_RDMA_WRITE:
            self._repeat_put = entry
        else:
            self._repeat_get = entry

    def _on_lane(self, t: Template, la: int, ra: int, timeout: float) -> bool:
        """A blocking request of one WR and one SGE (``t`` placed at ``la``/``ra``) run on
        the connection's direct lane while no channel holds it: the path of a
        :class:`Channel` call, through a channel the engine keeps for the template (its
        regions and access were checked when the template was made; the call checks the
        offsets again, and the regions' lifetimes).  True once it completed (its error
        raised); False, with nothing posted, when another call has the lane."""
        held = t.lane
        if not held:
            ch = Channel(self, t.conn, t.local, t.remote, self._poster, lent=True)
            lo, n, ro = t.single  # type: ignore[misc]
            call = ch.put if t.opcode == verbs.WR_RDMA_WRITE else ch.get
            held.append((call, lo - t.local.addr, ro - t.remote.addr, n, ch))
        call, dlo, dro, n, _ = held[0]
        # Counted as it starts, as a direct post is (without the lock: approximate when
        # several threads put at once); taken back if the lane was not free.
        self._lane_posts += 1
        try:
            call(la + dlo, ra + dro, n, timeout=timeout)
        except LaneBusy:
            self._lane_posts -= 1
            return False
        return True

    def _await_solo(
        self, lane: Lane, err: HixlError | None, handle: TransferHandle, start: float
    ) -> None:
        """After :meth:`_solo`'s post returned (``err``: the provider refused it): settle
        the post, then reap the send CQ on this thread until ``handle`` finishes, spinning
        for :data:`SPIN_S`, then with sleeps of up to 1 ms between polls; then stop
        counting as a poster (also when a poll raises).  The queue is polled under the
        lock, as every reaper does (completions of one queue pair are handled in order).
        The first round settles the post and polls in one turn of the lock."""
        cq = self.send_cq
        lock = self._lock
        spin_until = start + SPIN_S
        nap = 0.00005
        settle = True
        released = False
        try:
            while True:
                with lock:
                    if settle:
                        settle = False
                        self._poster.settle_locked(lane, err, handle)
                    if self._closed:
                        handle.finish(
                            StateError(f"engine {self.id} closed while the transfer was pending")
                        )
                        rows = None
                    else:
                        rows = cq.poll_rows(POLL_BATCH)
                        if rows:
                            self._reaper.reap_send(rows)
                    if handle.status is not TransferStatus.PENDING:
                        released = True
                        self._poster.release_poster()
                if self._poster.wake_due:  # the reap handed other lanes' backlog over
                    self._poster.wake()
                if released:
                    return
                now = time.monotonic()  # also when others' completions keep coming
                if now >= handle.deadline:
                    with lock:
                        self._fail(
                            lane.conn,
                            "a transfer timed out",
                            deadline_error(handle),
                            culprit=handle,
                        )
                elif not rows and now >= spin_until:
                    time.sleep(nap)
                    nap = min(nap * 2, 0.001)
        except BaseException:
            if not released:
                with lock:
                    self._poster.release_poster()
            raise

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
            ch = Channel(self, conn, local, rem, self._poster)
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
            return self._inbox.take_all(self._return_credits)

    def wait_notification(self, name: str, timeout: float, peer: str | None = None) -> Notification:
        """Wait up to ``timeout`` s for a notification called ``name`` (from ``peer``).

        The matching notification is taken out of the queue; others stay.  ``peer`` is
        matched against the id the sender's connection proved in its handshake.
        Raises :class:`TransferTimeout` when none arrives in time, :class:`StateError`
        when the engine is closed (or closes while waiting).
        """
        deadline = time.monotonic() + timeout
        with self._notify_cv:
            while True:
                for note in self._inbox.notes:
                    if note.name == name and (peer is None or note.peer == peer):
                        owed = self._inbox.take(note)
                        if owed is not None:
                            self._return_credits(*owed)
                        return note
                if self._closed or self._broken is not None:
                    self._check_open()
                    raise StateError(f"engine {self.id} is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._notify_cv.wait(left)
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
    """The engine as its poster and reaper see it (:class:`~hixl.engine.posting.PostingHost`,
    :class:`~hixl.engine.reaping.ReapingHost`).

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


def _every_for(conn: Connection, n: int, nbytes: int, every: int) -> int:
    """The signal group size for a request of ``n`` WRs and ``nbytes``: ``every``, or for
    a request of one group's WRs or fewer that carries :data:`SPREAD_BYTES` or more, a
    group per lane (two WRs of 1 MiB then go out on two lanes at once)."""
    k = len(conn.lanes)
    if k > 1 and 1 < n <= every and nbytes >= SPREAD_BYTES:
        return -(-n // k)
    return every


def _spread(chunk: Chunk, conn: Connection) -> list[tuple[Lane, Chunk]]:
    """``chunk`` (ids assigned) cut at signal-group boundaries into a part per lane, as
    even as the groups allow, each paired with its lane (lock held).

    A part completes under the ids of its own groups, as a whole chunk would.  The parts
    share the chain and its :class:`Built`: whichever part's post is handed back last
    returns the chain to the pool (``Built.parts``).  A chunk of one group, or a
    connection of one lane, stays whole on the next lane of the round robin.
    """
    lanes = conn.lanes
    k = min(len(lanes), chunk.groups)
    if k < 2:
        return [(conn.pick_lane(), chunk)]
    per, extra = divmod(chunk.groups, k)
    every, start = chunk.every, chunk.start
    parts: list[tuple[Lane, Chunk]] = []
    g = 0
    for i in range(k):
        n = per + (i < extra)
        part = Chunk(
            chunk.chain,
            start + g * every,
            min(chunk.stop, start + (g + n) * every),
            chunk.handle,
            every,
            chunk.first_id + g,
        )
        part.groups = n
        part.built = chunk.built
        parts.append((conn.pick_lane(), part))
        g += n
    if chunk.built is not None:
        chunk.built.parts = [True] + [False] * (k - 1)  # popped once per part posted
    return parts


_notify = notify  # the module, under a name the ``notify`` parameters do not shadow
