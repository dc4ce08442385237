"""The engine on a real verbs device: put/get, strided transfers, notifications, failures."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hixl.core.descriptors import BlockListDesc, ContiguousDesc, StridedDesc
from hixl.engine import Access, ConnState, Engine, TransferRequest, TransferStatus, handshake
from hixl.errors import (
    AlignmentError,
    BoundsError,
    CompletionError,
    ConnectionFailed,
    HandshakeError,
    RegistrationError,
    StateError,
    TransferTimeout,
)
from hixl.testbed.net import free_tcp_port

from .conftest import listening_engine

RW = Access.REMOTE_READ | Access.REMOTE_WRITE


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_contiguous_put_and_get_are_byte_exact(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    dst = np.zeros(1 << 16, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(1 << 16, 1)
    back = np.zeros_like(src)
    rsrc = client.register(src)
    rback = client.register(back)
    conn = client.connect(server.id)
    assert conn.state is ConnState.READY
    client.put(server.id, rsrc, "dst")
    assert np.array_equal(dst, src)
    dst[::3] ^= 0x5A
    client.get(server.id, rback, "dst")
    assert np.array_equal(back, dst)


def test_strided_put_moves_every_head_in_one_call(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    heads, tokens, head_bytes, pad = 8, 16, 128, 256
    remote = np.zeros(heads * tokens * pad, np.uint8)
    server.register(remote, access=RW, name="kv")
    local = pattern(heads * tokens * head_bytes, 2)
    r = client.register(local)
    client.connect(server.id)
    # local: packed rows of head_bytes; remote: rows padded to `pad` bytes
    client.put(
        server.id,
        r,
        "kv",
        local_desc=ContiguousDesc(offset=0, nbytes=local.nbytes),
        remote_desc=StridedDesc(offset=0, count=heads * tokens, size=head_bytes, stride=pad),
    )
    got = remote.reshape(-1, pad)[:, :head_bytes].reshape(-1)
    assert np.array_equal(got, local)
    assert not remote.reshape(-1, pad)[:, head_bytes:].any()


def test_notification_arrives_after_the_data(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    dst = np.zeros(1 << 20, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(1 << 20, 3)
    r = client.register(src)
    client.connect(server.id)
    h = client.put_async(server.id, r, "dst", notify="req42/layer7", notify_message=b"hi")
    note = server.wait_notification("req42/layer7", timeout=30)
    # The data must be visible the moment the notification is seen.
    assert np.array_equal(dst, src)
    assert note.message == b"hi" and note.peer == client.id
    h.wait(30)
    assert h.status is TransferStatus.DONE


def test_batch_and_many_outstanding(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    dst = np.zeros(64 * 4096, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(dst.nbytes, 4)
    r = client.register(src)
    client.connect(server.id)
    # 64 transfers of 4 KiB each, one 64-byte-aligned block per request, all outstanding
    handles = [
        client.put_async(
            server.id,
            r,
            "dst",
            local_desc=ContiguousDesc(offset=i * 4096, nbytes=4096),
            remote_desc=ContiguousDesc(offset=i * 4096, nbytes=4096),
        )
        for i in range(64)
    ]
    for h in handles:
        h.wait(60)
    assert np.array_equal(dst, src)
    dst[:] = 0
    reqs = [
        TransferRequest(
            op="write",
            local=r,
            remote="dst",
            local_desc=BlockListDesc.from_pairs([(i * 8192, 4096)]),
            remote_desc=BlockListDesc.from_pairs([(i * 8192, 4096)]),
        )
        for i in range(32)
    ]
    client.transfer(server.id, reqs, timeout=60)
    view = dst.reshape(-1, 8192)[:, :4096]
    assert np.array_equal(view, src.reshape(-1, 8192)[:, :4096])


def test_errors_before_posting_name_the_numbers(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    dst = np.zeros(8192, np.uint8)
    server.register(dst, access=RW, name="dst")
    ro = np.zeros(8192, np.uint8)
    server.register(ro, access=Access.REMOTE_READ, name="ro")
    src = pattern(16384, 5)
    r = client.register(src)
    client.connect(server.id)
    with pytest.raises(BoundsError, match="offset=4096 nbytes=8192 region_length=8192"):
        client.put(
            server.id,
            r,
            "dst",
            local_desc=ContiguousDesc(offset=0, nbytes=8192),
            remote_desc=ContiguousDesc(offset=4096, nbytes=8192),
        )
    with pytest.raises(BoundsError, match="local"):
        client.put(
            server.id,
            r,
            "dst",
            local_desc=ContiguousDesc(offset=12288, nbytes=8192),
            remote_desc=ContiguousDesc(offset=0, nbytes=8192),
        )
    with pytest.raises(RegistrationError, match="not remotely writable"):
        client.put(server.id, r, "ro", local_desc=ContiguousDesc(offset=0, nbytes=64))
    with pytest.raises(RegistrationError, match="no region named 'nope'"):
        client.put(server.id, r, "nope")
    with pytest.raises(AlignmentError):
        client.put(
            server.id,
            r,
            "dst",
            local_desc=ContiguousDesc(offset=8, nbytes=64, alignment=None),
            remote_desc=ContiguousDesc(offset=0, nbytes=64),
        )
    unregistered = np.zeros(64, np.uint8)
    other = Engine("127.0.0.1:0")
    try:
        foreign = other.register(unregistered)
        with pytest.raises(RegistrationError, match="not a region registered"):
            client.put(server.id, foreign, "dst")
    finally:
        other.close()
    with pytest.raises(ConnectionFailed, match="not connected"):
        client.put("127.0.0.1:1", r, "dst")
    assert not dst.any()  # nothing was written by any refused call
    # and the connection still works
    client.put(server.id, r, "dst", local_desc=ContiguousDesc(offset=0, nbytes=8192))
    assert np.array_equal(dst, src[:8192])


def test_tampered_rkey_fails_fast_and_only_that_connection(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    third = Engine(f"127.0.0.1:{free_tcp_port()}")
    try:
        dst = np.zeros(4096, np.uint8)
        server.register(dst, access=RW, name="dst")
        dst3 = np.zeros(4096, np.uint8)
        third.register(dst3, access=RW, name="dst")
        src = pattern(4096, 6)
        r = client.register(src)
        conn = client.connect(server.id)
        client.connect(third.id)
        # Simulate a peer advertising a wrong key: tamper with what the client believes.
        good = conn.remote_region("dst")
        from dataclasses import replace

        bad = replace(good, rkey=good.rkey ^ 0x00FF00)
        conn.set_remote_regions((bad,))  # test hook: as if the peer had announced this
        t0 = time.monotonic()
        with pytest.raises(CompletionError) as info:
            client.put(server.id, r, bad, timeout=20)
        assert info.value.status_name in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR")
        assert time.monotonic() - t0 < 10
        assert conn.state is ConnState.FAILED
        with pytest.raises(ConnectionFailed, match="has failed"):
            client.put(server.id, r, bad)
        client.put(third.id, r, "dst")  # other connections keep working
        assert np.array_equal(dst3, src)
        assert not dst.any()
        # a new connection to the same peer works again
        client.disconnect(server.id)
        client.connect(server.id)
        client.put(server.id, r, "dst")
        assert np.array_equal(dst, src)
    finally:
        third.close()


def test_connect_where_nothing_listens_fails_in_time() -> None:
    with Engine("127.0.0.1:0") as e:
        t0 = time.monotonic()
        with pytest.raises((ConnectionFailed, TransferTimeout)):
            e.connect(f"127.0.0.1:{free_tcp_port()}", timeout=5)
        assert time.monotonic() - t0 < 6


def test_connect_returns_once_the_peer_holds_the_connection() -> None:
    """When connect() returns, the server has the connection live: its peers list us and
    a notification goes out at once; for every one of 8 fresh clients."""
    with listening_engine() as server:
        for i in range(8):
            with Engine("127.0.0.1:0") as client:
                client.connect(server.id, timeout=30)
                assert client.id in server.peers, f"client {i}: server has {server.peers}"
                client.notify(server.id, f"hello-{i}", timeout=30)
            assert server.wait_notification(f"hello-{i}", timeout=30).peer == client.id


def test_token_mismatch_gets_no_keys() -> None:
    server = Engine(f"127.0.0.1:{free_tcp_port()}", token="s3cret")
    try:
        server.register(np.zeros(4096, np.uint8), access=RW, name="dst")
        with Engine("127.0.0.1:0", token="wrong") as bad:
            with pytest.raises(HandshakeError):
                bad.connect(server.id, timeout=10)
            assert bad.peers == []
        with Engine("127.0.0.1:0", token="s3cret") as good:
            conn = good.connect(server.id, timeout=10)
            assert conn.remote_region("dst").length == 4096
    finally:
        server.close()


def test_close_with_transfers_in_flight_and_double_close() -> None:
    server = Engine(f"127.0.0.1:{free_tcp_port()}")
    client = Engine("127.0.0.1:0")
    dst = np.zeros(4 << 20, np.uint8)
    server.register(dst, access=RW, name="dst")
    src = pattern(4 << 20, 7)
    r = client.register(src)
    client.connect(server.id)
    handles = [client.put_async(server.id, r, "dst") for _ in range(4)]
    client.close()
    client.close()
    for h in handles:
        assert h.done()
        if h.status is TransferStatus.FAILED:
            assert isinstance(h.error, (StateError, ConnectionFailed))
    with pytest.raises(StateError):
        client.register(np.zeros(64, np.uint8))
    server.close()
    server.close()


def test_peer_closing_fails_pending_and_engine_stays_usable(pair: tuple[Engine, Engine]) -> None:
    client, server = pair
    third = Engine(f"127.0.0.1:{free_tcp_port()}")
    try:
        server.register(np.zeros(1 << 20, np.uint8), access=RW, name="dst")
        dst3 = np.zeros(4096, np.uint8)
        third.register(dst3, access=RW, name="dst")
        src = pattern(1 << 20, 8)
        r = client.register(src)
        client.connect(server.id)
        client.connect(third.id)
        server.close()
        deadline = time.monotonic() + 10
        while client.connection(server.id).state is ConnState.READY:
            assert time.monotonic() < deadline, "peer close not noticed"
            time.sleep(0.01)
        with pytest.raises(ConnectionFailed):
            client.put(server.id, r, "dst", timeout=5)
        client.put(third.id, r, "dst", local_desc=ContiguousDesc(offset=0, nbytes=4096))
        assert np.array_equal(dst3, src[:4096])
    finally:
        third.close()


def test_unclosed_engine_warns_and_is_closed_when_collected() -> None:
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = Engine("127.0.0.1:0")
        tid = e.diagnostics().progress_thread_id
        del e
        deadline = time.monotonic() + 10
        while not any(issubclass(w.category, ResourceWarning) for w in caught):
            assert time.monotonic() < deadline, "no ResourceWarning for an unclosed engine"
            gc.collect()
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while any(t.native_id == tid for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the progress thread outlived its engine"
        time.sleep(0.05)


def test_region_registered_during_the_handshake_reaches_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A region registered after the server's ACCEPT went out but before it adopted the
    connection is announced once the connection is live (live connections alone get
    announcements, and this one was not yet)."""
    server = Engine(f"127.0.0.1:{free_tcp_port()}")
    client = Engine("127.0.0.1:0")
    late = np.zeros(4096, np.uint8)
    ready = handshake.Listener._ready

    def register_then_ready(listener: Any, inc: Any, msg: Any, rest: Any) -> None:
        # server side: the ACCEPT went out, READY arrived, the connection is not live yet
        server.register(late, access=Access.REMOTE_WRITE, name="late")
        ready(listener, inc, msg, rest)

    monkeypatch.setattr(handshake.Listener, "_ready", register_then_ready)
    try:
        client.connect(server.id, timeout=30.0)
        conn = client.connection(server.id)
        deadline = time.monotonic() + 10.0
        while not any(r.name == "late" for r in conn.remote_regions):
            assert time.monotonic() < deadline, conn.remote_regions
            time.sleep(0.01)
        src = np.full(4096, 7, np.uint8)
        client.put(server.id, client.register(src), "late", timeout=30.0)
        assert np.array_equal(late, src)
    finally:
        client.close()
        server.close()
