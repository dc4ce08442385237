"""Two-host tests: they run on host0 of a two-VM run and drive ``agent.py`` on host1.

Only ``make test-hosts`` (``hixl vm hosts`` with this directory on host0 and the agent
on host1, NICs at MTU 1500 and 9000) runs them. Anywhere else they are skipped with
the command to use; inside a two-host run nothing is ever skipped: a missing agent or
device is an error. Tests marked ``kills_peer`` power host1 off, so they run last.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from hixl import ConnectionFailed, Engine, TransferTimeout
from hixl.testbed.hosts import Control, HostEnv

from .agent import CONTROL_PORT, ENGINE_PORT

DRIVER_PORT = 5000


def in_two_host_run() -> bool:
    return os.environ.get("HIXL_HOSTS") == "2" and os.environ.get("HIXL_HOST_INDEX") == "0"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hosts: runs on host0 of a two-VM run (make test-hosts)")
    config.addinivalue_line("markers", "kills_peer: powers host1 off; runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [i for i in items if "tests/hosts/" in str(i.fspath).replace("\\", "/")]
    for item in mine:
        item.add_marker(pytest.mark.hosts)
        if not in_two_host_run():
            item.add_marker(
                pytest.mark.skip(reason="two-host test: run 'make test-hosts' (two VMs)")
            )
    # A test that powers the peer off must come after every test that needs it.
    killers = [i for i in items if i.get_closest_marker("kills_peer")]
    if killers:
        items[:] = [i for i in items if not i.get_closest_marker("kills_peer")] + killers


@pytest.fixture(scope="session")
def host() -> HostEnv:
    return HostEnv.from_environ()


@pytest.fixture(scope="session")
def agent(host: HostEnv) -> Iterator[Control]:
    """The control channel to host1's agent (it may still be booting: wait for it)."""
    ctl = Control.connect(host.peers[0], CONTROL_PORT, timeout=300.0)
    try:
        yield ctl
    finally:
        with contextlib.suppress(Exception):  # the peer may have been powered off
            ctl.call("bye")
        ctl.close()


@pytest.fixture(scope="session")
def peer_id(agent: Control, host: HostEnv) -> str:
    """host1's engine id, once its engine listens."""
    reply = agent.call("engine", port=ENGINE_PORT)
    return str(reply["id"])


@pytest.fixture(scope="session")
def session_engine(host: HostEnv, peer_id: str) -> Iterator[Engine]:
    # insecure: these tests are of the wire, not of authentication
    with Engine(f"{host.address}:{DRIVER_PORT}", insecure=True) as eng:
        yield eng


@pytest.fixture
def engine(session_engine: Engine, peer_id: str) -> Engine:
    """host0's engine, connected to host1's (again, if an earlier test broke the link)."""
    deadline = time.monotonic() + 60.0
    while True:  # host1 may hold a failed connection until it reads our close
        try:
            session_engine.connect(peer_id, timeout=10.0)
            return session_engine
        except (ConnectionFailed, TransferTimeout):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
