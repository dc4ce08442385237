"""``hixl demo`` end to end on a real verbs device: two worker processes, a small model."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from hixl.demo.kvdemo import DemoConfig, run_decode, run_demo, run_prefill
from hixl.errors import TransferTimeout
from hixl.testbed.net import free_tcp_port

SMALL = DemoConfig(layers=4, heads=8, head_dim=64, d_model=32, tokens=48, gen_tokens=4, seed=3)


def test_demo_moves_every_layer_bit_exact_and_generates_equal_tokens(tmp_path: Path) -> None:
    out = io.StringIO()
    path = tmp_path / "summary.json"
    t = time.monotonic()
    try:
        summary = run_demo(SMALL, timeout=150, json_path=str(path), out=out)
    finally:
        print(out.getvalue())  # the workers' lines: pytest shows them when the test fails
    elapsed = time.monotonic() - t
    text = out.getvalue()
    assert summary["ok"], text
    assert summary["layers_bit_exact"] == SMALL.layers
    assert all(r["bit_exact"] for r in summary["layers"])
    assert summary["tokens_equal"] and len(summary["tokens_received"]) == SMALL.gen_tokens + 1
    assert summary["received_equals_recompute"]
    assert summary["bytes_moved"] == SMALL.layers * SMALL.kv_bytes_per_layer
    assert summary["puts"] == SMALL.layers
    assert summary["wrs_posted"] == summary["wrs_planned"] < summary["per_head"]["wrs"]
    assert 0.0 <= summary["overlap_fraction"] <= 1.0
    # decode saw the layers in order, each after prefill had computed it
    arrived = [r["arrived_ms"] for r in summary["layers"]]
    assert arrived == sorted(arrived)
    for i in range(SMALL.layers):
        assert f"[decode ] layer {i}: landed" in text
    assert "hixl demo: VERIFIED" in text
    assert json.loads(path.read_text())["ok"] is True
    assert elapsed < 150


TINY = DemoConfig(layers=1, heads=1, head_dim=64, d_model=4, tokens=8, gen_tokens=1)


def test_decode_alone_gives_up_at_its_deadline() -> None:
    lines: list[str] = []
    t = time.monotonic()
    with pytest.raises(
        TransferTimeout, match="waiting for prefill to connect: the demo's deadline of 2 s passed"
    ):
        run_decode(TINY, f"127.0.0.1:{free_tcp_port()}", 2.0, lines.append)
    assert time.monotonic() - t < 60  # worker start and engine teardown, emulated
    assert lines and lines[0].startswith("listening on 127.0.0.1:")


def test_prefill_alone_gives_up_at_its_deadline() -> None:
    t = time.monotonic()
    with pytest.raises(
        TransferTimeout,
        match=r"connecting to decode at 127\.0\.0\.1:\d+ "
        r"\(last error: .*\): the demo's deadline",
    ):
        run_prefill(TINY, f"127.0.0.1:{free_tcp_port()}", 2.0, lambda line: None)
    assert time.monotonic() - t < 60  # worker start and engine teardown, emulated
