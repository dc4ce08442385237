"""Benchmark paths that need a device and that CI's native smoke run cannot reach.

``make bench-smoke`` runs natively, without a device; the paired A/B of the ceiling
probe (``bench_ceiling.py --against``) is the tool for changes on the stream's path, so
it runs here, on rxe, in its smallest form.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CEILING = REPO / "benchmarks" / "bench_ceiling.py"


def _ceiling(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    small = ["--rounds", "2", "--iters", "64", "--depth", "16", "--json", str(tmp_path / "c.json")]
    return subprocess.run(
        [sys.executable, str(CEILING), *small, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_ceiling_probe_pairs_a_checkout_against_itself(tmp_path: Path) -> None:
    out = _ceiling(tmp_path, "--against", str(REPO))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Paired against" in out.stdout
    data = json.loads((tmp_path / "c.json").read_text())
    rounds, summary = data["rounds"], data["summary"]
    assert len(rounds) == 2
    for r in rounds:
        # Both engines streamed in every round, each timed against the round's perftest.
        assert r["hixl_us_per_msg"] > 0 and r["against_us_per_msg"] > 0
        assert r["this_over_against"] == pytest.approx(
            r["against_us_per_msg"] / r["hixl_us_per_msg"]
        )
    assert 0 <= summary["this_wins"] <= 2
    assert summary["against"] == str(REPO)
