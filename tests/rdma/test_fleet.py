"""The fleet demo: 2 prefill x 2 decode workers through etcd, one decode killed mid-stream."""

from __future__ import annotations

import io

from hixl.demo.fleet import FLEET_CONFIG, run_fleet


def test_fleet_survives_a_killed_decode_worker() -> None:
    out = io.StringIO()
    # The 1x1 fleet is only the demo's yardstick for throughput: left out here.
    summary = run_fleet(
        FLEET_CONFIG, prefill=2, decode=2, requests=6, baseline=False, timeout=300, out=out
    )
    text = out.getvalue()
    fleet = summary["fleet"]
    assert fleet["killed"] == "decode-0", text
    assert fleet["completed"] == 6 and not fleet["missing"] and not fleet["duplicated"], text
    assert fleet["all_ok"], text
    assert fleet["per_decode"].get("decode-1", 0) >= 1, text
    assert summary["ok"] and summary["baseline"] is None, text
