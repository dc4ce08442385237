"""Who may listen without a token, on the null device (engines open no kernel device; see
benchmarks/backends/nulldev.py)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator

import pytest

from benchmarks.backends.nulldev import null_device
from hixl import Engine
from hixl.errors import ArgumentError
from hixl.testbed.net import free_tcp_port


@pytest.fixture(autouse=True)
def _null() -> Iterator[None]:
    with null_device():
        yield


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "192.168.0.7", "[::]", "[fe80::1]"])
def test_listening_off_loopback_without_a_token_is_refused_naming_the_fix(host: str) -> None:
    with pytest.raises(ArgumentError, match=r"without a token.*token=.*insecure=True") as err:
        Engine(f"{host}:5000")
    assert "'hixl token'" in str(err.value)


def test_loopback_clients_and_tokens_need_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hixl"):
        for kwargs in (
            {"engine_id": f"127.0.0.1:{free_tcp_port()}"},
            {"engine_id": f"127.0.0.2:{free_tcp_port('127.0.0.2')}"},
            {"engine_id": f"0.0.0.0:{free_tcp_port('0.0.0.0')}", "token": secrets.token_hex(32)},
            {"engine_id": "10.1.2.3:0"},  # a client: it listens nowhere
        ):
            Engine(**kwargs).close()  # type: ignore[arg-type]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_insecure_listens_off_loopback_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hixl"):
        eng = Engine(f"0.0.0.0:{free_tcp_port('0.0.0.0')}", insecure=True)
        eng.close()
    warned = [r.getMessage() for r in caplog.records if eng.id in r.getMessage()]
    assert len(warned) == 1 and "without a token" in warned[0], warned
