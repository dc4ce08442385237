"""hixl.compat on a real verbs device: two Hixl instances, links, transfers, notifies, codes.

Every wait has a deadline.  Buffers are numpy arrays registered by address, as
hixl callers register ``data_ptr()`` of their tensors.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from hixl import compat as hixl
from hixl.compat import (
    ALREADY_CONNECTED,
    FAILED,
    NOT_CONNECTED,
    PARAM_INVALID,
    SUCCESS,
    Hixl,
    MemDesc,
    MemType,
    NotifyDesc,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
)
from hixl.testbed.net import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hixl_style_script.py"
T = TypeVar("T")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def addr_of(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


def register(h: Hixl, arr: np.ndarray, mem_type: MemType = MemType.MEM_HOST) -> int:
    ret, handle = h.register_mem(MemDesc(addr_of(arr), arr.nbytes), mem_type)
    assert ret == SUCCESS, h.last_error
    assert handle != 0
    return handle


def eventually(fn: Callable[[], T], want: T, timeout: float = 30.0) -> T:
    """Call ``fn`` until it returns ``want`` or ``timeout`` s pass; return the last value."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[Hixl]:
    h = Hixl()
    assert h.initialize(f"127.0.0.1:{free_tcp_port()}", {}) == SUCCESS, h.last_error
    try:
        yield h
    finally:
        h.finalize()


@pytest.fixture
def client() -> Iterator[Hixl]:
    h = Hixl()
    assert h.initialize("127.0.0.1", {}) == SUCCESS, h.last_error
    try:
        yield h
    finally:
        h.finalize()


def server_id(h: Hixl) -> str:
    assert h.engine_id is not None
    return h.engine_id


def test_sync_write_then_read_many_descs_byte_exact(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(64 * 1024, np.uint8)
    register(server, remote)
    src_a, src_b = pattern(20_000, 1), pattern(9_000, 2)
    register(client, src_a)
    register(client, src_b)
    peer = server_id(server)
    assert client.connect(peer, timeout_in_millis=10_000) == SUCCESS, client.last_error

    # Odd addresses and lengths, two local regions interleaved: two engine requests, one batch.
    pieces = [
        (src_a, 3, 1, 1000),
        (src_b, 0, 5_001, 4_097),
        (src_a, 1_500, 20_000, 18_000),
        (src_b, 8_000, 40_123, 1_000),
        (src_a, 19_999, 63 * 1024, 1),
    ]
    expected = np.zeros_like(remote)
    descs = []
    for src, soff, roff, n in pieces:
        descs.append(TransferOpDesc(addr_of(src) + soff, addr_of(remote) + roff, n))
        expected[roff : roff + n] = src[soff : soff + n]
    ret = client.transfer_sync(peer, TransferOp.WRITE, descs, timeout_in_millis=30_000)
    assert ret == SUCCESS, client.last_error
    assert np.array_equal(remote, expected)

    remote[:] = pattern(remote.nbytes, 3)
    back = np.zeros(30_000, np.uint8)
    register(client, back)
    reads = [(0, 7, 3_333), (3_333, 50_001, 10_000), (20_000, 17, 9_999)]
    ret = client.transfer_sync(
        peer,
        TransferOp.READ,
        [TransferOpDesc(addr_of(back) + lo, addr_of(remote) + ro, n) for lo, ro, n in reads],
        timeout_in_millis=30_000,
    )
    assert ret == SUCCESS, client.last_error
    for lo, ro, n in reads:
        assert np.array_equal(back[lo : lo + n], remote[ro : ro + n])
    assert not back[29_999:].any()  # untouched past the last desc


def test_status_polls_from_a_busy_thread_finish_without_the_progress_thread(
    server: Hixl, client: Hixl
) -> None:
    """A caller that starts several writes and then polls ``get_transfer_status`` /
    ``get_all_transfer_status``, running only Python in between, keeps the GIL; with
    the switch interval at one second the engine's progress thread gets it about once
    a second, and the writes queued behind the first wait for it to post them.  Each
    status read drives the engine on the polling thread (it posts and reaps), so the
    rounds take about as long as the same rounds at the usual switch interval (the
    control, measured first): far less than the second a round that waited for the
    progress thread would add (in most rounds: a round in which the progress thread
    holds the engine lock while it waits for the GIL lasts until the interval forces a
    switch, hence the median)."""
    size, n = 4096, 8
    remote = np.zeros(n * size, np.uint8)
    register(server, remote)
    src = pattern(remote.nbytes, 6)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS, client.last_error

    def one_round(round_: int) -> float:
        start = time.monotonic()
        reqs = []
        for i in range(n):
            desc = TransferOpDesc(addr_of(src) + i * size, addr_of(remote) + i * size, size)
            ret, req = client.transfer_async(peer, TransferOp.WRITE, [desc], hixl.TransferArgs())
            assert ret == SUCCESS, client.last_error
            reqs.append(req)
        left = set(reqs)
        while left and time.monotonic() - start < 10:
            if round_ == 1:  # one round through get_all_transfer_status
                ret, results = client.get_all_transfer_status()
                assert ret == SUCCESS, client.last_error
                for r in results:
                    if r.req in left and r.status != TransferStatus.WAITING:
                        assert r.status == TransferStatus.COMPLETED, client.last_error
                        left.discard(r.req)
            else:
                for req in list(left):
                    ret, status = client.get_transfer_status(req)
                    if status != TransferStatus.WAITING:
                        assert (ret, status) == (SUCCESS, TransferStatus.COMPLETED)
                        left.discard(req)
        assert not left, f"round {round_}: {len(left)} of {n} still waiting after 10 s"
        return time.monotonic() - start

    control = [one_round(r) for r in range(5)]  # the usual switch interval
    interval = 1.0
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        took = [one_round(r) for r in range(5)]
    finally:
        sys.setswitchinterval(old)
    assert np.array_equal(remote, src)
    assert statistics.median(took) < statistics.median(control) + interval / 2, (took, control)


def test_async_write_polls_to_completion(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(256 * 1024, np.uint8)
    register(server, remote)
    src = pattern(remote.nbytes, 4)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS, client.last_error
    block = 8 * 1024 + 8
    descs = [
        TransferOpDesc(addr_of(src) + o, addr_of(remote) + o, min(block, src.nbytes - o))
        for o in range(0, src.nbytes, block)
    ]
    args = hixl.TransferArgs()
    args.user_data = 77  # only reported by get_all_transfer_status
    ret, req = client.transfer_async(peer, TransferOp.WRITE, descs, args)
    assert ret == SUCCESS and req != 0, client.last_error

    deadline = time.monotonic() + 30
    states = []
    while time.monotonic() < deadline:
        ret, status = client.get_transfer_status(req)
        states.append(status)
        if status != TransferStatus.WAITING:
            break
        time.sleep(0.001)
    assert (ret, states[-1]) == (SUCCESS, TransferStatus.COMPLETED), client.last_error
    assert set(states[:-1]) <= {TransferStatus.WAITING}
    assert np.array_equal(remote, src)
    # a finished request is released
    assert client.get_transfer_status(req) == (PARAM_INVALID, TransferStatus.FAILED)
    assert client.get_transfer_status(123456) == (PARAM_INVALID, TransferStatus.FAILED)


def test_async_read_reported_by_get_all_transfer_status(server: Hixl, client: Hixl) -> None:
    remote = pattern(32 * 1024, 5)
    register(server, remote)
    dst = np.zeros_like(remote)
    register(client, dst)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    half = remote.nbytes // 2
    reqs = []
    for k in range(2):
        desc = TransferOpDesc(addr_of(dst) + k * half, addr_of(remote) + k * half, half)
        args = hixl.TransferArgs()  # built without arguments, as in the binding
        args.user_data = k
        ret, req = client.transfer_async(peer, TransferOp.READ, [desc], args)
        assert ret == SUCCESS, client.last_error
        reqs.append(req)
    done: dict[int, tuple[int, TransferStatus]] = {}
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        ret, results = client.get_all_transfer_status(hixl.GetTransferStatusArgs(skip_waiting=True))
        assert ret == SUCCESS
        for r in results:
            assert r.status != TransferStatus.WAITING
            done[r.req] = (r.user_data, r.status)
        time.sleep(0.001)
    assert done == {
        reqs[0]: (0, TransferStatus.COMPLETED),
        reqs[1]: (1, TransferStatus.COMPLETED),
    }
    assert np.array_equal(dst, remote)


def test_notifies_arrive_after_the_data(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(4096, np.uint8)
    register(server, remote)
    src = pattern(4096, 6)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    desc = TransferOpDesc(addr_of(src), addr_of(remote), src.nbytes)
    ret, _req = client.transfer_async(peer, TransferOp.WRITE, [desc])
    assert ret == SUCCESS
    note = NotifyDesc(name="kv_ready", notify_msg="layer 3 \u2713")
    assert client.send_notify(peer, note, timeout_in_millis=10_000) == SUCCESS, client.last_error
    assert client.send_notify(peer, NotifyDesc("second", ""), 10_000) == SUCCESS

    got: list[NotifyDesc] = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        ret, notes = server.get_notifies()
        assert ret == SUCCESS
        if notes and not got:
            assert np.array_equal(remote, src)  # the notify came after the async write landed
        got.extend(notes)
        time.sleep(0.01)
    assert [(n.name, n.notify_msg) for n in got] == [("kv_ready", "layer 3 \u2713"), ("second", "")]
    assert server.get_notifies() == (SUCCESS, [])  # drained

    assert client.send_notify(peer, NotifyDesc("n", "m" * 1025), 1000) == PARAM_INVALID
    assert client.send_notify(peer, NotifyDesc("n" * 1025, ""), 1000) == PARAM_INVALID
    assert client.send_notify(peer, note, 0) == PARAM_INVALID


def test_link_status_codes(server: Hixl, client: Hixl) -> None:
    peer = server_id(server)
    nobody = f"127.0.0.1:{free_tcp_port()}"
    desc = [TransferOpDesc(0x1000, 0x2000, 8)]
    assert client.transfer_sync(nobody, TransferOp.READ, desc) == NOT_CONNECTED
    assert client.transfer_async(nobody, TransferOp.WRITE, desc) == (NOT_CONNECTED, 0)
    assert client.send_notify(nobody, NotifyDesc("a", "b")) == NOT_CONNECTED
    assert client.disconnect(nobody) == NOT_CONNECTED
    assert client.connect(nobody, 2000) == FAILED  # nothing listens there
    assert client.connect("127.0.0.1", 1000) == PARAM_INVALID  # a client id: no port
    assert client.connect(peer, 0) == PARAM_INVALID

    assert client.connect(peer, 10_000) == SUCCESS, client.last_error
    assert client.connect(peer, 10_000) == ALREADY_CONNECTED
    assert client.disconnect(peer) == SUCCESS
    assert client.disconnect(peer) == NOT_CONNECTED
    assert client.transfer_sync(peer, TransferOp.READ, desc) == NOT_CONNECTED
    # Reconnecting right away: the server may not have seen the goodbye yet, retry briefly.
    assert eventually(lambda: client.connect(peer, 10_000), SUCCESS) == SUCCESS, client.last_error

    # The server sees the client under the client's own id and may drop the link.
    client_id = client.engine_id
    assert client_id is not None and client_id.startswith("127.0.0.1:0~")
    assert eventually(lambda: server.disconnect(client_id), SUCCESS) == SUCCESS
    # The client's link is now broken: FAILED until it disconnects and connects again.
    remote = np.zeros(64, np.uint8)
    register(server, remote)
    local = np.zeros(64, np.uint8)
    register(client, local)
    desc = [TransferOpDesc(addr_of(local), addr_of(remote), 64)]
    assert eventually(lambda: client.transfer_sync(peer, TransferOp.READ, desc), FAILED) == FAILED
    assert client.connect(peer, 10_000) == SUCCESS, client.last_error  # replaces the broken link
    ret = eventually(lambda: client.transfer_sync(peer, TransferOp.READ, desc, 10_000), SUCCESS)
    assert ret == SUCCESS, client.last_error


def test_bad_descs_are_param_invalid_and_move_nothing(server: Hixl) -> None:
    client = Hixl()  # with the buffer pool off, unregistered local memory is refused too
    assert client.initialize("127.0.0.1", {hixl.OPTION_BUFFER_POOL: "0:0"}) == SUCCESS
    try:
        check_bad_descs(server, client)
    finally:
        client.finalize()


def check_bad_descs(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(8192, np.uint8)
    register(server, remote)
    src = pattern(8192, 7)
    register(client, src)
    stray = pattern(64, 8)  # never registered
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    good = TransferOpDesc(addr_of(src), addr_of(remote), 4096)
    cases = {
        "unregistered local": TransferOpDesc(addr_of(stray), addr_of(remote), 64),
        "unregistered remote": TransferOpDesc(addr_of(src), addr_of(remote) + (1 << 30), 64),
        "local out of bounds": TransferOpDesc(addr_of(src) + 8000, addr_of(remote), 500),
        "remote out of bounds": TransferOpDesc(addr_of(src), addr_of(remote) + 8000, 500),
        "zero length": TransferOpDesc(addr_of(src), addr_of(remote), 0),
        "overlapping destinations": TransferOpDesc(addr_of(src) + 4096, addr_of(remote) + 8, 64),
    }
    for what, bad in cases.items():
        for op in (TransferOp.WRITE, TransferOp.READ):
            if what == "overlapping destinations" and op is TransferOp.READ:
                continue  # on READ the overlap is on the source side, which is allowed
            ret = client.transfer_sync(peer, op, [good, bad], 10_000)
            assert ret == PARAM_INVALID, (what, op, client.last_error)
            assert client.transfer_async(peer, op, [good, bad]) == (PARAM_INVALID, 0), what
    assert not remote.any()  # the valid desc was not posted either
    assert client.transfer_sync(peer, TransferOp.WRITE, [], 1000) == PARAM_INVALID
    assert client.transfer_sync(peer, 7, [good], 1000) == PARAM_INVALID  # type: ignore[arg-type]
    assert client.transfer_sync(peer, TransferOp.WRITE, [good], -5) == PARAM_INVALID
    # and the link still works
    assert client.transfer_sync(peer, TransferOp.WRITE, [good], 10_000) == SUCCESS
    assert np.array_equal(remote[:4096], src[:4096])


def test_register_and_deregister(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(4096, np.uint8)
    handle = register(server, remote)
    assert register(server, remote) == handle  # same range, same handle
    src = pattern(4096, 9)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    desc = [TransferOpDesc(addr_of(src), addr_of(remote), 4096)]
    assert client.transfer_sync(peer, TransferOp.WRITE, desc, 10_000) == SUCCESS

    assert server.deregister_mem(handle) == SUCCESS
    assert server.deregister_mem(handle) == SUCCESS  # again: nothing to do
    assert server.deregister_mem(987654) == SUCCESS  # unknown non-zero handle: nothing to do
    assert server.deregister_mem(0) == PARAM_INVALID
    # The peer learns the memory is gone asynchronously; a transfer before that would reach
    # the closed MR and break the link (hixl says: disconnect before deregistering).  After
    # it, the transfer is refused before anything is posted.
    assert client.engine is not None
    conn = client.engine.connection(peer)
    assert eventually(lambda: len(conn.remote_regions), 0) == 0
    got = client.transfer_sync(peer, TransferOp.WRITE, desc, 10_000)
    assert got == PARAM_INVALID, client.last_error
    assert "remote memory not registered" in client.last_error

    # registered after the link exists: announced to the peer too (hixl wants it before connect)
    again = register(server, remote)
    assert again != handle
    ret = eventually(lambda: client.transfer_sync(peer, TransferOp.READ, desc, 10_000), SUCCESS)
    assert ret == SUCCESS, client.last_error


def test_memory_kinds(server: Hixl, client: Hixl) -> None:
    buf = np.zeros(4096, np.uint8)
    assert server.register_mem(MemDesc(0, 4096), MemType.MEM_HOST) == (PARAM_INVALID, 0)
    assert server.register_mem(MemDesc(addr_of(buf), 0), MemType.MEM_HOST) == (PARAM_INVALID, 0)
    bad_type: object = 5
    assert server.register_mem(MemDesc(addr_of(buf), 4096), bad_type) == (PARAM_INVALID, 0)  # type: ignore[arg-type]

    # local_only memory is not exposed to peers
    private = np.zeros(4096, np.uint8)
    ret, _ = server.register_mem(MemDesc(addr_of(private), 4096, local_only=True), MemType.MEM_HOST)
    assert ret == SUCCESS
    src = pattern(64, 10)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    desc = [TransferOpDesc(addr_of(src), addr_of(private), 64)]
    assert client.transfer_sync(peer, TransferOp.WRITE, desc, 10_000) == PARAM_INVALID
    assert not private.any()


def test_auto_connect_option(server: Hixl) -> None:
    remote = np.zeros(1024, np.uint8)
    register(server, remote)
    auto = Hixl()
    try:
        assert auto.initialize("127.0.0.1", {hixl.OPTION_AUTO_CONNECT: "1"}) == SUCCESS
        src = pattern(1024, 11)
        register(auto, src)
        peer = server_id(server)
        desc = [TransferOpDesc(addr_of(src), addr_of(remote), 1024)]
        assert auto.transfer_sync(peer, TransferOp.WRITE, desc, 10_000) == SUCCESS, auto.last_error
        assert np.array_equal(remote, src)
        assert auto.connect(peer, 10_000) == ALREADY_CONNECTED
    finally:
        auto.finalize()


def test_initialize_twice_and_finalize_twice() -> None:
    h = Hixl()
    try:
        assert h.initialize("127.0.0.1", {}) == SUCCESS
        first = h.engine_id
        assert h.initialize("127.0.0.1", {}) == SUCCESS  # ignored, as in hixl
        assert h.engine_id == first
    finally:
        h.finalize()
        h.finalize()
    assert h.engine is None
    port = free_tcp_port()
    with socket.create_server(("127.0.0.1", port)):  # the port is taken
        assert h.initialize(f"127.0.0.1:{port}", {}) == FAILED
        assert h.engine is None


def test_hixl_style_script_in_two_processes() -> None:
    engine_port, side_port = free_tcp_port(), free_tcp_port()
    common = [sys.executable, str(SCRIPT), "--side-port", str(side_port)]
    server = subprocess.Popen(
        [*common, "--role", "server", "--local-engine", f"127.0.0.1:{engine_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = subprocess.run(
            [*common, "--role", "client", "--remote-engine", f"127.0.0.1:{engine_port}"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        server_out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    assert client.returncode == 0, client.stdout + client.stderr
    assert server.returncode == 0, server_out
    assert "client read" in client.stderr and "verify ok" in server_out


# ------------------------------------------------------------------ MEM_DEVICE


def test_mem_device_host_memory_registers_as_host_and_moves_data(
    server: Hixl, client: Hixl, caplog: pytest.LogCaptureFixture
) -> None:
    remote = pattern(256 * 1024, 21)
    local = np.zeros(256 * 1024, np.uint8)
    other = np.zeros(4096, np.uint8)
    with caplog.at_level(logging.INFO, logger="hixl.compat"):
        register(server, remote, MemType.MEM_DEVICE)
        register(client, local, hixl.MEM_DEVICE)
        register(client, other, hixl.MEM_DEVICE)
    noted = [r for r in caplog.records if "registered as host memory" in r.getMessage()]
    assert [r.levelno for r in noted] == [logging.INFO, logging.INFO]  # once per instance
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    # the sample's shape: many 16 KiB blocks of one device buffer, read in one call
    block = 16 * 1024
    descs = [
        TransferOpDesc(addr_of(local) + i * block, addr_of(remote) + i * block, block)
        for i in range(remote.nbytes // block)
    ]
    ret = client.transfer_sync(peer, hixl.READ, descs, timeout_in_millis=30_000)
    assert ret == SUCCESS, client.last_error
    assert np.array_equal(local, remote)


def test_mem_device_that_cannot_be_registered_is_param_invalid(server: Hixl) -> None:
    # A page that is not mapped in this process stands in for a GPU/NPU pointer on rxe.
    with open("/proc/self/maps") as maps:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
    lowest = min(start for start, _ in spans)
    assert lowest > 0x10000
    ret, handle = server.register_mem(MemDesc(0x1000, 4096), MemType.MEM_DEVICE)
    assert (ret, handle) == (PARAM_INVALID, 0)
    assert "MEM_DEVICE addr=0x1000 len=4096 cannot be registered" in server.last_error
    assert "EFAULT" in server.last_error  # the verbs reason


# ------------------------------------------------------------------ buffer-pool relay


def pool_client(options: dict[str, str]) -> Hixl:
    h = Hixl()
    assert h.initialize("127.0.0.1", options) == SUCCESS, h.last_error
    return h


def test_relay_write_and_read_of_unregistered_memory_byte_exact(server: Hixl) -> None:
    remote = np.zeros(3 * 1024 * 1024 + 4096, np.uint8)
    register(server, remote)
    peer = server_id(server)
    client = pool_client({hixl.OPTION_BUFFER_POOL: "2:1"})  # 2 buffers of 1 MiB
    try:
        assert client.connect(peer, 10_000) == SUCCESS, client.last_error
        src = pattern(remote.nbytes, 31)  # never registered
        # one big desc (split over buffers) and many small ones (packed into one buffer)
        big = 3 * 1024 * 1024 - 1000
        descs = [TransferOpDesc(addr_of(src), addr_of(remote), big)]
        descs += [
            TransferOpDesc(addr_of(src) + big + k * 100, addr_of(remote) + big + k * 100, 100)
            for k in range(50)
        ]
        assert client.transfer_sync(peer, hixl.WRITE, descs, 30_000) == SUCCESS, client.last_error
        n = big + 50 * 100
        assert np.array_equal(remote[:n], src[:n])
        assert not remote[n:].any()

        back = np.zeros(remote.nbytes, np.uint8)  # never registered either
        rdescs = [TransferOpDesc(addr_of(back), addr_of(remote), n)]
        assert client.transfer_sync(peer, hixl.READ, rdescs, 30_000) == SUCCESS, client.last_error
        assert np.array_equal(back[:n], src[:n])
        pool = client.buffer_pool
        assert pool is not None and pool.count == 2 and pool.size == 1 << 20
        assert 1 <= pool.made <= 2
        assert client.engine is not None
        assert all(r.length != 1 << 20 or r.remote is None for r in client.engine.regions)
    finally:
        client.finalize()


def test_relay_mixes_with_registered_descs_in_one_call(server: Hixl) -> None:
    remote = np.zeros(8192, np.uint8)
    register(server, remote)
    peer = server_id(server)
    client = pool_client({})  # hixl's default pool, 4:8
    try:
        assert client.connect(peer, 10_000) == SUCCESS, client.last_error
        registered = pattern(4096, 32)
        register(client, registered)
        loose = pattern(4096, 33)
        descs = [
            TransferOpDesc(addr_of(registered), addr_of(remote), 4096),
            TransferOpDesc(addr_of(loose), addr_of(remote) + 4096, 4096),
        ]
        ret, req = client.transfer_async(peer, hixl.WRITE, descs)
        assert ret == SUCCESS, client.last_error
        state = eventually(
            lambda: client.get_transfer_status(req), (SUCCESS, hixl.TransferStatus.COMPLETED)
        )
        assert state == (SUCCESS, hixl.TransferStatus.COMPLETED), client.last_error
        assert np.array_equal(remote[:4096], registered)
        assert np.array_equal(remote[4096:], loose)
        assert client.buffer_pool is not None and client.buffer_pool.made == 1
    finally:
        client.finalize()


def test_relay_shared_by_many_requests_stays_correct_and_bounded(server: Hixl) -> None:
    each = 600 * 1024
    count = 8
    remote = np.zeros(each * count, np.uint8)
    register(server, remote)
    peer = server_id(server)
    client = pool_client({hixl.OPTION_BUFFER_POOL: "2:1", hixl.OPTION_AUTO_CONNECT: "1"})
    try:
        sources = [pattern(each, 40 + i) for i in range(count)]
        reqs = []
        for i in range(count // 2):  # half asynchronous ...
            d = [TransferOpDesc(addr_of(sources[i]), addr_of(remote) + i * each, each)]
            ret, req = client.transfer_async(peer, hixl.WRITE, d)
            assert ret == SUCCESS, client.last_error
            reqs.append(req)
        results: dict[int, int] = {}

        def sync(i: int) -> None:  # ... half synchronous, from their own threads
            d = [TransferOpDesc(addr_of(sources[i]), addr_of(remote) + i * each, each)]
            results[i] = client.transfer_sync(peer, hixl.WRITE, d, 60_000)

        threads = [threading.Thread(target=sync, args=(i,)) for i in range(count // 2, count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert results == {i: SUCCESS for i in range(count // 2, count)}, client.last_error
        want = (SUCCESS, hixl.TransferStatus.COMPLETED)
        for req in reqs:
            assert eventually(partial(client.get_transfer_status, req), want, 60) == want
        for i, src in enumerate(sources):
            assert np.array_equal(remote[i * each : (i + 1) * each], src), i
        assert client.buffer_pool is not None and client.buffer_pool.made <= 2
    finally:
        client.finalize()


def test_relay_off_refuses_unregistered_memory(server: Hixl) -> None:
    remote = np.zeros(4096, np.uint8)
    register(server, remote)
    client = pool_client({hixl.OPTION_BUFFER_POOL: "0:0", hixl.OPTION_AUTO_CONNECT: "1"})
    try:
        loose = pattern(4096, 50)
        d = [TransferOpDesc(addr_of(loose), addr_of(remote), 4096)]
        assert client.transfer_sync(server_id(server), hixl.WRITE, d, 10_000) == PARAM_INVALID
        assert "buffer pool is off" in client.last_error
        assert client.buffer_pool is None and not remote.any()
    finally:
        client.finalize()


# ------------------------------------------------------------------ async connect


def test_async_connect_status_sequence_on_a_real_link(server: Hixl, client: Hixl) -> None:
    acs = hixl.AsyncConnectStatus
    peer = server_id(server)
    remote = pattern(4096, 60)
    register(server, remote)
    local = np.zeros(4096, np.uint8)
    register(client, local)

    assert client.get_async_connect_status(peer) == (SUCCESS, acs.NOT_CONNECT)
    assert client.connect_async(peer, timeout_in_millis=10_000) == SUCCESS
    first = client.get_async_connect_status(peer)[1]
    assert first in (acs.CONNECT_PENDING, acs.CONNECTING, acs.CONNECTED)
    assert eventually(lambda: client.get_async_connect_status(peer), (SUCCESS, acs.CONNECTED)) == (
        SUCCESS,
        acs.CONNECTED,
    )
    assert client.get_all_async_connect_status() == (SUCCESS, {peer: acs.CONNECTED})
    d = [TransferOpDesc(addr_of(local), addr_of(remote), 4096)]
    assert client.transfer_sync(peer, hixl.READ, d, 10_000) == SUCCESS, client.last_error
    assert np.array_equal(local, remote)

    assert client.disconnect_async(peer, timeout_in_millis=10_000) == SUCCESS
    assert eventually(
        lambda: client.get_async_connect_status(peer), (SUCCESS, acs.NOT_CONNECT)
    ) == (
        SUCCESS,
        acs.NOT_CONNECT,
    )
    assert client.get_all_async_connect_status() == (SUCCESS, {})
    assert client.transfer_sync(peer, hixl.READ, d, 10_000) == NOT_CONNECTED

    nobody = f"127.0.0.1:{free_tcp_port()}"
    assert client.connect_async(nobody, 2000) == SUCCESS
    got = eventually(lambda: client.get_async_connect_status(nobody), (SUCCESS, acs.CONNECT_FAILED))
    assert got == (SUCCESS, acs.CONNECT_FAILED)
    assert client.connect_async(peer, 0) == PARAM_INVALID


def test_connect_async_does_not_block_the_caller(client: Hixl) -> None:
    acs = hixl.AsyncConnectStatus
    # A listener that accepts but never answers the handshake: connect takes its full timeout.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        peer = f"127.0.0.1:{mute.getsockname()[1]}"
        start = time.monotonic()
        assert client.connect_async(peer, timeout_in_millis=1500) == SUCCESS
        assert time.monotonic() - start < 0.5  # returned before the handshake could finish
        time.sleep(0.3)
        assert client.get_async_connect_status(peer) == (SUCCESS, acs.CONNECTING)
        got = eventually(
            lambda: client.get_async_connect_status(peer), (SUCCESS, acs.CONNECT_FAILED)
        )
        assert got == (SUCCESS, acs.CONNECT_FAILED)
        assert "connect" in client.last_error


# ------------------------------------------------------------------ channel pool


def test_channel_pool_connects_implicitly_and_caps_links() -> None:
    servers = [Hixl() for _ in range(4)]
    config = {
        "channel_pool.max_channel": "3",
        "channel_pool.high_waterline": "0.7",  # high mark 2
        "channel_pool.low_waterline": "0.4",  # low mark 1
    }
    client = pool_client({hixl.OPTION_GLOBAL_RESOURCE_CONFIG: json.dumps(config)})
    try:
        assert client.options.channel_pool is not None
        assert client.options.channel_pool.high_mark == 2
        remotes = []
        for s in servers:
            assert s.initialize(f"127.0.0.1:{free_tcp_port()}", {}) == SUCCESS, s.last_error
            r = np.zeros(1024, np.uint8)
            register(s, r)
            remotes.append(r)
        src = pattern(1024, 70)
        register(client, src)
        assert client.engine is not None
        for i, s in enumerate(servers):
            d = [TransferOpDesc(addr_of(src), addr_of(remotes[i]), 1024)]
            # no connect() and no AutoConnect: the channel pool links on first transfer
            ret = client.transfer_sync(server_id(s), hixl.WRITE, d, 10_000)
            assert ret == SUCCESS, client.last_error
            assert np.array_equal(remotes[i], src)
            assert len(client.engine.peers) <= 2, client.engine.peers  # never past the high mark
        # the least recently used links were closed first
        assert server_id(servers[-1]) in client.engine.peers
        assert server_id(servers[0]) not in client.engine.peers
    finally:
        client.finalize()
        for s in servers:
            s.finalize()


# ------------------------------------------------------------------ notify limits


def test_notifies_at_hixls_limits_arrive_whole_and_in_order(server: Hixl, client: Hixl) -> None:
    remote = np.zeros(4096, np.uint8)
    register(server, remote)
    src = pattern(4096, 80)
    register(client, src)
    peer = server_id(server)
    assert client.connect(peer, 10_000) == SUCCESS
    notes = [
        NotifyDesc("", "empty name"),
        NotifyDesc("n" * 1024, "m" * 1024),
        NotifyDesc("\u00e9" * 512, "\u2713" * 341),  # 1024 and 1023 bytes in UTF-8
        NotifyDesc("small", "after the big ones"),
    ]
    d = [TransferOpDesc(addr_of(src), addr_of(remote), 4096)]
    assert client.transfer_async(peer, hixl.WRITE, d)[0] == SUCCESS
    for note in notes:
        assert client.send_notify(peer, note, 10_000) == SUCCESS, client.last_error
    got: list[NotifyDesc] = []
    deadline = time.monotonic() + 20
    while len(got) < len(notes) and time.monotonic() < deadline:
        ret, new = server.get_notifies()
        assert ret == SUCCESS
        if new and not got:
            assert np.array_equal(remote, src)  # after the data
        got.extend(new)
        time.sleep(0.01)
    assert got == notes
