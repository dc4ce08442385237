"""Memory for send chains: touched once, handed out in blocks, taken back and reused.

:class:`ChainMemory` is the allocator :meth:`hixl.verbs.chain.SendChain.for_plan` and
:meth:`~hixl.verbs.chain.SendChain.blank` can make a chain's C arrays with, so that a new
chain lands in memory whose pages are already faulted in (see the class for the sizes,
the reserve and what is kept beyond it).  An engine keeps one per planner.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from hixl.errors import ArgumentError
from hixl.verbs._ffi import address, ffi
from hixl.verbs.structs import SGE_DTYPE, WR_DTYPE

__all__ = ["ChainMemory"]

_WR_SIZE = WR_DTYPE.itemsize
_SGE_SIZE = SGE_DTYPE.itemsize
_VOID_PTR = ffi.typeof("void *")
_PAGE = 4096


class _Capacities(Protocol):
    """What :meth:`ChainMemory.chain_bytes` reads of a :class:`~hixl.verbs.chain.SendChain`."""

    @property
    def capacity(self) -> int: ...

    @property
    def sge_capacity(self) -> int: ...


class ChainMemory:
    """Memory for chains, allocated and touched once and kept for the next chain.

    A new page of memory costs its first touch a page fault (about 1-3 µs each on the
    machines measured), so a chain of 8192 WRs made in new memory pays about 280 faults
    on top of being written.  This keeps ``reserve`` bytes touched from the start
    (when the engine is made), hands out blocks of a power-of-two size class from them,
    and takes a block back when the chain that held it is freed.  Blocks beyond the
    reserve come from the C heap; freed, they are kept for reuse while the memory kept
    beyond the reserve stays under ``retain`` bytes, and given back to the heap after.

    :attr:`allocator` is the cffi allocator to make chain arrays with (memory not
    cleared: :meth:`SendChain.for_plan` writes every byte).  Thread-safe: blocks are
    taken, returned and carved under a lock that guards a few integers and lists.

    :meth:`close` gives the memory back: free blocks at once, the reserve as soon as no
    chain holds a block of it (a chain keeps the memory it was made in alive, so closing
    never pulls memory from under one).  The allocator's functions hold the memory's
    state, not this object, so nothing here is a reference cycle: the reserve never
    waits for the cyclic garbage collector.
    """

    __slots__ = ("__weakref__", "_pool", "allocator")

    def __init__(self, reserve: int = 2 << 20, retain: int = 8 << 20) -> None:
        if reserve < 0 or retain < 0:
            raise ArgumentError(f"reserve and retain must be >= 0, got {reserve} and {retain}")
        self._pool = pool = _Pool(reserve, retain)
        self.allocator = ffi.new_allocator(
            alloc=pool.alloc, free=pool.release, should_clear_after_alloc=False
        )

    def __repr__(self) -> str:
        pool = self._pool
        free = sum(k * len(v) for k, v in pool.free.items())
        return (
            f"<ChainMemory reserve_left={pool.end - pool.next} free={free} "
            f"heap_kept={pool.kept}{' closed' if pool.closed else ''}>"
        )

    @staticmethod
    def chain_bytes(chain: _Capacities) -> int:
        """The memory a chain of ``chain``'s capacity holds when made here: its WR and
        SGE arrays, each rounded up to its block's size class."""
        return _size_class(chain.capacity * _WR_SIZE) + _size_class(chain.sge_capacity * _SGE_SIZE)

    @property
    def heap_blocks(self) -> int:
        """Blocks from the C heap, out or kept free."""
        return len(self._pool.heap)

    @property
    def heap_kept(self) -> int:
        """Bytes of the C heap's blocks, out or kept free."""
        return self._pool.kept

    @property
    def reserve_held(self) -> bool:
        """Whether the reserve is still allocated (False once closed and given back)."""
        return self._pool.slab is not None

    def close(self) -> None:
        """Give the free blocks back at once and the reserve when its last block is
        freed; later blocks come from the C heap and go back to it.  Idempotent."""
        self._pool.close()


def _size_class(size: int) -> int:
    """The block size :class:`ChainMemory` gives ``size`` bytes: a power of two, >= a page."""
    return max(_PAGE, 1 << (max(size, 1) - 1).bit_length())


class _Pool:
    """The state behind a :class:`ChainMemory`'s allocator (see there)."""

    __slots__ = (
        "closed",
        "end",
        "free",
        "heap",
        "kept",
        "lock",
        "next",
        "retain",
        "size",
        "slab",
        "slab_out",
    )

    def __init__(self, reserve: int, retain: int) -> None:
        self.slab: Any = ffi.new("char[]", max(reserve, 1))
        # Touch every page now: one store per page faults it in.
        np.frombuffer(ffi.buffer(self.slab), np.uint8)[::_PAGE] = 0
        self.next = address(self.slab)
        self.end = self.next + reserve
        # Reentrant: making a heap block may run the garbage collector, which may free a
        # chain, whose block comes back here in the same thread.
        self.lock = threading.RLock()
        self.free: dict[int, list[int]] = {}  # size class -> addresses of free blocks
        self.size: dict[int, int] = {}  # address of a block out -> its size class
        self.heap: dict[int, Any] = {}  # address -> the cdata owning a block from the heap
        self.retain = retain
        self.kept = 0  # bytes of heap blocks kept (out or free)
        self.slab_out = 0  # blocks of the reserve out
        self.closed = False

    def alloc(self, size: int) -> Any:
        size_class = _size_class(size)
        with self.lock:
            blocks = self.free.get(size_class)
            if blocks:
                addr = blocks.pop()
            elif self.slab is not None and self.next + size_class <= self.end:
                addr = self.next
                self.next += size_class
            else:
                block = ffi.new("char[]", size_class)
                addr = address(block)
                self.heap[addr] = block
                self.kept += size_class
            if addr not in self.heap:
                self.slab_out += 1
            self.size[addr] = size_class
        return ffi.cast(_VOID_PTR, addr)

    def release(self, ptr: Any) -> None:
        addr = int(ffi.cast("uintptr_t", ptr))
        with self.lock:
            size_class = self.size.pop(addr, 0)
            if not size_class:
                return
            if addr in self.heap:
                if self.closed or self.kept > self.retain:
                    del self.heap[addr]
                    self.kept -= size_class
                    return
            else:
                self.slab_out -= 1
                if self.closed:
                    if not self.slab_out:
                        self.slab = None
                    return
            self.free.setdefault(size_class, []).append(addr)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.next = self.end  # nothing more is carved from the reserve
            for size_class, blocks in self.free.items():
                for addr in blocks:
                    if self.heap.pop(addr, None) is not None:
                        self.kept -= size_class
            self.free.clear()
            if not self.slab_out:
                self.slab = None
