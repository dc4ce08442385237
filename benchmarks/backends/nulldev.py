"""A null verbs device: the engine's own path natively, with only the device call left out.

:func:`null_device` swaps :func:`hixl.verbs.adapter.open_device` for one that returns a
:class:`NullDevice` (rxe's limits, no kernel device).  Engines made inside it handshake
over TCP as ever; their queue pairs run the adapter's own ``post_pieces``/``post_whole``
(argument and region checks, linking the ranges) up to the ``ibv_post_send`` call, which
is a no-op; the WRs' signaled completions are then written to the send queue's
completion queue, as if the device had finished them at once.  That completion step
is the device's work: its time is counted apart (:attr:`NullDevice.device_s`), so
``wall - device_s`` is the software cost of validation, region lookup, planning,
building and posting.  No bytes move.

For cost measurements only: nothing here checks what a real device would refuse.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from hixl.verbs import adapter
from hixl.verbs.chain import SEND_SIGNALED, SendChain

#: rxe's limits on kernel 6.1 (docs: RXE-NOTES), so that plans match the VM's.
CAPS = adapter.DeviceCaps(
    max_sge=32,
    max_sge_rd=32,
    max_qp_wr=1 << 20,
    max_cqe=1 << 20,
    max_msg_sz=1 << 23,
    max_mr_size=(1 << 64) - 1,
    max_qp_rd_atom=128,
)
_keys = itertools.count(0x100)
_qpns = itertools.count(0x11)


class NullMR:
    """A registration: an address range and two keys."""

    def __init__(self, addr: int, length: int, access: int, owner: object) -> None:
        self.addr, self.length, self.access = addr, length, access
        self.lkey = self.rkey = next(_keys)
        self._owner = owner
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._owner = None


class NullCQ(adapter.CompletionQueue):
    """Completions the null queue pairs wrote; ``fd`` an eventfd when armed for events."""

    def __init__(self, depth: int, events: bool) -> None:  # no super(): no C queue
        self.depth = depth
        self.fd = os.eventfd(0, os.EFD_NONBLOCK) if events else None
        self._rows: deque[tuple[int, int, int, int]] = deque()
        self._armed = False
        self._closed = False

    def push(self, rows: list[tuple[int, int, int, int]]) -> None:
        self._rows.extend(rows)
        if self._armed and self.fd is not None:
            self._armed = False
            os.eventfd_write(self.fd, 1)

    def poll_rows(self, max_entries: int = 64) -> list[tuple[int, int, int, int]]:
        rows = self._rows
        out: list[tuple[int, int, int, int]] = []
        while rows and len(out) < max_entries:
            out.append(rows.popleft())
        return out

    def poll_one(self) -> tuple[int, int] | None:
        return (0, 0) if self._rows and self._rows.popleft() else None

    def poll(self, max_entries: int = 16) -> list[adapter.Completion]:
        return [
            adapter.Completion(w, s, 0, 0, None, q, v) for w, s, v, q in self.poll_rows(max_entries)
        ]

    def arm(self) -> None:
        self._armed = True
        if self._rows and self.fd is not None:
            self._armed = False
            os.eventfd_write(self.fd, 1)

    def take_event(self) -> bool:
        if self.fd is None:
            return False
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.fd is not None:
                os.close(self.fd)


class NullQP(adapter.QueuePair):
    """A queue pair whose ``ibv_post_send`` is a no-op; its completions come at once."""

    def __init__(self, device: NullDevice, send_cq: NullCQ, max_send_wr: int) -> None:
        self._null = device
        self._device = device  # type: ignore[assignment]
        self._cq = send_cq
        self._qp = None
        self.qpn = next(_qpns)
        self.max_send_wr = max_send_wr
        self.max_send_sge = CAPS.max_sge
        self._post_send_fn = _no_post
        self._bad_send = None
        self._closed = False

    @property
    def state_name(self) -> str:
        return "CLOSED" if self._closed else "RTS"

    def connect(self, *args: Any, **kwargs: Any) -> None:
        self._check_open()

    def to_error(self) -> None:
        pass

    def _complete(self, pieces: Sequence[tuple[SendChain, int, int]]) -> None:
        t0 = time.perf_counter()
        rows = []
        for chain, start, stop in pieces:
            wrs = chain.wrs[start:stop]
            signaled = wrs["wr_id"][(wrs["send_flags"] & SEND_SIGNALED) != 0]
            rows += [(int(w), 0, 0, self.qpn) for w in signaled]
        self._cq.push(rows)
        self._null.add_device_time(time.perf_counter() - t0)

    def post_pieces(self, pieces: Sequence[tuple[SendChain, int, int]]) -> None:
        super().post_pieces(pieces)
        self._complete(pieces)

    def post_whole(self, chain: SendChain) -> None:
        super().post_whole(chain)
        self._complete(((chain, 0, chain.num_wrs),))

    def post_chain(self, chain: SendChain, start: int = 0, stop: int | None = None) -> int:
        n = super().post_chain(chain, start, stop)
        self._complete(((chain, start, start + n),))
        return n

    def post_recv(self, wr_id: int, sges: Sequence[tuple[int, int, int]]) -> None:
        self._check_open()

    def close(self) -> None:
        self._closed = True


def _no_post(qp: Any, head: Any, bad: Any) -> int:
    return 0


class NullDevice:
    """What :class:`hixl.verbs.adapter.Device` offers the engine, with no device behind."""

    def __init__(self) -> None:
        self.name, self.port, self.gid_index = "null0", 1, 1
        self.caps = CAPS
        self.port_state, self.active_mtu, self.lid = 4, 1024, 0
        self.gid = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])
        self._closed = False
        self._lock = threading.Lock()
        self.device_s = 0.0
        self._cqs: weakref.WeakSet[NullCQ] = weakref.WeakSet()  # closed with the device

    def add_device_time(self, seconds: float) -> None:
        with self._lock:
            self.device_s += seconds

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, address: int, length: int, access: int, owner: object = None) -> NullMR:
        return NullMR(address, length, access, owner)

    def create_cq(self, depth: int, *, events: bool = False) -> NullCQ:
        cq = NullCQ(depth, events)
        self._cqs.add(cq)
        return cq

    def create_rc_qp(
        self,
        send_cq: NullCQ,
        recv_cq: NullCQ,
        max_send_wr: int,
        max_recv_wr: int,
        max_send_sge: int,
        max_recv_sge: int = 1,
    ) -> NullQP:
        return NullQP(self, send_cq, max_send_wr)

    def close(self) -> None:
        self._closed = True
        for cq in list(self._cqs):
            cq.close()  # its eventfd, as a real device's close() closes its CQs
        self._cqs.clear()

    def __enter__(self) -> NullDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def null_device() -> Iterator[list[NullDevice]]:
    """Within it, engines open null devices; yields the list of those opened so far."""
    opened: list[NullDevice] = []
    real = adapter.open_device

    def open_null(
        name: str | None = None, port: int | None = None, gid_index: int | None = None
    ) -> NullDevice:
        dev = NullDevice()
        opened.append(dev)
        return dev

    adapter.open_device = open_null  # type: ignore[assignment]
    try:
        yield opened
    finally:
        adapter.open_device = real
