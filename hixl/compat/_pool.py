"""hixl's buffer pool: transfers of unregistered host memory staged through registered buffers.

Real hixl keeps a pool of registered staging buffers (option ``BufferPool``,
``"NUM:SIZE"`` in MiB, default ``"4:8"``) and moves memory that no
``register_mem`` covers through it (hicann/hixl
``src/llm_datadist/adxl/buffer_transfer_service.cc``).  Here the same is done
on the local side of a transfer:

* WRITE: a chunk of the caller's memory is copied into a free buffer, and the
  buffer is written to the peer's registered memory by RDMA WRITE;
* READ: the peer's registered memory is read into a free buffer by RDMA READ,
  then copied out to the caller's memory.

Theory of operation
-------------------
:func:`~hixl.compat._descs.plan_relay` packs the descs into chunks of at most
one buffer.  :func:`run_relay` keeps several chunks in flight: it copies the
next chunk while earlier ones are on the wire, and only waits when every
buffer it could get is busy.  A relay that holds a buffer in flight never
waits on the pool, only on its own oldest transfer, so relays sharing the
pool cannot deadlock; one that holds none waits on the pool until its
deadline.  A buffer goes back to the pool only once the engine reports its
transfer finished (done or failed), never while the NIC may still touch it.

Buffers are allocated and registered on first use, up to NUM, and released
with the engine.  Locks: ``BufferPool._cond`` guards the free list and the
count of buffers made; registration and copies run outside it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hixl import Access, Engine, Region, RemoteRegion, TransferHandle, TransferRequest
from hixl.compat._descs import RelayPiece, plan_relay
from hixl.core.descriptors import BlockListDesc
from hixl.errors import StateError, TransferTimeout

__all__ = ["BufferPool", "StagingBuffer", "run_relay"]

MIB = 1 << 20


@dataclass(slots=True)
class StagingBuffer:
    """One registered staging buffer of the pool."""

    array: np.ndarray
    region: Region

    @property
    def addr(self) -> int:
        return self.region.addr


class BufferPool:
    """``count`` registered buffers of ``size`` bytes each, made on demand."""

    def __init__(self, engine: Engine, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self._engine = engine
        self._cond = threading.Condition()
        self._free: list[StagingBuffer] = []
        self._made = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<BufferPool {self.count} x {self.size} bytes, made={self._made}>"

    @property
    def made(self) -> int:
        """Buffers allocated and registered so far (at most ``count``)."""
        return self._made

    def try_acquire(self) -> StagingBuffer | None:
        """A free buffer, a new one while fewer than ``count`` exist, or None at once."""
        with self._cond:
            if self._closed:
                raise StateError("the buffer pool is closed (finalize was called)")
            if self._free:
                return self._free.pop()
            if self._made >= self.count:
                return None
            self._made += 1  # reserved; made outside the lock
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def acquire(self, deadline: float) -> StagingBuffer:
        """A buffer, waiting for one to be released until ``deadline`` (monotonic seconds).

        Raises :class:`TransferTimeout` when none is free in time.
        """
        while True:
            buf = self.try_acquire()
            if buf is not None:
                return buf
            with self._cond:
                if self._free or self._made < self.count or self._closed:
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"no staging buffer free before the deadline "
                        f"(pool of {self.count} x {self.size} bytes, all in use)"
                    )
                self._cond.wait(left)

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            if not self._closed:
                self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Release every free buffer's registration; wake waiters.  Idempotent."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._cond.notify_all()
        for buf in free:
            self._engine.deregister(buf.region)

    def _make(self) -> StagingBuffer:
        array = np.empty(self.size, dtype=np.uint8)
        region = self._engine.register(array, access=Access.LOCAL_WRITE)
        return StagingBuffer(array, region)


def _requests(
    op: str,
    buf: StagingBuffer,
    chunk: Sequence[RelayPiece],
    find_remote: Callable[[int, int], RemoteRegion],
) -> list[TransferRequest]:
    """One request per peer region the chunk touches, pieces in order."""
    groups: dict[int, tuple[RemoteRegion, list[RelayPiece]]] = {}
    for piece in chunk:
        remote = find_remote(piece.remote_addr, piece.nbytes)
        groups.setdefault(id(remote), (remote, []))[1].append(piece)
    return [
        TransferRequest(
            op=op,
            local=buf.region,
            remote=remote,
            local_desc=BlockListDesc.from_pairs(
                ((p.buf_off, p.nbytes) for p in pieces), alignment=None
            ),
            remote_desc=BlockListDesc.from_pairs(
                ((p.remote_addr - remote.addr, p.nbytes) for p in pieces), alignment=None
            ),
        )
        for remote, pieces in groups.values()
    ]


def run_relay(
    engine: Engine,
    pool: BufferPool,
    peer: str,
    op: str,
    descs: Sequence[tuple[int, int, int]],
    find_remote: Callable[[int, int], RemoteRegion],
    deadline: float,
) -> None:
    """Move ``(local_addr, remote_addr, nbytes)`` descs through ``pool``; block until done.

    ``op`` is ``"write"`` (local to remote) or ``"read"``.  The local
    addresses must be host memory this process may read (write) for
    ``nbytes``; remote ones must lie in regions ``find_remote`` knows.
    Raises what the engine raises (:class:`TransferTimeout` after
    ``deadline``, :class:`ConnectionFailed`, :class:`CompletionError`...).
    """
    chunks = plan_relay(descs, pool.size)
    inflight: deque[tuple[StagingBuffer, TransferHandle, list[RelayPiece]]] = deque()

    def finish_oldest() -> None:
        buf, handle, chunk = inflight.popleft()
        try:
            handle.wait(max(0.0, deadline - time.monotonic()))
            if op == "read":
                for p in chunk:
                    ctypes.memmove(p.local_addr, buf.addr + p.buf_off, p.nbytes)
        finally:
            if handle.done():
                pool.release(buf)
            else:  # still owned by the NIC: wait for the engine to fail it, then release
                inflight.appendleft((buf, handle, chunk))

    try:
        for chunk in chunks:
            buf = pool.try_acquire() if inflight else pool.acquire(deadline)
            while buf is None:
                finish_oldest()
                buf = pool.try_acquire() if inflight else pool.acquire(deadline)
            try:
                if op == "write":
                    for p in chunk:
                        ctypes.memmove(buf.addr + p.buf_off, p.local_addr, p.nbytes)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout("relay missed its deadline before posting every chunk")
                handle = engine.transfer_async(
                    peer, _requests(op, buf, chunk, find_remote), timeout=left
                )
            except BaseException:
                pool.release(buf)
                raise
            inflight.append((buf, handle, chunk))
        while inflight:
            finish_oldest()
    finally:
        # On failure, buffers still on the wire go back only once the engine has
        # finished their transfers (each has its own deadline, so this is bounded).
        while inflight:
            buf, handle, _ = inflight.popleft()
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
            finally:
                if handle.done():
                    pool.release(buf)
