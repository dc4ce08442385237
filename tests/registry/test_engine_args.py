"""Engine registry arguments that fail before any device is opened (no RDMA needed)."""

from __future__ import annotations

import socket
import time

import pytest

from hixl import Engine
from hixl.errors import ArgumentError, RegistryUnavailable


def test_name_needs_a_registry() -> None:
    with pytest.raises(ArgumentError, match="name='decode-1' needs registry="):
        Engine("127.0.0.1:5000", name="decode-1")


def test_a_connect_only_engine_cannot_be_announced() -> None:
    with pytest.raises(ArgumentError, match="does not listen"):
        Engine("127.0.0.1:0", name="decode-1", registry="memory://args")


def test_unreachable_registry_fails_at_construction_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"etcd://127.0.0.1:{port} is unreachable"):
            Engine("127.0.0.1:0", registry=f"etcd://127.0.0.1:{port}")
        assert time.monotonic() - t0 < 3.0


def test_bad_registry_url() -> None:
    with pytest.raises(ArgumentError, match="registry URL 'etcd:/x'"):
        Engine("127.0.0.1:0", registry="etcd:/x")
