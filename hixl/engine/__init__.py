"""The transfer engine: registered memory, connections, one-sided put/get, notifications.

Theory of operation
-------------------
An :class:`Engine` owns one verbs device (PD), one send CQ and one receive CQ
shared by all its connections, and one background *progress thread*.  A
connection to a peer is one RC queue pair plus the TCP socket the handshake
ran on; that socket stays open as the control channel (region updates,
goodbyes) and tells us at once when the peer process dies (EOF).

Data path.  ``put``/``get`` plan the transfer with the pure descriptor core
(:mod:`hixl.core.plan`), check local and remote bounds, access and alignment
*before* anything is posted, and turn each planned work request into a
``SendRequest`` with the registered addresses and keys.  Work requests go
out in chunks; only the last of each chunk is signaled, and since an RC
queue completes in order its completion frees the whole chunk's send-queue
slots.  Chunks that do not fit in the send queue wait in a per-connection
backlog and are posted by the progress thread as slots free up (flow control
against the send-queue depth).

Notifications.  A notification is a SEND carrying ``name\\0message`` posted
on the same queue pair right after a transfer's data.  RC delivers in order,
so when the target sees the notification every byte before it has landed.
Each connection keeps receive buffers posted for them.

Progress.  The progress thread polls both CQs and the control sockets.  It
never blocks while holding the GIL: it arms each CQ for a completion event
as soon as a poll drains it, and then waits in ``selector.select`` on their completion
channels' descriptors and the sockets, which releases the GIL and wakes at
once for a completion or control traffic (and every 20 ms while transfers
are pending, to enforce deadlines).  pyverbs does not expose a channel's
descriptor; :mod:`hixl.verbs.adapter` finds it in ``/proc/self/fd``, and where it
cannot, the thread polls with a back-off of up to 2 ms instead.  Application
threads never poll; ``TransferHandle.wait`` sleeps on an event.

Plans.  Bounds, alignment and the plan of a request depend only on its
descriptors and the two regions' sizes, so they are computed once per such
key (hashable descriptors only) and reused: KV transfers repeat the same
layout for every layer.

Failure.  The first completion error on a connection fails the transfer that
owns it with :class:`CompletionError` (carrying the status name), moves the
queue pair to ERR (flushing everything still queued, so no late DMA touches
user memory), and marks the connection failed: pending and later calls on it
fail at once with :class:`ConnectionFailed`.  A transfer that passes its
deadline does the same with :class:`TransferTimeout`: its requests cannot be
cancelled any other way.  Other connections are not affected.

Lifetimes.  ``Engine.close()`` stops the listener and the progress thread,
fails every pending transfer, says goodbye to every peer, and closes all
verbs objects (QPs, MRs, CQs, PD, context).  It may be called twice; an engine
collected while open warns with ``ResourceWarning``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import secrets
import selectors
import socket
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hixl.core import wire as _wire
from hixl.core.descriptors import ContiguousDesc, Descriptor, as_segments
from hixl.core.plan import DeviceLimits, Op, check_alignment, check_bounds, plan_transfer
from hixl.core.wire import RemoteRegion
from hixl.errors import (
    ArgumentError,
    ConnectionFailed,
    HandshakeError,
    HixlError,
    RegistrationError,
    StateError,
    TransferTimeout,
)
from hixl.verbs import adapter as _verbs

log = logging.getLogger("hixl.engine")

_QI = TypeVar("_QI", _wire.Info, _wire.Accept)

__all__ = [
    "Access",
    "Connection",
    "ConnState",
    "Engine",
    "Notification",
    "Region",
    "RemoteRegion",
    "TransferHandle",
    "TransferRequest",
    "TransferStatus",
]

_NOTIFY_SLOT = 1024  # bytes per notification buffer: name + NUL + message
_MAX_NOTIFY_NAME = 256
_RECV_SLOTS = 64  # receive buffers per connection, for notifications
_SEND_NOTIFY_SLOTS = 1024
_CHUNK = 16  # work requests per signaled chunk
_IDLE_MAX = 0.002  # longest progress-thread sleep when it has to poll, seconds
_SLEEP_PENDING = 0.02  # with completion events: longest sleep while transfers are pending
_SLEEP_IDLE = 0.1  # ... and with nothing pending
_POLL_BATCH = 64  # completions taken per poll
_PLAN_CACHE = 512  # planned (descriptor pair, region sizes) kept per engine
_WAKE = object()  # selector key data of the socket that wakes the progress thread
_handle_lock = threading.Lock()  # orders a handle's finish against a waiter making its Event


class Access(enum.IntFlag):
    """What may be done to a registered region.

    ``NONE`` suits a buffer that is only ever the *source* of a put (it may be
    read-only).  ``LOCAL_WRITE`` lets a ``get`` land in it.  ``REMOTE_READ``
    and ``REMOTE_WRITE`` expose it to connected peers; only such regions'
    addresses and keys are ever sent over the network.  ``REMOTE_WRITE``
    implies ``LOCAL_WRITE`` (a verbs rule).
    """

    NONE = 0
    LOCAL_WRITE = _verbs.ACCESS_LOCAL_WRITE
    REMOTE_WRITE = _verbs.ACCESS_REMOTE_WRITE
    REMOTE_READ = _verbs.ACCESS_REMOTE_READ


class TransferStatus(enum.Enum):
    """Life of a transfer: PENDING, then DONE or FAILED, never back."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class ConnState(enum.Enum):
    """Life of a connection; transitions are in :data:`_TRANSITIONS`."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


# (state, event) -> next state.  Anything else is an illegal transition.
_TRANSITIONS: dict[tuple[ConnState, str], ConnState] = {
    (ConnState.CONNECTING, "established"): ConnState.READY,
    (ConnState.CONNECTING, "fail"): ConnState.FAILED,
    (ConnState.CONNECTING, "close"): ConnState.CLOSED,
    (ConnState.READY, "fail"): ConnState.FAILED,
    (ConnState.READY, "close"): ConnState.CLOSED,
    (ConnState.FAILED, "fail"): ConnState.FAILED,
    (ConnState.FAILED, "close"): ConnState.CLOSED,
    (ConnState.CLOSED, "close"): ConnState.CLOSED,
    (ConnState.CLOSED, "fail"): ConnState.CLOSED,
}


@dataclass(frozen=True, slots=True)
class Notification:
    """A notification that arrived from ``peer``: ``name`` and an optional ``message``."""

    peer: str
    name: str
    message: bytes


class Region:
    """A registered memory region of an :class:`Engine`.

    ``addr`` and ``length`` are in bytes.  Offsets in descriptors are relative
    to ``addr``.  Obtain one from :meth:`Engine.register`; release it with
    :meth:`Engine.deregister` (or by closing the engine).
    """

    def __init__(self, engine: Engine, mr: _verbs.MemoryRegion, access: Access, name: str) -> None:
        self._engine = engine
        self._mr = mr
        self.addr = mr.addr
        self.length = mr.length
        self.access = access
        self.name = name

    @property
    def closed(self) -> bool:
        return self._mr.closed

    @property
    def remote(self) -> RemoteRegion | None:
        """What peers see of this region, or None when it is not remotely accessible."""
        remote_bits = int(self.access) & (_wire.REMOTE_READ | _wire.REMOTE_WRITE)
        if not remote_bits or self.closed:
            return None
        return RemoteRegion(
            addr=self.addr,
            length=self.length,
            rkey=self._mr.rkey,
            access=remote_bits,
            name=self.name,
        )

    def __repr__(self) -> str:
        name = f" name={self.name!r}" if self.name else ""
        state = " closed" if self.closed else ""
        return (
            f"<Region addr={self.addr:#x} length={self.length} access={self.access!r}{name}{state}>"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRequest:
    """One piece of a batch: move ``local_desc`` of ``local`` to/from ``remote_desc`` of ``remote``.

    ``op`` is ``"write"`` (put: local -> remote) or ``"read"`` (get: remote ->
    local).  ``remote`` is a :class:`RemoteRegion` from the connection or the
    name the peer registered it under.  A missing descriptor means the whole
    region, or as many bytes as the other side describes.
    """

    op: str
    local: Region
    remote: RemoteRegion | str
    local_desc: Descriptor | None = None
    remote_desc: Descriptor | None = None


class TransferHandle:
    """An asynchronous transfer: poll :meth:`done` / :attr:`status`, or :meth:`wait`."""

    def __init__(self, peer: str, nbytes: int, num_wrs: int, deadline: float) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.num_wrs = num_wrs
        self.deadline = deadline
        self._status = TransferStatus.PENDING
        self._error: HixlError | None = None
        self._event: threading.Event | None = None  # made by the first wait() that sleeps
        self._chunks_left = 0

    @property
    def status(self) -> TransferStatus:
        return self._status

    @property
    def error(self) -> HixlError | None:
        """The error that failed the transfer, or None."""
        return self._error

    def done(self) -> bool:
        """True once the transfer finished, successfully or not."""
        return self._status is not TransferStatus.PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finishes; raise its error if it failed.

        ``timeout`` (seconds) bounds this wait only; when it passes first this
        raises :class:`TransferTimeout` and the transfer goes on.  The transfer
        has its own deadline, after which it fails on its own.
        """
        event = None
        with _handle_lock:  # most handles are done before anyone waits: no Event for them
            if self._status is TransferStatus.PENDING:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
        if event is not None:
            # One second of grace past the deadline, for the progress thread to fail it.
            own_limit = self.deadline - time.monotonic() + 1.0
            limit = own_limit if timeout is None else min(own_limit, timeout)
            if not event.wait(max(0.0, limit)):
                waited = "past its deadline" if limit == own_limit else f"after {timeout} s"
                raise TransferTimeout(
                    f"transfer to {self.peer} still pending {waited} "
                    f"({self.nbytes} bytes, {self.num_wrs} work requests)"
                )
        if self._error is not None:
            raise self._error

    def _finish(self, error: HixlError | None) -> None:
        with _handle_lock:
            if self._status is not TransferStatus.PENDING:
                return
            self._error = error
            self._status = TransferStatus.DONE if error is None else TransferStatus.FAILED
            event = self._event
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        return (
            f"<TransferHandle peer={self.peer} nbytes={self.nbytes} "
            f"wrs={self.num_wrs} status={self._status.value}>"
        )


@dataclass(slots=True)
class _Chunk:
    """Consecutive work requests posted together; only the last one is signaled."""

    requests: list[_verbs.SendRequest]
    handle: TransferHandle | None
    notify_slot: int | None = None
    wr_id: int = 0  # posted as the last request's wr_id, signaled


class Connection:
    """An RC queue pair to one peer, plus the TCP control socket.

    Read-only for users: ``peer``, ``state``, ``mtu``, ``remote_regions``.
    Transfers go through the :class:`Engine`.
    """

    def __init__(self, engine: Engine, peer: str, outbound: bool) -> None:
        self._engine = engine
        self.peer = peer
        self.outbound = outbound
        self.state = ConnState.CONNECTING
        self.failure: str | None = None
        self._sent_regions: tuple[RemoteRegion, ...] = ()  # what our handshake message carried
        self.mtu = 0
        self._remote: tuple[RemoteRegion, ...] = ()
        dev = engine._dev
        self._qp = dev.create_rc_qp(
            engine._send_cq, engine._recv_cq, engine._sq_depth, _RECV_SLOTS, dev.caps.max_sge, 1
        )
        self.qpn = self._qp.qpn
        self.psn = secrets.randbits(24)
        self._recv_buf = np.zeros(_RECV_SLOTS * _NOTIFY_SLOT, dtype=np.uint8)
        self._recv_mr = dev.register(
            self._recv_buf.ctypes.data,
            self._recv_buf.nbytes,
            _verbs.ACCESS_LOCAL_WRITE,
            self._recv_buf,
        )
        for slot in range(_RECV_SLOTS):
            self._post_recv(slot)
        self._sock: socket.socket | None = None
        self._decoder: _wire.Decoder | None = None
        self._backlog: deque[_Chunk] = deque()
        self._inflight: dict[int, _Chunk] = {}  # wr_id of a chunk's signaled WR -> chunk
        self._sq_used = 0

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

    def __repr__(self) -> str:
        return (
            f"<Connection peer={self.peer} qpn={self.qpn:#x} state={self.state.name} "
            f"mtu={self.mtu} regions={len(self._remote)}>"
        )

    # -- state ---------------------------------------------------------------------------
    def _transition(self, event: str) -> None:
        key = (self.state, event)
        if key not in _TRANSITIONS:
            raise StateError(
                f"connection to {self.peer}: illegal transition {event!r} "
                f"in state {self.state.name}"
            )
        self.state = _TRANSITIONS[key]

    def _check_ready(self) -> None:
        if self.state is ConnState.READY:
            return
        if self.state is ConnState.FAILED:
            raise ConnectionFailed(
                f"connection to {self.peer} has failed: {self.failure}; "
                "disconnect and connect again"
            )
        raise StateError(f"connection to {self.peer} is {self.state.name}")

    # -- verbs ---------------------------------------------------------------------------
    def _post_recv(self, slot: int) -> None:
        self._qp.post_recv(
            slot, [(self._recv_mr.addr + slot * _NOTIFY_SLOT, _NOTIFY_SLOT, self._recv_mr.lkey)]
        )

    def _local_info(self, cls: type[_QI], proof: bytes) -> _QI:
        dev = self._engine._dev
        self._sent_regions = self._engine._exposed()
        return cls(
            proof=proof,
            qpn=self.qpn,
            psn=self.psn,
            gid=dev.gid,
            mtu=dev.active_mtu,
            max_sge=dev.caps.max_sge,
            recv_slots=_RECV_SLOTS,
            recv_slot_size=_NOTIFY_SLOT,
            regions=self._sent_regions,
        )

    def _establish(self, remote: _wire.QpInfo) -> None:
        self.mtu = min(self._engine._dev.active_mtu, remote.mtu)
        self._qp.connect(
            remote.qpn,
            remote.psn,
            self.psn,
            remote.gid,
            self.mtu,
            timeout=self._engine._qp_timeout,
            retry_cnt=7,  # rxe reads 7 as "retry until the transfer deadline"
            rnr_retry=7,
        )
        self._remote = remote.regions

    def _destroy(self) -> None:
        self._qp.close()
        self._recv_mr.close()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()


def _buffer_span(obj: object) -> tuple[int, int, object, bool]:
    """``(address, nbytes, owner, readonly)`` of a buffer to register."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        addr, length = obj
        return int(addr), int(length), None, False
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "numel"):
        # A torch tensor, duck-typed so hixl does not depend on torch.
        tensor: Any = obj
        dev_type = getattr(getattr(tensor, "device", None), "type", "cpu")
        if dev_type != "cpu":
            raise RegistrationError(f"only CPU tensors can be registered, got device {dev_type}")
        if not tensor.is_contiguous():
            raise RegistrationError("tensor is not contiguous; register .contiguous() instead")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        return int(tensor.data_ptr()), nbytes, tensor, False
    if isinstance(obj, np.ndarray):
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise RegistrationError(
                f"array is not contiguous (strides {obj.strides}); "
                "register its base buffer and use a strided descriptor"
            )
        return int(obj.ctypes.data), int(obj.nbytes), obj, not obj.flags.writeable
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError as exc:
        raise RegistrationError(
            f"cannot register {type(obj).__name__}: not a buffer, array, tensor or "
            "(address, length) tuple"
        ) from exc
    if not view.contiguous:
        raise RegistrationError("buffer is not contiguous")
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    # The memoryview is kept as the owner: while it is alive a bytearray cannot be resized
    # (and so its memory cannot move under the registration).
    return int(arr.ctypes.data), int(view.nbytes), (view, arr), view.readonly


class Engine:
    """A hixl transfer engine, named ``"ip:port"``.

    ``Engine("10.0.0.1:5000")`` listens on that address for peers; port 0
    means the engine only makes outgoing connections (its id then gets a
    random ``~suffix`` to stay unique).  ``device``/``port``/``gid_index``
    default to what ``hixl devices`` marks.  ``token`` (optional shared
    secret) makes both ends prove they know it before any region key is
    sent.  ``alignment`` is the policy for offsets inside regions (bytes, 0 to
    turn it off).  ``qp_timeout`` is the verbs ACK-timeout exponent, which
    bounds how long a silent peer takes to fail a transfer.

    Raises :class:`ArgumentError` for a bad id, :class:`DeviceError` when no
    device is usable, :class:`OSError` when the address cannot be bound.
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
        handshake_timeout: float = 10.0,
        qp_timeout: int = 14,
        max_peers: int = 64,
    ) -> None:
        try:
            host, tcp_port = _wire.parse_engine_id(engine_id)
        except ValueError as exc:
            raise ArgumentError(f"bad engine id {engine_id!r}: {exc}") from exc
        self._closed = True  # until fully built, so __del__ stays quiet on failure
        self._token = token.encode() if isinstance(token, str) else token
        self.alignment = alignment or None
        self._handshake_timeout = handshake_timeout
        self._qp_timeout = qp_timeout
        self._max_peers = max_peers
        self._lock = threading.RLock()
        self._notify_cv = threading.Condition(self._lock)
        self._dev = _verbs.open_device(device, port, gid_index)
        try:
            caps = self._dev.caps
            self._sq_depth = max(_CHUNK * 2, min(send_queue_depth, caps.max_qp_wr))
            self.limits = DeviceLimits(
                max_sge=caps.max_sge,
                max_sge_rd=caps.max_sge_rd,
                max_msg_sz=min(caps.max_msg_sz, 0xFFFF_FFFF),
            )
            cq_depth = max_peers * (self._sq_depth // _CHUNK + _RECV_SLOTS + 4)
            self._send_cq = self._dev.create_cq(cq_depth, events=True)
            self._recv_cq = self._dev.create_cq(max_peers * _RECV_SLOTS + 16, events=True)
            self._notify_buf = np.zeros(_SEND_NOTIFY_SLOTS * _NOTIFY_SLOT, dtype=np.uint8)
            self._notify_mr = self._dev.register(
                self._notify_buf.ctypes.data, self._notify_buf.nbytes, 0, self._notify_buf
            )
            self._free_notify = list(range(_SEND_NOTIFY_SLOTS))
            self._listener: socket.socket | None = None
            if tcp_port:
                self._listener = socket.create_server((host, tcp_port), backlog=64)
                self._listener.setblocking(False)
                self.id = engine_id
            else:
                self.id = f"{host}:0~{secrets.token_hex(4)}"
        except BaseException:
            self._dev.close()
            raise
        self._regions: dict[tuple[int, int], Region] = {}
        self._conns: dict[str, Connection] = {}
        self._by_qpn: dict[int, Connection] = {}
        self._handles: set[TransferHandle] = set()
        self._notes: deque[Notification] = deque()
        self._next_wr = 1
        self._plans: dict[tuple[Any, ...], tuple[list[tuple[int, list[tuple[int, int]]]], int]]
        self._plans = {}
        self._handshakes = threading.BoundedSemaphore(16)
        self._selector = selectors.DefaultSelector()
        if self._listener is not None:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        # Completion events wake the progress thread (no polling while idle) where the
        # device's completion channels could be opened; otherwise it polls with a back-off.
        cqs = (self._send_cq, self._recv_cq)
        self._event_cqs = all(cq.fd is not None for cq in cqs)
        self._armed: set[_verbs.CompletionQueue] = set()
        if self._event_cqs:
            for cq in cqs:
                assert cq.fd is not None
                self._selector.register(cq.fd, selectors.EVENT_READ, cq)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._stop = threading.Event()
        self._closed = False
        self._next_expiry_check = 0.0
        # The thread holds the engine only weakly between rounds, so an engine the
        # application forgets to close is still collected (and warns, and closes).
        self._thread = threading.Thread(
            target=_progress_loop,
            args=(weakref.ref(self), self._stop),
            name=f"hixl-progress-{self.id}",
            daemon=True,
        )
        self._thread.start()
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
    def device(self) -> _verbs.Device:
        return self._dev

    def close(self) -> None:
        """Fail pending transfers, say goodbye to peers, release every resource.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in list(self._conns.values()):
                self._drop(conn, "engine closed", send_bye=True)
            for h in list(self._handles):
                h._finish(StateError(f"engine {self.id} closed while the transfer was pending"))
            self._handles.clear()
            self._notify_cv.notify_all()
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._listener is not None:
            self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._regions.clear()
        self._dev.close()
        log.debug("engine %s closed", self.id)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"engine {self.id} is closed")

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
        memory again with the same access returns the same region.

        Raises :class:`RegistrationError` for an unsupported, empty or
        read-only-but-writable request or an access clash, and
        :class:`VerbsError` when the device refuses.
        """
        self._check_open()
        access = Access(access)
        if access & Access.REMOTE_WRITE:
            access |= Access.LOCAL_WRITE
        addr, length, owner, readonly = _buffer_span(buffer)
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
            mr = self._dev.register(addr, length, int(access), owner)
            region = Region(self, mr, access, name)
            self._regions[(addr, length)] = region
            if region.remote is not None:
                self._announce()
        log.debug("registered %r", region)
        return region

    def deregister(self, region: Region) -> None:
        """Release ``region``; peers are told it is gone.  Idempotent."""
        with self._lock:
            if self._regions.get((region.addr, region.length)) is not region:
                return
            del self._regions[(region.addr, region.length)]
            was_remote = region.remote is not None
            region._mr.close()
            if was_remote and not self._closed:
                self._announce()

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
        return tuple(r.remote for r in self._regions.values() if r.remote is not None)

    def _announce(self) -> None:
        msg = _wire.encode(_wire.Regions(regions=self._exposed()))
        for conn in self._conns.values():
            if conn.state is ConnState.READY and conn._sock is not None:
                self._send_control(conn, msg)

    def _send_control(self, conn: Connection, data: bytes) -> None:
        assert conn._sock is not None
        try:
            conn._sock.sendall(data)
        except OSError as exc:
            self._fail(conn, f"control connection lost: {exc}")

    # -- connections ---------------------------------------------------------------------
    def connect(self, peer: str, timeout: float = 10.0) -> Connection:
        """Connect to the engine listening at ``peer`` (``"ip:port"``).

        Returns the existing connection when one is ready.  Raises
        :class:`ConnectionFailed` when nothing answers or the peer refuses,
        :class:`HandshakeError` when it answers with something malformed or
        fails authentication, :class:`TransferTimeout` after ``timeout`` s.
        """
        self._check_open()
        try:
            host, port = _wire.parse_engine_id(peer)
        except ValueError as exc:
            raise ArgumentError(f"bad peer id {peer!r}: {exc}") from exc
        if port == 0:
            raise ArgumentError(f"peer {peer!r} does not listen (port 0)")
        with self._lock:
            old = self._conns.get(peer)
            if old is not None and old.state is ConnState.READY:
                return old
            if old is not None:
                self._drop(old, "replaced by a new connection", send_bye=False)
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=max(0.01, timeout))
        except TimeoutError as exc:
            raise TransferTimeout(f"connect to {peer}: no answer within {timeout} s") from exc
        except OSError as exc:
            raise ConnectionFailed(f"connect to {peer}: {exc.strerror or exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chan = _Channel(sock, peer)
        conn: Connection | None = None
        try:
            nonce = _wire.make_nonce()
            chan.send(_wire.Hello(engine_id=self.id, nonce=nonce), deadline)
            ch = chan.expect(_wire.Challenge, deadline)
            if not _wire.verify_proof(self._token, "server", nonce, ch.engine_id, ch.proof):
                raise HandshakeError(f"peer {peer} could not prove it knows the token")
            with self._lock:
                self._check_open()
                conn = Connection(self, peer, outbound=True)
                self._by_qpn[conn.qpn] = conn
            own = _wire.proof(self._token, "client", ch.nonce, self.id)
            chan.send(conn._local_info(_wire.Info, own), deadline)
            acc = chan.expect(_wire.Accept, deadline)
            conn._establish(acc)
            chan.send(_wire.Ready(), deadline)
            with self._lock:
                self._check_open()
                self._adopt(conn, chan)
            log.debug("connected to %r", conn)
            return conn
        except BaseException:
            with self._lock:
                if conn is not None:
                    self._by_qpn.pop(conn.qpn, None)
                    conn._destroy()
            sock.close()
            raise

    def _adopt(self, conn: Connection, chan: _Channel) -> None:
        """Make a handshaken connection live: index it and watch its control socket."""
        if len(self._conns) >= self._max_peers:
            raise ConnectionFailed(
                f"engine {self.id} already has {len(self._conns)} peers "
                f"(max_peers={self._max_peers})"
            )
        conn._transition("established")
        conn._sock = chan.sock
        conn._decoder = chan.decoder
        chan.sock.settimeout(5.0)
        self._conns[conn.peer] = conn
        self._selector.register(chan.sock, selectors.EVENT_READ, conn)
        for msg in chan.pending:
            self._on_control(conn, msg)
        # Regions registered or released since the handshake carried ours were announced
        # only to live connections, which this one was not yet: tell the peer now.
        exposed = self._exposed()
        if exposed != conn._sent_regions:
            self._send_control(conn, _wire.encode(_wire.Regions(regions=exposed)))

    def _serve_handshake(self, sock: socket.socket, addr: Any) -> None:
        """Server side of the handshake, in its own short-lived thread."""
        deadline = time.monotonic() + self._handshake_timeout
        chan = _Channel(sock, f"{addr[0]}:{addr[1]}")
        conn: Connection | None = None
        try:
            hello = chan.expect(_wire.Hello, deadline)
            chan.peer = hello.engine_id
            nonce = _wire.make_nonce()
            chan.send(
                _wire.Challenge(
                    engine_id=self.id,
                    nonce=nonce,
                    proof=_wire.proof(self._token, "server", hello.nonce, self.id),
                ),
                deadline,
            )
            info = chan.expect(_wire.Info, deadline)
            if not _wire.verify_proof(self._token, "client", nonce, hello.engine_id, info.proof):
                chan.refuse(_wire.ErrorCode.AUTH, "authentication failed")
                raise HandshakeError(f"peer {hello.engine_id} failed authentication")
            with self._lock:
                self._check_open()
                old = self._conns.get(hello.engine_id)
                if old is not None and old.state is ConnState.READY and old._sock is not None:
                    # A peer that disconnects and reconnects at once: its goodbye (or EOF)
                    # may be waiting unread on the old control socket.  Read it first.
                    self._read_control(old)
                if old is not None and old.state is ConnState.READY:
                    chan.refuse(
                        _wire.ErrorCode.ALREADY_CONNECTED,
                        f"{hello.engine_id} is already connected to {self.id}",
                    )
                    raise ConnectionFailed(f"peer {hello.engine_id} is already connected")
                if old is not None:
                    self._drop(old, "replaced by a new connection", send_bye=False)
                conn = Connection(self, hello.engine_id, outbound=False)
                self._by_qpn[conn.qpn] = conn
            conn._establish(info)
            chan.send(conn._local_info(_wire.Accept, b""), deadline)
            chan.expect(_wire.Ready, deadline)
            with self._lock:
                self._check_open()
                self._adopt(conn, chan)
            log.debug("accepted %r", conn)
        except Exception as exc:  # noqa: BLE001 - a bad peer must never stop the listener
            log.info("handshake from %s rejected: %s", chan.peer, exc)
            if isinstance(exc, HandshakeError) and chan.decoder.error_code is not None:
                chan.refuse(chan.decoder.error_code, str(exc))
            with self._lock:
                if conn is not None and self._conns.get(conn.peer) is not conn:
                    self._by_qpn.pop(conn.qpn, None)
                    conn._destroy()
            sock.close()
        finally:
            self._handshakes.release()

    def disconnect(self, peer: str) -> None:
        """Close the connection to ``peer``; its pending transfers fail.  Unknown peers: no-op."""
        with self._lock:
            conn = self._conns.get(peer)
            if conn is not None:
                self._drop(conn, f"disconnected by {self.id}", send_bye=True)

    def connection(self, peer: str) -> Connection:
        """The connection to ``peer``; :class:`ConnectionFailed` if there is none."""
        conn = self._conns.get(peer)  # one dict lookup is atomic: no lock on the hot path
        if conn is None:
            with self._lock:
                known = sorted(self._conns)
            raise ConnectionFailed(f"not connected to {peer!r} (connected: {known})")
        return conn

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
    ) -> None:
        """Mark ``conn`` failed: flush its queue pair and fail its pending transfers.

        The connection is FAILED before any handle finishes, so a caller woken by
        its handle already sees the state.  ``culprit`` (the transfer that caused
        the failure) gets ``error``; every other pending transfer gets
        :class:`ConnectionFailed` naming ``reason``.  ``expected`` (a peer's
        orderly goodbye) logs at INFO instead of WARNING.
        """
        if conn.state in (ConnState.FAILED, ConnState.CLOSED):
            if culprit is not None and error is not None:
                culprit._finish(error)
                self._handles.discard(culprit)
            return
        conn._transition("fail")
        conn.failure = reason
        log.log(
            logging.INFO if expected else logging.WARNING,
            "connection to %s failed: %s",
            conn.peer,
            reason,
        )
        if culprit is not None and error is not None:
            culprit._finish(error)
            self._handles.discard(culprit)
        try:
            conn._qp.to_error()
        except HixlError as exc:
            log.debug("moving qp of %s to ERR failed: %s", conn.peer, exc)
        self._fail_pending(conn, ConnectionFailed(f"connection to {conn.peer} failed: {reason}"))

    def _fail_pending(self, conn: Connection, error: HixlError) -> None:
        handles = {c.handle for c in list(conn._inflight.values()) + list(conn._backlog)}
        for chunk in list(conn._inflight.values()) + list(conn._backlog):
            self._release_notify(chunk)
        conn._inflight.clear()
        conn._backlog.clear()
        conn._sq_used = 0
        for h in handles:
            if h is not None:
                h._finish(error)
                self._handles.discard(h)

    def _drop(self, conn: Connection, reason: str, *, send_bye: bool) -> None:
        """Close ``conn`` for good and forget it (caller holds the lock)."""
        if send_bye and conn._sock is not None and conn.state is ConnState.READY:
            with contextlib.suppress(OSError):
                conn._sock.sendall(_wire.encode(_wire.Bye(reason=_printable(reason, 1000))))
        if conn.state is ConnState.READY:
            with contextlib.suppress(HixlError):
                conn._qp.to_error()
        self._fail_pending(conn, ConnectionFailed(f"connection to {conn.peer} closed: {reason}"))
        conn._transition("close")
        if conn._sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn._sock)
        self._by_qpn.pop(conn.qpn, None)
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]
        conn._destroy()

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
        """
        self.put_async(
            peer,
            local,
            remote,
            local_desc=local_desc,
            remote_desc=remote_desc,
            notify=notify,
            notify_message=notify_message,
            timeout=timeout,
        ).wait()

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

        Errors as for :meth:`put`.  ``local`` needs ``Access.LOCAL_WRITE``.
        """
        self.get_async(
            peer, local, remote, local_desc=local_desc, remote_desc=remote_desc, timeout=timeout
        ).wait()

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
        """Start a put (see :meth:`put`); return its :class:`TransferHandle`."""
        req = TransferRequest(
            op="write", local=local, remote=remote, local_desc=local_desc, remote_desc=remote_desc
        )
        return self.transfer_async(
            peer, [req], notify=notify, notify_message=notify_message, timeout=timeout
        )

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
        """Start a get (see :meth:`get`); return its :class:`TransferHandle`."""
        req = TransferRequest(
            op="read", local=local, remote=remote, local_desc=local_desc, remote_desc=remote_desc
        )
        return self.transfer_async(peer, [req], timeout=timeout)

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
        self.transfer_async(
            peer, requests, notify=notify, notify_message=notify_message, timeout=timeout
        ).wait()

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
        """
        if timeout <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        if not requests and notify is None:
            raise ArgumentError("empty transfer: no requests and no notification")
        payload = _notify_payload(notify, notify_message) if notify is not None else None
        self._check_open()
        conn = self.connection(peer)
        conn._check_ready()
        # Validation, planning and building read only immutable values (regions' keys,
        # the peer's announced region tuple), so they run without the engine lock; the
        # progress thread keeps reaping completions meanwhile.
        wrs: list[_verbs.SendRequest] = []
        nbytes = 0
        for i, req in enumerate(requests):
            built, n = self._build(conn, req, i)
            wrs.extend(built)
            nbytes += n
        with self._lock:
            self._check_open()
            conn._check_ready()
            handle = TransferHandle(peer, nbytes, len(wrs), time.monotonic() + timeout)
            chunks = [_Chunk(wrs[i : i + _CHUNK], handle) for i in range(0, len(wrs), _CHUNK)]
            if payload is not None:
                slot = self._take_notify_slot()
                start = slot * _NOTIFY_SLOT
                self._notify_buf[start : start + len(payload)] = np.frombuffer(payload, np.uint8)
                send = _verbs.SendRequest(
                    0,
                    _verbs.WR_SEND,
                    [(self._notify_mr.addr + start, len(payload), self._notify_mr.lkey)],
                )
                chunks.append(_Chunk([send], handle, slot))
            handle._chunks_left = len(chunks)
            for chunk in chunks:
                chunk.wr_id = self._next_wr
                self._next_wr += 1
                conn._backlog.append(chunk)
            self._handles.add(handle)
            self._pump(conn)
        return handle

    def notify(self, peer: str, name: str, message: bytes = b"", timeout: float = 10.0) -> None:
        """Send a notification to ``peer`` alone (after everything posted before it)."""
        self.transfer(peer, [], notify=name, notify_message=message, timeout=timeout)

    def _build(
        self, conn: Connection, req: TransferRequest, index: int
    ) -> tuple[list[_verbs.SendRequest], int]:
        """Check one request against regions and policy, and plan its work requests."""
        where = f"request {index}"
        if req.op not in ("write", "read"):
            raise ArgumentError(f"{where}: op must be 'write' or 'read', not {req.op!r}")
        op = Op.WRITE if req.op == "write" else Op.READ
        local = req.local
        if not isinstance(local, Region) or local._engine is not self or local.closed:
            raise RegistrationError(
                f"{where}: local memory is not a region registered with this engine: {local!r}"
            )
        if op is Op.READ and not local.access & Access.LOCAL_WRITE:
            raise RegistrationError(
                f"{where}: get needs a local region with LOCAL_WRITE access; {local!r}"
            )
        remote = self._resolve_remote(conn, req.remote, where)
        need = _wire.REMOTE_WRITE if op is Op.WRITE else _wire.REMOTE_READ
        if not remote.access & need:
            verb = "writable" if op is Op.WRITE else "readable"
            raise RegistrationError(
                f"{where}: peer region {remote.name or hex(remote.addr)} "
                f"(length={remote.length}) is not remotely {verb}"
            )
        ldesc, rdesc = req.local_desc, req.remote_desc
        # Checks and plan depend only on this key, and KV transfers repeat the same
        # layouts layer after layer, so they are done once per key.  Descriptors that
        # cannot be hashed (block lists hold arrays) are planned every time.
        key = (op, ldesc, rdesc, local.length, remote.length)
        try:
            cached = self._plans.get(key)
            hashable = True
        except TypeError:
            cached, hashable = None, False
        if cached is None:
            cached = self._plan(ldesc, rdesc, op, local.length, remote.length, where)
            if hashable:
                if len(self._plans) >= _PLAN_CACHE:
                    self._plans.clear()
                self._plans[key] = cached
        wrs, nbytes = cached
        opcode = _verbs.WR_RDMA_WRITE if op is Op.WRITE else _verbs.WR_RDMA_READ
        laddr, lkey, raddr, rkey = local.addr, local._mr.lkey, remote.addr, remote.rkey
        send = _verbs.SendRequest
        out = [
            send(
                0, opcode, [(laddr + o, n, lkey) for o, n in sges], raddr + roff, rkey, None, False
            )
            for roff, sges in wrs
        ]
        return out, nbytes

    def _plan(
        self,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        op: Op,
        local_len: int,
        remote_len: int,
        where: str,
    ) -> tuple[list[tuple[int, list[tuple[int, int]]]], int]:
        """Bounds, alignment and the plan of one request, as ``(work requests, bytes)``."""
        if ldesc is None and rdesc is None:
            ldesc = ContiguousDesc(offset=0, nbytes=local_len, alignment=None)
            rdesc = ldesc
        elif ldesc is None:
            assert rdesc is not None
            ldesc = ContiguousDesc(offset=0, nbytes=as_segments(rdesc).nbytes, alignment=None)
        elif rdesc is None:
            rdesc = ContiguousDesc(offset=0, nbytes=as_segments(ldesc).nbytes, alignment=None)
        check_bounds(ldesc, local_len, what=f"{where}: local")
        check_bounds(rdesc, remote_len, what=f"{where}: remote")
        if self.alignment:
            check_alignment(ldesc, 0, self.alignment, what=f"{where}: local")
            check_alignment(rdesc, 0, self.alignment, what=f"{where}: remote")
        plan = plan_transfer(ldesc, rdesc, op, self.limits)
        return list(plan.wrs()), plan.nbytes

    def _resolve_remote(
        self, conn: Connection, remote: RemoteRegion | str, where: str
    ) -> RemoteRegion:
        if isinstance(remote, str):
            return conn.remote_region(remote)
        if isinstance(remote, RemoteRegion) and remote in conn._remote:
            return remote
        raise RegistrationError(
            f"{where}: remote memory {remote!r} is not a region peer {conn.peer} exposes"
        )

    def _take_notify_slot(self) -> int:
        if not self._free_notify:
            raise StateError(f"{_SEND_NOTIFY_SLOTS} notifications already in flight")
        return self._free_notify.pop()

    def _release_notify(self, chunk: _Chunk) -> None:
        if chunk.notify_slot is not None:
            self._free_notify.append(chunk.notify_slot)
            chunk.notify_slot = None

    def _pump(self, conn: Connection) -> None:
        """Post backlogged chunks while the send queue has room (caller holds the lock)."""
        while conn._backlog and conn.state is ConnState.READY:
            chunk = conn._backlog[0]
            n = len(chunk.requests)
            if conn._sq_used + n > self._sq_depth:
                return
            try:
                conn._qp.post_send(chunk.requests, chunk.wr_id)
            except HixlError as exc:
                self._fail(conn, f"post_send failed: {exc}", exc, culprit=chunk.handle)
                return
            conn._backlog.popleft()
            conn._sq_used += n
            conn._inflight[chunk.wr_id] = chunk

    # -- notifications -------------------------------------------------------------------
    def notifications(self) -> list[Notification]:
        """Take every notification received so far (oldest first)."""
        with self._lock:
            out = list(self._notes)
            self._notes.clear()
            return out

    def wait_notification(self, name: str, timeout: float, peer: str | None = None) -> Notification:
        """Wait up to ``timeout`` s for a notification called ``name`` (from ``peer``).

        The matching notification is taken out of the queue; others stay.
        Raises :class:`TransferTimeout` when none arrives in time.
        """
        deadline = time.monotonic() + timeout
        with self._notify_cv:
            while True:
                for note in self._notes:
                    if note.name == name and (peer is None or note.peer == peer):
                        self._notes.remove(note)
                        return note
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._notify_cv.wait(left)
        raise TransferTimeout(
            f"no notification {name!r}{' from ' + peer if peer else ''} within {timeout} s"
        )

    # -- progress ------------------------------------------------------------------------
    def _progress_step(self, idle: float) -> bool:
        """One round of the progress thread; True when there was work to do.

        With completion events the thread sleeps in the selector until a completion,
        control traffic or the next deadline check; ``idle`` (the polling back-off)
        only matters without them.
        """
        busy = False
        try:
            with self._lock:
                if self._closed:
                    return False
                if self._event_cqs:
                    busy = self._poll_events()
                else:
                    busy |= self._poll_send() > 0
                    busy |= self._poll_recv() > 0
                now = time.monotonic()
                if now >= self._next_expiry_check:
                    self._expire(now)
                    self._next_expiry_check = now + 0.01
                if busy:
                    timeout = 0.0
                elif self._event_cqs:
                    timeout = _SLEEP_PENDING if self._handles else _SLEEP_IDLE
                else:
                    timeout = idle
            events = self._selector.select(timeout=timeout)
            for key, _ in events:
                data = key.data
                if data is None:
                    self._accept()
                elif data is _WAKE:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                elif isinstance(data, _verbs.CompletionQueue):
                    with self._lock:
                        if data.take_event():
                            self._armed.discard(data)
                    busy = True
                else:
                    self._read_control(data)
                    busy = True
        except (OSError, ValueError, KeyError) as exc:
            if not self._stop.is_set():
                log.debug("progress loop: %s", exc)
        except HixlError as exc:
            log.warning("progress loop: %s", exc)
        return busy

    def _poll_events(self) -> bool:
        """Poll the CQs that may hold something, arm the drained ones.  True if more is queued.

        An armed CQ whose event has not fired holds nothing new, so it is skipped.  A CQ
        that a poll drains (fewer than a full batch) is armed at once and polled once more,
        for what completed before the arming; after that the thread may sleep.
        """
        busy = False
        for cq, poll in ((self._send_cq, self._poll_send), (self._recv_cq, self._poll_recv)):
            if cq in self._armed:
                continue
            if poll() == _POLL_BATCH:
                busy = True  # maybe more queued: poll again before arming
                continue
            cq.arm()
            self._armed.add(cq)
            if poll() == _POLL_BATCH:
                self._armed.discard(cq)  # more may be queued from before the arming
                busy = True
        return busy

    def _poll_send(self) -> int:
        """Handle up to a batch of send completions; return how many there were."""
        wcs = self._send_cq.poll(_POLL_BATCH)
        for wc in wcs:
            conn = self._by_qpn.get(wc.qp_num)
            if conn is None:
                continue
            chunk = conn._inflight.pop(wc.wr_id, None)
            if chunk is None:
                continue  # completion of a chunk that was already failed
            conn._sq_used -= len(chunk.requests)
            op = "RDMA transfer" if chunk.notify_slot is None else "notification"
            self._release_notify(chunk)
            handle = chunk.handle
            if not wc.ok:
                err = _completion_error(op, wc, conn.peer)
                self._fail(conn, f"completion error {wc.status_name}", err, culprit=handle)
                continue
            if handle is not None:
                handle._chunks_left -= 1
                if handle._chunks_left == 0:
                    handle._finish(None)
                    self._handles.discard(handle)
            self._pump(conn)
        return len(wcs)

    def _poll_recv(self) -> int:
        """Handle up to a batch of receive completions; return how many there were."""
        wcs = self._recv_cq.poll(_POLL_BATCH)
        for wc in wcs:
            conn = self._by_qpn.get(wc.qp_num)
            if conn is None:
                continue
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
            slot = wc.wr_id
            start = slot * _NOTIFY_SLOT
            raw = bytes(conn._recv_buf[start : start + min(wc.byte_len, _NOTIFY_SLOT)])
            note = _parse_notification(conn.peer, raw)
            if live:
                try:
                    conn._post_recv(slot)
                except HixlError as exc:
                    self._fail(conn, f"re-posting a receive failed: {exc}")
            if note is None:
                log.warning("dropped a malformed notification from %s", conn.peer)
                continue
            self._notes.append(note)
            self._notify_cv.notify_all()
        return len(wcs)

    def _expire(self, now: float) -> None:
        for h in [h for h in self._handles if h.deadline <= now]:
            err = TransferTimeout(
                f"transfer to {h.peer} did not complete within its deadline "
                f"({h.nbytes} bytes, {h.num_wrs} work requests); the connection is marked "
                "failed because its requests cannot be recalled"
            )
            conn = self._conns.get(h.peer)
            if conn is not None:
                self._fail(conn, "a transfer timed out", err, culprit=h)
            else:
                h._finish(err)
                self._handles.discard(h)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        if not self._handshakes.acquire(blocking=False):
            sock.close()  # too many handshakes at once; the peer may retry
            return
        sock.setblocking(True)
        threading.Thread(
            target=self._serve_handshake,
            args=(sock, addr),
            daemon=True,
            name=f"hixl-handshake-{addr[0]}:{addr[1]}",
        ).start()

    def _read_control(self, conn: Connection) -> None:
        assert conn._sock is not None and conn._decoder is not None
        try:
            data = conn._sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            data = b""
            log.debug("control socket of %s: %s", conn.peer, exc)
        with self._lock:
            if not data:
                self._selector.unregister(conn._sock)
                self._fail(conn, "peer closed the control connection (process gone?)")
                return
            try:
                msgs = conn._decoder.feed(data)
            except HandshakeError as exc:
                self._selector.unregister(conn._sock)
                self._fail(conn, f"malformed control message: {exc}")
                return
            for msg in msgs:
                self._on_control(conn, msg)

    def _on_control(self, conn: Connection, msg: _wire.Message) -> None:
        if isinstance(msg, _wire.Regions):
            conn._remote = msg.regions
        elif isinstance(msg, _wire.Bye):
            self._poll_recv()  # notifications the peer sent before its goodbye come first
            if conn._sock is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(conn._sock)
            self._fail(conn, f"peer said goodbye: {msg.reason}", expected=True)
        elif isinstance(msg, _wire.Notify):
            self._notes.append(Notification(conn.peer, msg.name, msg.message))
            self._notify_cv.notify_all()
        elif isinstance(msg, _wire.Error):
            self._fail(conn, f"peer reported {msg.code}: {msg.message}")
        else:
            self._fail(conn, f"unexpected {type(msg).__name__} on the control channel")


def _progress_loop(engine_ref: weakref.ref[Engine], stop: threading.Event) -> None:
    """Body of an engine's progress thread: rounds with an idle back-off of up to 2 ms."""
    idle = 0.0
    while not stop.is_set():
        engine = engine_ref()
        if engine is None:
            return
        busy = engine._progress_step(idle)
        del engine
        idle = 0.0 if busy else min(_IDLE_MAX, idle * 2 + 0.00005)


def _printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with anything the wire refuses replaced."""
    return "".join(c if c.isprintable() or c in "\t\n" else "?" for c in text[:limit])


def _completion_error(op: str, wc: _verbs.Completion, peer: str) -> HixlError:
    from hixl.errors import CompletionError

    return CompletionError(f"{op} to {peer}", wc.status, wc.status_name, wc.wr_id, wc.vendor_err)


def _notify_payload(name: str, message: bytes) -> bytes:
    if not isinstance(name, str) or not name or len(name) > _MAX_NOTIFY_NAME or "\0" in name:
        raise ArgumentError(
            f"notification name must be 1..{_MAX_NOTIFY_NAME} characters without NUL, got {name!r}"
        )
    raw = name.encode() + b"\0" + bytes(message)
    if len(raw) > _NOTIFY_SLOT:
        raise ArgumentError(
            f"notification too large: name+message={len(raw)} bytes, at most {_NOTIFY_SLOT}"
        )
    return raw


def _parse_notification(peer: str, raw: bytes) -> Notification | None:
    name, sep, message = raw.partition(b"\0")
    if not sep or not name:
        return None
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return None
    return Notification(peer, text, message)


class _Channel:
    """Blocking framed messaging over the handshake socket, with deadlines."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.decoder = _wire.Decoder(max_payload=1 << 20)
        self.pending: deque[_wire.Message] = deque()

    def send(self, msg: _wire.Message, deadline: float) -> None:
        self._timeout(deadline)
        self.sock.sendall(_wire.encode(msg))

    def _timeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"handshake with {self.peer} exceeded its deadline")
        self.sock.settimeout(left)

    def recv(self, deadline: float) -> _wire.Message:
        while not self.pending:
            self._timeout(deadline)
            try:
                data = self.sock.recv(65536)
            except TimeoutError as exc:
                raise TransferTimeout(f"handshake with {self.peer}: no answer in time") from exc
            if not data:
                self.decoder.eof()
                raise ConnectionFailed(f"{self.peer} closed the connection during the handshake")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.popleft()

    def expect(self, kind: type[Any], deadline: float) -> Any:
        msg = self.recv(deadline)
        if isinstance(msg, _wire.Error):
            raise ConnectionFailed(f"{self.peer} refused: {msg.code}: {msg.message}")
        return _wire.expect(msg, kind)

    def refuse(self, code: Any, message: str) -> None:
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(
                _wire.encode(_wire.Error(code=code, message=_printable(message, 1000)))
            )
        except (OSError, HixlError):
            pass
