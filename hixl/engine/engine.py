"""The :class:`Engine` facade: lifetime, registration, connections, transfers, notifications.

Each part lives in its own module and talks back through a small protocol it defines:
the connection table, admission, control messages and notification credits
(:mod:`~hixl.engine.peers`), registered regions (:mod:`~hixl.engine.regions`), the
single-request paths (:mod:`~hixl.engine.single`), queueing (:mod:`~hixl.engine.queueing`),
posting (:mod:`~hixl.engine.posting`), send completions (:mod:`~hixl.engine.reaping`), the
progress thread and the handshake; :class:`~hixl.engine.host.Parts` answers those
protocols.  This class builds the parts, holds the one lock they share and delegates each
public call; the data calls (put, get, batches, KV blocks, notifications) come from
:class:`~hixl.engine.transfers.TransferCalls`.  The threading and locking rules are in
:mod:`hixl.engine.locks`.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING

from hixl.core.wire import RemoteRegion
from hixl.engine.channel import Channel, hold_direct_lane
from hixl.engine.config import EngineConfig, is_loopback
from hixl.engine.connection import Connection, Lane
from hixl.engine.datapath import Planner, resolve_remote
from hixl.engine.device import open_engine_device
from hixl.engine.diagnostics import Diagnostics
from hixl.engine.handles import TransferHandle
from hixl.engine.handshake import Listener
from hixl.engine.host import Parts
from hixl.engine.inbox import Inbox
from hixl.engine.kv import KVBlocks
from hixl.engine.locks import engine_lock
from hixl.engine.names import Names
from hixl.engine.peers import Peers
from hixl.engine.posting import Poster
from hixl.engine.progress import Progress
from hixl.engine.queueing import Queuer
from hixl.engine.reaping import SendReaper
from hixl.engine.regions import Access, Region, RegionTable
from hixl.engine.single import SinglePaths
from hixl.engine.transfers import TransferCalls
from hixl.errors import RegistrationError, StateError
from hixl.verbs import adapter as verbs
from hixl.verbs.adapter import gid_to_str

if TYPE_CHECKING:
    from hixl.registry import Registry, Watch

__all__ = ["Diagnostics", "Engine"]

log = logging.getLogger("hixl.engine")


class Engine(TransferCalls):
    """A hixl transfer engine, named ``"ip:port"``.

    ``Engine("10.0.0.1:5000")`` listens on that address for peers; port 0 means the engine
    only makes outgoing connections (its id then gets a random ``~suffix`` to stay unique).
    Every option, its default and what it bounds: docs/api.md ("Engine").  In short:
    ``device``/``port``/``gid_index`` pick the device (default: what ``hixl devices``
    marks).  ``token`` is a shared secret both ends prove before any region key is sent;
    without one any client that reaches the port learns the rkeys of every remotely
    accessible region, so an engine listening beyond loopback (``0.0.0.0`` included) needs
    a token, or ``insecure=True`` to run open on purpose (it then logs a WARNING once).
    ``alignment`` is the offset policy in bytes (0: off); ``qp_timeout`` the verbs
    ACK-timeout exponent, which bounds how long a silent peer takes to fail a transfer;
    ``lanes`` the queue pairs a connection sends over, and ``direct_lane`` one more, with a
    completion queue of its own, for a :meth:`channel`.  ``max_peers``,
    ``max_handshakes``, ``max_handshakes_per_source`` (an IPv4 address, all of 127.0.0.0/8,
    or an IPv6 /64) and ``handshake_timeout`` bound connections and incoming handshakes
    (over a limit a client is answered ERROR(BUSY) and asks again);
    ``max_notifications_per_peer`` and ``max_notifications`` bound notifications received
    and not taken: a sender out of credits waits for the application here to take some
    (see :mod:`hixl.engine.inbox`).  ``completion_events=False`` makes the progress thread
    poll the CQs (a test hook).  ``gil_switch_interval`` (seconds), for an application that
    asks for it, lowers the process's GIL switch interval when that is longer; the
    default, None, leaves it alone.  A client whose id names a listening ``ip:port`` must
    connect from that ip; ``trust_peer_hosts=True`` lifts that for peers behind NAT or a
    proxy.  ``registry`` (``"etcd://10.0.0.1:2379"``, ``"memory://NAME"`` or a shared
    :class:`hixl.registry.Registry`) lets :meth:`connect` take names; with ``name`` the
    engine announces itself there (``role``, its id, GID and MTU, ``capacity``) under a
    lease that ends with it.

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

        self._direct_lane = cfg.direct_lane
        if gil_switch_interval is not None and sys.getswitchinterval() > gil_switch_interval:
            sys.setswitchinterval(gil_switch_interval)  # asked for by name (see above)
        self._names: Names | None = None
        if registry is not None:
            # Before the device, so that an unreachable registry fails before it is opened.
            self._names = Names(registry, self._peer_gone)
        self.qp_timeout = qp_timeout
        self._lock = lock = engine_lock()
        try:
            opened = open_engine_device(
                cfg, engine_id, device, port, gid_index,
                send_queue_depth=send_queue_depth, completion_events=completion_events,
            )  # fmt: skip
        except BaseException:
            if self._names is not None:
                self._names.close()
            raise
        self._dev, self.id, self.sq_depth, self.limits = (
            opened.dev, opened.id, opened.sq_depth, opened.limits,
        )  # fmt: skip
        self.send_cq, self.recv_cq = opened.send_cq, opened.recv_cq
        self._notify_slots, listener, every = opened.notify_slots, opened.listener, opened.every
        self._listener = listener
        self._planner = planner = Planner(self.limits, alignment or None)
        # Every part's host; it holds the engine weakly, so an engine dropped without close()
        # is still collected (and warns).
        self._parts = parts = Parts(self, lock, planner, self.limits)
        self._kv = KVBlocks(parts, planner.memory)  # register_kv, put_blocks, get_blocks
        self._regions = RegionTable(lock, self._dev, self.id)
        conns: dict[str, Connection] = {}
        by_qpn: dict[int, Lane] = {}  # every lane made, connected or not
        self._handles = handles = set[TransferHandle]()
        # Unread notifications and the credits that bound them (see hixl.engine.inbox).
        self._inbox = Inbox(max_notifications_per_peer, max_notifications, max_peers)
        self._poster = poster = Poster(lock, self.sq_depth, planner, parts)
        self._reaper = reaper = SendReaper(by_qpn, handles, poster, parts)
        queuer = Queuer(lock, poster, planner, handles, self._notify_slots, every, parts)
        self._singles = SinglePaths(
            lock, planner, poster, reaper, queuer, self.send_cq, self.sq_depth, conns,
            handles, self.id, parts,
        )  # fmt: skip
        self._peers = peers = Peers(
            self.id, cfg.token, lock, self._dev, qp_timeout=qp_timeout,
            sq_depth=self.sq_depth, cqs=(self.send_cq, self.recv_cq), lanes=cfg.lanes,
            direct_lane=cfg.direct_lane, max_peers=max_peers, conns=conns, by_qpn=by_qpn,
            handles=handles, inbox=self._inbox, regions=self._regions,
            notify_slots=self._notify_slots, poster=poster, reaper=reaper,
            forget=self._singles.forget,
        )  # fmt: skip
        parts.attach(poster, queuer, peers, self._singles)
        self._progress = Progress(
            peers, listener, (self.send_cq, self.recv_cq), completion_events, poster, reaper
        )
        poster.attach(self._progress, self.send_cq, reaper.reap_send)
        self._incoming: Listener | None = None
        if listener is not None:
            self._incoming = Listener(
                peers,
                listener,
                register=self._progress.register,
                unregister=self._progress.unregister,
                max_handshakes=max_handshakes,
                max_per_source=max_handshakes_per_source,
                timeout=handshake_timeout,
                trust_hosts=trust_peer_hosts,
            )
        peers.attach(self._progress, self._incoming)
        self._closed = False
        self._progress.start()
        if listener is not None and cfg.token is None and not is_loopback(cfg.host):
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
        peers = getattr(self, "_peers", None)
        regions = getattr(self, "_regions", ())
        return (
            f"<Engine id={getattr(self, 'id', '?')} peers={len(peers.conns) if peers else 0}"
            f" regions={len(regions)} {state}>"
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
        thread, poster, peers, incoming = (
            self._progress.thread, self._poster, self._peers, self._incoming,
        )  # fmt: skip
        with self._lock:
            return Diagnostics(
                progress_thread_id=thread.native_id,
                progress_alive=thread.is_alive(),
                completion_events=self._progress.events,
                pending_transfers=len(self._handles),
                peers=len(peers.conns),
                regions=len(self._regions),
                handshakes=incoming.pending if incoming is not None else 0,
                refused_busy=incoming.refused_busy if incoming is not None else 0,
                notifications=len(self._inbox),
                notifications_dropped=self._inbox.dropped,
                send_posts=poster.send_posts + poster.direct_posts + poster.lane_posts,
                posted_wrs=poster.posted_wrs + poster.direct_posts + poster.lane_posts,
                direct_posts=poster.direct_posts + poster.lane_posts,
                lane_posts=poster.lane_posts,
                slot_messages=poster.slot_messages + peers.open_messages(),
                chains_built=self._planner.chains_built,
                chains_refilled=self._planner.chains_refilled,
            )

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
            self._peers.drop_all()
            self._peers.finish_all(
                StateError(f"engine {self.id} closed while the transfer was pending")
            )
        self._poster.wake_if_due()
        self._progress.stop()
        self._peers.wait_posters(10.0)  # a thread still posting to a queue pair about to go
        if self._incoming is not None:
            self._incoming.close()  # the progress thread is gone: nobody else touches it
        if self._listener is not None:
            self._listener.close()
        self._peers.release_dead()
        self._progress.close()
        self._regions.by_span.clear()
        self._singles.clear()
        self._dev.close()
        with self._lock:
            self._notify_slots.close()
        self._planner.close()
        log.debug("engine %s closed", self.id)

    def _check_open(self) -> None:
        self._peers.check_open()

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
        region = self._regions.add(self, buffer, access, name, self._peers.announce)
        self._poster.wake_if_due()
        log.debug("registered %r", region)
        return region

    def deregister(self, region: Region) -> None:
        """Release ``region``; peers are told it is gone.  Idempotent."""
        with self._lock:
            self._regions.remove(region, None if self._closed else self._peers.announce)
        self._poster.wake_if_due()

    @property
    def regions(self) -> list[Region]:
        """Regions currently registered."""
        with self._lock:
            return list(self._regions.by_span.values())

    def find_region(self, addr: int, nbytes: int) -> Region:
        """The local region holding ``[addr, addr + nbytes)``.

        Raises :class:`RegistrationError` when no registered region holds it.
        """
        return self._regions.find(addr, nbytes)

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

        Returns once the peer holds the connection live and has granted notification
        credits (it lists us in its :attr:`peers`), or the existing connection when one is
        ready.  Raises only
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
        return self._peers.connect(peer, timeout, address, self._names)

    def disconnect(self, peer: str) -> None:
        """Close the connection to ``peer``; its pending transfers fail.  Unknown peers: no-op."""
        self._peers.disconnect(peer)

    def connection(self, peer: str) -> Connection:
        """The connection to ``peer``; :class:`ConnectionFailed` if there is none."""
        return self._peers.connection(peer, self._names)

    def _peer_gone(self, engine_id: str, reason: str) -> None:
        """Registry watch thread: a peer reached by name left or restarted; fail it now."""
        self._peers.peer_gone(engine_id, reason)

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
            return list(self._peers.conns)

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
        return hold_direct_lane(
            peer, conn, self._lock, self._check_open,
            lambda: self._parts.new_channel(conn, local, rem, lent=False),
            direct_lane=self._direct_lane,
        )  # fmt: skip
