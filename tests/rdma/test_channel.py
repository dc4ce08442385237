"""Channels: one thread's blocking puts and gets on a connection's direct lane.

A :class:`hixl.Channel` posts one work request per call on a queue pair with a
completion queue of its own and polls it on the caller's thread.  These tests check
that it moves exactly the bytes asked for, refuses bad input before posting anything,
fails with the work request's own status, follows the regions' and the connection's
lifetimes, and shares the connection with ordinary transfers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hixl import (
    Access,
    AlignmentError,
    ArgumentError,
    BoundsError,
    Channel,
    CompletionError,
    Connection,
    ConnectionFailed,
    ConnState,
    ContiguousDesc,
    Engine,
    HixlError,
    Region,
    RegistrationError,
    StateError,
)
from hixl.testbed.net import free_tcp_port

from .loops import UntilError, killing_the_peer_ends_the_loop

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
KIB = 1024


def pattern(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_puts_and_gets_move_exactly_their_bytes(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    remote = pattern(256 * KIB, 1)
    server.register(remote, access=RW, name="dst")
    local = pattern(256 * KIB, 2)
    r_local = client.register(local, access=Access.LOCAL_WRITE)
    client.connect(server.id, timeout=30.0)
    rng = np.random.default_rng(3)
    with client.channel(server.id, r_local, "dst") as ch:
        assert isinstance(ch, Channel) and not ch.closed
        for i in range(60):
            n = int(rng.choice([64, 4 * KIB, 64 * KIB, 192, 1 * KIB]))
            lo = int(rng.integers(0, (256 * KIB - n) // 64 + 1)) * 64
            ro = int(rng.integers(0, (256 * KIB - n) // 64 + 1)) * 64
            if i % 2:
                local[lo : lo + n] = pattern(n, 100 + i)
                before = remote.copy()
                ch.put(lo, ro, n, timeout=30)
                assert np.array_equal(remote[ro : ro + n], local[lo : lo + n]), f"put {i}"
                before[ro : ro + n] = local[lo : lo + n]
                assert np.array_equal(remote, before), f"put {i} wrote outside its range"
            else:
                remote[ro : ro + n] = pattern(n, 200 + i)
                before = local.copy()
                ch.get(lo, ro, n, timeout=30)
                assert np.array_equal(local[lo : lo + n], remote[ro : ro + n]), f"get {i}"
                before[lo : lo + n] = remote[ro : ro + n]
                assert np.array_equal(local, before), f"get {i} wrote outside its range"
    assert ch.closed
    assert client.diagnostics().pending_transfers == 0


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        ((0, 60 * KIB, 8 * KIB), BoundsError, "remote out of bounds"),
        ((60 * KIB, 0, 8 * KIB), BoundsError, "local out of bounds"),
        ((0, 0, 0), ArgumentError, "nbytes must be > 0"),
        ((0, -64, 64), HixlError, "offset"),
        ((32, 0, 64), AlignmentError, "local"),
        ((0, 32, 64), AlignmentError, "remote"),
        ((0.0, 0, 64), ArgumentError, "integers"),
        ((0, 0, True), ArgumentError, "bools"),
        ((0, 0, "64"), ArgumentError, "integers"),
    ],
)
def test_bad_calls_are_refused_before_anything_is_posted(
    pair: tuple[Engine, Engine], args: tuple[Any, ...], error: type[Exception], words: str
) -> None:
    client, server = pair
    remote = np.zeros(64 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    local = pattern(64 * KIB, 4)
    r_local = client.register(local, access=RW)
    client.connect(server.id, timeout=30.0)
    with client.channel(server.id, r_local, "dst") as ch:
        for call in (ch.put, ch.get):
            with pytest.raises(error) as info:
                call(*args, timeout=5)
            assert words in str(info.value), str(info.value)
        assert not remote.any(), "a refused put wrote to the peer"
        assert np.array_equal(local, pattern(64 * KIB, 4)), "a refused get wrote locally"
        ch.put(0, 0, 4 * KIB, timeout=30)  # the channel still works afterwards
        assert np.array_equal(remote[: 4 * KIB], local[: 4 * KIB])
        ch.put(np.int64(64), np.uint32(128), np.int32(64), timeout=30)  # numpy ints are fine
        assert np.array_equal(remote[128:192], local[64:128])


def test_over_the_message_size_and_bad_timeouts_are_refused(
    pair: tuple[Engine, Engine],
) -> None:
    client, server = pair
    big = client.limits.max_msg_sz
    remote = np.zeros(big + 64 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    r_local = client.register(np.ones(big + 64 * KIB, np.uint8), access=RW)
    client.connect(server.id, timeout=30.0)
    with client.channel(server.id, r_local, "dst") as ch:
        with pytest.raises(ArgumentError, match="message size"):
            ch.put(0, 0, big + 64, timeout=5)
        for timeout in (0, -1.0):
            with pytest.raises(ArgumentError, match="timeout"):
                ch.put(0, 0, 64, timeout=timeout)
        assert not remote.any()


def test_access_is_checked_per_direction(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    server.register(np.zeros(8 * KIB, np.uint8), access=Access.REMOTE_WRITE, name="wo")
    server.register(np.zeros(8 * KIB, np.uint8), access=Access.REMOTE_READ, name="ro")
    r_nolw = client.register(np.ones(8 * KIB, np.uint8), access=Access.NONE)
    client.connect(server.id, timeout=30.0)
    with client.channel(server.id, r_nolw, "wo") as ch:
        ch.put(0, 0, 64)
        with pytest.raises(RegistrationError, match="LOCAL_WRITE"):
            ch.get(0, 0, 64)
    with (
        client.channel(server.id, r_nolw, "ro") as ch,
        pytest.raises(RegistrationError, match="not remotely writable"),
    ):
        ch.put(0, 0, 64)


def test_opening_checks_regions_and_allows_one_channel_per_connection(
    pair: tuple[Engine, Engine],
) -> None:
    client, server = pair
    server.register(np.zeros(8 * KIB, np.uint8), access=RW, name="dst")
    r_local = client.register(np.ones(8 * KIB, np.uint8), access=RW)
    client.connect(server.id, timeout=30.0)
    with pytest.raises(RegistrationError, match="no region named"):
        client.channel(server.id, r_local, "nope")
    foreign = server.register(np.ones(64, np.uint8), access=RW)
    with pytest.raises(RegistrationError, match="registered with this engine"):
        client.channel(server.id, foreign, "dst")
    ch = client.channel(server.id, r_local, "dst")
    with pytest.raises(StateError, match="already has an open channel"):
        client.channel(server.id, r_local, "dst")
    ch.close()
    ch.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        ch.put(0, 0, 64)
    with client.channel(server.id, r_local, "dst") as again:
        again.put(0, 0, 64)


@pytest.mark.parametrize("which", ["server", "client"])
def test_no_direct_lane_is_a_clear_error_and_puts_still_work(which: str) -> None:
    server = Engine(f"127.0.0.1:{free_tcp_port()}", direct_lane=which != "server")
    client = Engine("127.0.0.1:0", direct_lane=which != "client")
    try:
        remote = np.zeros(8 * KIB, np.uint8)
        server.register(remote, access=RW, name="dst")
        r_local = client.register(pattern(8 * KIB, 5), access=RW)
        conn = client.connect(server.id, timeout=30.0)
        why = "peer made fewer queue pairs" if which == "server" else "direct_lane=False"
        with pytest.raises(StateError, match=why):
            client.channel(server.id, r_local, "dst")
        assert len(conn.lanes) == 2
        client.put(server.id, r_local, "dst", timeout=30)
        assert np.array_equal(remote, pattern(8 * KIB, 5))
    finally:
        client.close()
        server.close()


def test_a_put_refused_by_the_target_fails_with_its_own_status(
    pair: tuple[Engine, Engine],
) -> None:
    """The client believes the peer's 8 KiB region is 1 MiB (test hook): a put past the
    real end passes the channel's checks and the target refuses it with
    IBV_WC_REM_ACCESS_ERR; the connection is FAILED and later calls are refused."""
    client, server = pair
    remote = np.zeros(8 * KIB, np.uint8)
    server.register(remote, access=RW, name="dst")
    r_local = client.register(pattern(64 * KIB, 6), access=RW)
    conn = client.connect(server.id, timeout=30.0)
    good = conn.remote_region("dst")
    conn.set_remote_regions((replace(good, length=1 << 20),))
    ch = client.channel(server.id, r_local, "dst")
    ch.put(0, 0, 4 * KIB, timeout=30)
    with pytest.raises(CompletionError) as info:
        ch.put(0, 32 * KIB, 4 * KIB, timeout=30)
    assert info.value.status_name == "IBV_WC_REM_ACCESS_ERR", str(info.value)
    assert conn.state is ConnState.FAILED
    with pytest.raises(ConnectionFailed, match="completion error"):
        ch.put(0, 0, 64, timeout=30)
    with pytest.raises(ConnectionFailed):
        client.put(server.id, r_local, "dst", timeout=30)
    ch.close()


def withdraw(server: Engine, region: Region, conn: Connection) -> None:
    """Deregister ``region`` on ``server`` and wait until ``conn`` (the client's
    connection to it) has the peer's REGIONS change."""
    before = conn.remote_regions
    server.deregister(region)
    deadline = time.monotonic() + 10
    while conn.remote_regions is before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn.remote_regions is not before, "the peer's REGIONS change never came"


def dst_and_src(
    client: Engine, server: Engine, nbytes: int, seed: int
) -> tuple[np.ndarray, Region, np.ndarray, Region, Connection]:
    """A zeroed region of ``nbytes`` that ``server`` exposes as "dst", a patterned one of
    ``client``'s, and the client's connection to ``server``."""
    remote = np.zeros(nbytes, np.uint8)
    r_remote = server.register(remote, access=RW, name="dst")
    src = pattern(nbytes, seed)
    r = client.register(src, access=RW)
    conn = client.connect(server.id, timeout=30.0)
    return remote, r_remote, src, r, conn


def expose_again(server: Engine, conn: Connection, nbytes: int) -> np.ndarray:
    """Register a new zeroed region of ``nbytes`` on ``server`` as "dst" (after
    :func:`withdraw`) and wait until ``conn`` sees it; return its buffer."""
    buf = np.zeros(nbytes, np.uint8)
    server.register(buf, access=RW, name="dst")
    deadline = time.monotonic() + 10
    while not any(x.name == "dst" for x in conn.remote_regions) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(x.name == "dst" for x in conn.remote_regions), "the new region never came"
    return buf


def test_withdrawn_or_closed_regions_are_refused(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    remote = np.zeros(8 * KIB, np.uint8)
    r_remote = server.register(remote, access=RW, name="dst")
    r_local = client.register(pattern(8 * KIB, 7), access=RW)
    r_other = client.register(pattern(8 * KIB, 8), access=RW)
    conn = client.connect(server.id, timeout=30.0)
    with client.channel(server.id, r_other, "dst") as ch:
        ch.put(0, 0, 64)
        client.deregister(r_other)
        with pytest.raises(RegistrationError, match="deregistered"):
            ch.put(0, 0, 64)
    with client.channel(server.id, r_local, "dst") as ch:
        ch.put(0, 0, 8 * KIB)
        assert np.array_equal(remote, pattern(8 * KIB, 7))
        withdraw(server, r_remote, conn)
        with pytest.raises(RegistrationError, match="no longer exposes"):
            ch.put(0, 0, 64)


def test_channel_calls_beside_a_put_async_stream_on_the_same_connection(
    pair: tuple[Engine, Engine],
) -> None:
    """Another thread streams put_async to the same peer while channel puts and gets run:
    every byte of both lands where it should."""
    client, server = pair
    a = np.zeros(256 * KIB, np.uint8)
    b = np.zeros(256 * KIB, np.uint8)
    server.register(a, access=RW, name="a")
    server.register(b, access=RW, name="b")
    src_a = pattern(256 * KIB, 9)
    src_b = pattern(256 * KIB, 10)
    r_a = client.register(src_a, access=Access.NONE)
    r_b = client.register(src_b, access=RW)
    client.connect(server.id, timeout=30.0)
    failures: list[BaseException] = []

    def stream() -> None:
        try:
            hs = []
            for i in range(64):
                d = ContiguousDesc(offset=i * 4 * KIB, nbytes=4 * KIB)
                hs.append(client.put_async(server.id, r_a, "a", local_desc=d, remote_desc=d))
            for h in hs:
                h.wait(60)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    rng = np.random.default_rng(12)
    try:
        with client.channel(server.id, r_b, "b") as ch:
            for i in range(40):
                lo, ro = (int(x) * 4 * KIB for x in rng.integers(0, 64, 2))
                ch.put(lo, ro, 4 * KIB, timeout=60)
                assert np.array_equal(b[ro : ro + 4 * KIB], src_b[lo : lo + 4 * KIB]), i
                b[ro : ro + 4 * KIB] = pattern(4 * KIB, 300 + i)
                back = int(rng.integers(0, 64)) * 4 * KIB
                ch.get(back, ro, 4 * KIB, timeout=60)
                assert np.array_equal(src_b[back : back + 4 * KIB], b[ro : ro + 4 * KIB]), i
    finally:
        t.join(60)
    assert not failures, failures
    assert np.array_equal(a, src_a)


def test_a_peer_killed_under_channel_puts_ends_them_in_time() -> None:
    """The peer process is killed while another thread loops on channel puts of 8 MiB:
    the put under way (or the next) ends with an error naming the peer, within its
    timeout and a margin, and the connection is FAILED."""

    def start(client: Engine, peer: str, r: Region) -> Callable[[], None]:
        ch = client.channel(peer, r, "buf")
        return lambda: ch.put(0, 0, 8 << 20, timeout=3)

    killing_the_peer_ends_the_loop(start)


def test_closing_the_engine_ends_a_channel_put_under_way(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    size = 8 << 20
    server.register(np.zeros(size, np.uint8), access=RW, name="dst")
    r_src = client.register(pattern(size, 11), access=Access.NONE)
    client.connect(server.id, timeout=30.0)
    ch = client.channel(server.id, r_src, "dst")
    loop = UntilError(lambda: ch.put(0, 0, size, timeout=60))
    assert loop.wait_first(30), loop.errors
    client.close()
    loop.join(30)
    assert not loop.thread.is_alive(), "a channel put outlived its engine's close()"
    assert len(loop.errors) == 1 and isinstance(loop.errors[0], HixlError), loop.errors
    with pytest.raises(StateError):
        ch.put(0, 0, 64)


def _wait_busy(conn: Any, t: threading.Thread) -> bool:
    """Until the channel call on ``t`` is under way (``Connection.direct_busy``); False
    if ``t`` ended first."""
    deadline = time.monotonic() + 10
    while not conn.direct_busy:
        if not t.is_alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


@pytest.mark.parametrize("how", ["channel", "put"])
def test_a_notification_waits_for_a_call_under_way_on_the_direct_lane(
    pair: tuple[Engine, Engine], how: str
) -> None:
    """A notification sent while another thread's 8 MiB call is out on the direct lane (a
    channel put, or a blocking ``Engine.put`` while no channel is open) arrives only once
    every byte of it has landed: it is held behind the lane."""
    client, server = pair
    size = 8 << 20
    dst = np.zeros(size, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = np.zeros(size, np.uint8)
    r = client.register(src, access=Access.NONE)
    conn = client.connect(server.id, timeout=30.0)
    d = ContiguousDesc(offset=0, nbytes=size)
    with contextlib.ExitStack() as stack:
        if how == "channel":
            ch = stack.enter_context(client.channel(server.id, r, "dst"))

            def call() -> None:
                ch.put(0, 0, size, timeout=60)
        else:
            client.put(server.id, r, "dst", local_desc=d, remote_desc=d, timeout=60)

            def call() -> None:  # repeats the template just made: on the lane
                client.put(server.id, r, "dst", local_desc=d, remote_desc=d, timeout=60)

        checked = 0
        for k in range(4):
            src[:] = k + 1
            t = threading.Thread(target=call)
            t.start()
            under_way = _wait_busy(conn, t)
            client.notify(server.id, f"n{k}", timeout=60)
            server.wait_notification(f"n{k}", timeout=60)
            landed = int(np.count_nonzero(dst == k + 1))
            t.join(60)
            assert landed == size, f"round {k}: {size - landed} bytes not there at the notification"
            checked += under_way
    assert checked, "no round caught the call under way"


def test_a_second_thread_on_a_busy_channel_is_refused(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    size = 8 << 20
    dst = np.zeros(size, np.uint8)
    server.register(dst, access=RW, name="dst")
    r = client.register(pattern(size, 13), access=RW)
    conn = client.connect(server.id, timeout=30.0)
    refused = 0
    with client.channel(server.id, r, "dst") as ch:
        for _ in range(3):
            t = threading.Thread(target=ch.put, args=(0, 0, size), kwargs={"timeout": 60})
            t.start()
            if _wait_busy(conn, t):
                try:
                    ch.get(0, 0, 64)
                except StateError as exc:
                    assert "in use by another thread" in str(exc)
                    refused += 1
            t.join(60)
            if refused:
                break
        ch.get(0, 0, 64)  # free again afterwards
    assert refused, "a call on a busy channel was never refused"
    assert np.array_equal(dst, pattern(size, 13))


# -- the engine's own blocking puts on the direct lane ------------------------------------


def test_blocking_puts_use_the_direct_lane_until_a_channel_is_opened(
    pair: tuple[Engine, Engine],
) -> None:
    """Repeated blocking single puts and gets run on the direct lane (``lane_posts``);
    while a channel is open they take an ordinary lane, and the bytes are right on both."""
    client, server = pair
    dst = np.zeros(256 * KIB, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(256 * KIB, 40)
    r = client.register(src, access=RW)
    client.connect(server.id, timeout=30.0)
    rng = np.random.default_rng(41)

    def rounds(n: int, seed: int) -> None:
        for i in range(n):
            lo, ro = (int(x) * 4 * KIB for x in rng.integers(0, 64, 2))
            ld, rd = (
                ContiguousDesc(offset=lo, nbytes=4 * KIB),
                ContiguousDesc(offset=ro, nbytes=4 * KIB),
            )
            client.put(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
            assert np.array_equal(dst[ro : ro + 4 * KIB], src[lo : lo + 4 * KIB]), i
            dst[ro : ro + 4 * KIB] = pattern(4 * KIB, seed + i)
            client.get(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
            assert np.array_equal(src[lo : lo + 4 * KIB], dst[ro : ro + 4 * KIB]), i

    rounds(1, 500)  # plans the two templates
    d0 = client.diagnostics()
    rounds(20, 600)
    d1 = client.diagnostics()
    assert d1.lane_posts - d0.lane_posts == 40
    assert d1.direct_posts - d0.direct_posts == 40
    with client.channel(server.id, r, "dst") as ch:
        rounds(20, 700)
        d2 = client.diagnostics()
        assert d2.lane_posts == d1.lane_posts  # the channel has the lane
        assert d2.direct_posts - d1.direct_posts == 40  # on an idle ordinary lane instead
        ch.put(0, 0, 4 * KIB)
        assert np.array_equal(dst[: 4 * KIB], src[: 4 * KIB])
    rounds(5, 800)
    assert client.diagnostics().lane_posts - d2.lane_posts == 10
    assert client.diagnostics().pending_transfers == 0


def test_a_repeated_blocking_call_is_checked_again_on_every_repeat(
    pair: tuple[Engine, Engine],
) -> None:
    """The very same blocking put (and get) repeated runs on the direct lane each time,
    and each repeat still sees what changed since the last: a channel opened (an
    ordinary lane instead), a bad timeout, the local region deregistered, the peer's
    region withdrawn; the bytes are right throughout."""
    client, server = pair
    remote, r_remote, src, r, conn = dst_and_src(client, server, 16 * KIB, 50)
    ld = ContiguousDesc(offset=4 * KIB, nbytes=4 * KIB)
    rd = ContiguousDesc(offset=8 * KIB, nbytes=4 * KIB)

    def put_and_get(seed: int) -> None:
        src[4 * KIB : 8 * KIB] = pattern(4 * KIB, seed)
        client.put(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
        assert np.array_equal(remote[8 * KIB : 12 * KIB], pattern(4 * KIB, seed))
        remote[8 * KIB : 12 * KIB] = pattern(4 * KIB, seed + 1)
        client.get(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
        assert np.array_equal(src[4 * KIB : 8 * KIB], pattern(4 * KIB, seed + 1))

    for i in range(10):
        put_and_get(900 + 2 * i)
    d0 = client.diagnostics()
    for i in range(10):
        put_and_get(920 + 2 * i)
    d1 = client.diagnostics()
    assert d1.lane_posts - d0.lane_posts == 20
    with client.channel(server.id, r, "dst"):
        put_and_get(950)
        d2 = client.diagnostics()
        assert d2.lane_posts == d1.lane_posts  # the channel has the lane
        assert d2.direct_posts - d1.direct_posts == 2
    put_and_get(960)
    assert client.diagnostics().lane_posts - d2.lane_posts == 2
    for bad in (0, -1.0):
        with pytest.raises(ArgumentError, match="timeout"):
            client.put(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=bad)
    put_and_get(970)
    # The peer withdraws its region: the next repeat is refused before anything is posted.
    withdraw(server, r_remote, conn)
    for call in (client.put, client.get):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
    # Exposed again under the same name: the repeat runs, on the new region.
    remote = expose_again(server, conn, 16 * KIB)
    put_and_get(980)  # the general path: a new template, on the new region
    d3 = client.diagnostics()
    put_and_get(990)  # repeated from it: the region check below is the repeat's own
    assert client.diagnostics().lane_posts - d3.lane_posts == 2
    client.deregister(r)
    for call in (client.put, client.get):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=60)
    assert client.diagnostics().pending_transfers == 0
    assert conn.state is ConnState.READY


def test_repeated_async_calls_at_new_offsets_are_checked_again_every_time(
    pair: tuple[Engine, Engine],
) -> None:
    """``put_async``/``get_async`` of the same regions and sizes at new offsets go
    straight into a lane's ring (``Diagnostics.slot_messages``), and each call still
    sees what is wrong or changed: a range past its region, a misaligned offset, a bad
    timeout, the peer's region withdrawn, the local region deregistered.  Nothing wrong
    is queued, and the bytes are right throughout."""
    client, server = pair
    remote, r_remote, src, r, conn = dst_and_src(client, server, 64 * KIB, 60)

    def at(i: int) -> ContiguousDesc:
        return ContiguousDesc(offset=i * 4 * KIB, nbytes=4 * KIB)

    def stream(seed: int) -> None:
        src[:] = pattern(64 * KIB, seed)
        hs = [
            client.put_async(server.id, r, "dst", local_desc=at(i), remote_desc=at(15 - i))
            for i in range(16)
        ]
        for h in hs:
            h.wait(timeout=60)
        for i in range(16):
            assert np.array_equal(
                remote[at(15 - i).offset :][: 4 * KIB], src[at(i).offset :][: 4 * KIB]
            )
        remote[:] = pattern(64 * KIB, seed + 1)
        hs = [
            client.get_async(server.id, r, "dst", local_desc=at(i), remote_desc=at(i))
            for i in range(16)
        ]
        for h in hs:
            h.wait(timeout=60)
        assert np.array_equal(src, remote)

    stream(600)
    d0 = client.diagnostics()
    stream(602)
    assert client.diagnostics().slot_messages - d0.slot_messages == 32
    for ld, rd, err in (
        (at(15), ContiguousDesc(offset=61 * KIB, nbytes=4 * KIB, alignment=None), BoundsError),
        (ContiguousDesc(offset=61 * KIB, nbytes=4 * KIB, alignment=None), at(0), BoundsError),
        (at(1), ContiguousDesc(offset=32, nbytes=4 * KIB, alignment=None), AlignmentError),
    ):
        for call in (client.put_async, client.get_async):
            with pytest.raises(err):
                call(server.id, r, "dst", local_desc=ld, remote_desc=rd)
    for bad in (0, -1.0):
        for call in (client.put_async, client.get_async):
            with pytest.raises(ArgumentError, match="timeout"):
                call(server.id, r, "dst", local_desc=at(1), remote_desc=at(2), timeout=bad)
    stream(604)
    withdraw(server, r_remote, conn)
    for call in (client.put_async, client.get_async):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=at(1), remote_desc=at(2))
    remote = expose_again(server, conn, 64 * KIB)
    stream(606)  # on the new region
    client.deregister(r)
    for call in (client.put_async, client.get_async):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=at(1), remote_desc=at(2))
    assert client.diagnostics().pending_transfers == 0
    assert conn.state is ConnState.READY


def test_the_very_same_async_call_repeated_is_checked_again_every_time(
    pair: tuple[Engine, Engine],
) -> None:
    """One pair of descriptor objects passed to ``put_async``/``get_async`` again and
    again (each call after the first through the ring runner) is still refused for a bad
    timeout, once the peer withdrew its region and once the local region is gone, and a
    call without descriptors after it moves the whole region; the bytes are right
    throughout."""
    client, server = pair
    remote, r_remote, src, r, conn = dst_and_src(client, server, 16 * KIB, 70)
    ld = ContiguousDesc(offset=4 * KIB, nbytes=4 * KIB)
    rd = ContiguousDesc(offset=12 * KIB, nbytes=4 * KIB)

    def repeat(seed: int) -> None:
        src[4 * KIB : 8 * KIB] = pattern(4 * KIB, seed)
        hs = [
            client.put_async(server.id, r, "dst", local_desc=ld, remote_desc=rd) for _ in range(8)
        ]
        for h in hs:
            h.wait(timeout=60)
        assert np.array_equal(remote[12 * KIB :], src[4 * KIB : 8 * KIB])
        remote[12 * KIB :] = pattern(4 * KIB, seed + 1)
        hs = [
            client.get_async(server.id, r, "dst", local_desc=ld, remote_desc=rd) for _ in range(8)
        ]
        for h in hs:
            h.wait(timeout=60)
        assert np.array_equal(src[4 * KIB : 8 * KIB], pattern(4 * KIB, seed + 1))

    # The first call makes the runner; the next one, without descriptors, must not be
    # taken for a pair it has seen.
    client.put_async(server.id, r, "dst", local_desc=ld, remote_desc=rd).wait(timeout=60)
    src[:] = pattern(16 * KIB, 698)
    client.put_async(server.id, r, "dst").wait(timeout=60)
    assert np.array_equal(remote, src)
    repeat(700)
    d0 = client.diagnostics()
    repeat(702)
    assert client.diagnostics().slot_messages - d0.slot_messages == 16
    for bad in (0, -1.0):
        for call in (client.put_async, client.get_async):
            with pytest.raises(ArgumentError, match="timeout"):
                call(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=bad)
    # No descriptors after the primed pair: the whole region, not the pair's place.
    src[:] = pattern(16 * KIB, 704)
    client.put_async(server.id, r, "dst").wait(timeout=60)
    assert np.array_equal(remote, src)
    repeat(706)
    withdraw(server, r_remote, conn)
    for call in (client.put_async, client.get_async):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=ld, remote_desc=rd)
    remote = expose_again(server, conn, 16 * KIB)
    repeat(708)  # on the new region
    client.deregister(r)
    for call in (client.put_async, client.get_async):
        with pytest.raises(RegistrationError):
            call(server.id, r, "dst", local_desc=ld, remote_desc=rd)
    assert client.diagnostics().pending_transfers == 0
    assert conn.state is ConnState.READY


def test_channels_opened_while_other_threads_put_never_meet_their_calls(
    pair: tuple[Engine, Engine],
) -> None:
    """Two threads repeat blocking 1 MiB puts (on the direct lane while no channel is
    open) while the main thread opens, uses and closes a channel again and again: the
    channel's calls never find the lane taken, and every byte of both lands."""
    client, server = pair
    size = 1 << 20
    dst = np.zeros(4 * size, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(4 * size, 42)
    r = client.register(src, access=RW)
    client.connect(server.id, timeout=30.0)
    stop = threading.Event()
    failures: list[BaseException] = []
    puts = [0, 0]

    def putter(k: int) -> None:
        d = ContiguousDesc(offset=k * size, nbytes=size)
        try:
            while not stop.is_set():
                client.put(server.id, r, "dst", local_desc=d, remote_desc=d, timeout=60)
                puts[k] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=putter, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        lane_before = client.diagnostics().lane_posts
        for i in range(12):
            with client.channel(server.id, r, "dst") as ch:
                for j in range(4):
                    lo = 2 * size + ((i * 4 + j) % 16) * 4 * KIB
                    ro = 3 * size + j * 4 * KIB
                    ch.put(lo, ro, 4 * KIB, timeout=60)
                    assert np.array_equal(dst[ro : ro + 4 * KIB], src[lo : lo + 4 * KIB])
            time.sleep(0.02)  # let the putters back onto the lane
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures
    assert min(puts) > 0
    assert client.diagnostics().lane_posts > lane_before, "no put ran on the direct lane"
    assert np.array_equal(dst[: 2 * size], src[: 2 * size])
