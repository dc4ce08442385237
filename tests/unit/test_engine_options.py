"""Engine options are checked before any device is opened: these run without RDMA."""

from __future__ import annotations

import sys

import pytest

from hixl import ArgumentError, Engine, HixlError


@pytest.mark.parametrize("token", ["", b""])
def test_an_empty_token_is_refused_with_the_way_out(token: str | bytes) -> None:
    with pytest.raises(ArgumentError, match=r"token must not be empty .*'hixl token'"):
        Engine("127.0.0.1:0", token=token)


def test_a_token_of_another_type_is_refused() -> None:
    with pytest.raises(ArgumentError, match="token must be str, bytes or None, got int"):
        Engine("127.0.0.1:0", token=123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "option",
    [
        "max_peers",
        "max_handshakes",
        "max_handshakes_per_source",
        "max_notifications_per_peer",
        "max_notifications",
    ],
)
@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_limits_below_one_or_not_integers_are_refused(option: str, value: object) -> None:
    with pytest.raises(ArgumentError, match=rf"{option} must be an integer >= 1, got {value!r}"):
        Engine("127.0.0.1:0", **{option: value})  # type: ignore[arg-type]


def test_handshake_timeout_must_be_positive() -> None:
    with pytest.raises(ArgumentError, match="handshake_timeout must be > 0 seconds, got 0"):
        Engine("127.0.0.1:0", handshake_timeout=0)


@pytest.mark.parametrize("lanes", [0, 9, True, 1.5])
def test_lanes_outside_one_to_eight_are_refused(lanes: object) -> None:
    msg = rf"lanes must be an integer in \[1, 8\], got {lanes!r}"
    with pytest.raises(ArgumentError, match=msg):
        Engine("127.0.0.1:0", lanes=lanes)  # type: ignore[arg-type]


def test_an_engine_leaves_the_switch_interval_alone_unless_asked() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with pytest.raises(HixlError):  # no verbs device here; the option is applied first
            Engine("127.0.0.1:0", device="no-such-device")
        assert sys.getswitchinterval() == pytest.approx(0.005)
        with pytest.raises(HixlError):
            Engine("127.0.0.1:0", device="no-such-device", gil_switch_interval=0.001)
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("interval", [0, -0.1, 1.5])
def test_a_switch_interval_outside_zero_to_one_second_is_refused(interval: float) -> None:
    with pytest.raises(ArgumentError, match=r"gil_switch_interval must lie in \(0, 1\]"):
        Engine("127.0.0.1:0", gil_switch_interval=interval)
