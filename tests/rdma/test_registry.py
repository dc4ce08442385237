"""Engines with names: announce, connect by name, capacity, restart, leave, etcd outages."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl import Access, ConnState, Engine
from hixl.core.directory import EventKind
from hixl.errors import ConnectionFailed, NameNotFound, RegistryUnavailable
from hixl.registry import DirectoryEvent, Watch, open_registry
from hixl.testbed.etcd import EtcdServer
from hixl.testbed.net import free_tcp_port

SIZE = 64 * 1024


def next_event(w: Watch, kind: EventKind, name: str, timeout: float = 10.0) -> DirectoryEvent:
    deadline = time.monotonic() + timeout
    while True:
        ev = w.get(max(0.0, deadline - time.monotonic()))
        if ev.name == name:
            assert ev.kind is kind, ev
            return ev


def decode_engine(url: str, port: int, name: str = "decode-1") -> tuple[Engine, np.ndarray]:
    eng = Engine(f"127.0.0.1:{port}", name=name, registry=url, role="decode", capacity=8)
    buf = np.zeros(SIZE, np.uint8)
    eng.register(buf, access=Access.REMOTE_WRITE | Access.REMOTE_READ, name="kv")
    return eng, buf


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def test_connect_by_name_put_capacity_leave() -> None:
    url = "memory://rdma-names"
    decode, kv = decode_engine(url, free_tcp_port())
    prefill = Engine("127.0.0.1:0", registry=url)
    try:
        w = prefill.watch()
        assert prefill.registry is not None
        prefill.registry.wait_synced(w, 10.0)
        # A watch made before the first listing sees the names already there as joins.
        assert w.members()["decode-1"].engine == decode.id
        w.drain()
        ann = prefill.registry.resolve("decode-1")
        assert ann.engine == decode.id and ann.role == "decode" and ann.capacity == 8
        assert ipaddress.IPv6Address(ann.gid) == ipaddress.IPv6Address(decode.device.gid)
        assert ann.mtu == decode.device.active_mtu
        conn = prefill.connect("decode-1", timeout=30)
        assert conn.peer == decode.id and prefill.connection("decode-1") is conn
        src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        prefill.put("decode-1", prefill.register(src), "kv")
        assert np.array_equal(kv, src)
        decode.set_capacity(3)
        ev = next_event(w, EventKind.UPDATE, "decode-1")
        assert ev.current is not None and ev.current.capacity == 3
        decode.close()
        next_event(w, EventKind.LEAVE, "decode-1", timeout=2.0)
        with pytest.raises(NameNotFound, match="decode-1"):
            prefill.connect("decode-1")
    finally:
        prefill.close()
        decode.close()


def test_restart_with_same_name_replaces_the_connection() -> None:
    url = "memory://rdma-restart"
    port = free_tcp_port()
    first, _ = decode_engine(url, port)
    prefill = Engine("127.0.0.1:0", registry=url)
    second = None
    try:
        old = prefill.connect("decode-1", timeout=30)
        first.close()
        second, kv = decode_engine(url, port)  # the same name and address, a new process
        new = prefill.connect("decode-1", timeout=30)
        assert new is not old and old.state is ConnState.CLOSED
        src = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
        prefill.put("decode-1", prefill.register(src), "kv")
        assert np.array_equal(kv, src)
    finally:
        prefill.close()
        first.close()
        if second is not None:
            second.close()


def test_name_leaving_fails_its_connection() -> None:
    """A peer whose name leaves the registry (its lease ended) is failed at once: the
    connection does not wait for a transfer deadline to notice a host that is gone."""
    url = "memory://rdma-leave"
    shared = open_registry(url, ttl=1)
    decode = Engine(f"127.0.0.1:{free_tcp_port()}", name="decode-1", registry=shared)
    decode.register(np.zeros(SIZE, np.uint8), access=Access.REMOTE_WRITE, name="kv")
    prefill = Engine("127.0.0.1:0", registry=url)
    try:
        conn = prefill.connect("decode-1", timeout=30)
        src = prefill.register(np.ones(SIZE, np.uint8))
        prefill.put("decode-1", src, "kv")
        t0 = time.monotonic()
        shared.close(revoke=False)  # the decode side stops refreshing: its lease runs out
        deadline = t0 + 5
        while conn.state is ConnState.READY and time.monotonic() < deadline:
            time.sleep(0.05)
        assert conn.state is ConnState.FAILED
        assert time.monotonic() - t0 <= 1 + 1.0  # TTL + 1 s
        with pytest.raises(ConnectionFailed, match="left registry memory://rdma-leave"):
            prefill.put("decode-1", src, "kv")
    finally:
        prefill.close()
        decode.close()
        shared.close()


def test_connect_under_way_gives_up_when_the_name_leaves() -> None:
    """A connect by name that started while the peer's lease was still alive (its host just
    died: the TCP port answers, the handshake never does) fails with ConnectionFailed as
    soon as the name leaves, within TTL + 1 s, not after its own 10 s timeout."""
    url = "memory://rdma-leave-connect"
    shared = open_registry(url, ttl=1)
    with socket.create_server(("127.0.0.1", 0), backlog=4) as silent:  # never accepts
        port = silent.getsockname()[1]
        shared.announce(
            "ghost",
            role="decode",
            engine_id=f"127.0.0.1:{port}",
            gid="fe80::1",
            mtu=1024,
            capacity=1,
        )
        prefill = Engine("127.0.0.1:0", registry=url)
        try:
            t0 = time.monotonic()
            # The ghost's process stops refreshing its lease now; the connect starts after.
            threading.Timer(0.2, shared.close, kwargs={"revoke": False}).start()
            with pytest.raises(ConnectionFailed, match="ghost left registry") as err:
                prefill.connect("ghost", timeout=10)
            took = time.monotonic() - t0
            print(f"connect gave up after {took:.2f} s: {err.value}")
            assert took <= 0.2 + 1 + 1.0  # the lease went TTL after the last refresh, + 1 s
            assert prefill.peers == []
        finally:
            prefill.close()
            shared.close()


def test_etcd_stopped_existing_connections_carry_on(etcd: EtcdServer) -> None:
    decode, kv = decode_engine(etcd.url, free_tcp_port())
    prefill = Engine("127.0.0.1:0", registry=etcd.url)
    try:
        conn = prefill.connect("decode-1", timeout=30)
        data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        src = prefill.register(data)
        etcd.stop()
        prefill.put("decode-1", src, "kv")  # no registry needed for a live connection
        assert np.array_equal(kv, data)
        assert prefill.connect("decode-1") is conn  # the live connection carries on
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"registry {etcd.url}"):
            prefill.connect("decode-2", timeout=30)
        assert time.monotonic() - t0 < 2.0
        etcd.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                prefill.registry.resolve("decode-1")  # type: ignore[union-attr]
                break
            except RegistryUnavailable:
                time.sleep(0.1)
        assert prefill.connect("decode-1").peer == decode.id
    finally:
        prefill.close()
        decode.close()
