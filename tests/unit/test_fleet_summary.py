"""The multi-host fleet's pure pieces: the shared token, the timeline after a cut, and
etcd's warnings kept for the summary."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.demo.fleet import (
    LEAVE_LIMIT_S,
    TOKEN_ENV,
    cut_in_time,
    cut_timeline,
    etcd_warnings,
    fleet_token,
    format_fleet,
)
from hixl.errors import ArgumentError


def test_fleet_token_comes_from_the_environment() -> None:
    assert fleet_token({TOKEN_ENV: "ab" * 32}) == "ab" * 32
    with pytest.raises(ArgumentError, match=TOKEN_ENV):
        fleet_token({})
    with pytest.raises(ArgumentError, match=TOKEN_ENV):
        fleet_token({TOKEN_ENV: ""})


ROUTER = {
    "choices": [
        {"t": 10.0, "req": 0, "attempt": 1, "decode": "decode-0"},
        {"t": 11.0, "req": 2, "attempt": 1, "decode": "decode-1"},
        {"t": 12.5, "req": 4, "attempt": 1, "decode": "decode-0"},
        {"t": 16.0, "req": 4, "attempt": 2, "decode": "decode-1"},
    ],
    "failures": [
        {"req": 9, "decode": "decode-0", "t_end": 5.0},  # long before the cut: not counted
        {"req": 4, "decode": "decode-0", "t_end": 15.9},
        {"req": 6, "decode": "decode-1", "t_end": 17.0},  # another worker: not counted
    ],
    "leaves": [
        {"t": 3.0, "name": "decode-0"},  # an earlier leave (a restart): before the cut
        {"t": 15.8, "name": "decode-0"},
        {"t": 15.0, "name": "decode-1"},
    ],
}


def test_cut_timeline_on_the_cutting_hosts_clock() -> None:
    got = cut_timeline(ROUTER, "decode-0", 12.6)
    assert got["lease_gone_s"] == pytest.approx(3.2)
    assert got["last_choice_s"] == pytest.approx(-0.1)  # chosen just before the cut
    assert got["last_given_up_s"] == pytest.approx(3.3)


def test_cut_timeline_from_the_leave_on_another_clock() -> None:
    got = cut_timeline(ROUTER, "decode-0", None)  # earliest leave of decode-0: t = 3.0
    assert got["lease_gone_s"] == 0.0
    assert got["last_choice_s"] == pytest.approx(9.5)
    assert got["last_given_up_s"] == pytest.approx(12.9)


def test_cut_timeline_without_events() -> None:
    empty: dict[str, list[dict[str, float]]] = {"choices": [], "failures": [], "leaves": []}
    assert cut_timeline(empty, "decode-0", None) == {
        "lease_gone_s": None,
        "last_choice_s": None,
        "last_given_up_s": None,
    }
    got = cut_timeline(empty, "decode-0", 1.0)
    assert got == {"lease_gone_s": None, "last_choice_s": None, "last_given_up_s": None}


def _row(gone: float | None, choice: float | None, given_up: float | None) -> dict[str, Any]:
    return {"lease_gone_s": gone, "last_choice_s": choice, "last_given_up_s": given_up}


def test_a_give_up_just_after_a_late_leave_is_in_time() -> None:
    # Seen in CI, printed as +3.99 s and +4.00 s: the leave just inside TTL + 1 = 4 s, the
    # attempt given up a few ms after it and so just past 4 s.
    assert cut_in_time([_row(3.994, -0.30, 4.004), _row(0.0, -5.59, 0.01)])


def test_a_leave_seen_past_ttl_plus_one_second_is_in_time() -> None:
    # Leaves seen in the VM fleet: the lease left +4.07 s and +4.86 s after the order
    # (etcd looks for expired leases every 0.5 s and revokes them through its log, on a
    # VM that shares two emulated CPUs with three others).
    assert cut_in_time([_row(4.07, -0.21, 4.08), _row(0.0, -5.14, None)])
    assert cut_in_time([_row(4.86, -0.29, 4.89), _row(0.0, -10.05, None)])


def test_routers_that_go_on_using_the_lost_worker_are_late() -> None:
    assert not cut_in_time([])
    assert not cut_in_time([_row(None, -0.3, None)])  # the leave never seen
    assert not cut_in_time([_row(LEAVE_LIMIT_S + 0.01, -0.3, None)])  # the lease outlived it
    assert not cut_in_time([_row(3.0, 3.6, None)])  # chosen again 0.6 s after the leave
    assert not cut_in_time([_row(3.0, -0.3, 3.6)])  # given up 0.6 s after the leave
    assert not cut_in_time([_row(3.0, -0.3, 3.1), _row(0.0, 0.6, None)])  # the other router
    assert cut_in_time([_row(3.0, None, None), _row(0.0, None, None)])


def test_etcd_warnings_keeps_the_last_warnings_and_errors_of_its_log() -> None:
    log = "\n".join(
        [
            '{"level":"info","ts":"t0","msg":"ready to serve client requests"}',
            "not json at all",
            '{"level":"warn","ts":"t1","msg":"apply request took too long","took":"612ms"}',
            "[1, 2]",
            '{"level":"warn","ts":"t2","msg":"slow fdatasync","took":"1.2s"}',
            '{"level":"error","ts":"t3","msg":"failed to revoke lease"}',
        ]
    )
    assert etcd_warnings(log) == [
        "t1 apply request took too long (took 612ms)",
        "t2 slow fdatasync (took 1.2s)",
        "t3 failed to revoke lease",
    ]
    assert etcd_warnings(log, limit=1) == ["t3 failed to revoke lease"]
    assert etcd_warnings(log, limit=0) == []
    assert etcd_warnings("") == []


@given(st.lists(st.text(max_size=300) | st.just('{"level":"warn","msg":"' + "x" * 400 + '"}')))
def test_etcd_warnings_never_raises_and_stays_bounded(lines: list[str]) -> None:
    got = etcd_warnings("\n".join(lines), limit=3)
    assert len(got) <= 3 and all(len(w) <= 200 for w in got)


def _fleet(requests_per_s: float) -> dict[str, Any]:
    return {
        "prefill": 2,
        "decode": 2,
        "requests": 6,
        "killed": "decode-0",
        "completed": 6,
        "missing": [],
        "duplicated": [],
        "retries": 1,
        "per_decode": {"decode-1": 5},
        "all_ok": True,
        "requests_per_s": requests_per_s,
    }


def test_the_fleet_summary_with_and_without_its_1x1_yardstick() -> None:
    fleet, base = _fleet(0.5), _fleet(0.25)
    with_base = format_fleet(
        {"fleet": fleet, "baseline": base, "throughput_ratio": 2.0, "ok": True}
    )
    assert "vs 1x1 0.25 req/s in the same run: 2.00x" in with_base
    alone = format_fleet({"fleet": fleet, "baseline": None, "throughput_ratio": None, "ok": True})
    assert "throughput 0.50 req/s\n" in alone and "1x1" not in alone
    assert alone.endswith("result: OK")
