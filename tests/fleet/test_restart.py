"""A worker restarts with the same name: it is found again, the old connection is
replaced cleanly (no second connection, the old one closed, transfers land in the new
process's memory)."""

from __future__ import annotations

import time

import pytest

from hixl import ConnectionFailed, ConnState, Engine
from hixl.testbed.hosts import Control, HostEnv

from .agent import pattern, sha
from .conftest import wait_region

NBYTES = 1 << 20


def test_worker_restarts_with_the_same_name(
    host: HostEnv, url: str, agents: dict[int, Control], token: str
) -> None:
    store = agents[3]
    first = store.call(
        "engine", listen=f"{host.peers[2]}:5610", name="store-3", nbytes=NBYTES, url=url
    )
    try:
        with Engine(f"{host.address}:0", registry=url, token=token) as eng:
            old = eng.connect("store-3", timeout=30)
            assert old.peer == first["id"]
            wait_region(eng, "store-3", "data")
            data = pattern(1, NBYTES)
            src = eng.register(data)
            eng.put("store-3", src, "data", timeout=30)
            assert store.call("sha")["sha"] == sha(data)

            t0 = time.monotonic()
            second = store.call("restart")  # closes its engine, opens a new one, same name
            assert second["id"] == first["id"] and second["instance"] != first["instance"]
            # The registry tells this engine: the old connection fails, no deadline needed.
            while old.state is ConnState.READY:
                assert time.monotonic() - t0 < 10.0, old
                time.sleep(0.05)
            print(f"old connection {old.state.name} {time.monotonic() - t0:.2f} s after restart")
            with pytest.raises(ConnectionFailed):
                eng.put("store-3", src, "data", timeout=30)

            found = eng.registry.resolve("store-3")  # type: ignore[union-attr]
            assert found.instance == second["instance"] and found.engine == second["id"]
            new = eng.connect("store-3", timeout=30)
            assert new is not old and old.state is ConnState.CLOSED
            assert eng.peers == [new.peer] and eng.connection("store-3") is new
            wait_region(eng, "store-3", "data")
            again = pattern(2, NBYTES)
            eng.put("store-3", eng.register(again), "data", timeout=30)
            assert store.call("sha")["sha"] == sha(again)
    finally:
        store.call("close_engine")
