"""The ``Hixl`` object: Huawei hixl's engine calls on top of :class:`hixl.Engine`.

Theory of operation
-------------------
One :class:`Hixl` owns one :class:`hixl.Engine`, built with the alignment
policy off (hixl callers pass arbitrary addresses).  ``register_mem``
registers ``(addr, len)`` with remote read and write access, as hixl exposes
every registered region to its peers; MEM_DEVICE memory is host memory here.

A transfer's descs are checked in full first.  Descs whose local memory is
registered are grouped per (local region, peer region) pair into one engine
batch; descs whose local memory is not registered go through the buffer
pool (:mod:`hixl.compat._pool`), as hixl does.  Peer memory must always be
registered.

Links come from ``connect``, from ``connect_async`` (worker threads, see
:mod:`hixl.compat._connect`), or implicitly on first use when the
``AutoConnect`` option or a ``GlobalResourceConfig`` channel pool asks for it.
With a channel pool, idle links are closed at the high waterline and no more
than ``max_channel`` links exist.

Lock: ``Hixl._lock`` guards the handle, request and link-use tables only.
It is never held across an engine call that may do socket I/O or wait
(register, deregister, connect, disconnect, transfer, notify).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hixl import Access, ConnState, Engine, Region, TransferHandle, TransferRequest
from hixl import TransferStatus as _EngineStatus
from hixl.compat._connect import ConnectExecutor
from hixl.compat._descs import checked_desc, group_op_descs
from hixl.compat._notify import ENVELOPE_NAME, check_notify, encode_notify, open_envelope
from hixl.compat._options import (
    CompatOptions,
    Refusal,
    engine_id_for,
    parse_options,
    status_of,
)
from hixl.compat._pool import MIB, BufferPool, run_relay
from hixl.compat._types import (
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    Status,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
)
from hixl.errors import ArgumentError, HixlError, RegistrationError, StateError, VerbsError

__all__ = ["Hixl", "get_capability"]

log = logging.getLogger("hixl.compat")

_AUTO_CONNECT_TIMEOUT_S = 3.0  # hixl's kConnectWhenTransferTimeout (3000 ms)
_MAX_NOTIFY_QUEUE = 4096  # hixl's kMaxNotifyQueueSize
_MAX_PENDING = 65536  # asynchronous requests alive at once
_ENGINE_MAX_PEERS = 64  # the engine's default link table size


def get_capability(feature_type: object, /) -> tuple[Status, int]:
    """``(status, FEATURE_SUPPORTED | FEATURE_NOT_SUPPORTED)`` for ``feature_type``.

    Auto connect and client/server communication are supported; other
    non-negative values are not; a negative or non-int value is PARAM_INVALID.
    """
    if not isinstance(feature_type, int) or isinstance(feature_type, bool) or feature_type < 0:
        return Status.PARAM_INVALID, FEATURE_NOT_SUPPORTED
    supported = int(feature_type) in {int(f) for f in FeatureType}
    return Status.SUCCESS, FEATURE_SUPPORTED if supported else FEATURE_NOT_SUPPORTED


class _Job:
    """An asynchronous relay on a worker thread; looks like a :class:`TransferHandle`."""

    def __init__(self) -> None:
        self.status = _EngineStatus.PENDING
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.status = _EngineStatus.DONE if error is None else _EngineStatus.FAILED


@dataclass(slots=True)
class _Pending:
    parts: list[TransferHandle | _Job]
    user_data: int
    peer: str

    def state(self) -> tuple[_EngineStatus, BaseException | None]:
        for part in self.parts:
            if part.status is _EngineStatus.FAILED:
                return _EngineStatus.FAILED, part.error
        if any(part.status is _EngineStatus.PENDING for part in self.parts):
            return _EngineStatus.PENDING, None
        return _EngineStatus.DONE, None


@dataclass(slots=True)
class _Plan:
    """A checked transfer: engine requests for registered memory, relay descs for the rest."""

    kind: str
    direct: list[TransferRequest]
    relay: list[tuple[int, int, int]] = field(default_factory=list)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _timeout_s(call: str, timeout_in_millis: object) -> float:
    if (
        not isinstance(timeout_in_millis, int | float)
        or isinstance(timeout_in_millis, bool)
        or not math.isfinite(timeout_in_millis)
        or timeout_in_millis <= 0
    ):
        raise ArgumentError(f"{call}: timeout_in_millis must be > 0, got {timeout_in_millis!r}")
    return float(timeout_in_millis) / 1000.0


def _op_kind(op: object) -> str:
    try:
        kind = TransferOp(op)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ArgumentError(f"op must be TransferOp.READ or TransferOp.WRITE, got {op!r}") from None
    return "read" if kind is TransferOp.READ else "write"


def _peer(remote_engine: object) -> str:
    if not isinstance(remote_engine, str) or not remote_engine:
        raise ArgumentError(f"remote_engine must be a non-empty str, got {remote_engine!r}")
    return remote_engine


class Hixl:
    """One hixl instance: call :meth:`initialize` first and :meth:`finalize` last.

    Every method returns a status code (or ``(status, value)``) and never
    raises for a failure; :attr:`last_error` holds the reason of the latest
    one.  Methods may be called from several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._engine: Engine | None = None
        self._options = CompatOptions()
        self._handles: dict[int, Region] = {}
        self._next_handle = 1
        self._outbound: set[str] = set()  # peers this side connected to
        self._pending: dict[int, _Pending] = {}
        self._next_req = 1
        self._busy: Counter[str] = Counter()  # transfers in progress per peer
        self._last_use: dict[str, float] = {}
        self._pool: BufferPool | None = None
        self._relays: ThreadPoolExecutor | None = None
        self._connector: ConnectExecutor | None = None
        self._notes: deque[NotifyDesc] = deque()
        self._device_noted = False
        self.last_error = ""

    # -- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> Hixl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is not None:
            warnings.warn(
                "hixl.compat.Hixl collected without finalize(); finalizing now",
                ResourceWarning,
                stacklevel=2,
            )
            with contextlib.suppress(Exception):
                self.finalize()

    def __repr__(self) -> str:
        state = "uninitialized" if self._engine is None else f"engine={self._engine.id}"
        return f"<hixl.compat.Hixl {state} mems={len(self._handles)} pending={len(self._pending)}>"

    @property
    def engine_id(self) -> str | None:
        """The id peers know this instance by (a client's has a ``~suffix``), or None."""
        engine = self._engine
        return None if engine is None else str(engine.id)

    @property
    def engine(self) -> Engine | None:
        """The underlying :class:`hixl.Engine` (None before ``initialize``), for native calls."""
        return self._engine

    @property
    def options(self) -> CompatOptions:
        """The options as ``initialize`` understood them."""
        return self._options

    @property
    def buffer_pool(self) -> BufferPool | None:
        """The staging pool (None when turned off with ``BufferPool="0:0"`` or before init)."""
        return self._pool

    def _fail(self, call: str, exc: BaseException) -> Status:
        code = status_of(exc)
        self.last_error = f"{call}: {exc}"
        if isinstance(exc, HixlError | ValueError | TypeError | OSError):
            log.warning("%s -> %s: %s", call, code.name, exc)
        else:  # not an expected failure: keep the traceback for the bug report
            log.error("%s -> %s: unexpected %r", call, code.name, exc, exc_info=exc)
        return code

    def _require(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise Refusal(Status.FAILED, "not initialized: call initialize() first")
        return engine

    def initialize(self, local_engine: str, options: Mapping[str, str] | None = None) -> Status:
        """Create the engine named by ``local_engine`` (``"ip:port"`` listens, ``"ip"`` connects).

        Returns SUCCESS (also when already initialized: the call is then
        ignored), PARAM_INVALID for a bad id or option, UNSUPPORTED for an
        option that asks for an Ascend-only feature, FAILED when no verbs
        device is usable or the address cannot be bound.
        """
        try:
            with self._lock:
                if self._engine is not None:
                    log.info("initialize: already initialized, ignoring repeated call")
                    return Status.SUCCESS
                opts = parse_options(options)
                engine_id = engine_id_for(local_engine)
                for note in opts.notes:
                    log.warning("initialize: %s", note)
                for key in opts.unknown:
                    log.warning("initialize: unknown option %r ignored", key)
                max_peers = _ENGINE_MAX_PEERS
                if opts.channel_pool is not None:
                    max_peers = min(opts.channel_pool.max_channel, _ENGINE_MAX_PEERS)
                engine = Engine(
                    engine_id,
                    device=opts.device,
                    token=opts.token,
                    alignment=opts.alignment,
                    max_peers=max_peers,
                    gil_switch_interval=opts.gil_switch_interval,
                )
                self._engine, self._options = engine, opts
                if opts.buffer_pool is not None:
                    num, size_mib = opts.buffer_pool
                    self._pool = BufferPool(engine, num, size_mib * MIB)
                self._connector = ConnectExecutor(opts.connect_threads, opts.connect_queue)
                self._device_noted = False
                log.debug("initialized %s as engine %s", local_engine, engine.id)
                return Status.SUCCESS
        except Exception as exc:
            return self._fail("initialize", exc)

    def finalize(self) -> None:
        """Close every link, release registrations and the engine.  Safe to call twice.

        Pending asynchronous transfers fail; their ids are forgotten.
        ``initialize`` may be called again afterwards.
        """
        with self._lock:
            engine, self._engine = self._engine, None
            pool, self._pool = self._pool, None
            relays, self._relays = self._relays, None
            connector, self._connector = self._connector, None
            self._handles.clear()
            self._outbound.clear()
            self._pending.clear()
            self._busy.clear()
            self._last_use.clear()
            self._notes.clear()
        if pool is not None:
            pool.close()
        if engine is not None:
            try:
                engine.close()  # fails pending transfers, so relay workers finish promptly
            except Exception as exc:  # noqa: BLE001 - finalize reports nothing, never raises
                self._fail("finalize", exc)
        if relays is not None:
            relays.shutdown(wait=True, cancel_futures=True)
        if connector is not None:
            connector.shutdown(timeout=10.0)

    # -- memory --------------------------------------------------------------------------
    def register_mem(self, mem_desc: MemDesc, mem_type: MemType, /) -> tuple[Status, int]:
        """Register ``mem_desc.len`` bytes at ``mem_desc.addr``; return ``(status, handle)``.

        The memory is exposed to peers for remote read and write (unless the
        hixl.compat extra ``mem_desc.local_only``).  Registering the same
        range again returns the same handle.  MEM_DEVICE memory is host
        memory here (there is no device memory): it is registered as such,
        noted once at INFO.  Memory the verbs device refuses to register
        gives PARAM_INVALID with the device's reason in ``last_error``.  The
        handle is 0 on failure.
        """
        try:
            engine = self._require()
            addr = getattr(mem_desc, "addr", None)
            length = getattr(mem_desc, "len", None)
            if (
                not isinstance(addr, int)
                or not isinstance(length, int)
                or isinstance(addr, bool)
                or isinstance(length, bool)
                or addr <= 0
                or length <= 0
            ):
                raise ArgumentError(
                    f"mem_desc needs int addr > 0 and len > 0, got addr={addr!r} len={length!r}"
                )
            try:
                kind = MemType(mem_type)
            except (ValueError, TypeError):
                raise ArgumentError(f"mem_type must be a MemType, got {mem_type!r}") from None
            access = (
                Access.LOCAL_WRITE
                if getattr(mem_desc, "local_only", False)
                else Access.REMOTE_READ | Access.REMOTE_WRITE
            )
            try:
                region = engine.register((addr, length), access=access)
            except VerbsError as exc:
                reason = errno.errorcode.get(exc.errno or 0, "?")
                raise ArgumentError(
                    f"{kind.name} addr={addr:#x} len={length} cannot be registered "
                    f"({reason}): {exc}"
                ) from exc
            if kind is MemType.MEM_DEVICE and not self._device_noted:
                self._device_noted = True
                log.info(
                    "register_mem: MEM_DEVICE addr=%#x len=%d registered as host memory "
                    "(no device memory on this machine; later ones are not logged)",
                    addr,
                    length,
                )
            with self._lock:
                for handle, known in self._handles.items():
                    if known is region:
                        return Status.SUCCESS, handle
                handle = self._next_handle
                self._next_handle += 1
                self._handles[handle] = region
                return Status.SUCCESS, handle
        except Exception as exc:
            return self._fail("register_mem", exc), 0

    def deregister_mem(self, mem_handle: int, /) -> Status:
        """Release the registration ``mem_handle`` from ``register_mem``.

        Returns PARAM_INVALID for 0 or a non-int, SUCCESS for an unknown
        non-zero handle (nothing to do) and for a repeated call.  Peers are
        told the memory is gone; transfers to it then give PARAM_INVALID.
        """
        try:
            engine = self._require()
            if not _is_int(mem_handle) or mem_handle == 0:
                raise ArgumentError(f"mem_handle must be a non-zero int, got {mem_handle!r}")
            with self._lock:
                region = self._handles.pop(mem_handle, None)
            if region is not None:
                engine.deregister(region)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("deregister_mem", exc)

    # -- links ---------------------------------------------------------------------------
    def _make_room(self, engine: Engine, peer: str, deadline: float) -> None:
        """With a channel pool: close idle links at the high mark, respect max_channel."""
        pool = self._options.channel_pool
        if pool is None or peer in engine.peers:
            return
        peers = engine.peers
        if len(peers) >= pool.high_mark:
            with self._lock:
                waiting = {pending.peer for pending in self._pending.values()}
                idle = [p for p in peers if not self._busy[p] and p not in waiting]
                idle.sort(key=lambda p: self._last_use.get(p, 0.0))
            for victim in idle[: max(0, len(peers) - pool.low_mark)]:
                log.info("channel pool: closing idle link to %s (%d links)", victim, len(peers))
                engine.disconnect(victim)
                with self._lock:
                    self._outbound.discard(victim)
                    self._last_use.pop(victim, None)
        while len(engine.peers) >= pool.max_channel:
            if time.monotonic() >= deadline:
                raise Refusal(
                    Status.RESOURCE_EXHAUSTED,
                    f"channel pool full: {len(engine.peers)} links, max_channel="
                    f"{pool.max_channel}, none idle to close",
                )
            time.sleep(0.01)

    def _open_link(self, engine: Engine, peer: str, timeout: float) -> None:
        self._make_room(engine, peer, time.monotonic() + timeout)
        engine.connect(peer, timeout=timeout)
        with self._lock:
            self._outbound.add(peer)
            self._last_use[peer] = time.monotonic()

    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Link to the instance listening at ``remote_engine`` (``"ip:port"``).

        Returns SUCCESS, ALREADY_CONNECTED when this side already has a
        working link to it, PARAM_INVALID for a bad id or timeout, TIMEOUT
        when the handshake does not finish in time, FAILED when the peer
        cannot be reached or refuses, RESOURCE_EXHAUSTED when a channel pool
        is full.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("connect", timeout_in_millis)
            peer = _peer(remote_engine)
            with self._lock:
                mine = peer in self._outbound
            if mine and peer in engine.peers and engine.connection(peer).state is ConnState.READY:
                raise Refusal(Status.ALREADY_CONNECTED, f"already connected to {peer}")
            self._open_link(engine, peer, timeout)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("connect", exc)

    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Close the link to ``remote_engine`` (made by either side).

        Returns SUCCESS, NOT_CONNECTED when there is no link, PARAM_INVALID
        for a bad timeout.  Pending transfers on that link fail.
        """
        try:
            engine = self._require()
            _timeout_s("disconnect", timeout_in_millis)
            peer = _peer(remote_engine)
            with self._lock:
                self._outbound.discard(peer)
                self._last_use.pop(peer, None)
            if peer not in engine.peers:
                raise Refusal(Status.NOT_CONNECTED, f"not connected to {peer}")
            engine.disconnect(peer)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("disconnect", exc)

    def connect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Queue a ``connect``; return at once.  Follow it with ``get_async_connect_status``.

        Returns SUCCESS once queued (status CONNECT_PENDING, then CONNECTING,
        then CONNECTED or CONNECT_FAILED), PARAM_INVALID for a bad timeout,
        RESOURCE_EXHAUSTED when the queue is full, FAILED before initialize.
        """
        return self._submit("connect_async", remote_engine, timeout_in_millis, True)

    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Queue a ``disconnect``; return at once (status DISCONNECT_PENDING,
        DISCONNECTING, then NOT_CONNECT).  Codes as for :meth:`connect_async`."""
        return self._submit("disconnect_async", remote_engine, timeout_in_millis, False)

    def _submit(
        self, call: str, remote_engine: str, timeout_in_millis: int, is_connect: bool
    ) -> Status:
        try:
            self._require()
            _timeout_s(call, timeout_in_millis)
            peer = _peer(remote_engine)
            connector = self._connector
            if connector is None:
                raise Refusal(Status.FAILED, "not initialized: call initialize() first")
            if is_connect:
                code = connector.submit(peer, True, lambda: self.connect(peer, timeout_in_millis))
            else:
                code = connector.submit(
                    peer, False, lambda: self.disconnect(peer, timeout_in_millis)
                )
            if code is not Status.SUCCESS:
                raise Refusal(code, f"{call}: connect pool refused the task ({code.name})")
            return Status.SUCCESS
        except Exception as exc:
            return self._fail(call, exc)

    def get_async_connect_status(self, remote_engine: str, /) -> tuple[Status, AsyncConnectStatus]:
        """``(status, AsyncConnectStatus)`` of the latest async request for ``remote_engine``.

        NOT_CONNECT when there is none (or after a disconnect finished).
        """
        try:
            self._require()
            connector = self._connector
            if connector is None:
                raise Refusal(Status.FAILED, "not initialized: call initialize() first")
            return Status.SUCCESS, connector.status(_peer(remote_engine))
        except Exception as exc:
            return self._fail("get_async_connect_status", exc), AsyncConnectStatus.NOT_CONNECT

    def get_all_async_connect_status(self) -> tuple[Status, dict[str, AsyncConnectStatus]]:
        """``(status, {remote_engine: AsyncConnectStatus})`` for every remote with an entry."""
        try:
            self._require()
            connector = self._connector
            if connector is None:
                raise Refusal(Status.FAILED, "not initialized: call initialize() first")
            return Status.SUCCESS, connector.statuses()
        except Exception as exc:
            return self._fail("get_all_async_connect_status", exc), {}

    def _link(self, engine: Engine, peer: str) -> None:
        """Make sure there is a working link to ``peer``, connecting implicitly if allowed."""
        implicit = self._options.auto_connect or self._options.channel_pool is not None
        if peer in engine.peers:
            conn = engine.connection(peer)
            if conn.state is ConnState.READY:
                return
            if not implicit:
                raise Refusal(
                    Status.FAILED,
                    f"the link to {peer} is {conn.state.name}: {conn.failure}; "
                    "disconnect() and connect() again",
                )
        elif not implicit:
            raise Refusal(
                Status.NOT_CONNECTED,
                f"not connected to {peer} (links: {sorted(engine.peers)}); call connect() first",
            )
        self._open_link(engine, peer, _AUTO_CONNECT_TIMEOUT_S)

    def _plan(self, engine: Engine, peer: str, op: object, op_descs: object) -> _Plan:
        kind = _op_kind(op)
        if not isinstance(op_descs, Sequence) or isinstance(op_descs, str | bytes):
            raise ArgumentError(f"op_descs must be a list of TransferOpDesc, got {op_descs!r}")
        checked = [checked_desc(i, d) for i, d in enumerate(op_descs)]
        if not checked:
            raise ArgumentError("op_descs is empty: nothing to transfer")
        self._link(engine, peer)
        conn = engine.connection(peer)
        direct: list[object] = []
        relay: list[tuple[int, int, int]] = []
        for i, (local_addr, remote_addr, nbytes) in enumerate(checked):
            try:
                conn.find_remote(remote_addr, nbytes)
            except RegistrationError as exc:
                raise RegistrationError(f"op_descs[{i}]: {exc}") from exc
            try:
                engine.find_region(local_addr, nbytes)
                direct.append(op_descs[i])
            except RegistrationError as exc:
                if self._pool is None:
                    raise RegistrationError(
                        f"op_descs[{i}]: {exc}, and the buffer pool is off (BufferPool='0:0')"
                    ) from exc
                relay.append((local_addr, remote_addr, nbytes))
        requests = []
        if direct:
            groups = group_op_descs(
                direct, engine.find_region, conn.find_remote, alignment=engine.alignment
            )
            requests = [
                TransferRequest(
                    op=kind,
                    local=g.local,
                    remote=g.remote,
                    local_desc=g.local_desc,
                    remote_desc=g.remote_desc,
                )
                for g in groups
            ]
        return _Plan(kind, requests, relay)

    def _start(
        self, engine: Engine, peer: str, plan: _Plan, timeout: float
    ) -> list[TransferHandle | _Job]:
        """Post the direct part and start the relayed part on a worker; return both."""
        parts: list[TransferHandle | _Job] = []
        if plan.direct:
            parts.append(engine.transfer_async(peer, plan.direct, timeout=timeout))
        if plan.relay:
            job = _Job()
            pool = self._pool
            if pool is None:
                raise StateError("the buffer pool closed during the call")
            deadline = time.monotonic() + timeout
            conn = engine.connection(peer)

            def relay() -> None:
                try:
                    run_relay(engine, pool, peer, plan.kind, plan.relay, conn.find_remote, deadline)
                except BaseException as exc:  # noqa: BLE001 - reported through the job
                    job.finish(exc)
                else:
                    job.finish(None)
                finally:
                    with self._lock:
                        self._busy[peer] -= 1

            with self._lock:
                if self._relays is None:
                    self._relays = ThreadPoolExecutor(
                        max_workers=max(1, min(4, pool.count)),
                        thread_name_prefix="hixl-compat-relay",
                    )
                self._busy[peer] += 1
                self._relays.submit(relay)
            parts.append(job)
        return parts

    # -- transfers -----------------------------------------------------------------------
    def transfer_sync(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        timeout_in_millis: int = 1000,
    ) -> Status:
        """Move every desc of ``op_descs`` (READ: remote to local, WRITE: local to remote).

        Returns when every byte has landed: SUCCESS; PARAM_INVALID for a bad
        op, timeout or desc, or peer memory no region it registered holds
        (local memory that is not registered goes through the buffer pool,
        unless it is off); NOT_CONNECTED without a link; TIMEOUT when the
        transfer misses its deadline (the link is then unusable: disconnect
        and connect again); FAILED for a completion error or a broken link.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("transfer_sync", timeout_in_millis)
            peer = _peer(remote_engine)
            plan = self._plan(engine, peer, op, op_descs)
            deadline = time.monotonic() + timeout
            with self._lock:
                self._busy[peer] += 1
                self._last_use[peer] = time.monotonic()
            try:
                handle = (
                    engine.transfer_async(peer, plan.direct, timeout=timeout)
                    if plan.direct
                    else None
                )
                try:
                    if plan.relay:
                        pool = self._pool
                        if pool is None:
                            raise StateError("the buffer pool closed during the call")
                        conn = engine.connection(peer)
                        run_relay(
                            engine, pool, peer, plan.kind, plan.relay, conn.find_remote, deadline
                        )
                finally:
                    if handle is not None:
                        handle.wait()
            finally:
                with self._lock:
                    self._busy[peer] -= 1
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("transfer_sync", exc)

    def transfer_async(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        args: TransferArgs | None = None,
    ) -> tuple[Status, int]:
        """Start a transfer as ``transfer_sync`` does; return ``(status, req_id)``.

        Poll ``get_transfer_status(req_id)``.  Errors found before posting are
        returned here (req_id 0) with the codes of ``transfer_sync``.  The
        transfer has a deadline (60 s, hixl.compat option
        ``hixl.AsyncTransferTimeout`` in ms), after which it reports FAILED.
        Relayed parts run on a worker thread; the caller does not wait.
        """
        try:
            engine = self._require()
            peer = _peer(remote_engine)
            user_data = 0 if args is None else getattr(args, "user_data", 0)
            if not _is_int(user_data):
                raise ArgumentError(f"args.user_data must be an int, got {user_data!r}")
            with self._lock:
                if len(self._pending) >= _MAX_PENDING:
                    raise Refusal(
                        Status.RESOURCE_EXHAUSTED,
                        f"{len(self._pending)} asynchronous requests unfinished; poll them first",
                    )
            plan = self._plan(engine, peer, op, op_descs)
            parts = self._start(engine, peer, plan, self._options.async_timeout_ms / 1000.0)
            with self._lock:
                req = self._next_req
                self._next_req += 1
                self._pending[req] = _Pending(parts, int(user_data), peer)
                self._last_use[peer] = time.monotonic()
            return Status.SUCCESS, req
        except Exception as exc:
            return self._fail("transfer_async", exc), 0

    def _report(self, req: int, pending: _Pending) -> tuple[Status, TransferStatus]:
        """State of one request; a finished one is forgotten (caller holds the lock)."""
        state, error = pending.state()
        if state is _EngineStatus.PENDING:
            return Status.SUCCESS, TransferStatus.WAITING
        del self._pending[req]
        if state is _EngineStatus.DONE:
            return Status.SUCCESS, TransferStatus.COMPLETED
        error = error or StateError("transfer failed without an error")
        return self._fail(f"transfer {req} to {pending.peer}", error), TransferStatus.FAILED

    def _drive(self, req_id: int | None) -> None:
        """Before a status read: let the engine post and reap on this thread
        (:meth:`TransferHandle.done` of one pending part of request ``req_id``, or of
        any request for None, called outside this object's lock), so a caller that
        polls the status sees its transfer finish without waiting for the engine's
        progress thread."""
        with self._lock:
            if req_id is None:
                pendings: Iterable[_Pending] = self._pending.values()
            else:
                one = self._pending.get(req_id)
                pendings = () if one is None else (one,)
            part = next(
                (
                    p
                    for pending in pendings
                    for p in pending.parts
                    if isinstance(p, TransferHandle) and p.status is _EngineStatus.PENDING
                ),
                None,
            )
        if part is not None:
            part.done()

    def get_transfer_status(self, req_id: int, /) -> tuple[Status, TransferStatus]:
        """``(status, TransferStatus)`` of the request ``req_id`` from ``transfer_async``.

        WAITING while it runs; COMPLETED (with SUCCESS) once every byte
        landed; FAILED with the failure's code (FAILED, TIMEOUT, ...).  After
        COMPLETED or FAILED the id is released, and asking again (or for an
        unknown id) gives ``(PARAM_INVALID, FAILED)``.
        """
        try:
            self._require()
            if _is_int(req_id):
                self._drive(req_id)
            with self._lock:
                pending = self._pending.get(req_id) if _is_int(req_id) else None
                if pending is None:
                    raise ArgumentError(f"unknown transfer request id {req_id!r}")
                return self._report(req_id, pending)
        except Exception as exc:
            return self._fail("get_transfer_status", exc), TransferStatus.FAILED

    def get_all_transfer_status(
        self, args: GetTransferStatusArgs | None = None
    ) -> tuple[Status, list[TransferResult]]:
        """Every asynchronous request's state, oldest first: ``(status, [TransferResult])``.

        At most ``args.max_query_count`` results; WAITING ones are left out
        with ``args.skip_waiting``.  Finished requests reported here are
        released, as by ``get_transfer_status``.
        """
        try:
            self._require()
            args = args or GetTransferStatusArgs()
            limit, skip = args.max_query_count, args.skip_waiting
            if not _is_int(limit) or limit < 0:
                raise ArgumentError(f"max_query_count must be an int >= 0, got {limit!r}")
            out: list[TransferResult] = []
            self._drive(None)
            with self._lock:
                for req, pending in list(self._pending.items()):
                    if len(out) >= limit:
                        break
                    _, state = self._report(req, pending)
                    if skip and state is TransferStatus.WAITING:
                        continue
                    out.append(TransferResult._make(req, pending.user_data, state))
            return Status.SUCCESS, out
        except Exception as exc:
            return self._fail("get_all_transfer_status", exc), []

    # -- notifications -------------------------------------------------------------------
    def send_notify(
        self, remote_engine: str, notify: NotifyDesc, timeout_in_millis: int = 1000
    ) -> Status:
        """Send ``notify`` to ``remote_engine``; it arrives after all data sent before it.

        Returns SUCCESS; PARAM_INVALID for a bad timeout or a name or message
        over 1024 bytes (hixl's limits); NOT_CONNECTED without a link; TIMEOUT
        or FAILED when it cannot be delivered.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("send_notify", timeout_in_millis)
            peer = _peer(remote_engine)
            name, message = check_notify(notify)
            self._link(engine, peer)
            engine_name, body = encode_notify(name, message)
            engine.notify(peer, engine_name, body, timeout=timeout)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("send_notify", exc)

    def get_notifies(self) -> tuple[Status, list[NotifyDesc]]:
        """Take every notification received so far, oldest first: ``(status, [NotifyDesc])``.

        Messages are decoded as UTF-8 (bad bytes replaced).  At most 4096 wait
        to be taken (hixl's queue size); newer ones beyond that are dropped
        with a warning.
        """
        try:
            engine = self._require()
            notes = engine.notifications()
            with self._lock:
                for note in notes:
                    if note.name == ENVELOPE_NAME:
                        try:
                            desc = NotifyDesc(*open_envelope(note.message))
                        except ValueError as exc:
                            log.warning("dropped a malformed notify from %s: %s", note.peer, exc)
                            continue
                    else:
                        desc = NotifyDesc(note.name, note.message.decode("utf-8", "replace"))
                    if len(self._notes) >= _MAX_NOTIFY_QUEUE:
                        log.warning(
                            "notify queue full (%d): dropped %r from %s",
                            _MAX_NOTIFY_QUEUE,
                            desc.name,
                            note.peer,
                        )
                        continue
                    self._notes.append(desc)
                out = list(self._notes)
                self._notes.clear()
            return Status.SUCCESS, out
        except Exception as exc:
            return self._fail("get_notifies", exc), []
