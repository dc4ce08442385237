"""A private etcd per test (Debian's etcd-server, started by hixl.testbed.etcd).

Without etcd installed the etcd tests skip, except where the run promised it (CI, or
``HIXL_REQUIRE_ETCD=1``, which ``make test`` sets): there a missing etcd is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hixl.testbed.etcd import EtcdError, EtcdServer, find_etcd


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    try:
        find_etcd()
    except EtcdError as exc:
        if os.environ.get("CI", "").lower() == "true" or os.environ.get("HIXL_REQUIRE_ETCD") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    server = EtcdServer()
    server.start()
    yield server
    server.close()
