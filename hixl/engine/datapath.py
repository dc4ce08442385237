"""From transfer requests to work requests: checks, cached plans, and notification buffers.

Everything here runs without the engine lock: it reads only immutable values (a
region's keys, the peer's announced region tuple) and the plan cache, whose dict
operations are atomic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hixl.core import notify, wire
from hixl.core.descriptors import ContiguousDesc, Descriptor, as_segments
from hixl.core.plan import DeviceLimits, Op, check_alignment, check_bounds, plan_transfer
from hixl.core.wire import RemoteRegion
from hixl.engine.regions import Access, Region
from hixl.errors import ArgumentError, RegistrationError, StateError
from hixl.verbs import adapter as verbs

if TYPE_CHECKING:
    from hixl.engine.connection import Connection
    from hixl.engine.handles import TransferRequest

__all__ = ["CHUNK", "NotifySlots", "Planner"]

CHUNK = 16  # work requests per signaled chunk
PLAN_CACHE = 512  # planned (descriptor pair, region sizes) kept per engine

_PlannedWrs = list[tuple[int, list[tuple[int, int]]]]  # (remote offset, [(local offset, n)])


class Planner:
    """Checks requests against regions and policy, and turns them into work requests.

    Bounds, alignment and the plan depend only on (op, descriptors, region sizes), and
    KV transfers repeat the same layout layer after layer, so each is planned once.
    Descriptors that cannot be hashed (block lists hold arrays) are planned every time.
    """

    def __init__(self, limits: DeviceLimits, alignment: int | None) -> None:
        self.limits = limits
        self.alignment = alignment
        self._plans: dict[tuple[Any, ...], tuple[_PlannedWrs, int]] = {}

    def build(
        self, owner: object, conn: Connection, req: TransferRequest, index: int
    ) -> tuple[list[verbs.SendRequest], int]:
        """Work requests and byte count of one request; raises before anything is posted."""
        where = f"request {index}"
        if req.op not in ("write", "read"):
            raise ArgumentError(f"{where}: op must be 'write' or 'read', not {req.op!r}")
        op = Op.WRITE if req.op == "write" else Op.READ
        local = req.local
        if not isinstance(local, Region) or local.engine is not owner or local.closed:
            raise RegistrationError(
                f"{where}: local memory is not a region registered with this engine: {local!r}"
            )
        if op is Op.READ and not local.access & Access.LOCAL_WRITE:
            raise RegistrationError(
                f"{where}: get needs a local region with LOCAL_WRITE access; {local!r}"
            )
        remote = _resolve_remote(conn, req.remote, where)
        need = wire.REMOTE_WRITE if op is Op.WRITE else wire.REMOTE_READ
        if not remote.access & need:
            verb = "writable" if op is Op.WRITE else "readable"
            raise RegistrationError(
                f"{where}: peer region {remote.name or hex(remote.addr)} "
                f"(length={remote.length}) is not remotely {verb}"
            )
        wrs, nbytes = self._cached(op, req.local_desc, req.remote_desc, local, remote, where)
        opcode = verbs.WR_RDMA_WRITE if op is Op.WRITE else verbs.WR_RDMA_READ
        laddr, lkey, raddr, rkey = local.addr, local.lkey, remote.addr, remote.rkey
        send = verbs.SendRequest
        out = [
            send(
                0, opcode, [(laddr + o, n, lkey) for o, n in sges], raddr + roff, rkey, None, False
            )
            for roff, sges in wrs
        ]
        return out, nbytes

    def _cached(
        self,
        op: Op,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        local: Region,
        remote: RemoteRegion,
        where: str,
    ) -> tuple[_PlannedWrs, int]:
        key = (op, ldesc, rdesc, local.length, remote.length)
        try:
            cached = self._plans.get(key)
            hashable = True
        except TypeError:
            cached, hashable = None, False
        if cached is None:
            cached = self._plan(ldesc, rdesc, op, local.length, remote.length, where)
            if hashable:
                if len(self._plans) >= PLAN_CACHE:
                    self._plans.clear()
                self._plans[key] = cached
        return cached

    def _plan(
        self,
        ldesc: Descriptor | None,
        rdesc: Descriptor | None,
        op: Op,
        local_len: int,
        remote_len: int,
        where: str,
    ) -> tuple[_PlannedWrs, int]:
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


def _resolve_remote(conn: Connection, remote: RemoteRegion | str, where: str) -> RemoteRegion:
    if isinstance(remote, str):
        return conn.remote_region(remote)
    if isinstance(remote, RemoteRegion) and conn.exposes(remote):
        return remote
    raise RegistrationError(
        f"{where}: remote memory {remote!r} is not a region peer {conn.peer} exposes"
    )


class NotifySlots:
    """Registered send buffers for outgoing notifications, one slot per notification in flight.

    ``take``/``release`` run under the engine lock.
    """

    def __init__(self, device: verbs.Device, count: int) -> None:
        self.count = count
        self._buf = np.zeros(count * notify.SLOT_BYTES, dtype=np.uint8)
        self._mr = device.register(self._buf.ctypes.data, self._buf.nbytes, 0, self._buf)
        self._free = list(range(count))

    def take(self, payload: bytes, *, fence: bool = False) -> tuple[int, verbs.SendRequest]:
        """A slot holding ``payload`` and the SEND work request that carries it.

        ``fence`` (for a notification after READs) makes the SEND wait until the READs
        before it have completed, so the target hears "done" only once its memory has
        been read.
        """
        if not self._free:
            raise StateError(f"{self.count} notifications already in flight")
        slot = self._free.pop()
        start = slot * notify.SLOT_BYTES
        self._buf[start : start + len(payload)] = np.frombuffer(payload, np.uint8)
        sge = (self._mr.addr + start, len(payload), self._mr.lkey)
        return slot, verbs.SendRequest(0, verbs.WR_SEND, [sge], fence=fence)

    def release(self, slot: int) -> None:
        self._free.append(slot)
