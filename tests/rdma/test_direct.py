"""Blocking single requests posted and completed on the caller's thread (direct posts).

A repeated ``put``/``get`` of one work request to a connection with an idle queue pair
skips the hand-over and the handle: the caller reserves the lane's window, posts, and
polls the send CQ itself (``SinglePaths._solo``).  These tests check that such transfers move
their bytes, share the queue pairs correctly with ``put_async`` traffic, fail with their
own status, and end when the engine closes under them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hixl.core.descriptors import ContiguousDesc
from hixl.core.states import ConnState
from hixl.engine import Access, Engine, Region
from hixl.errors import CompletionError, ConnectionFailed, HixlError

from .loops import killing_the_peer_ends_the_loop

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
KIB = 1024


def pattern(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_repeated_blocking_puts_and_gets_are_posted_directly_and_move_their_bytes(
    pair: tuple[Engine, Engine],
) -> None:
    client, server = pair
    remote = np.zeros(64 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    src = pattern(64 * KIB, 1)
    back = np.zeros(64 * KIB, np.uint8)
    r_src = client.register(src, access=Access.NONE)
    r_back = client.register(back, access=Access.LOCAL_WRITE)
    client.connect(server.id, timeout=30.0)
    before = client.diagnostics().direct_posts
    rng = np.random.default_rng(2)
    n = 40
    for i in range(n):
        lo, ro = (int(x) * 4 * KIB for x in rng.integers(0, 16, 2))
        ld, rd = (
            ContiguousDesc(offset=lo, nbytes=4 * KIB),
            ContiguousDesc(offset=ro, nbytes=4 * KIB),
        )
        client.put(server.id, r_src, "dst", local_desc=ld, remote_desc=rd, timeout=30)
        assert np.array_equal(remote[ro : ro + 4 * KIB], src[lo : lo + 4 * KIB]), f"put {i}"
        client.get(server.id, r_back, "dst", local_desc=ld, remote_desc=rd, timeout=30)
        assert np.array_equal(back[lo : lo + 4 * KIB], remote[ro : ro + 4 * KIB]), f"get {i}"
    # The first put and the first get are checked and planned in full; every later one
    # reuses their template at its offsets and is posted by this thread.
    assert client.diagnostics().direct_posts - before == 2 * n - 2
    assert client.diagnostics().pending_transfers == 0


def test_blocking_puts_beside_a_put_async_stream_all_land(
    pair: tuple[Engine, Engine],
) -> None:
    """A blocking put finds a lane idle (posted directly) or busy with the stream's
    batches (queued behind them); either way every byte of both lands."""
    client, server = pair
    remote = np.zeros(128 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    src = pattern(128 * KIB, 3)
    r_src = client.register(src, access=Access.NONE)
    client.connect(server.id, timeout=30.0)
    half = 64 * KIB
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            handles = []
            for i in range(300):
                off = (i % 16) * 4 * KIB
                d = ContiguousDesc(offset=off, nbytes=4 * KIB)
                handles.append(
                    client.put_async(server.id, r_src, "dst", local_desc=d, remote_desc=d)
                )
            for h in handles:
                h.wait(60)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    before = client.diagnostics().direct_posts
    for i in range(60):
        off = half + (i % 16) * 4 * KIB
        d = ContiguousDesc(offset=off, nbytes=4 * KIB)
        client.put(server.id, r_src, "dst", local_desc=d, remote_desc=d, timeout=60)
        assert np.array_equal(remote[off : off + 4 * KIB], src[off : off + 4 * KIB])
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert np.array_equal(remote, src)
    assert client.diagnostics().pending_transfers == 0
    assert client.diagnostics().direct_posts > before  # some found a lane idle


def test_threads_repeating_one_template_at_their_own_offsets_all_land(
    pair: tuple[Engine, Engine],
) -> None:
    """Four threads loop on blocking 4 KiB puts of one template (same regions and sizes),
    each at offsets of its own 64 KiB quarter.  Direct posts and queued ones interleave
    on the connection's lanes and share the template's pooled chains; every put's bytes
    are where its caller put them the moment it returns."""
    client, server = pair
    threads_n, per, rounds = 4, 64 * KIB, 40
    remote = np.zeros(threads_n * per, np.uint8)
    server.register(remote, access=RW, name="dst")
    src = pattern(threads_n * per, 7)
    r_src = client.register(src, access=Access.NONE)
    client.connect(server.id, timeout=30.0)
    first = ContiguousDesc(offset=0, nbytes=4 * KIB)
    client.put(server.id, r_src, "dst", local_desc=first, remote_desc=first, timeout=30)
    before = client.diagnostics().direct_posts
    errors: list[BaseException] = []
    start = threading.Barrier(threads_n)

    def loop(k: int) -> None:
        rng = np.random.default_rng(10 + k)
        try:
            start.wait(30)
            for _ in range(rounds):
                lo, ro = (k * per + int(x) * 4 * KIB for x in rng.integers(0, 16, 2))
                ld = ContiguousDesc(offset=lo, nbytes=4 * KIB)
                rd = ContiguousDesc(offset=ro, nbytes=4 * KIB)
                client.put(server.id, r_src, "dst", local_desc=ld, remote_desc=rd, timeout=60)
                if not np.array_equal(remote[ro : ro + 4 * KIB], src[lo : lo + 4 * KIB]):
                    raise AssertionError(f"thread {k}: put {lo} -> {ro} did not land there")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers), "a blocking put never returned"
    assert not errors, errors
    assert client.diagnostics().direct_posts > before
    assert client.diagnostics().pending_transfers == 0


def test_a_direct_put_refused_by_the_target_fails_with_its_own_status(
    pair: tuple[Engine, Engine],
) -> None:
    """The client believes the peer's 8 KiB region is 1 MiB (test hook): a put at an
    offset past the real end passes the client's checks, is posted directly, and the
    target refuses it: IBV_WC_REM_ACCESS_ERR, the connection FAILED, later calls refused."""
    client, server = pair
    remote = np.zeros(8 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    src = pattern(64 * KIB, 4)
    r_src = client.register(src, access=Access.NONE)
    conn = client.connect(server.id, timeout=30.0)
    good = conn.remote_region("dst")
    conn.set_remote_regions((replace(good, length=1 << 20),))
    first = ContiguousDesc(offset=0, nbytes=4 * KIB)
    client.put(server.id, r_src, "dst", local_desc=first, remote_desc=first, timeout=30)
    assert np.array_equal(remote[: 4 * KIB], src[: 4 * KIB])
    before = client.diagnostics().direct_posts
    past = ContiguousDesc(offset=32 * KIB, nbytes=4 * KIB)
    with pytest.raises(CompletionError) as info:
        client.put(server.id, r_src, "dst", local_desc=first, remote_desc=past, timeout=30)
    assert info.value.status_name == "IBV_WC_REM_ACCESS_ERR", str(info.value)
    assert client.diagnostics().direct_posts == before + 1
    assert conn.state is ConnState.FAILED
    with pytest.raises(ConnectionFailed):
        client.put(server.id, r_src, "dst", local_desc=first, remote_desc=first, timeout=30)
    assert client.diagnostics().pending_transfers == 0


def test_closing_the_engine_ends_a_direct_put_under_way(
    pair: tuple[Engine, Engine],
) -> None:
    """Another thread loops on blocking 8 MiB puts (one work request each, a few tenths
    of a second apiece on soft-RoCE) while the engine closes: the loop ends with a hixl
    error or a finished put, promptly, and nothing crashes."""
    client, server = pair
    size = 8 << 20
    remote = np.zeros(size, np.uint8)
    server.register(remote, access=RW, name="dst")
    r_src = client.register(pattern(size, 5), access=Access.NONE)
    client.connect(server.id, timeout=30.0)
    client.put(server.id, r_src, "dst", timeout=60)  # checked and planned: the template
    outcome: list[BaseException | None] = []
    started = threading.Event()

    def loop() -> None:
        try:
            while True:
                started.set()
                client.put(server.id, r_src, "dst", timeout=60)
        except HixlError as exc:
            outcome.append(exc)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            outcome.append(exc)

    t = threading.Thread(target=loop)
    t.start()
    started.wait(10)
    time.sleep(0.3)
    assert client.diagnostics().direct_posts >= 1
    client.close()
    t.join(30)
    assert not t.is_alive(), "a blocking put outlived its engine's close()"
    assert len(outcome) == 1 and isinstance(outcome[0], HixlError), outcome


def test_a_peer_killed_under_direct_puts_ends_them_in_time() -> None:
    """A peer process is killed while another thread loops on blocking 8 MiB puts to it:
    the put under way (or the next) ends with an error naming the peer, within its
    timeout and a margin, and the connection is FAILED."""

    def start(client: Engine, peer: str, r: Region) -> Callable[[], None]:
        client.put(peer, r, "buf", timeout=30)  # checked and planned: the template
        return lambda: client.put(peer, r, "buf", timeout=3)

    def check(client: Engine) -> None:
        assert client.diagnostics().direct_posts >= 1

    killing_the_peer_ends_the_loop(start, check)
