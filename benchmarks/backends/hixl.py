"""hixl, driven the way the benchmarks drive every contender.

An :class:`EnginePair` is a listening engine and a client engine connected to it in this
process, on the device hixl picks; :func:`hixl_stream` keeps ``depth`` transfers in flight
like ``ib_write_bw -t``; :func:`check_bytes` verifies the bytes after a stream.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from hixl import Access, ContiguousDesc, Engine, Region
from hixl.testbed.net import free_tcp_port

from ..common.errors import BenchError


class EnginePair:
    """A listening server engine and a client engine connected to it, in this process."""

    def __init__(self, max_size: int) -> None:
        self.server = Engine(f"127.0.0.1:{free_tcp_port()}")
        self.client = Engine("127.0.0.1:0")
        rng = np.random.default_rng(7)
        self.remote_buf = rng.integers(0, 256, max_size, dtype=np.uint8)
        self.src = rng.integers(0, 256, max_size, dtype=np.uint8)
        self.dst = np.zeros(max_size, np.uint8)
        self.server.register(
            self.remote_buf, access=Access.REMOTE_WRITE | Access.REMOTE_READ, name="bench"
        )
        self.r_src = self.client.register(self.src, access=Access.NONE)
        self.r_dst = self.client.register(self.dst, access=Access.LOCAL_WRITE)
        self.peer = self.server.id
        self.client.connect(self.peer, timeout=30.0)

    def close(self) -> None:
        self.client.close()
        self.server.close()


SAMPLE_EVERY = 16
""":func:`hixl_stream` times one call in this many."""


def hixl_stream(
    pair: EnginePair, op: str, size: int, iters: int, depth: int
) -> tuple[float, float]:
    """Run ``iters`` transfers of ``size`` bytes with up to ``depth`` in flight.

    Returns ``(wall seconds, seconds spent inside put_async/get_async)``; the second is
    the Python cost of validating, planning and posting, paid on the caller's thread.
    It is estimated from one call in ``SAMPLE_EVERY`` (the first, then every
    ``SAMPLE_EVERY``-th), timed alone and scaled: timing every call would add two clock
    readings per message to the stream, and in the VM (no usable TSC, the clock source
    is the HPET) each one is a system call of a few microseconds that ``ib_write_bw``'s
    loop does not pay.
    """
    desc = ContiguousDesc(offset=0, nbytes=size)
    eng = pair.client
    start = eng.put_async if op == "write" else eng.get_async
    local: Region = pair.r_src if op == "write" else pair.r_dst
    timeout = 60.0 + depth * size / 1e6  # generous: >= 1 MB/s per message in flight
    window: deque[Any] = deque()
    clock = time.perf_counter
    in_call = 0.0
    timed = 0
    peer = pair.peer
    t0 = clock()
    for i in range(iters):
        if len(window) >= depth:
            window.popleft().wait()
        sampled = not i % SAMPLE_EVERY
        if sampled:
            c0 = clock()
        window.append(
            start(peer, local, "bench", local_desc=desc, remote_desc=desc, timeout=timeout)
        )
        if sampled:
            in_call += clock() - c0
            timed += 1
    while window:
        window.popleft().wait()
    return clock() - t0, in_call * iters / max(1, timed)


def check_bytes(pair: EnginePair, op: str, size: int) -> None:
    """After a put the remote buffer must equal the source; after a get, the reverse."""
    a, b = (pair.src, pair.remote_buf) if op == "write" else (pair.remote_buf, pair.dst)
    if not np.array_equal(a[:size], b[:size]):
        raise BenchError(f"hixl {op} of {size} bytes did not move the bytes exactly")
