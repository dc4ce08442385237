"""The demo's pure parts: model determinism, KV layouts vs descriptors, greedy decoding
from copied caches, the block table, summary arithmetic, and the process supervision."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hixl.core.plan import DeviceLimits, Op, plan_transfer
from hixl.demo import kvdemo as _demo
from hixl.demo.kvmodel import (
    DecodeSession,
    DemoConfig,
    PagedKV,
    TinyLM,
    allocate_blocks,
    decode_blocks,
    encode_blocks,
    kv_digest,
    layer_descriptors,
    paged_layout,
    per_head_put_wrs,
    source_layout,
    source_view,
    strided_put_wrs,
)
from hixl.demo.kvsummary import format_summary, length, overlap, summarize, union
from hixl.errors import ArgumentError, HixlError

SMALL = DemoConfig(layers=3, heads=4, head_dim=96, d_model=32, tokens=40, gen_tokens=6, seed=7)


def prefill_all(model: TinyLM) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    run = model.prefill(model.cfg.prompt_tokens())
    kvs = [run.step() for _ in range(model.cfg.layers)]
    return kvs, run.next_token()


def apply_plan(local: np.ndarray, remote: np.ndarray, ldesc: Any, rdesc: Any) -> int:
    """Execute a planned WRITE with memcpy: each WR gathers its SGEs into one remote run."""
    plan = plan_transfer(ldesc, rdesc, Op.WRITE, DeviceLimits())
    for roff, sges in plan.wrs():
        data = np.concatenate([local[o : o + n] for o, n in sges])
        remote[roff : roff + data.size] = data
    return plan.num_wrs


# --- configuration -------------------------------------------------------------------


def test_config_validates_with_numbers() -> None:
    with pytest.raises(ArgumentError, match="head_dim=95 must be even"):
        DemoConfig(head_dim=95)
    with pytest.raises(ArgumentError, match=r"layers=0 is outside \[1, 256\]"):
        DemoConfig(layers=0)
    with pytest.raises(ArgumentError, match="needs 313 blocks of 16 tokens for 5001 tokens"):
        DemoConfig(tokens=5000, gen_tokens=0, block_size=16)


def test_block_size_grows_to_keep_the_table_small() -> None:
    assert DemoConfig().block_size == 16
    big = DemoConfig(tokens=8000, gen_tokens=16)
    assert big.block_size == 64 and big.blocks_needed <= 240
    assert DemoConfig().ffn == 2 * DemoConfig().d_model


def test_config_round_trips_through_the_command_line() -> None:
    p = argparse.ArgumentParser()
    _demo.add_model_options(p)
    cfg = DemoConfig(
        layers=9,
        heads=12,
        head_dim=64,
        tokens=33,
        gen_tokens=2,
        seed=5,
        prompt="--tricky prompt, with = signs",
    )
    assert _demo.config_from_args(p.parse_args(cfg.to_argv())) == cfg


def test_prompt_is_bytes_repeated_to_fit() -> None:
    cfg = DemoConfig(tokens=7, prompt="abc")
    assert bytes(cfg.prompt_tokens().astype(np.uint8)) == b"abcabca"


# --- model -----------------------------------------------------------------------------


def test_model_is_deterministic_and_seeded() -> None:
    a, b = TinyLM(SMALL), TinyLM(SMALL)
    for wa, wb in zip(a.layers, b.layers, strict=True):
        assert np.array_equal(wa.wqkv, wb.wqkv) and np.array_equal(wa.w_down, wb.w_down)
    (kva, fa), (kvb, fb) = prefill_all(a), prefill_all(b)
    assert fa == fb
    for (ka, va), (kb, vb) in zip(kva, kvb, strict=True):
        assert ka.tobytes() == kb.tobytes() and va.tobytes() == vb.tobytes()
    other, _ = prefill_all(TinyLM(dataclasses.replace(SMALL, seed=8)))
    assert other[0][0].tobytes() != kva[0][0].tobytes()


def test_prefill_output_shape_and_order() -> None:
    model = TinyLM(SMALL)
    run = model.prefill(SMALL.prompt_tokens())
    with pytest.raises(ArgumentError, match="only 0 of 3 layers computed"):
        run.next_token()
    k, v = run.step()
    assert k.shape == v.shape == (SMALL.heads, SMALL.tokens, SMALL.head_dim)
    assert k.dtype == np.float16 and k.flags.c_contiguous and v.flags.c_contiguous
    assert np.isfinite(k).all() and np.isfinite(v).all() and k.std() > 0.1


def test_token_by_token_matches_the_batched_prefill() -> None:
    """Decoding the prompt one token at a time reproduces prefill's cache (to fp16 rounding)."""
    model = TinyLM(SMALL)
    kvs, first = prefill_all(model)
    pool, ids = allocate_blocks(SMALL)
    lay = paged_layout(SMALL, pool, SMALL.block_size)
    cache = PagedKV(np.zeros(lay.nbytes, np.uint8), lay, ids)
    session = DecodeSession(model, cache, 0)
    for tok in SMALL.prompt_tokens():
        nxt = session.step(int(tok))
    assert nxt == first
    for i, (k, v) in enumerate(kvs):
        k2, v2 = cache.read(i, SMALL.tokens)
        np.testing.assert_allclose(k2.astype(np.float32), k.astype(np.float32), atol=2e-2)
        np.testing.assert_allclose(v2.astype(np.float32), v.astype(np.float32), atol=2e-2)


# --- layouts and descriptors --------------------------------------------------------


def test_source_layout_is_padded_and_the_view_matches_it() -> None:
    src = source_layout(SMALL)
    assert src.vector_bytes == 192 and src.stride_token == 256
    buf = np.zeros(src.nbytes, np.uint8)
    view = source_view(buf, src)
    assert view.shape == (SMALL.layers, 2, SMALL.heads, SMALL.tokens, SMALL.head_dim)
    view[1, 1, 2, 3, :] = 1.0
    at = src.offset_of(1, 1, 2, 3)
    assert np.array_equal(buf[at : at + 192].view(np.float16), np.ones(96, np.float16))
    assert not buf[at + 192 : at + 256].any()  # padding untouched


def test_planned_put_fills_decode_blocks_like_numpy_and_never_reads_padding() -> None:
    model = TinyLM(SMALL)
    kvs, _ = prefill_all(model)
    src = source_layout(SMALL)
    pool, ids = allocate_blocks(SMALL)
    dst = paged_layout(SMALL, pool, SMALL.block_size)
    local = np.full(src.nbytes, 0xFF, np.uint8)  # padding poisoned: it must never travel
    view = source_view(local, src)
    expect = np.zeros(dst.nbytes, np.uint8)
    remote = np.zeros(dst.nbytes, np.uint8)
    for i, (k, v) in enumerate(kvs):
        view[i, 0], view[i, 1] = k, v
        PagedKV(expect, dst, ids).write_prompt(i, k, v)
        ldesc, rdesc = layer_descriptors(src, dst, ids, i)
        assert ldesc.nbytes == rdesc.nbytes == SMALL.kv_bytes_per_layer
        apply_plan(local, remote, ldesc, rdesc)
        got_k, got_v = PagedKV(remote, dst, ids).read(i, SMALL.tokens)
        assert kv_digest(got_k, got_v) == kv_digest(k, v)
    assert np.array_equal(remote, expect)


def test_work_request_counts_strided_vs_per_head() -> None:
    cfg = DemoConfig(layers=2, heads=8, head_dim=96, d_model=16, tokens=128, gen_tokens=4)
    src = source_layout(cfg)
    pool, ids = allocate_blocks(cfg)
    dst = paged_layout(cfg, pool, cfg.block_size)
    limits = DeviceLimits(max_sge=32)
    ours = strided_put_wrs(src, dst, ids, limits)
    base = per_head_put_wrs(src, dst, ids, limits)
    # each block of a plane holds 16 tokens x 8 heads = 128 rows: 4 WRs of 32 rows
    assert ours.puts == 2 and ours.wrs == 2 * 2 * 8 * 4
    # one put per (layer, K|V, head); each token row is its own remote run
    assert base.puts == 2 * 2 * 8 and base.wrs == 2 * 2 * 8 * 128


def test_block_table_round_trip_and_errors() -> None:
    pool, ids = allocate_blocks(SMALL)
    assert len(set(ids.tolist())) == ids.size == SMALL.blocks_needed and ids.max() < pool
    msg = encode_blocks(pool, 16, ids)
    p, bs, back = decode_blocks(msg)
    assert (p, bs) == (pool, 16) and np.array_equal(back, ids)
    with pytest.raises(ArgumentError, match="malformed block table: 9 bytes"):
        decode_blocks(msg[:9])
    with pytest.raises(ArgumentError, match="malformed block table: pool=2"):
        decode_blocks(encode_blocks(2, 16, np.array([0, 5])))


# --- greedy decoding from caches -----------------------------------------------------


def test_generation_from_a_copied_cache_equals_the_local_one() -> None:
    model = TinyLM(SMALL)
    kvs, first = prefill_all(model)
    pool, ids = allocate_blocks(SMALL)
    lay = paged_layout(SMALL, pool, SMALL.block_size)
    local = np.zeros(lay.nbytes, np.uint8)
    for i, (k, v) in enumerate(kvs):
        PagedKV(local, lay, ids).write_prompt(i, k, v)
    copied = local.copy()
    # the same tokens in other blocks, in another order: layout must not matter
    other_ids = ids[::-1].copy()
    moved = np.zeros_like(local)
    for i in range(SMALL.layers):
        k, v = PagedKV(local, lay, ids).read(i, SMALL.tokens)
        PagedKV(moved, lay, other_ids).write_prompt(i, k, v)

    def gen(buf: np.ndarray, table: np.ndarray) -> list[int]:
        return model.generate(PagedKV(buf, lay, table), first, SMALL.tokens, SMALL.gen_tokens)

    a, b, c = gen(local, ids), gen(copied, ids), gen(moved, other_ids)
    assert a == b == c and len(a) == SMALL.gen_tokens
    assert np.array_equal(local, copied)  # both caches got the same appended tokens


def test_a_corrupted_cache_changes_the_digest() -> None:
    model = TinyLM(SMALL)
    kvs, _ = prefill_all(model)
    k, v = kvs[0]
    bad = k.copy()
    bad.view(np.uint16)[0, 0, 0] ^= 1  # one bit
    assert kv_digest(bad, v) != kv_digest(k, v)


# --- summary arithmetic --------------------------------------------------------------


def test_interval_arithmetic() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert length([(0, 1), (0.5, 2)]) == 2
    assert overlap([(0, 10)], [(1, 2), (1.5, 3), (9, 12)]) == pytest.approx(3.0)
    assert overlap([(0, 1)], []) == 0


def fake_results(
    cfg: DemoConfig, *, exact: bool = True, tokens_equal: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Layers compute 1 s each back to back; layer i's transfer takes 0.5 s after it."""
    pool, ids = allocate_blocks(cfg)
    src = source_layout(cfg)
    dst = paged_layout(cfg, pool, cfg.block_size)
    limits = DeviceLimits()
    pl, dl = [], []
    for i in range(cfg.layers):
        ldesc, rdesc = layer_descriptors(src, dst, ids, i)
        wrs = plan_transfer(ldesc, rdesc, Op.WRITE, limits).num_wrs
        pl.append(
            {
                "layer": i,
                "compute": [100.0 + i, 101.0 + i],
                "transfer": [101.0 + i, 101.5 + i],
                "post": [101.0 + i, 101.1 + i],
                "nbytes": cfg.kv_bytes_per_layer,
                "num_wrs": wrs,
                "sha256": "x",
            }
        )
        dl.append({"layer": i, "arrived": 101.6 + i, "bit_exact": exact or i != 1})
    prefill = {
        "device": "rxe0",
        "limits": {"max_sge": 32, "max_sge_rd": 32, "max_msg_sz": 8 << 20},
        "layers": pl,
        "first_token": 5,
        "build_s": 0.1,
    }
    decode = {
        "pool_blocks": pool,
        "block_size": cfg.block_size,
        "block_ids": ids.tolist(),
        "layers": dl,
        "first_token": 5,
        "received_equals_recompute": True,
        "tokens_received": [5, 6, 7],
        "tokens_local": [5, 6, 7] if tokens_equal else [5, 6],
        "build_s": 0.1,
        "recompute_s": 1.0,
        "generate_s": 0.5,
    }
    return prefill, decode


def test_summary_overlap_and_counts() -> None:
    cfg = DemoConfig(layers=4, heads=8, head_dim=64, d_model=16, tokens=64, gen_tokens=2)
    s = summarize(cfg, *fake_results(cfg))
    assert s["ok"]
    # transfers 0..2 hide fully behind the next layer's compute; the last one is exposed
    assert s["transfer_busy_ms"] == pytest.approx(2000)
    assert s["overlapped_ms"] == pytest.approx(1500)
    assert s["exposed_ms"] == pytest.approx(500)
    assert s["overlap_fraction"] == pytest.approx(0.75)
    assert [r["hidden_fraction"] for r in s["layers"]] == pytest.approx([1, 1, 1, 0])
    assert s["tail_after_compute_ms"] == pytest.approx(500)
    assert s["bytes_moved"] == 4 * cfg.kv_bytes_per_layer
    assert s["per_head"]["puts"] == 4 * 2 * 8
    assert s["per_head"]["wrs"] == 4 * 2 * 8 * 64
    assert s["wrs_avoided"] == s["per_head"]["wrs"] - s["wrs_posted"] > 0
    text = format_summary(s)
    assert text.startswith("hixl demo: VERIFIED")
    assert "(75%)" in text and "4/4 layers bit-exact" in text and "EQUAL" in text


@pytest.mark.parametrize("bad", ["exact", "tokens"])
def test_summary_fails_on_a_bad_layer_or_different_tokens(bad: str) -> None:
    cfg = DemoConfig(layers=3, heads=2, head_dim=64, d_model=16, tokens=20, gen_tokens=2)
    s = summarize(cfg, *fake_results(cfg, exact=bad != "exact", tokens_equal=bad != "tokens"))
    assert not s["ok"]
    assert format_summary(s).startswith("hixl demo: FAILED")


# --- orchestration without RDMA ------------------------------------------------------


def test_supervise_kills_the_survivor_when_one_worker_fails() -> None:
    procs = {
        "decode": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        "prefill": subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
    }
    t = time.monotonic()
    try:
        with pytest.raises(
            HixlError,
            match=r"prefill worker failed \(exit status 3\); "
            r"stopped decode",
        ):
            _demo._supervise(procs, time.monotonic() + 30, 30)
        assert procs["decode"].wait(timeout=10) != 0
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert time.monotonic() - t < 20


def test_supervise_enforces_the_deadline() -> None:
    procs = {"decode": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])}
    try:
        with pytest.raises(HixlError, match="exceeded its timeout of 1 s; killed decode"):
            _demo._supervise(procs, time.monotonic() + 1, 1)
        assert procs["decode"].wait(timeout=10) != 0
    finally:
        procs["decode"].kill()
        procs["decode"].wait()


def test_demo_without_rdma_reruns_itself_in_the_vm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hixl.testbed.vm as vm
    from hixl import cli as _cli

    calls: list[tuple[list[str], Any]] = []
    monkeypatch.delenv("HIXL_IN_VM", raising=False)
    monkeypatch.setattr(vm, "host_has_rdma", lambda: False)

    def fake_run(cmd: list[str], cfg: Any) -> int:
        calls.append((cmd, cfg))
        return 0

    monkeypatch.setattr(vm, "run_with_rdma", fake_run)
    out = tmp_path / "s.json"
    assert _cli.main(["demo", "--layers", "9", "--timeout", "50", "--json", str(out)]) == 0
    ((cmd, cfg),) = calls
    assert cmd[:4] == [sys.executable, "-m", "hixl", "demo"]
    assert "--layers=9" in cmd and "--timeout=50.0" in cmd and f"--json={out}" in cmd
    assert cfg.rw_dirs == (tmp_path,) and cfg.timeout > 50


def test_demo_rejects_a_json_path_in_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hixl import cli as _cli

    assert _cli.main(["demo", "--json", str(tmp_path / "no" / "s.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_worker_reports_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "r.json"
    assert _demo.main(["decode", "--result", str(result)]) == 1
    assert capsys.readouterr().out == "error: ArgumentError: decode needs --listen\n"
    assert _demo.main(["prefill", "--peer", "x:1", "--result", str(result), "--heads", "0"]) == 1
    assert "error: ArgumentError: heads=0 is outside [1, 256]" in capsys.readouterr().out
    assert not result.exists()
