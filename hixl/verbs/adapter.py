"""The one adapter over pyverbs.

This is the only module in hixl that imports pyverbs.  It exposes a small,
typed surface (device, memory region, completion queue, RC queue pair) and
translates every pyverbs exception into :class:`hixl.VerbsError` or
:class:`hixl.DeviceError` at this boundary, so no caller ever sees a
``PyverbsError``.

Lifetimes: a :class:`Device` owns the protection domain and everything made
from it.  ``Device.close()`` closes queue pairs, memory regions and completion
queues (in that order) before the PD and the context.  Every object's
``close()`` may be called twice.

Theory of operation for work requests: pyverbs' ``SendWR(next_wr=...)`` and
``SGE`` objects keep no reference to each other, and ``MR(address=...)`` keeps
none to the buffer it registers.  :meth:`QueuePair.post_send` therefore keeps
the whole chain alive in a local list until ``ibv_post_send`` has returned,
and :class:`MemoryRegion` holds a reference to the object that owns the
memory.  Only the legacy ``post_send`` path is used: rdma-core < 64 has an
rxe bug in ``ibv_wr_set_sge_list`` with SGEs of unequal lengths.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hixl.errors import DeviceError, HixlError, StateError, VerbsError

# pyverbs' base module calls logging.basicConfig() on import, which would configure the
# application's root logger behind its back.  A library must not do that, so the root
# logger's handlers and level are put back as they were once pyverbs is loaded.
_root = logging.getLogger()
_root_state = (list(_root.handlers), _root.level)
try:
    import pyverbs.cq as _cq
    import pyverbs.device as _device
    import pyverbs.mr as _mr
    import pyverbs.pd as _pd
    import pyverbs.qp as _qp
    import pyverbs.wr as _wr
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError

    try:  # the enum module moved between rdma-core releases
        import pyverbs.libibverbs_enums as _e
    except ImportError:  # pragma: no cover - depends on rdma-core version
        import pyverbs.enums as _e
    _IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    _IMPORT_ERROR = exc
finally:
    _root.handlers[:] = _root_state[0]
    _root.setLevel(_root_state[1])
    del _root, _root_state

log = logging.getLogger("hixl.verbs")

# ibv_wc_status values (a stable ABI enum in <infiniband/verbs.h>).
WC_STATUS_NAMES: dict[int, str] = {
    0: "IBV_WC_SUCCESS",
    1: "IBV_WC_LOC_LEN_ERR",
    2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR",
    4: "IBV_WC_LOC_PROT_ERR",
    5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR",
    7: "IBV_WC_BAD_RESP_ERR",
    8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR",
    10: "IBV_WC_REM_ACCESS_ERR",
    11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR",
    13: "IBV_WC_RNR_RETRY_EXC_ERR",
    14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR",
    16: "IBV_WC_REM_ABORT_ERR",
    17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR",
    19: "IBV_WC_FATAL_ERR",
    20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR",
}

# ibv_mtu enum value <-> bytes.
MTU_BYTES: dict[int, int] = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
MTU_ENUM: dict[int, int] = {v: k for k, v in MTU_BYTES.items()}

# Access flags (ibv_access_flags values, stable ABI).
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4

# Opcodes we use (ibv_wr_opcode / ibv_wc_opcode, stable ABI).
WR_RDMA_WRITE = 0
WR_RDMA_WRITE_WITH_IMM = 1
WR_SEND = 2
WR_SEND_WITH_IMM = 3
WR_RDMA_READ = 4
_RDMA_OPCODES = frozenset((WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, WR_RDMA_READ))
_SIGNALED = 2  # IBV_SEND_SIGNALED
_FENCE = 1  # IBV_SEND_FENCE: start only after every earlier READ/atomic has completed
_WR_CACHE = 256  # pyverbs work requests a queue pair keeps for reuse


def available() -> tuple[bool, str]:
    """Return ``(True, "")`` when pyverbs imports, else ``(False, reason)``."""
    if _IMPORT_ERROR is not None:
        return False, f"pyverbs cannot be imported: {_IMPORT_ERROR}"
    return True, ""


def _require() -> None:
    if _IMPORT_ERROR is not None:
        raise DeviceError(
            f"pyverbs cannot be imported ({_IMPORT_ERROR}). Install the distribution's "
            "python3-pyverbs and use a venv made with --system-site-packages; "
            "run 'hixl doctor' for details"
        )


@contextmanager
def _translate(op: str) -> Iterator[None]:
    """Turn any pyverbs exception raised inside the block into a VerbsError."""
    try:
        yield
    except HixlError:
        raise
    except PyverbsError as exc:
        raise _verbs_error(op, exc) from exc


def _verbs_error(op: str, exc: Exception) -> VerbsError:
    """The :class:`VerbsError` for a pyverbs exception raised by ``op``."""
    if isinstance(exc, PyverbsRDMAError):
        code = exc.error_code if exc.error_code != -1 else None
        return VerbsError(op, str(exc), code)
    return VerbsError(op, str(exc))


def device_names() -> list[str]:
    """Names of the verbs devices on this machine.

    Raises :class:`DeviceError` when the kernel has no RDMA support at all
    (pyverbs raises rather than returning an empty list in that case).
    """
    _require()
    try:
        devs = _device.get_device_list()
    except PyverbsError as exc:
        raise DeviceError(
            f"cannot list verbs devices ({exc}); this kernel may have no RDMA support. "
            "Run 'hixl doctor', or run under 'hixl vm run -- CMD'"
        ) from exc
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


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
        self._ctx = ctx
        self.name = name
        self.port = port
        self._children: list[Any] = []  # QueuePair, MemoryRegion, CompletionQueue
        self._closed = False
        with _translate("alloc_pd"):
            self._pd = _pd.PD(ctx)
        with _translate("query_device/query_port"):
            dattr = ctx.query_device()
            pattr = ctx.query_port(port)
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
        with _translate("query_gid"):
            self.gid = _gid_bytes(ctx.query_gid(port, gid_index))

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
        """Register ``length`` bytes at ``address`` with ``access`` flags.

        ``owner`` is the object that owns the memory; the region keeps it alive.
        """
        self._check_open()
        with _translate(f"reg_mr(length={length}, access={access:#x})"):
            mr = _mr.MR(self._pd, length, access, address=address)
        region = MemoryRegion(mr, address, length, access, owner)
        self._children.append(region)
        return region

    def create_cq(self, depth: int, *, events: bool = False) -> CompletionQueue:
        """Create a completion queue with room for ``depth`` completions.

        With ``events``, the queue gets its own completion channel, and
        :attr:`CompletionQueue.fd` is a non-blocking file descriptor that turns
        readable when a completion arrives after :meth:`CompletionQueue.arm`.
        Where the channel's descriptor cannot be found, ``fd`` is None and the
        caller has to poll.
        """
        self._check_open()
        depth = min(depth, self.caps.max_cqe)
        channel, fd = (None, None)
        if events:
            channel, fd = _comp_channel(self._ctx)
        try:
            with _translate(f"create_cq(cqe={depth})"):
                cq = _cq.CQ(self._ctx, depth, None, channel, 0)
        except BaseException:
            if channel is not None:
                channel.close()
            raise
        wrapped = CompletionQueue(cq, depth, channel, fd)
        self._children.append(wrapped)
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
        cap = _qp.QPCap(
            max_send_wr=max_send_wr,
            max_recv_wr=max_recv_wr,
            max_send_sge=max_send_sge,
            max_recv_sge=max_recv_sge,
        )
        with _translate("create_qp(RC)"):
            init = _qp.QPInitAttr(
                qp_type=_e.IBV_QPT_RC, scq=send_cq._cq, rcq=recv_cq._cq, cap=cap, sq_sig_all=0
            )
            qp = _qp.QP(self._pd, init)
        wrapped = QueuePair(qp, self, max_send_wr, max_send_sge)
        self._children.append(wrapped)
        wrapped._to_init()
        return wrapped

    def close(self) -> None:
        """Close every child (QPs, then MRs, then CQs), then the PD and context."""
        if self._closed:
            return
        self._closed = True
        order = (QueuePair, MemoryRegion, CompletionQueue)
        for kind in order:
            for child in [c for c in self._children if isinstance(c, kind)]:
                child.close()
        self._children.clear()
        with _translate("dealloc_pd"):
            self._pd.close()
        with _translate("close_device"):
            self._ctx.close()
        log.debug("closed device %s", self.name)


def _gid_bytes(gid: Any) -> bytes:
    text = str(gid.gid) if hasattr(gid, "gid") else str(gid)
    return ipaddress.IPv6Address(text).packed


def open_device(
    name: str | None = None, port: int | None = None, gid_index: int | None = None
) -> Device:
    """Open a verbs device.

    With no arguments, the device, port and GID follow the rule ``hixl
    devices`` marks (:func:`hixl.verbs.devices.choose_gid`): the first ACTIVE port
    with an IPv4-mapped RoCEv2 GID bound to a netdev, as perftest chooses.
    Explicit ``name``, ``port`` and ``gid_index`` narrow or override that.
    The GID table is read with one ``ibv_query_gid_table`` call rather than
    from sysfs, which matters on rxe's 1024-entry tables under emulation.

    Raises :class:`DeviceError` when no such device, port or GID exists.
    """
    _require()
    names = device_names()
    if not names:
        raise DeviceError(
            "no verbs devices found; create one with 'hixl rxe up' "
            "or run under 'hixl vm run -- CMD'"
        )
    if name is not None and name not in names:
        raise DeviceError(f"no RDMA device named {name!r} (devices: {', '.join(names)})")
    problems: list[str] = []
    for cand in [name] if name is not None else names:
        with _translate(f"open_device({cand})"):
            ctx = _device.Context(name=cand)
        try:
            chosen = _choose_port_gid(ctx, cand, port, gid_index, problems)
            if chosen is None:
                ctx.close()
                continue
            dev = Device(ctx, cand, *chosen)
        except BaseException:
            ctx.close()
            raise
        log.debug("opened %r", dev)
        return dev
    raise DeviceError("no usable RDMA port: " + "; ".join(problems))


def _choose_port_gid(
    ctx: Any, name: str, port: int | None, gid_index: int | None, problems: list[str]
) -> tuple[int, int] | None:
    """``(port, gid_index)`` to use on an opened device, or None (reason in ``problems``)."""
    from hixl.verbs.devices import ROCE_V2, Gid, choose_gid

    with _translate("query_device"):
        nports = int(ctx.query_device().phys_port_cnt)
    for num in [port] if port is not None else range(1, nports + 1):
        with _translate(f"query_port({num})"):
            pattr = ctx.query_port(num)
        if int(pattr.state) != int(_e.IBV_PORT_ACTIVE):
            problems.append(f"{name} port {num} is not ACTIVE (state {int(pattr.state)})")
            continue
        if gid_index is not None:
            return num, gid_index
        with _translate("query_gid_table"):
            entries = ctx.query_gid_table(int(pattr.gid_tbl_len) * nports)
        gids = []
        for ent in entries:
            if int(ent.port_num) != num:
                continue
            try:
                netdev = socket.if_indextoname(int(ent.ndev_ifindex))
            except OSError:
                netdev = None
            gtype = ROCE_V2 if int(ent.gid_type) == int(_e.IBV_GID_TYPE_ROCE_V2) else "RoCE v1"
            gid = ipaddress.IPv6Address(str(ent.gid_str())).exploded
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
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<MemoryRegion addr={self.addr:#x} length={self.length} "
            f"rkey={self.rkey:#x} access={self.access:#x}"
            f"{' closed' if self._closed else ''}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _translate("dereg_mr"):
            self._mr.close()
        self._owner = None


@dataclass(frozen=True, slots=True)
class Completion:
    """One work completion, as plain values."""

    wr_id: int
    status: int
    opcode: int
    byte_len: int
    imm_data: int | None
    qp_num: int
    vendor_err: int

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def status_name(self) -> str:
        return WC_STATUS_NAMES.get(self.status, f"IBV_WC_STATUS_{self.status}")


_WC_WITH_IMM = 2  # ibv_wc_flags IBV_WC_WITH_IMM


class CompletionQueue:
    """A completion queue, polled without blocking; optionally with completion events.

    ``fd`` (None without events) is the completion channel's descriptor: after
    :meth:`arm`, the next completion makes it readable; :meth:`take_event` then
    consumes that event, and the queue must be armed again for the next one.
    Completions that were already queued when it was armed raise no event, so
    poll once more after arming, before sleeping on ``fd``.
    """

    def __init__(self, cq: Any, depth: int, channel: Any = None, fd: int | None = None) -> None:
        self._cq = cq
        self._channel = channel
        self.fd = fd
        self.depth = depth
        self._closed = False

    def poll(self, max_entries: int = 16) -> list[Completion]:
        """Return up to ``max_entries`` completions, possibly none.  Never blocks."""
        if self._closed:
            raise StateError("completion queue is closed")
        try:  # inline rather than _translate(): this runs for every completion
            n, wcs = self._cq.poll(max_entries)
        except PyverbsError as exc:
            raise _verbs_error("poll_cq", exc) from exc
        out = []
        for wc in wcs[:n]:
            flags = wc.wc_flags
            out.append(
                Completion(
                    wc.wr_id,
                    wc.status,
                    wc.opcode,
                    wc.byte_len,
                    wc.imm_data if flags & _WC_WITH_IMM else None,
                    wc.qp_num,
                    wc.vendor_err,
                )
            )
        return out

    def arm(self) -> None:
        """Ask for an event on ``fd`` at the next completion (``ibv_req_notify_cq``)."""
        if self._closed:
            raise StateError("completion queue is closed")
        with _translate("req_notify_cq"):
            self._cq.req_notify()

    def take_event(self) -> bool:
        """Consume and acknowledge one pending event; False when there was none.

        Never blocks: the channel's descriptor is non-blocking.
        """
        if self._closed or self._channel is None:
            return False
        try:
            self._channel.get_cq_event(self._cq)
        except PyverbsError:
            return False  # EAGAIN: nothing pending (a spurious wake-up)
        with _translate("ack_cq_events"):
            self._cq.ack_events(1)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _translate("destroy_cq"):
            self._cq.close()
        if self._channel is not None:
            with _translate("destroy_comp_channel"):
                self._channel.close()


_EVENT_FD_LINK = "anon_inode:[infinibandevent]"
_channel_lock = threading.Lock()


def _event_fds() -> set[int]:
    """This process's open completion-channel descriptors (from /proc/self/fd)."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_FD_LINK:
                out.add(int(name))
        except (OSError, ValueError):
            continue
    return out


def _comp_channel(ctx: Any) -> tuple[Any, int | None]:
    """A completion channel and its descriptor (set non-blocking), or (None, None).

    pyverbs keeps the channel's ``fd`` to itself, so it is found as the one completion
    channel descriptor that appeared while the channel was created.  Channels are
    created under a lock so that two engines starting at once cannot confuse them.
    """
    with _channel_lock:
        before = _event_fds()
        with _translate("create_comp_channel"):
            channel = _cq.CompChannel(ctx)
        new = _event_fds() - before
    if len(new) != 1:
        log.debug("completion channel descriptor not found (%s); polling instead", new)
        channel.close()
        return None, None
    fd = new.pop()
    os.set_blocking(fd, False)
    return channel, fd


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One send-queue work request in plain values.

    ``opcode`` is one of the ``WR_*`` constants; ``sges`` are
    ``(address, length, lkey)``; ``remote_addr``/``rkey`` are used by RDMA
    opcodes; ``imm`` by the ``*_WITH_IMM`` opcodes.  ``fence`` posts it with
    ``IBV_SEND_FENCE`` (it waits for earlier READs to complete).
    """

    wr_id: int
    opcode: int
    sges: Sequence[tuple[int, int, int]]
    remote_addr: int = 0
    rkey: int = 0
    imm: int | None = None
    signaled: bool = True
    fence: bool = False


_QPS_NAMES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "ERR"}


class QueuePair:
    """A reliable-connected queue pair.

    Lifecycle: created in INIT by :meth:`Device.create_rc_qp`; :meth:`connect`
    moves it through RTR to RTS given the remote side's QPN, PSN and GID.
    """

    def __init__(self, qp: Any, device: Device, max_send_wr: int, max_send_sge: int) -> None:
        self._qp = qp
        self._device = device
        self.qpn = int(qp.qp_num)
        self.max_send_wr = max_send_wr
        self.max_send_sge = max_send_sge
        self._wr_cache: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"<QueuePair qpn={self.qpn:#x} state={self.state_name}>"

    @property
    def state_name(self) -> str:
        if self._closed:
            return "CLOSED"
        try:
            with _translate("query_qp"):
                attr, _ = self._qp.query(_e.IBV_QP_STATE)
            return _QPS_NAMES.get(int(attr.qp_state), str(int(attr.qp_state)))
        except VerbsError:
            return "UNKNOWN"

    def _to_init(self) -> None:
        attr = _qp.QPAttr()
        attr.qp_state = _e.IBV_QPS_INIT
        attr.pkey_index = 0
        attr.port_num = self._device.port
        attr.qp_access_flags = ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_LOCAL_WRITE
        mask = _e.IBV_QP_STATE | _e.IBV_QP_PKEY_INDEX | _e.IBV_QP_PORT | _e.IBV_QP_ACCESS_FLAGS
        with _translate("modify_qp(INIT)"):
            self._qp.modify(attr, mask)

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
        if mtu not in MTU_ENUM:
            raise VerbsError("modify_qp(RTR)", f"path MTU {mtu} is not one of {sorted(MTU_ENUM)}")
        rd_atomic = max(1, min(rd_atomic, self._device.caps.max_qp_rd_atom or 1))
        with _translate("modify_qp(RTR): address vector"):
            gr = GlobalRoute(dgid=_pyverbs_gid(remote_gid), sgid_index=self._device.gid_index)
            ah = AHAttr(port_num=self._device.port, is_global=1, gr=gr, dlid=0)
        attr = _qp.QPAttr()
        attr.qp_state = _e.IBV_QPS_RTR
        attr.path_mtu = MTU_ENUM[mtu]
        attr.dest_qp_num = remote_qpn
        attr.rq_psn = remote_psn
        attr.max_dest_rd_atomic = rd_atomic
        attr.min_rnr_timer = 12
        attr.ah_attr = ah
        mask = (
            _e.IBV_QP_STATE
            | _e.IBV_QP_AV
            | _e.IBV_QP_PATH_MTU
            | _e.IBV_QP_DEST_QPN
            | _e.IBV_QP_RQ_PSN
            | _e.IBV_QP_MAX_DEST_RD_ATOMIC
            | _e.IBV_QP_MIN_RNR_TIMER
        )
        with _translate(f"modify_qp(RTR, dest_qpn={remote_qpn:#x}, mtu={mtu})"):
            self._qp.modify(attr, mask)
        attr = _qp.QPAttr()
        attr.qp_state = _e.IBV_QPS_RTS
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.sq_psn = local_psn
        attr.max_rd_atomic = rd_atomic
        mask = (
            _e.IBV_QP_STATE
            | _e.IBV_QP_TIMEOUT
            | _e.IBV_QP_RETRY_CNT
            | _e.IBV_QP_RNR_RETRY
            | _e.IBV_QP_SQ_PSN
            | _e.IBV_QP_MAX_QP_RD_ATOMIC
        )
        with _translate("modify_qp(RTS)"):
            self._qp.modify(attr, mask)
        log.debug("qp %#x connected to %#x (mtu %d)", self.qpn, remote_qpn, mtu)

    def to_error(self) -> None:
        """Move the QP to the error state: outstanding work requests are flushed.

        After this returns the device no longer touches memory for this QP's
        requests, so buffers of transfers that were in flight may be reused.
        """
        if self._closed:
            return
        attr = _qp.QPAttr()
        attr.qp_state = _e.IBV_QPS_ERR
        with _translate("modify_qp(ERR)"):
            self._qp.modify(attr, _e.IBV_QP_STATE)

    def post_send(self, requests: Sequence[SendRequest], signal_id: int | None = None) -> None:
        """Post ``requests`` as one chain with a single ``ibv_post_send``.

        With ``signal_id``, the last request is posted signaled with that
        ``wr_id`` whatever its own ``wr_id``/``signaled`` say (how the engine
        signals one request per chunk without copying it).
        """
        if self._closed:
            raise StateError(f"queue pair {self.qpn:#x} is closed")
        if not requests:
            return
        if len(requests) == 1 and requests[0].imm is None:
            self._post_one(requests[0], signal_id)
            return
        keep: list[Any] = []  # pyverbs does not keep SGEs or next_wr alive
        nxt = None
        sge_cls, wr_cls, rdma = _wr.SGE, _wr.SendWR, _RDMA_OPCODES
        last = len(requests) - 1
        try:  # inline rather than _translate(): this runs for every chunk
            for i in range(last, -1, -1):
                req = requests[i]
                sges = [sge_cls(a, n, k) for a, n, k in req.sges]
                keep.append(sges)
                wr_id, signaled = req.wr_id, req.signaled
                if i == last and signal_id is not None:
                    wr_id, signaled = signal_id, True
                w = wr_cls(
                    wr_id=wr_id,
                    opcode=req.opcode,
                    num_sge=len(sges),
                    sg=sges or None,
                    send_flags=(_SIGNALED if signaled else 0) | (_FENCE if req.fence else 0),
                    next_wr=nxt,
                )
                if req.imm is not None:
                    w.imm_data = req.imm
                if req.opcode in rdma:
                    w.set_wr_rdma(req.rkey, req.remote_addr)
                keep.append(w)
                nxt = w
            self._qp.post_send(nxt)
        except PyverbsError as exc:
            raise _verbs_error("post_send", exc) from exc
        del keep

    def _post_one(self, req: SendRequest, signal_id: int | None) -> None:
        """Post one request, reusing the pyverbs work request built for the same values.

        A work request is fully determined by its opcode, SGEs and remote address and
        key, and ``ibv_post_send`` copies it into the send queue, so one pyverbs
        ``SendWR`` per such key serves every later post of it, with only ``wr_id`` and
        the flags set anew.  Callers post under one lock (the engine's), never at once.
        """
        key = (req.opcode, tuple(req.sges), req.remote_addr, req.rkey)
        try:
            entry = self._wr_cache.get(key)
            if entry is None:
                sges = [_wr.SGE(a, n, k) for a, n, k in req.sges]
                w = _wr.SendWR(opcode=req.opcode, num_sge=len(sges), sg=sges or None)
                if req.opcode in _RDMA_OPCODES:
                    w.set_wr_rdma(req.rkey, req.remote_addr)
                if len(self._wr_cache) >= _WR_CACHE:
                    self._wr_cache.clear()
                entry = self._wr_cache[key] = (w, sges)
            w = entry[0]
            fence = _FENCE if req.fence else 0
            if signal_id is None:
                w.wr_id, w.send_flags = req.wr_id, (_SIGNALED if req.signaled else 0) | fence
            else:
                w.wr_id, w.send_flags = signal_id, _SIGNALED | fence
            self._qp.post_send(w)
        except PyverbsError as exc:
            raise _verbs_error("post_send", exc) from exc

    def post_recv(self, wr_id: int, sges: Sequence[tuple[int, int, int]]) -> None:
        """Post one receive work request (pyverbs requires at least one SGE)."""
        if self._closed:
            raise StateError(f"queue pair {self.qpn:#x} is closed")
        with _translate("post_recv"):
            sge_objs = [_wr.SGE(a, n, k) for a, n, k in sges]
            w = _wr.RecvWR(wr_id=wr_id, num_sge=len(sge_objs), sg=sge_objs)
            self._qp.post_recv(w)
        del sge_objs, w

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wr_cache.clear()
        with _translate("destroy_qp"):
            self._qp.close()


def _pyverbs_gid(raw: bytes) -> Any:
    from pyverbs.addr import GID

    return GID(ipaddress.IPv6Address(raw).exploded)
