"""Shared RDMA fixtures: a device, an engine pair, a connected pair.

Every test in this folder is marked ``rdma`` and needs a real verbs device (rxe).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hixl.engine import Engine
from hixl.testbed.net import free_tcp_port
from hixl.verbs import adapter as verbs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/rdma/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.rdma)


@pytest.fixture
def device() -> Iterator[verbs.Device]:
    dev = verbs.open_device()
    try:
        yield dev
    finally:
        dev.close()


def listening_engine(**options: object) -> Engine:
    """An engine listening on a free loopback port."""
    return Engine(f"127.0.0.1:{free_tcp_port()}", **options)  # type: ignore[arg-type]


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    """``(client, server)``: a connect-only engine and a listening one, not connected yet."""
    server = listening_engine()
    client = Engine("127.0.0.1:0")
    try:
        yield client, server
    finally:
        client.close()
        server.close()


@pytest.fixture
def connected(pair: tuple[Engine, Engine]) -> tuple[Engine, Engine]:
    """``(client, server)`` with the client connected to the server."""
    client, server = pair
    client.connect(server.id, timeout=30.0)
    return client, server
