"""hixl.core.ratelimit: a peer's control-message budget."""

from __future__ import annotations

import pytest

from hixl.core.ratelimit import Budget


def test_within_rate_no_wait_and_burst_of_one_second() -> None:
    b = Budget(1000, 10, now=0.0)
    assert b.charge(1000, 10, now=0.0) == 0.0
    assert b.charge(500, 1, now=0.0) == pytest.approx(0.5)  # bytes: 500 over
    assert b.charge(0, 0, now=0.5) == 0.0  # refilled


def test_messages_bound_too() -> None:
    b = Budget(1 << 30, 100, now=0.0)
    assert b.charge(10, 300, now=0.0) == pytest.approx(2.0)


def test_idle_time_never_builds_more_than_one_second() -> None:
    b = Budget(100, 100, now=0.0)
    assert b.charge(200, 0, now=3600.0) == pytest.approx(1.0)


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rates must be > 0"):
        Budget(0, 1, now=0.0)


def test_work_is_a_share_of_a_thread() -> None:
    b = Budget(1 << 30, 1 << 30, now=0.0, work_per_s=0.05)
    assert b.charge(0, 0, now=0.0, work=0.05) == 0.0  # the burst: one second's share
    assert b.charge(0, 0, now=0.0, work=0.25) == pytest.approx(5.0)  # 0.25 s over at 5 %
    assert b.charge(0, 0, now=5.0) == 0.0  # paid back


def test_work_unbounded_by_default() -> None:
    b = Budget(1000, 10, now=0.0)
    assert b.charge(0, 0, now=0.0, work=1e9) == 0.0


def test_work_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rates must be > 0"):
        Budget(1, 1, now=0.0, work_per_s=0.0)
