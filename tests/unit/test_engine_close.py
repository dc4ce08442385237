"""What an engine gives back when it closes, on the null device (no RDMA needed: engines
handshake over TCP and post into nothing, see benchmarks/backends/nulldev.py)."""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from benchmarks.backends.nulldev import null_device
from hixl import Access, Engine
from hixl.engine.datapath import CHAIN_RESERVE
from hixl.testbed.net import free_tcp_port

RW = Access.REMOTE_READ | Access.REMOTE_WRITE


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def server() -> Iterator[Engine]:
    with null_device() as opened:
        eng = Engine(f"127.0.0.1:{free_tcp_port()}")
        eng.register(np.zeros(1 << 16, np.uint8), access=RW, name="dst")
        opened.clear()
        try:
            yield eng
        finally:
            eng.close()


def test_closed_engines_give_their_buffers_back_without_the_cyclic_collector(
    server: Engine,
) -> None:
    """connect -> put -> close by a fresh client engine, 20 times, the cyclic garbage
    collector off (it runs by object counts, not bytes, and a loop of engines made few
    objects): each engine's chain reserve (2 MiB) and notification buffers must go at
    close, not with the engine object. The engines' Python objects stay (the collector
    is off); they are well under half a reserve each."""

    def cycle(i: int) -> None:
        with null_device() as opened, Engine("127.0.0.1:0") as cli:
            src = cli.register(np.full(4096, i % 251, np.uint8), access=Access.NONE)
            cli.connect(server.id, timeout=10)
            cli.put(server.id, src, "dst", timeout=10)
            opened.clear()

    for i in range(3):  # warm-up: first calls, the server's first peers
        cycle(i)
    gc.collect()
    cycles = 20
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        rss0 = rss_bytes()
        for i in range(cycles):
            cycle(i)
        grown = rss_bytes() - rss0
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()
    bound = cycles * CHAIN_RESERVE // 2
    assert grown < bound, (
        f"RSS grew {grown / 2**20:.1f} MiB in {cycles} closed engines "
        f"(bound {bound / 2**20:.0f} MiB: half a chain reserve each)"
    )


def test_connections_that_are_gone_are_not_kept_by_the_calls_kept_for_them() -> None:
    """A client puts to three servers in turn, each of which goes away: the calls it keeps
    checked and planned (templates, fast paths) must not keep those connections, and
    with them their receive buffers and region tables, for as long as the cache lasts."""
    # No direct lane: the null device does not poll one.
    with null_device() as opened, Engine("127.0.0.1:0", direct_lane=False) as cli:
        src = cli.register(np.ones(1 << 16, np.uint8), access=Access.NONE)
        gone = []
        for _ in range(3):
            with Engine(f"127.0.0.1:{free_tcp_port()}", direct_lane=False) as srv:
                srv.register(np.zeros(1 << 16, np.uint8), access=RW, name="dst")
                cli.connect(srv.id, timeout=10)
                for _ in range(3):
                    cli.put(srv.id, src, "dst", timeout=10)
                    cli.put_async(srv.id, src, "dst", timeout=10).wait()
                gone.append(weakref.ref(cli.connection(srv.id)))
            cli.disconnect(srv.id)
            opened.clear()
        deadline = time.monotonic() + 5
        while any(r() is not None for r in gone) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        kept = [r() for r in gone if r() is not None]
    assert not kept, f"{len(kept)} of 3 connections to peers that left are still held: {kept}"
