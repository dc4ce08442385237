"""No socket I/O under the engine lock: a peer that stops reading stalls nobody else."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from hixl import Access, Engine
from hixl.engine import locks
from hixl.testbed.net import free_tcp_port

from .conftest import listening_engine
from .peerproc import PeerProcess

REGIONS = 150
LIMIT = 0.100  # seconds: the bound for register() and puts while a peer stalls
# Every call, slowest included: between the emulator's rare hiccups (one register() of
# 150 took 114 ms in a clean-clone CI run) and the defect (register() blocked 5 s).
STALL_S = 1.0


def test_stalled_peer_never_blocks_register_or_other_puts() -> None:
    """A peer process frozen with SIGSTOP reads nothing from its control socket.

    Every region registered after that is announced to it; the announcements (a few MB in
    all, as each carries every exposed region) fill the socket buffers.  register() and
    puts to a healthy peer must still finish within 100 ms (19 calls in 20 of each), and
    none may take a second.  (Before control messages were queued for the progress
    thread, register() sent them itself under the engine lock and blocked for up to 5 s
    here.)
    """
    stalled = PeerProcess(f"127.0.0.1:{free_tcp_port()}", 4096)
    healthy = listening_engine()
    eng = Engine("127.0.0.1:0")
    try:
        stalled.wait_ready()
        dst = np.zeros(4096, np.uint8)
        healthy.register(dst, access=Access.REMOTE_WRITE, name="dst")
        src = eng.register(np.full(4096, 5, np.uint8), access=Access.NONE)
        eng.connect(stalled.id, timeout=30)
        eng.connect(healthy.id, timeout=30)
        eng.put(healthy.id, src, "dst", timeout=30)  # warm-up
        assert stalled.proc.pid is not None
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        buffers, register_s, put_s = [], [], []
        for i in range(REGIONS):
            buf = np.zeros(4096, np.uint8)
            buffers.append(buf)
            t0 = time.perf_counter()
            eng.register(buf, access=Access.REMOTE_WRITE, name=f"region-{i:04d}-" + "x" * 100)
            register_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.put(healthy.id, src, "dst", timeout=10)
            put_s.append(time.perf_counter() - t0)
        print(
            f"while a peer stalls: register() max {max(register_s) * 1e3:.1f} ms, "
            f"put max {max(put_s) * 1e3:.1f} ms over {REGIONS} rounds"
        )
        for name, times in (("register()", register_s), ("put", put_s)):
            slow = sorted(times)
            assert slow[-1] < STALL_S, (name, slow[-5:])
            assert slow[int(len(slow) * 0.95)] < LIMIT, (name, slow[-10:])
        assert np.all(dst == 5)
    finally:
        if stalled.proc.pid is not None:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        eng.close()
        healthy.close()
        stalled.close()


def test_no_wakeup_or_socket_send_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the lock checks on, every path that queues control traffic or drops a
    connection lets go of the engine lock before the wake-up byte or a send: a region
    announced and withdrawn, a disconnect (its goodbye), a peer's goodbye read, and
    close().  A wake-up sent under the lock raises in the caller (or kills the progress
    thread, which fails the put after it)."""
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)  # engines made from here are checked
    server = listening_engine()
    client = Engine("127.0.0.1:0")
    try:
        client.connect(server.id, timeout=30)
        dst = np.zeros(4096, np.uint8)
        region = server.register(dst, access=Access.REMOTE_WRITE, name="late")  # announced
        deadline = time.monotonic() + 10
        conn = client.connection(server.id)
        while not any(r.name == "late" for r in conn.remote_regions):
            assert time.monotonic() < deadline, "the new region was never announced"
            time.sleep(0.01)
        src = client.register(np.full(4096, 7, np.uint8), access=Access.NONE)
        client.put(server.id, src, "late", timeout=30)
        assert np.all(dst == 7)
        server.deregister(region)  # withdrawn
        client.disconnect(server.id)  # a goodbye queued, the connection dropped
        client.connect(server.id, timeout=30)  # the server drops the old one for it
        assert client.connection(server.id).state.name == "READY"
    finally:
        client.close()
        server.close()
