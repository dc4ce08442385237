"""Four-host fleet tests: they run on host0 of a four-VM run and drive ``agent.py`` on
host1..host3.

Only ``make test-fleet`` (``hixl vm hosts`` with four hosts: this directory on host0, the
agent on the others, one shared ``$HIXL_FLEET_TOKEN``) runs them; anywhere else they are
skipped with the command to use. host0 runs etcd on its wire address for the whole
session. Tests marked ``kills_peer`` cut a host off, so they run last.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from hixl import Engine, HixlError
from hixl.demo.fleet import ETCD_PORT, fleet_token
from hixl.testbed.etcd import EtcdServer
from hixl.testbed.hosts import Control, HostEnv

from .agent import CONTROL_PORT


def in_fleet_run() -> bool:
    return os.environ.get("HIXL_HOSTS") == "4" and os.environ.get("HIXL_HOST_INDEX") == "0"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fleet: runs on host0 of a four-VM run (make test-fleet)")
    config.addinivalue_line("markers", "kills_peer: cuts a host off; runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [i for i in items if "tests/fleet/" in str(i.fspath).replace("\\", "/")]
    for item in mine:
        item.add_marker(pytest.mark.fleet)
        if not in_fleet_run():
            item.add_marker(pytest.mark.skip(reason="four-host test: run 'make test-fleet'"))
    killers = [i for i in mine if i.get_closest_marker("kills_peer")]
    if killers:
        items[:] = [i for i in items if i not in killers] + killers


@pytest.fixture(scope="session")
def host() -> HostEnv:
    return HostEnv.from_environ()


@pytest.fixture(scope="session")
def token() -> str:
    return fleet_token()


@pytest.fixture(scope="session")
def etcd(host: HostEnv) -> Iterator[EtcdServer]:
    """etcd on host0's wire address, for the whole session (tests may stop and start it)."""
    with EtcdServer(host.address, client_port=ETCD_PORT, peer_port=ETCD_PORT + 1) as server:
        yield server


@pytest.fixture
def url(etcd: EtcdServer) -> str:
    if not etcd.running:  # a test that stopped it and failed before starting it again
        etcd.start()
    return etcd.url


@pytest.fixture(scope="session")
def agents(host: HostEnv) -> Iterator[dict[int, Control]]:
    """Control channels to host1..host3's agents (they may still be booting: wait)."""
    channels: dict[int, Control] = {}
    try:
        for i, addr in enumerate(host.peers, start=1):
            channels[i] = Control.connect(addr, CONTROL_PORT, timeout=300.0)
        yield channels
    finally:
        for ctl in channels.values():
            with contextlib.suppress(Exception):  # a host may have been cut off
                ctl.call("bye")
            ctl.close()


def wait_region(eng: Engine, peer: str, name: str, seconds: float = 20.0) -> None:
    """Until ``peer``'s region ``name`` is known here (regions are announced after connect)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            eng.connection(peer).remote_region(name)
            return
        except HixlError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
