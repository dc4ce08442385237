"""The registry client against the in-process store: leases, watches, outages, bad values.

Every wait has a deadline; timings assert the documented bounds (expiry within TTL plus
the store's check interval).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hixl.core.directory import PREFIX, EventKind, encode, key_for
from hixl.errors import (
    ArgumentError,
    NameNotFound,
    RegistryUnavailable,
    StateError,
    TransferTimeout,
)
from hixl.registry import (
    Announcement,
    MemoryBackend,
    MemoryStore,
    Registry,
    open_registry,
    parse_url,
)


def announce(
    reg: Registry,
    name: str,
    *,
    role: str = "decode",
    engine_id: str = "10.0.0.2:5000",
    mtu: int = 1024,
    capacity: int = 64,
) -> Announcement:
    return reg.announce(
        name, role=role, engine_id=engine_id, gid="fe80::2", mtu=mtu, capacity=capacity
    )


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore("test")


@pytest.fixture
def regs(store: MemoryStore) -> Iterator[tuple[Registry, Registry]]:
    a = Registry(MemoryBackend(store), ttl=1, timeout=2.0)
    b = Registry(MemoryBackend(store), ttl=1, timeout=2.0)
    yield a, b
    a.close()
    b.close()


def next_event(w, kind: EventKind, name: str, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    """The next event for ``name``, which must be of ``kind``."""
    deadline = time.monotonic() + timeout
    while True:
        ev = w.get(max(0.0, deadline - time.monotonic()))
        if ev.name == name:
            assert ev.kind is kind, ev
            return ev


def test_announce_resolve_update_withdraw(regs: tuple[Registry, Registry]) -> None:
    a, b = regs
    w = b.watch()
    ann = announce(a, "decode-1")
    assert b.resolve("decode-1") == ann
    assert next_event(w, EventKind.JOIN, "decode-1").current == ann
    a.update("decode-1", capacity=10)
    ev = next_event(w, EventKind.UPDATE, "decode-1")
    assert ev.current is not None and ev.current.capacity == 10 and not ev.restarted
    assert w.members()["decode-1"].capacity == 10
    assert [x.name for x in b.list(role="decode")] == ["decode-1"]
    assert b.list(role="prefill") == []
    a.withdraw("decode-1")
    next_event(w, EventKind.LEAVE, "decode-1")
    with pytest.raises(NameNotFound, match="no engine named 'decode-1' in registry memory://test"):
        b.resolve("decode-1")


def test_bad_arguments_are_named(regs: tuple[Registry, Registry]) -> None:
    a, _ = regs
    with pytest.raises(ArgumentError, match="mtu=1500"):
        announce(a, "x", mtu=1500)
    with pytest.raises(ArgumentError, match="registry name"):
        a.resolve("no/slash")
    with pytest.raises(StateError, match="not announced by this process"):
        a.update("never", capacity=1)
    for url in ["http://x:1", "etcd://", "etcd://h:99999", "memory://", "etcd://a b:1"]:
        with pytest.raises(ArgumentError, match="registry URL"):
            parse_url(url)
    assert parse_url("etcd://10.0.0.1") == ("etcd", "10.0.0.1", 2379)
    assert parse_url("etcd://[fe80::1]:2") == ("etcd", "fe80::1", 2)


def test_lease_expiry_is_seen_within_ttl(regs: tuple[Registry, Registry]) -> None:
    a, b = regs
    w = b.watch()
    announce(a, "decode-1")
    next_event(w, EventKind.JOIN, "decode-1")
    time.sleep(2.5)  # the keep-alive holds the name past the 1 s TTL
    assert "decode-1" in w.members()
    a.close(revoke=False)  # as if the process died: nothing refreshes the lease now
    t0 = time.monotonic()
    next_event(w, EventKind.LEAVE, "decode-1", timeout=3.0)
    assert time.monotonic() - t0 <= 1.0 + 0.5


def test_close_revokes_at_once(regs: tuple[Registry, Registry]) -> None:
    a, b = regs
    w = b.watch()
    announce(a, "decode-1")
    next_event(w, EventKind.JOIN, "decode-1")
    t0 = time.monotonic()
    a.close()
    next_event(w, EventKind.LEAVE, "decode-1", timeout=1.0)
    assert time.monotonic() - t0 < 0.5
    a.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        announce(a, "decode-1")


def test_restart_with_same_name(store: MemoryStore, regs: tuple[Registry, Registry]) -> None:
    old, watcher = regs
    w = watcher.watch()
    first = announce(old, "decode-1")
    next_event(w, EventKind.JOIN, "decode-1")
    old.close(revoke=False)  # the old process dies...
    new = Registry(MemoryBackend(store), ttl=1)  # ...and its successor takes the name
    try:
        second = announce(new, "decode-1", engine_id="10.0.0.2:5001")
        ev = next_event(w, EventKind.UPDATE, "decode-1")
        assert ev.restarted and ev.previous == first and ev.current == second
        time.sleep(2.0)  # the old lease expires; the name, now on the new lease, stays
        assert watcher.resolve("decode-1") == second
        assert w.members()["decode-1"] == second
    finally:
        new.close()


def test_outage_fails_fast_and_recovers(
    store: MemoryStore, regs: tuple[Registry, Registry]
) -> None:
    a, b = regs
    w = b.watch()
    announce(a, "decode-1")
    next_event(w, EventKind.JOIN, "decode-1")
    store.stop()
    t0 = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="memory://test"):
        b.resolve("decode-1")
    with pytest.raises(RegistryUnavailable, match="memory://test"):
        announce(a, "prefill-1", role="prefill")
    assert time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + 3
    while w.synced and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not w.synced and "decode-1" in w.members()  # last known view is kept
    time.sleep(1.5)  # longer than the TTL: a stopped store does not expire leases
    store.start()
    # Both names are there again without any call: prefill-1 was kept and is made now.
    next_event(w, EventKind.JOIN, "prefill-1", timeout=3.0)
    assert {x.name for x in b.list()} == {"decode-1", "prefill-1"}
    assert w.synced


def test_store_losing_its_data_gets_everything_again(
    store: MemoryStore, regs: tuple[Registry, Registry]
) -> None:
    a, b = regs
    w = b.watch()
    announce(a, "decode-1")
    announce(a, "decode-2")
    store.stop()
    store.start(wipe=True)  # a new, empty store: the lease is unknown there
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if {x.name for x in b.list()} == {"decode-1", "decode-2"}:
            break
        time.sleep(0.05)
    assert {x.name for x in b.list()} == {"decode-1", "decode-2"}
    time.sleep(0.5)
    assert set(w.members()) == {"decode-1", "decode-2"}


def test_malformed_and_foreign_values_are_skipped(
    store: MemoryStore, regs: tuple[Registry, Registry], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = regs
    caplog.set_level(logging.WARNING, logger="hixl.registry")
    w = b.watch()
    announce(a, "decode-1")
    next_event(w, EventKind.JOIN, "decode-1")
    store.put_raw(PREFIX + "junk", b"\x00not json")
    store.put_raw(PREFIX + "foreign", b'{"v": 1, "name": "foreign", "rkey": 1234}')
    store.put_raw(PREFIX + "bad/name", b"{}")
    stolen = encode(
        Announcement(name="other", role="x", engine="1.2.3.4:5", gid="::1", mtu=256, capacity=0)
    )
    store.put_raw(PREFIX + "decode-2", stolen)  # a value naming another key
    store.put_raw("/not/hixl", b"whatever")
    announce(a, "decode-3")
    next_event(w, EventKind.JOIN, "decode-3")  # the watch went on past all of them
    assert set(w.members()) == {"decode-1", "decode-3"}
    assert {x.name for x in b.list()} == {"decode-1", "decode-3"}
    with pytest.raises(NameNotFound, match="malformed"):
        b.resolve("junk")
    text = caplog.text
    assert "not UTF-8 JSON" in text and "unexpected ['rkey']" in text
    assert "the key names 'decode-2'" in text and "registry name 'bad/name'" in text
    # A good value overwritten with junk is that name leaving.
    store.put_raw(key_for("decode-1"), b"[]")
    next_event(w, EventKind.LEAVE, "decode-1")


def test_watch_queue_is_bounded(regs: tuple[Registry, Registry]) -> None:
    a, b = regs
    w = b.watch()
    announce(a, "decode-1")
    for i in range(1100):
        a.update("decode-1", capacity=i)
    deadline = time.monotonic() + 5
    while w.members().get("decode-1", None) is None or w.members()["decode-1"].capacity != 1099:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    events = w.drain()
    assert len(events) == 1024 and w.dropped == 1101 - 1024
    assert events[-1].current is not None and events[-1].current.capacity == 1099
    with pytest.raises(TransferTimeout):
        w.get(0.05)
    w.close()
    with pytest.raises(StateError):
        w.get(1.0)


def test_memory_url_shares_one_store_per_name() -> None:
    with open_registry("memory://shared-x", ttl=2) as a, open_registry("memory://shared-x") as b:
        announce(a, "p")
        assert b.resolve("p").engine == "10.0.0.2:5000"
        with open_registry("memory://shared-y") as c, pytest.raises(NameNotFound):
            c.resolve("p")


def test_unreachable_etcd_url_fails_at_construction() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        t0 = time.monotonic()
        with pytest.raises(
            RegistryUnavailable, match=f"registry etcd://127.0.0.1:{port} is unreachable"
        ):
            open_registry(f"etcd://127.0.0.1:{port}", timeout=1.0)
        assert time.monotonic() - t0 < 3.0


def test_close_ends_the_registry_threads(store: MemoryStore) -> None:
    reg = Registry(MemoryBackend(store), ttl=1)
    announce(reg, "decode-1")
    reg.watch()
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("hixl-registry-announce") for n in names)
    assert any(n.startswith("hixl-registry-watch") for n in names)
    reg.close()
    deadline = time.monotonic() + 3
    while any(t.name.startswith("hixl-registry") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
