"""etcd stops: live connections and transfers carry on, new lookups fail fast with an
error naming the registry, and when etcd is back the engines announce themselves again
(with what changed meanwhile) without a restart."""

from __future__ import annotations

import time

import pytest

from hixl import ConnState, Engine
from hixl.errors import RegistryUnavailable
from hixl.testbed.etcd import EtcdServer
from hixl.testbed.hosts import Control, HostEnv

from .agent import pattern, sha
from .conftest import wait_region

NBYTES = 4 << 20  # a few tenths of a second on this wire: still in flight when etcd stops


def test_etcd_stopped_and_back(
    host: HostEnv, url: str, etcd: EtcdServer, agents: dict[int, Control], token: str
) -> None:
    store = agents[3]
    info = store.call(
        "engine", listen=f"{host.peers[2]}:5610", name="store-3", nbytes=NBYTES, url=url
    )
    try:
        with Engine(
            f"{host.address}:5620", name="router-0", role="prefill", registry=url, token=token
        ) as eng:
            registry = eng.registry
            assert registry is not None
            mine = registry.resolve("router-0").instance
            conn = eng.connect("store-3", timeout=30)
            wait_region(eng, "store-3", "data")
            data = pattern(3, NBYTES)
            src = eng.register(data)

            handle = eng.put_async("store-3", src, "data", timeout=60)
            t0 = time.monotonic()
            etcd.stop()
            print(f"etcd stopped in {time.monotonic() - t0:.2f} s; put done: {handle.done()}")
            handle.wait(60)  # the transfer under way carries on
            assert store.call("sha")["sha"] == sha(data)
            assert eng.connect("store-3") is conn  # a live connection needs no lookup
            more = pattern(4, NBYTES)
            eng.put("store-3", eng.register(more), "data", timeout=60)
            assert store.call("sha")["sha"] == sha(more)

            for lookup in (
                lambda: eng.connect("decode-9", timeout=30),
                lambda: registry.resolve("store-3"),
            ):
                t0 = time.monotonic()
                with pytest.raises(RegistryUnavailable, match=f"registry {url}"):
                    lookup()
                assert time.monotonic() - t0 < 2.0  # fast, not a 30 s connect deadline

            kept = store.call("set_capacity", capacity=5)  # made while etcd is down
            assert kept["kept"], kept
            time.sleep(1.0)
            etcd.start()  # the same data directory, as after a reboot
            t0 = time.monotonic()
            while True:
                try:
                    ann = registry.resolve("store-3")
                    if ann.capacity == 5:
                        break
                except RegistryUnavailable:
                    pass
                assert time.monotonic() - t0 < 15.0, "store-3's capacity was never re-announced"
                time.sleep(0.1)
            print(f"store-3 re-announced its capacity {time.monotonic() - t0:.2f} s after start")
            # Same processes: nothing was restarted to come back.
            assert ann.instance == info["instance"]
            assert registry.resolve("router-0").instance == mine
            assert conn.state is ConnState.READY and eng.connect("store-3") is conn
            last = pattern(5, NBYTES)
            eng.put("store-3", eng.register(last), "data", timeout=60)
            assert store.call("sha")["sha"] == sha(last)
    finally:
        if not etcd.running:
            etcd.start()
        store.call("close_engine")
