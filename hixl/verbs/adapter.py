"""The one adapter over verbs: cffi (ABI mode) over the system's ``libibverbs.so.1``.

This module owns every verbs resource the engine uses -- device context, protection
domain, memory regions, completion queues with their channels, RC queue pairs -- and
posts and reaps through the provider's ops table.  The declarations live in
:mod:`hixl.verbs._ffi`, the work-request arrays in :mod:`hixl.verbs.chain`, and the
completion queues in :mod:`hixl.verbs.completions` (their names are re-exported here);
nothing else in hixl calls into libibverbs (pyverbs serves only the tests, as an
independent second binding, and ``hixl doctor``'s probe in a child process).  There is
one data path, in array form, with no Python object per work request:
:meth:`QueuePair.post_chain` posts a :class:`~hixl.verbs.chain.SendChain` and
:meth:`CompletionQueue.poll_array` returns completions as a numpy structured array.

Every failure leaves as :class:`hixl.VerbsError` (with ``op`` and ``errno``) or
:class:`hixl.DeviceError`; completion errors carry their ``ibv_wc_status``.

Lifetimes: a :class:`Device` owns the protection domain and everything made from it.
``Device.close()`` closes queue pairs, memory regions and completion queues (in that
order) before the PD and the context.  Every ``close()`` may be called twice, and an
open device collected by the garbage collector warns with ``ResourceWarning``.

Threads: cffi releases the GIL for every C call, so posting a long chain (which on rxe
runs the whole send side inside ``post_send``) and :meth:`CompletionQueue.wait` let
other Python threads run.  Each object is used under one lock by its caller (the
engine's): the receive request buffer of a queue pair and the completion array of a CQ
are reused from call to call.
"""

from __future__ import annotations

import errno as _errno
import ipaddress
import logging
import os
import socket
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from hixl.errors import ArgumentError, DeviceError, StateError, VerbsError
from hixl.verbs._ffi import POST_RECV, POST_SEND, address, ffi, lib
from hixl.verbs.chain import SEND_SIGNALED, SendChain
from hixl.verbs.completions import (
    WC_REM_ACCESS_ERR,
    WC_STATUS_NAMES,
    WC_SUCCESS,
    WC_WR_FLUSH_ERR,
    Completion,
    CompletionQueue,
    _err,
    _lib,
)

__all__ = [
    "ACCESS_LOCAL_WRITE",
    "ACCESS_REMOTE_READ",
    "ACCESS_REMOTE_WRITE",
    "MTU_BYTES",
    "MTU_ENUM",
    "WC_OPCODE_RECV",
    "WC_OPCODE_RECV_RDMA_WITH_IMM",
    "WC_REM_ACCESS_ERR",
    "WC_STATUS_NAMES",
    "WC_SUCCESS",
    "WC_WR_FLUSH_ERR",
    "WR_RDMA_READ",
    "WR_RDMA_WRITE",
    "WR_RDMA_WRITE_WITH_IMM",
    "WR_SEND",
    "WR_SEND_WITH_IMM",
    "Completion",
    "CompletionQueue",
    "Device",
    "DeviceCaps",
    "MemoryRegion",
    "QueuePair",
    "SendChain",
    "SendRequest",
    "available",
    "device_names",
    "gid_to_str",
    "open_device",
]

log = logging.getLogger("hixl.verbs")

# ibv_mtu enum value <-> bytes.
MTU_BYTES: dict[int, int] = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
MTU_ENUM: dict[int, int] = {v: k for k, v in MTU_BYTES.items()}

# ibv_access_flags.
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4

# ibv_wr_opcode / ibv_wc_opcode.
WR_RDMA_WRITE = 0
WR_RDMA_WRITE_WITH_IMM = 1
WR_SEND = 2
WR_SEND_WITH_IMM = 3
WR_RDMA_READ = 4
WC_OPCODE_RECV = 128
WC_OPCODE_RECV_RDMA_WITH_IMM = 129

# ibv_port_state, ibv_qp_type, ibv_qp_state, ibv_gid_type.
_PORT_ACTIVE = 4
_QPT_RC = 2
_QPS_INIT, _QPS_RTR, _QPS_RTS, _QPS_ERR = 1, 2, 3, 6
_QPS_NAMES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "ERR"}
_GID_TYPE_ROCE_V2 = 2

# ibv_qp_attr_mask bits.
_QP_STATE = 1 << 0
_QP_ACCESS_FLAGS = 1 << 3
_QP_PKEY_INDEX = 1 << 4
_QP_PORT = 1 << 5
_QP_AV = 1 << 7
_QP_PATH_MTU = 1 << 8
_QP_TIMEOUT = 1 << 9
_QP_RETRY_CNT = 1 << 10
_QP_RNR_RETRY = 1 << 11
_QP_RQ_PSN = 1 << 12
_QP_MAX_QP_RD_ATOMIC = 1 << 13
_QP_MIN_RNR_TIMER = 1 << 15
_QP_SQ_PSN = 1 << 16
_QP_MAX_DEST_RD_ATOMIC = 1 << 17
_QP_DEST_QPN = 1 << 20

_WR_SIZE: int = ffi.sizeof("struct ibv_send_wr")


def available() -> tuple[bool, str]:
    """Return ``(True, "")`` when libibverbs loads, else ``(False, reason)``."""
    try:
        lib()
    except OSError as exc:
        return False, f"libibverbs.so.1 cannot be loaded ({exc}); install rdma-core"
    return True, ""


def device_names() -> list[str]:
    """Names of the verbs devices on this machine (``ibv_get_device_list``).

    Raises :class:`DeviceError` when the kernel has no RDMA support at all.
    """
    with _DeviceList() as devs:
        return list(devs)


class _DeviceList:
    """``ibv_get_device_list`` as a context manager: ``{name: struct ibv_device *}``."""

    def __enter__(self) -> dict[str, Any]:
        L = _lib()
        num = ffi.new("int *")
        self._list = L.ibv_get_device_list(num)
        if self._list == ffi.NULL:
            code = ffi.errno
            raise DeviceError(
                f"cannot list verbs devices ({os.strerror(code)}); this kernel may have no "
                "RDMA support. Run 'hixl doctor', or run under 'hixl vm run -- CMD'"
            )
        out = {}
        for i in range(num[0]):
            dev = self._list[i]
            out[ffi.string(L.ibv_get_device_name(dev)).decode()] = dev
        return out

    def __exit__(self, *exc: object) -> None:
        _lib().ibv_free_device_list(self._list)


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """Limits of an opened device and port that transfers must respect."""

    max_sge: int
    max_sge_rd: int
    max_qp_wr: int
    max_cqe: int
    max_msg_sz: int
    max_mr_size: int
    max_qp_rd_atom: int


def gid_to_str(gid: bytes) -> str:
    """Format a 16-byte GID the way ``ibv_devinfo -v`` does (IPv6 text)."""
    return str(ipaddress.IPv6Address(gid))


class Device:
    """An opened verbs device: context, one port, one protection domain.

    Use :func:`open_device` to make one.  A context manager; ``close()`` is
    idempotent and closes every child first.
    """

    def __init__(self, ctx: Any, name: str, port: int, gid_index: int) -> None:
        L = _lib()
        self._ctx = ctx
        self.name = name
        self.port = port
        # QueuePair, MemoryRegion, CompletionQueue made here, for close(); the closed ones
        # are dropped when the list doubles (a server's peers come and go).
        self._children: list[Any] = []
        self._prune_at = 64
        self._children_lock = threading.Lock()  # children are made in several threads
        self._closed = False
        self._pd = L.ibv_alloc_pd(ctx)
        if self._pd == ffi.NULL:
            exc = _err("alloc_pd")
            self._release()
            raise exc
        dattr = ffi.new("struct ibv_device_attr *")
        rc = L.ibv_query_device(ctx, dattr)
        if rc:
            self._release()
            raise _err("query_device", rc)
        pattr = ffi.new("struct ibv_port_attr *")
        rc = L.ibv_query_port(ctx, port, pattr)
        if rc:
            self._release()
            raise _err(f"query_port({port})", rc)
        self.caps = DeviceCaps(
            max_sge=int(dattr.max_sge),
            max_sge_rd=int(dattr.max_sge_rd) or int(dattr.max_sge),
            max_qp_wr=int(dattr.max_qp_wr),
            max_cqe=int(dattr.max_cqe),
            max_msg_sz=int(pattr.max_msg_sz),
            max_mr_size=int(dattr.max_mr_size),
            max_qp_rd_atom=int(dattr.max_qp_rd_atom),
        )
        self.port_state = int(pattr.state)
        self.active_mtu = MTU_BYTES.get(int(pattr.active_mtu), 1024)
        self.lid = int(pattr.lid)
        self.gid_index = gid_index
        gid = ffi.new("union ibv_gid *")
        rc = L.ibv_query_gid(ctx, port, gid_index, gid)
        if rc:
            self._release()
            raise _err(f"query_gid(port={port}, index={gid_index})", rc)
        self.gid = bytes(ffi.buffer(gid.raw))

    def _release(self) -> None:
        L = _lib()
        if self._pd != ffi.NULL:
            L.ibv_dealloc_pd(self._pd)
            self._pd = ffi.NULL
        L.ibv_close_device(self._ctx)
        self._closed = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Device {self.name} port={self.port} gid_index={self.gid_index} "
            f"mtu={self.active_mtu} {state}>"
        )

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"device {self.name} is closed")

    def register(
        self, address: int, length: int, access: int, owner: object = None
    ) -> MemoryRegion:
        """Register ``length`` bytes at ``address`` with ``access`` flags (``ibv_reg_mr``).

        ``owner`` is the object that owns the memory; the region keeps it alive.
        """
        self._check_open()
        if length < 1 or address < 0:
            raise ArgumentError(f"reg_mr: address={address:#x} length={length} (want >= 1 byte)")
        mr = _lib().ibv_reg_mr(self._pd, ffi.cast("void *", address), length, access)
        if mr == ffi.NULL:
            raise _err(f"reg_mr(addr={address:#x}, length={length}, access={access:#x})")
        region = MemoryRegion(mr, address, length, access, owner)
        self._adopt(region)
        return region

    def _adopt(self, child: Any) -> None:
        with self._children_lock:
            if len(self._children) >= self._prune_at:
                self._children = [c for c in self._children if not c.closed]
                self._prune_at = max(64, 2 * len(self._children))
            self._children.append(child)

    def create_cq(self, depth: int, *, events: bool = False) -> CompletionQueue:
        """Create a completion queue with room for ``depth`` completions.

        With ``events``, the queue gets its own completion channel, and
        :attr:`CompletionQueue.fd` is a non-blocking file descriptor that turns
        readable when a completion arrives after :meth:`CompletionQueue.arm`.
        """
        self._check_open()
        L = _lib()
        depth = max(1, min(depth, self.caps.max_cqe))
        channel = ffi.NULL
        if events:
            channel = L.ibv_create_comp_channel(self._ctx)
            if channel == ffi.NULL:
                raise _err("create_comp_channel")
        cq = L.ibv_create_cq(self._ctx, depth, ffi.NULL, channel, 0)
        if cq == ffi.NULL:
            exc = _err(f"create_cq(cqe={depth})")
            if channel != ffi.NULL:
                L.ibv_destroy_comp_channel(channel)
            raise exc
        wrapped = CompletionQueue(cq, depth, channel)
        self._adopt(wrapped)
        return wrapped

    def create_rc_qp(
        self,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        max_send_wr: int,
        max_recv_wr: int,
        max_send_sge: int,
        max_recv_sge: int = 1,
    ) -> QueuePair:
        """Create a reliable-connected QP and move it to INIT.

        The QP allows remote READ and WRITE at the QP level; which memory is
        reachable is decided per region by the memory region's access flags.
        """
        self._check_open()
        init = ffi.new("struct ibv_qp_init_attr *")
        init.send_cq = send_cq.handle
        init.recv_cq = recv_cq.handle
        init.cap.max_send_wr = max_send_wr
        init.cap.max_recv_wr = max_recv_wr
        init.cap.max_send_sge = max_send_sge
        init.cap.max_recv_sge = max_recv_sge
        init.qp_type = _QPT_RC
        init.sq_sig_all = 0
        qp = _lib().ibv_create_qp(self._pd, init)
        if qp == ffi.NULL:
            raise _err(
                f"create_qp(RC, max_send_wr={max_send_wr}, max_recv_wr={max_recv_wr}, "
                f"max_send_sge={max_send_sge}, max_recv_sge={max_recv_sge})"
            )
        wrapped = QueuePair(qp, self, max_send_wr, max_send_sge, max_recv_sge)
        self._adopt(wrapped)
        wrapped._to_init()
        return wrapped

    def close(self) -> None:
        """Close every child (QPs, then MRs, then CQs), then the PD and context."""
        if self._closed:
            return
        for kind in (QueuePair, MemoryRegion, CompletionQueue):
            for child in [c for c in self._children if isinstance(c, kind)]:
                child.close()
        self._children.clear()
        self._closed = True
        L = _lib()
        rc = L.ibv_dealloc_pd(self._pd)
        rc2 = L.ibv_close_device(self._ctx)
        log.debug("closed device %s", self.name)
        if rc:
            raise _err("dealloc_pd", rc)
        if rc2:
            raise _err("close_device", rc2)


def open_device(
    name: str | None = None, port: int | None = None, gid_index: int | None = None
) -> Device:
    """Open a verbs device.

    With no arguments, the device, port and GID follow the rule ``hixl devices``
    marks (:func:`hixl.verbs.devices.choose_gid`): the first ACTIVE port with an
    IPv4-mapped RoCEv2 GID bound to a netdev, as perftest chooses.  Explicit
    ``name``, ``port`` and ``gid_index`` narrow or override that.  The GID table is
    read with one ``ibv_query_gid_table`` call rather than from sysfs, which
    matters on rxe's 1024-entry tables under emulation.

    Raises :class:`DeviceError` when no such device, port or GID exists.
    """
    L = _lib()
    problems: list[str] = []
    with _DeviceList() as devs:
        if not devs:
            raise DeviceError(
                "no verbs devices found; create one with 'hixl rxe up' "
                "or run under 'hixl vm run -- CMD'"
            )
        if name is not None and name not in devs:
            raise DeviceError(f"no RDMA device named {name!r} (devices: {', '.join(devs)})")
        for cand in [name] if name is not None else list(devs):
            ctx = L.ibv_open_device(devs[cand])
            if ctx == ffi.NULL:
                raise _err(f"open_device({cand})")
            try:
                chosen = _choose_port_gid(ctx, cand, port, gid_index, problems)
            except BaseException:
                L.ibv_close_device(ctx)
                raise
            if chosen is None:
                L.ibv_close_device(ctx)
                continue
            dev = Device(ctx, cand, *chosen)  # closes ctx itself if it fails
            log.debug("opened %r", dev)
            return dev
    raise DeviceError("no usable RDMA port: " + "; ".join(problems))


def _choose_port_gid(
    ctx: Any, name: str, port: int | None, gid_index: int | None, problems: list[str]
) -> tuple[int, int] | None:
    """``(port, gid_index)`` to use on an opened device, or None (reason in ``problems``)."""
    from hixl.verbs.devices import ROCE_V2, Gid, choose_gid

    L = _lib()
    dattr = ffi.new("struct ibv_device_attr *")
    rc = L.ibv_query_device(ctx, dattr)
    if rc:
        raise _err("query_device", rc)
    nports = int(dattr.phys_port_cnt)
    for num in [port] if port is not None else range(1, nports + 1):
        pattr = ffi.new("struct ibv_port_attr *")
        rc = L.ibv_query_port(ctx, num, pattr)
        if rc:
            raise _err(f"query_port({num})", rc)
        if int(pattr.state) != _PORT_ACTIVE:
            problems.append(f"{name} port {num} is not ACTIVE (state {int(pattr.state)})")
            continue
        if gid_index is not None:
            return num, gid_index
        cap = max(1, int(pattr.gid_tbl_len) * nports)
        entries = ffi.new("struct ibv_gid_entry[]", cap)
        got = L._ibv_query_gid_table(ctx, entries, cap, 0, ffi.sizeof("struct ibv_gid_entry"))
        if got < 0:
            raise _err("query_gid_table", -got if got < -1 else None)
        gids = []
        for i in range(got):
            ent = entries[i]
            if int(ent.port_num) != num:
                continue
            try:
                netdev = socket.if_indextoname(int(ent.ndev_ifindex))
            except OSError:
                netdev = None
            gtype = ROCE_V2 if int(ent.gid_type) == _GID_TYPE_ROCE_V2 else "RoCE v1"
            gid = ipaddress.IPv6Address(bytes(ffi.buffer(ent.gid.raw))).exploded
            gids.append(Gid(index=int(ent.gid_index), gid=gid, type=gtype, netdev=netdev))
        best = choose_gid(gids)
        if best is not None:
            return num, best.index
        problems.append(
            f"{name} port {num} has no IPv4 RoCEv2 GID ({len(gids)} GIDs; does its "
            "netdev have an IPv4 address?)"
        )
    return None


class MemoryRegion:
    """A registered memory region.  ``addr``/``length`` in bytes; keys for SGEs/peers."""

    def __init__(self, mr: Any, addr: int, length: int, access: int, owner: object) -> None:
        self._mr = mr
        self.addr = addr
        self.length = length
        self.access = access
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)
        self._owner = owner  # keeps the registered memory alive
        #: True once :meth:`close` ran (read-only to users; a plain attribute, since the
        #: data path reads it for every request it posts).
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"<MemoryRegion addr={self.addr:#x} length={self.length} "
            f"rkey={self.rkey:#x} access={self.access:#x}"
            f"{' closed' if self.closed else ''}>"
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        rc = _lib().ibv_dereg_mr(self._mr)
        self._owner = None
        if rc:
            raise _err("dereg_mr", rc)


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One send-queue work request in plain values (for the few that are not chains).

    ``opcode`` is one of the ``WR_*`` constants; ``sges`` are
    ``(address, length, lkey)``; ``remote_addr``/``rkey`` are used by RDMA
    opcodes; ``imm`` (host order) by the ``*_WITH_IMM`` opcodes.
    """

    wr_id: int
    opcode: int
    sges: Sequence[tuple[int, int, int]]
    remote_addr: int = 0
    rkey: int = 0
    imm: int | None = None
    signaled: bool = True


class QueuePair:
    """A reliable-connected queue pair.

    Lifecycle: created in INIT by :meth:`Device.create_rc_qp`; :meth:`connect`
    moves it through RTR to RTS given the remote side's QPN, PSN and GID.
    ``max_send_wr`` is the send-queue depth asked for: callers pace against it.
    """

    def __init__(
        self, qp: Any, device: Device, max_send_wr: int, max_send_sge: int, max_recv_sge: int
    ) -> None:
        self._qp = qp
        self._device = device
        self.qpn = int(qp.qp_num)
        self.max_send_wr = max_send_wr
        self.max_send_sge = max_send_sge
        ops = qp.context.ops
        self._post_send_fn = ffi.cast(POST_SEND, ops.post_send)
        self._post_recv_fn = ffi.cast(POST_RECV, ops.post_recv)
        self._bad_send = ffi.new("struct ibv_send_wr **")
        self._bad_recv = ffi.new("struct ibv_recv_wr **")
        self._recv_wr = ffi.new("struct ibv_recv_wr *")
        self._recv_sges = ffi.new("struct ibv_sge[]", max(1, max_recv_sge))
        self._closed = False

    def __repr__(self) -> str:
        return f"<QueuePair qpn={self.qpn:#x} state={self.state_name}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def state_name(self) -> str:
        if self._closed:
            return "CLOSED"
        attr = ffi.new("struct ibv_qp_attr *")
        init = ffi.new("struct ibv_qp_init_attr *")
        if _lib().ibv_query_qp(self._qp, attr, _QP_STATE, init):
            return "UNKNOWN"
        return _QPS_NAMES.get(int(attr.qp_state), str(int(attr.qp_state)))

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"queue pair {self.qpn:#x} is closed")

    def _modify(self, op: str, attr: Any, mask: int) -> None:
        rc = _lib().ibv_modify_qp(self._qp, attr, mask)
        if rc:
            raise _err(op, rc)

    def _to_init(self) -> None:
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = _QPS_INIT
        attr.pkey_index = 0
        attr.port_num = self._device.port
        attr.qp_access_flags = ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_LOCAL_WRITE
        mask = _QP_STATE | _QP_PKEY_INDEX | _QP_PORT | _QP_ACCESS_FLAGS
        self._modify("modify_qp(INIT)", attr, mask)

    def connect(
        self,
        remote_qpn: int,
        remote_psn: int,
        local_psn: int,
        remote_gid: bytes,
        mtu: int,
        timeout: int = 14,
        retry_cnt: int = 7,
        rnr_retry: int = 7,
        rd_atomic: int = 16,
    ) -> None:
        """Move INIT -> RTR -> RTS towards the remote QP.

        ``mtu`` is the path MTU in bytes (256..4096).  ``timeout`` is the ACK
        timeout exponent (4.096 us * 2**timeout) and with ``retry_cnt`` bounds
        how long a dead peer takes to surface as ``IBV_WC_RETRY_EXC_ERR``.
        """
        self._check_open()
        if mtu not in MTU_ENUM:
            raise VerbsError("modify_qp(RTR)", f"path MTU {mtu} is not one of {sorted(MTU_ENUM)}")
        if len(remote_gid) != 16:
            raise VerbsError("modify_qp(RTR)", f"remote GID has {len(remote_gid)} bytes, not 16")
        rd_atomic = max(1, min(rd_atomic, self._device.caps.max_qp_rd_atom or 1))
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = _QPS_RTR
        attr.path_mtu = MTU_ENUM[mtu]
        attr.dest_qp_num = remote_qpn
        attr.rq_psn = remote_psn
        attr.max_dest_rd_atomic = rd_atomic
        attr.min_rnr_timer = 12
        ah = attr.ah_attr
        ah.is_global = 1
        ah.port_num = self._device.port
        ah.dlid = 0
        ah.grh.sgid_index = self._device.gid_index
        ah.grh.hop_limit = 1
        ffi.memmove(ah.grh.dgid.raw, remote_gid, 16)
        mask = (
            _QP_STATE
            | _QP_AV
            | _QP_PATH_MTU
            | _QP_DEST_QPN
            | _QP_RQ_PSN
            | _QP_MAX_DEST_RD_ATOMIC
            | _QP_MIN_RNR_TIMER
        )
        self._modify(f"modify_qp(RTR, dest_qpn={remote_qpn:#x}, mtu={mtu})", attr, mask)
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = _QPS_RTS
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.sq_psn = local_psn
        attr.max_rd_atomic = rd_atomic
        mask = (
            _QP_STATE
            | _QP_TIMEOUT
            | _QP_RETRY_CNT
            | _QP_RNR_RETRY
            | _QP_SQ_PSN
            | _QP_MAX_QP_RD_ATOMIC
        )
        self._modify("modify_qp(RTS)", attr, mask)
        log.debug("qp %#x connected to %#x (mtu %d)", self.qpn, remote_qpn, mtu)

    def to_error(self) -> None:
        """Move the QP to the error state: outstanding work requests are flushed.

        After this returns the device no longer touches memory for this QP's
        requests, so buffers of transfers that were in flight may be reused.
        """
        if self._closed:
            return
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = _QPS_ERR
        self._modify("modify_qp(ERR)", attr, _QP_STATE)

    def post_chain(self, chain: SendChain, start: int = 0, stop: int | None = None) -> int:
        """Post WRs ``start .. stop-1`` of ``chain`` with one ``post_send``; return how many.

        The return value is less than asked only when the send queue was full
        (``ENOMEM``): the provider posted everything before the first WR it
        refused, and the caller resumes from ``start + returned`` once completions
        have freed room.  Any other refusal raises :class:`VerbsError` naming the
        WR; WRs before it were posted.  A chain whose memory regions were closed is
        refused before anything is posted (:class:`RegistrationError`).  The GIL is
        released during the call.
        """
        self._check_open()
        stop = chain.num_wrs if stop is None else stop
        if not 0 <= start < stop <= chain.num_wrs:
            raise ArgumentError(
                f"post_chain: WRs {start}..{stop} outside the chain's 0..{chain.num_wrs}"
            )
        chain.check_regions()
        head = chain.head
        last = head[stop - 1]
        link = last.next
        last.next = ffi.NULL  # end this post at `stop`; restored below
        try:
            rc = self._post_send_fn(self._qp, head + start, self._bad_send)
        finally:
            last.next = link
        if rc == 0:
            return stop - start
        bad = (address(self._bad_send[0]) - chain.wr_base) // _WR_SIZE
        if not start <= bad < stop:
            bad = start  # the provider did not say: assume nothing was posted
        if rc == _errno.ENOMEM:
            return bad - start
        raise VerbsError(
            "post_send",
            f"{os.strerror(rc)} at WR {bad} of {chain.num_wrs} "
            f"(WRs {start}..{bad - 1} were posted)",
            rc,
        )

    def post_whole(self, chain: SendChain) -> None:
        """Post every WR of ``chain`` with one ``post_send``: :meth:`post_pieces` of the
        single range ``(chain, 0, chain.num_wrs)``, with the same checks and errors, in
        fewer steps (a blocking request's direct post).  The GIL is released during the
        call."""
        if self._closed:
            self._check_open()  # raises
        chain.check_regions()
        rc = self._post_send_fn(self._qp, chain.head, self._bad_send)
        if rc:
            self._post_failed(((chain, 0, chain.num_wrs),), rc)

    def post_and_poll(
        self, chain: SendChain, cq: CompletionQueue
    ) -> Callable[[int], tuple[int, int] | None]:
        """A function that posts ``chain`` whole with one ``post_send`` and then polls
        ``cq`` up to ``polls`` times back to back for one completion, returning its
        ``(status, vendor_err)``, or None when none came: a channel's request in one
        Python call, with every pointer bound once (the polls are bare ``poll_cq`` calls
        in a tight loop, no clock, so a completion that comes a little after the post is
        seen within one poll's time).

        The caller checks, before each call, that the chain's regions are open (the
        function does not: it is the hot path of :class:`~hixl.engine.channel.Channel`,
        which checks its one region itself) and that the queue pair and the queue are
        not closed (the engine frees them only once no call is under way).  A refused
        post raises :class:`VerbsError`, a failed poll too.
        """
        post_fn, qp, head, bad = self._post_send_fn, self._qp, chain.head, self._bad_send
        poll_fn, c, wc = cq.inline_poll()
        span = ((chain, 0, 1),)

        def post_and_poll(polls: int) -> tuple[int, int] | None:
            rc = post_fn(qp, head, bad)
            if rc:
                self._post_failed(span, rc)
            for _ in range(polls):
                n = poll_fn(c, 1, wc)
                if n:
                    if n < 0:
                        raise _err("poll_cq", -n if n < -1 else None)
                    return wc.status, wc.vendor_err
            return None

        return post_and_poll

    def post_pieces(self, pieces: Sequence[tuple[SendChain, int, int]]) -> None:
        """Post several ranges ``(chain, start, stop)`` of chains as one ``post_send``.

        The last WR of each range is linked to the first of the next for the duration
        of the call, then every link is restored, so the chains are as they were.  The
        ranges must not overlap.  Unlike :meth:`post_chain`, a refusal of any kind
        (``ENOMEM`` included: the caller paces against the queue's depth) raises
        :class:`VerbsError` naming the range and WR; the ranges before it were posted.
        Chains whose memory regions were closed are refused before anything is posted.
        The GIL is released during the call.
        """
        self._check_open()
        if not pieces:
            return
        for chain, start, stop in pieces:
            if not 0 <= start < stop <= chain.num_wrs:
                raise ArgumentError(
                    f"post_pieces: WRs {start}..{stop} outside the chain's 0..{chain.num_wrs}"
                )
            chain.check_regions()
        if len(pieces) == 1 and pieces[0][2] == pieces[0][0].num_wrs:
            # One range to the chain's end: its last WR already ends the list.
            chain, start, _ = pieces[0]
            rc = self._post_send_fn(self._qp, chain.head + start, self._bad_send)
            if rc == 0:
                return
            self._post_failed(pieces, rc)
        saved = []
        try:
            nxt = ffi.NULL
            for chain, start, stop in reversed(pieces):
                last = chain.head[stop - 1]
                saved.append((last, last.next))
                last.next = nxt
                nxt = chain.head + start
            rc = self._post_send_fn(self._qp, nxt, self._bad_send)
        finally:
            for last, link in reversed(saved):
                last.next = link
        if rc == 0:
            return
        self._post_failed(pieces, rc)

    def _post_failed(self, pieces: Sequence[tuple[SendChain, int, int]], rc: int) -> NoReturn:
        where = "an unknown WR"
        bad = address(self._bad_send[0])
        for i, (chain, start, stop) in enumerate(pieces):
            k = (bad - chain.wr_base) // _WR_SIZE
            if chain.wr_base <= bad and start <= k < stop:
                where = f"WR {k} of range {i} ({start}..{stop - 1})"
                break
        raise VerbsError("post_send", f"{os.strerror(rc)} at {where} of {len(pieces)} ranges", rc)

    def post_send(self, requests: Sequence[SendRequest], signal_id: int | None = None) -> None:
        """Post ``requests`` as one chain with a single ``post_send``.

        For the few requests that are not planned transfers (notifications).  With
        ``signal_id``, the last request is posted signaled with that ``wr_id``
        whatever its own ``wr_id``/``signaled`` say.  A full send queue raises
        :class:`VerbsError` (``ENOMEM``): callers pace against ``max_send_wr``.
        """
        self._check_open()
        if not requests:
            return
        n = len(requests)
        m = sum(len(r.sges) for r in requests)
        wrs = ffi.new("struct ibv_send_wr[]", n)
        sges = ffi.new("struct ibv_sge[]", max(1, m))
        k = 0
        for i, req in enumerate(requests):
            w = wrs[i]
            w.wr_id, signaled = req.wr_id, req.signaled
            if i == n - 1 and signal_id is not None:
                w.wr_id, signaled = signal_id, True
            w.opcode = req.opcode
            w.send_flags = SEND_SIGNALED if signaled else 0
            w.num_sge = len(req.sges)
            w.sg_list = sges + k if req.sges else ffi.NULL
            for a, length, key in req.sges:
                s = sges[k]
                s.addr, s.length, s.lkey = a, length, key
                k += 1
            if req.imm is not None:
                w.imm_data = socket.htonl(req.imm)
            if req.opcode in (WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, WR_RDMA_READ):
                w.wr.rdma.remote_addr = req.remote_addr
                w.wr.rdma.rkey = req.rkey
            w.next = wrs + (i + 1) if i + 1 < n else ffi.NULL
        rc = self._post_send_fn(self._qp, wrs, self._bad_send)
        if rc:
            raise _err(f"post_send({n} WRs)", rc)

    def post_recv(self, wr_id: int, sges: Sequence[tuple[int, int, int]]) -> None:
        """Post one receive work request with ``sges`` as ``(address, length, lkey)``."""
        self._check_open()
        if len(sges) > len(self._recv_sges):
            raise ArgumentError(
                f"post_recv: {len(sges)} SGEs but the QP takes {len(self._recv_sges)}"
            )
        w = self._recv_wr
        w.wr_id = wr_id
        w.num_sge = len(sges)
        w.sg_list = self._recv_sges
        w.next = ffi.NULL
        for i, (a, length, key) in enumerate(sges):
            s = self._recv_sges[i]
            s.addr, s.length, s.lkey = a, length, key
        rc = self._post_recv_fn(self._qp, w, self._bad_recv)
        if rc:
            raise _err("post_recv", rc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rc = _lib().ibv_destroy_qp(self._qp)
        if rc:
            raise _err("destroy_qp", rc)
