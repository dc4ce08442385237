"""The registry against a real etcd 3.4 on this host (a private one per test).

Processes that die are real processes killed with SIGKILL; etcd outages are the etcd
process stopped and started again by the harness.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd3gw.client import Etcd3Client

from hixl.core.directory import PREFIX, EventKind, key_for
from hixl.errors import NameNotFound, RegistryUnavailable
from hixl.registry import Announcement, Registry, Watch, open_registry
from hixl.testbed.etcd import EtcdServer

ANNOUNCER = Path(__file__).with_name("announcer.py")


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


TTL = 2


@pytest.fixture
def watcher(etcd: EtcdServer) -> Iterator[tuple[Registry, Watch]]:
    reg = open_registry(etcd.url, ttl=TTL, timeout=1.0)
    w = reg.watch()
    reg.wait_synced(w, 5.0)
    yield reg, w
    reg.close()


def next_event(w: Watch, kind: EventKind, name: str, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        ev = w.get(max(0.0, deadline - time.monotonic()))
        if ev.name == name:
            assert ev.kind is kind, ev
            return ev


def spawn(url: str, name: str, engine_id: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(ANNOUNCER), url, name, engine_id, str(TTL)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the announcer exits (EOF) if it cannot announce
    assert line.startswith("ready "), line
    return proc, line.split()[1]


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10)


def test_announce_resolve_watch_on_etcd(etcd: EtcdServer, watcher: tuple[Registry, Watch]) -> None:
    reg, w = watcher
    with open_registry(etcd.url, ttl=TTL) as other:
        ann = announce(other, "decode-1")
        assert next_event(w, EventKind.JOIN, "decode-1").current == ann
        assert reg.resolve("decode-1") == ann
        other.update("decode-1", capacity=3)
        assert next_event(w, EventKind.UPDATE, "decode-1").current.capacity == 3
        assert [a.name for a in reg.list("decode")] == ["decode-1"]
        time.sleep(TTL * 1.5)  # the keep-alive holds the lease
        assert reg.resolve("decode-1").capacity == 3
    next_event(w, EventKind.LEAVE, "decode-1", timeout=2.0)  # close revoked the lease


def test_killed_process_leaves_within_ttl(
    etcd: EtcdServer, watcher: tuple[Registry, Watch]
) -> None:
    _, w = watcher
    proc, _ = spawn(etcd.url, "decode-1", "10.0.0.2:5000")
    try:
        next_event(w, EventKind.JOIN, "decode-1")
    finally:
        kill(proc)
    t0 = time.monotonic()
    next_event(w, EventKind.LEAVE, "decode-1", timeout=TTL + 3)
    elapsed = time.monotonic() - t0
    # etcd checks expired leases every 0.5 s; the keep-alive ran at most TTL/3 ago.
    assert elapsed <= TTL + 1.0, elapsed


def test_restart_with_same_name(etcd: EtcdServer, watcher: tuple[Registry, Watch]) -> None:
    reg, w = watcher
    old, old_instance = spawn(etcd.url, "decode-1", "10.0.0.2:5000")
    try:
        next_event(w, EventKind.JOIN, "decode-1")
    finally:
        kill(old)
    new, new_instance = spawn(etcd.url, "decode-1", "10.0.0.2:5001")
    try:
        ev = next_event(w, EventKind.UPDATE, "decode-1")
        assert ev.restarted
        assert ev.previous.instance == old_instance and ev.current.instance == new_instance
        time.sleep(TTL + 1.5)  # the old lease has expired; the key moved to the new one
        assert reg.resolve("decode-1").engine == "10.0.0.2:5001"
        assert w.members()["decode-1"].instance == new_instance
        assert not [e for e in w.drain() if e.name == "decode-1" and e.kind is EventKind.LEAVE]
    finally:
        kill(new)


def test_etcd_stop_and_start(etcd: EtcdServer, watcher: tuple[Registry, Watch]) -> None:
    reg, w = watcher
    with open_registry(etcd.url, ttl=TTL) as worker:
        announce(worker, "decode-1")
        next_event(w, EventKind.JOIN, "decode-1")
        etcd.stop()
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"registry {etcd.url}"):
            reg.resolve("decode-1")
        with pytest.raises(RegistryUnavailable, match=f"registry {etcd.url}"):
            announce(worker, "decode-2")
        assert time.monotonic() - t0 < 2.0
        time.sleep(TTL + 1)
        assert "decode-1" in w.members()  # the watcher keeps the last known view
        etcd.start()
        # Nothing restarted: decode-2 (wanted while etcd was down) appears by itself.
        next_event(w, EventKind.JOIN, "decode-2", timeout=TTL + 5)
        assert {a.name for a in reg.list()} == {"decode-1", "decode-2"}
        assert w.synced


def test_etcd_losing_its_data_gets_announcements_again(
    etcd: EtcdServer, watcher: tuple[Registry, Watch]
) -> None:
    reg, w = watcher
    with open_registry(etcd.url, ttl=TTL) as worker:
        announce(worker, "decode-1")
        next_event(w, EventKind.JOIN, "decode-1")
        etcd.kill()
        etcd.start(wipe=True)  # same port, empty data: the worker's lease is gone
        deadline = time.monotonic() + TTL + 5
        while time.monotonic() < deadline:
            try:
                if reg.resolve("decode-1").name == "decode-1":
                    break
            except (NameNotFound, RegistryUnavailable):
                time.sleep(0.1)
        assert reg.resolve("decode-1").engine == "10.0.0.2:5000"
        time.sleep(1.0)
        assert "decode-1" in w.members() and w.synced


def test_malformed_values_in_etcd_are_skipped(
    etcd: EtcdServer, watcher: tuple[Registry, Watch], caplog: pytest.LogCaptureFixture
) -> None:
    reg, w = watcher
    caplog.set_level(logging.WARNING, logger="hixl.registry")
    raw = Etcd3Client(host="127.0.0.1", port=etcd.client_port, api_path="/v3/", timeout=2)
    raw.put(PREFIX + "junk", b"\xff\x00")
    raw.put(PREFIX + "foreign", '{"v":1,"name":"foreign","addr":"10.0.0.9","rkey":77}')
    raw.put(PREFIX + "x" * 100, "{}")
    with open_registry(etcd.url, ttl=TTL) as worker:
        announce(worker, "decode-1")
        next_event(w, EventKind.JOIN, "decode-1")
        assert set(w.members()) == {"decode-1"}
        assert [a.name for a in reg.list()] == ["decode-1"]
        with pytest.raises(NameNotFound, match="malformed"):
            reg.resolve("foreign")
        raw.put(key_for("decode-1"), "[1]")
        next_event(w, EventKind.LEAVE, "decode-1")
    # A new watcher lists the junk too, and skips it the same way.
    with open_registry(etcd.url) as late:
        w2 = late.watch()
        late.wait_synced(w2, 5.0)
        assert w2.members() == {}
    assert "not UTF-8 JSON" in caplog.text and "unexpected ['addr', 'rkey']" in caplog.text


def test_log_tail_is_the_end_of_etcds_own_log(etcd: EtcdServer) -> None:
    assert EtcdServer().log_tail() == "", "a server never started has no log"
    tail = etcd.log_tail(4096)
    assert 0 < len(tail.encode()) <= 4096
    path = etcd.log_path
    assert path is not None
    whole = path.read_bytes().decode("utf-8", "replace")  # etcd may have logged more since
    assert tail in whole and whole.index(tail) >= len(whole) - len(tail) - (1 << 16)
    assert '"msg"' in tail  # etcd logs JSON lines
