"""KV caches in blocks over RDMA: register_kv, put_blocks/get_blocks, head ranges, torch.

Every test checks every byte of the destination against numpy slicing of the source,
untouched blocks included.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hixl.engine import Access, Engine
from hixl.errors import (
    AlignmentError,
    CompletionError,
    DescriptorError,
    RegistrationError,
    TransferTimeout,
)

from .conftest import listening_engine

Arr = np.ndarray[Any, Any]
NB, BS, H, D = 24, 4, 8, 16  # blocks, tokens per block, KV heads, head dim


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    """``(prefill, decode)``, not connected: tests register first, then connect."""
    decode = listening_engine()
    prefill = Engine("127.0.0.1:0")
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def filled(shape: tuple[int, ...], seed: int, dtype: Any = np.float16) -> Arr:
    raw = np.random.default_rng(seed).integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16)
    return raw.view(np.float16).reshape(shape).astype(dtype, copy=False)


def blocks(a: Arr, axis: int, ids: list[int]) -> Arr:
    return np.take(a, ids, axis=axis)


def check_moved(
    src: Arr, src_axis: int, sids: list[int], dst: Arr, dst_axis: int, dids: list[int], before: Arr
) -> None:
    """dst's blocks dids equal src's blocks sids (as block arrays); all others unchanged."""
    got = np.moveaxis(blocks(dst, dst_axis, dids), dst_axis, 0)
    want = np.moveaxis(blocks(src, src_axis, sids), src_axis, 0)
    assert got.tobytes() == want.tobytes()
    rest = [j for j in range(dst.shape[dst_axis]) if j not in set(dids)]
    assert blocks(dst, dst_axis, rest).tobytes() == blocks(before, dst_axis, rest).tobytes()


def test_put_blocks_flash_attention_layout_with_notification(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    layers = 3
    src = [filled((2, NB, BS, H, D), seed=i) for i in range(layers)]
    dst = [np.zeros((2, NB, BS, H, D), np.float16) for _ in range(layers)]
    before = [d.copy() for d in dst]
    kv_p = prefill.register_kv("p", src, block_axis=1, heads_axis=3)
    decode.register_kv("d", dst, block_axis=1, heads_axis=3)
    prefill.connect(decode.id, timeout=30)
    sids, dids = [3, 4, 5, 10, 0, 23], [7, 8, 9, 1, 20, 2]
    prefill.put_blocks(decode.id, kv_p, "d", sids, dids, notify="req-1")
    note = decode.wait_notification("req-1", timeout=30)
    assert note.peer == prefill.id
    for s, d, b in zip(src, dst, before, strict=True):
        check_moved(s, 1, sids, d, 1, dids, b)


def test_get_blocks_between_flashinfer_and_flash_attention_layouts(
    engines: tuple[Engine, Engine],
) -> None:
    """The connecting engine pulls (a decode worker reading a prefill worker's cache)."""
    puller, server = engines
    src = filled((NB, 2, BS, H, D), seed=5)  # FlashInfer: (num_blocks, 2, ...)
    dst = np.zeros((2, NB, BS, H, D), np.float16)  # FlashAttention: (2, num_blocks, ...)
    before = dst.copy()
    server.register_kv("p", [src], block_axis=0)
    kv_d = puller.register_kv("d", [dst], block_axis=1)
    puller.connect(server.id, timeout=30)
    sids, dids = [1, 2, 3, 17], [5, 6, 7, 0]
    handle = puller.get_blocks_async(server.id, kv_d, "p", dids, sids, notify="req-2")
    handle.wait(30)
    server.wait_notification("req-2", timeout=30)
    check_moved(src, 0, sids, dst, 1, dids, before)


def test_head_ranges_both_splits(engines: tuple[Engine, Engine]) -> None:
    """TP 1 -> TP 4 (a quarter of the heads into a 2-head cache) and TP 4 -> TP 1 (a
    2-head cache into a head range of an 8-head cache), NHD blocks."""
    prefill, decode = engines
    full = filled((NB, BS, H, D), seed=7)
    part = filled((NB, BS, 2, D), seed=8)
    dst_part = np.zeros((NB, BS, 2, D), np.float16)
    dst_full = np.zeros((NB, BS, H, D), np.float16)
    kv_full = prefill.register_kv("full", [full], heads_axis=2)
    kv_part = prefill.register_kv("part", [part], heads_axis=2)
    decode.register_kv("dpart", [dst_part], heads_axis=2)
    decode.register_kv("dfull", [dst_full], heads_axis=2)
    prefill.connect(decode.id, timeout=30)
    sids, dids = [0, 1, 2, 9, 11], [4, 5, 6, 0, 23]
    prefill.put_blocks(decode.id, kv_full, "dpart", sids, dids, heads=(2, 4))
    assert dst_part[dids].tobytes() == full[sids][:, :, 2:4].tobytes()
    rest = [j for j in range(NB) if j not in dids]
    assert not dst_part[rest].any()
    prefill.put_blocks(decode.id, kv_part, "dfull", sids, dids, remote_heads=(6, 8))
    assert dst_full[dids][:, :, 6:8].tobytes() == part[sids].tobytes()
    assert not dst_full[dids][:, :, :6].any()
    assert not dst_full[rest].any()
    # and a READ of a head range: heads 6..7 of the 8-head cache into the 2-head one
    before = part.copy()
    prefill.get_blocks(
        decode.id, kv_part, "dfull", [20, 21], [dids[0], dids[1]], remote_heads=(6, 8)
    )
    assert part[[20, 21]].tobytes() == dst_full[dids[:2]][:, :, 6:8].tobytes()
    others = [j for j in range(NB) if j not in (20, 21)]
    assert part[others].tobytes() == before[others].tobytes()


def test_torch_separate_k_v_tensors_bf16_and_a_layer_subset(
    engines: tuple[Engine, Engine],
) -> None:
    torch = pytest.importorskip("torch")
    prefill, decode = engines
    layers = 4
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(NB, BS, H, D, generator=gen).to(torch.bfloat16) for _ in range(2 * layers)]
    dst = [torch.zeros(NB, BS, H, D, dtype=torch.bfloat16) for _ in range(2 * layers)]
    kv_p = prefill.register_kv("p", src, heads_axis=2)
    decode.register_kv("d", dst, heads_axis=2)
    prefill.connect(decode.id, timeout=30)
    sids, dids = [2, 3, 4, 5], [10, 11, 12, 13]
    chosen = range(2, 6)  # layers 1 and 2, K and V
    prefill.put_blocks(decode.id, kv_p, "d", sids, dids, tensors=chosen)
    for t in range(2 * layers):
        got = dst[t][dids].view(torch.int16).numpy()
        if t in chosen:
            assert got.tobytes() == src[t][sids].view(torch.int16).numpy().tobytes()
        else:
            assert not got.any()
    # layer 0 here into layer 3 there (a layer range remapped)
    prefill.put_blocks(decode.id, kv_p, "d", [0, 1], [0, 1], tensors=[0, 1], remote_tensors=[6, 7])
    for t in (0, 1):
        got = dst[6 + t][[0, 1]].view(torch.int16).numpy().tobytes()
        assert got == src[t][[0, 1]].view(torch.int16).numpy().tobytes()


def test_mismatches_fail_before_posting(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    src = [filled((NB, BS, H, D), seed=1) for _ in range(2)]
    dst = np.zeros((NB, BS, H, D), np.float32)
    dst16 = [np.zeros((NB, BS, H, D), np.float16) for _ in range(2)]
    kv = prefill.register_kv("p", src, heads_axis=2)
    decode.register_kv("f32", [dst, dst], heads_axis=2)
    decode.register_kv("d", dst16, heads_axis=2)
    private = np.zeros((NB, BS, H, D), np.float16)
    decode.register_kv("private", [private], access=Access.LOCAL_WRITE)
    prefill.connect(decode.id, timeout=30)
    # a cache peers cannot reach is not announced: neither listed nor found
    assert prefill.remote_kv_caches(decode.id) == ("d", "f32")
    assert not [r for r in prefill.connection(decode.id).remote_regions if "private" in r.name]
    with pytest.raises(RegistrationError, match="no KV cache named 'private'"):
        prefill.put_blocks(decode.id, kv, "private", [0], [0], timeout=0.2)
    with pytest.raises(DescriptorError, match="tensor 0: dtype float16 vs float32"):
        prefill.put_blocks(decode.id, kv, "f32", [0], [0])
    with pytest.raises(DescriptorError, match="repeats destination block 3"):
        prefill.put_blocks(decode.id, kv, "d", [0, 1], [3, 3])
    with pytest.raises(DescriptorError, match=r"remote_blocks\[1\]=24 is outside"):
        prefill.put_blocks(decode.id, kv, "d", [0, 1], [3, 24])
    with pytest.raises(DescriptorError, match="block shape"):
        prefill.put_blocks(decode.id, kv, "d", [0], [0], heads=(0, 4))
    with pytest.raises(RegistrationError, match="no KV cache named 'nope'"):
        prefill.put_blocks(decode.id, kv, "nope", [0], [0])
    assert not any(d.any() for d in dst16)
    # the connection is still good
    prefill.put_blocks(decode.id, kv, "d", [0], [1])
    assert dst16[1][1].tobytes() == src[1][0].tobytes()
    # the alignment policy: where blocks start, here and (checked here) on the peer
    flat = np.zeros(NB * BS * H * D + 16, np.float16)
    odd = [flat[16:].reshape(NB, BS, H, D)] * 2  # starts 32 bytes into its storage
    with pytest.raises(AlignmentError, match="cache 'odd': tensor 0 starts at offset 32"):
        prefill.register_kv("odd", odd)
    loose = listening_engine(alignment=None)
    try:
        loose.register_kv("odd", odd)
        prefill.connect(loose.id, timeout=30)
        with pytest.raises(AlignmentError, match="KV cache 'odd': tensor 0 starts at offset 32"):
            prefill.put_blocks(loose.id, kv, "odd", [0], [0])
        assert not flat.any()
    finally:
        loose.close()


def test_no_write_lands_after_a_transfer_timeout(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    nb, big = 64, (64, 16, 8, 128)  # 64 blocks of 32 KiB per tensor: 16 MiB in all
    src = [np.ones(big, np.float16) for _ in range(8)]
    dst = [np.zeros(big, np.float16) for _ in range(8)]
    kv = prefill.register_kv("p", src)
    decode.register_kv("d", dst)
    prefill.connect(decode.id, timeout=30)
    ids = list(range(nb))
    with pytest.raises(TransferTimeout) as info:
        prefill.put_blocks(decode.id, kv, "d", ids, ids[::-1], timeout=0.001, notify="r9")
    err = info.value
    assert "request 'r9'" in str(err)
    lost, landed = err.remote_blocks, err.landed_remote_blocks  # type: ignore[attr-defined]
    assert sorted(lost + landed) == ids
    for b in landed:  # reported as landed: every tensor's block is there
        assert all((d[b] == 1).all() for d in dst)
    snap = [d.copy() for d in dst]
    time.sleep(0.5)
    assert all(np.array_equal(a, b) for a, b in zip(snap, dst, strict=True))


def test_a_request_failing_part_way_reports_the_blocks_that_landed() -> None:
    """The decode side's cache is one storage, block-major (its 4 tensors are strided
    views); the client is made to believe (test hook) that the region's key is that of a
    second region over the first half of the blocks, so the device refuses the writes to
    blocks 32 and up.  One queue pair: the first blocks' WRs complete in order before the
    refused one, and the error reports them as landed, byte for byte, and the rest as not
    known to have landed."""
    decode = listening_engine()
    prefill = Engine("127.0.0.1:0", lanes=1)
    try:
        nb, nt = 64, 4
        big = np.zeros((nb, nt, BS, H, D), np.float16)
        decode.register_kv("d", [big[:, t] for t in range(nt)])
        decode.register(
            big[: nb // 2], access=Access.REMOTE_WRITE | Access.LOCAL_WRITE, name="half"
        )
        src = [filled((nb, BS, H, D), seed=20 + t) for t in range(nt)]
        kv = prefill.register_kv("p", src)
        conn = prefill.connect(decode.id, timeout=30)
        deadline = time.monotonic() + 30
        while not any(r.name == "half" for r in conn.remote_regions):
            assert time.monotonic() < deadline, "the region 'half' was never announced"
            time.sleep(0.01)
        half = conn.remote_region("half")
        conn.set_remote_regions(  # (a region is known by its key and address: one of them)
            tuple(
                replace(r, rkey=half.rkey) if r.name == "hixl.kv:d/0" else r
                for r in conn.remote_regions
                if r.name != "half"
            )
        )
        lids = [(7 * k) % nb for k in range(40)]  # never consecutive: one run per block
        rids = list(range(40))
        with pytest.raises(CompletionError) as info:
            prefill.put_blocks(decode.id, kv, "d", lids, rids, notify="req-5", timeout=60)
        err = info.value
        assert err.status_name == "IBV_WC_REM_ACCESS_ERR", str(err)
        landed = err.landed_remote_blocks  # type: ignore[attr-defined]
        assert err.landed_local_blocks == lids[: len(landed)]  # type: ignore[attr-defined]
        assert 0 < len(landed) <= nb // 2 and landed == rids[: len(landed)]
        assert err.remote_blocks == rids[len(landed) :]  # type: ignore[attr-defined]
        assert f"({len(landed)} of 40 known to have landed)" in str(err)
        for k, r in enumerate(landed):
            for t in range(nt):
                assert big[r, t].tobytes() == src[t][lids[k]].tobytes()
        assert not big[nb // 2 :].any()
    finally:
        prefill.close()
        decode.close()


def test_layouts_registered_by_storage_mla_permuted_views_and_float8(
    engines: tuple[Engine, Engine],
) -> None:
    """MLA blocks, K/V views of one storage (one region), a dense permuted view (HND
    storage seen as NHD), and torch float8 as its own dtype and as uint8 views."""
    prefill, decode = engines
    mla = filled((NB, BS, 64), seed=11)
    kvbuf = filled((2, NB, BS, H, D), seed=12)
    hnd = filled((NB, H, BS, D), seed=13)
    nhd_view = hnd.transpose(0, 2, 1, 3)  # (NB, BS, H, D) over HND storage
    dst_mla = np.zeros_like(mla)
    dst_kv = np.zeros((2, NB, BS, H, D), np.float16)
    dst_nhd = np.zeros((NB, BS, H, D), np.float16)
    src = prefill.register_kv("p", [mla, kvbuf[0], kvbuf[1], nhd_view])
    assert len(src.regions) == 3  # kvbuf's two views share their storage's region
    decode.register_kv("d", [dst_mla, dst_kv[0], dst_kv[1], dst_nhd])
    prefill.connect(decode.id, timeout=30)
    sids, dids = [0, 5, 6, 7, 20], [1, 2, 3, 10, 23]
    prefill.put_blocks(decode.id, src, "d", sids, dids)
    assert dst_mla[dids].tobytes() == mla[sids].tobytes()
    assert dst_kv[:, dids].tobytes() == kvbuf[:, sids].tobytes()
    assert (
        np.ascontiguousarray(dst_nhd[dids]).tobytes()
        == np.ascontiguousarray(nhd_view[sids]).tobytes()
    )
    rest = [j for j in range(NB) if j not in dids]
    assert not dst_mla[rest].any() and not dst_kv[:, rest].any() and not dst_nhd[rest].any()

    torch = pytest.importorskip("torch")
    f8 = torch.arange(NB * BS * H * D, dtype=torch.int64).remainder(251).to(torch.uint8)
    f8 = f8.view(torch.float8_e4m3fn).reshape(NB, BS, H, D)
    out8 = torch.zeros(NB, BS, H, D, dtype=torch.float8_e4m3fn)
    out_u8 = torch.zeros(NB, BS, H, D, dtype=torch.uint8)
    k8 = prefill.register_kv("f8", [f8, f8.view(torch.uint8)])
    decode.register_kv("d8", [out8, out_u8])
    deadline = time.monotonic() + 30
    while True:  # registered after connecting: wait for the announcement
        try:
            prefill.put_blocks(decode.id, k8, "d8", sids, dids)
            break
        except RegistrationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    want = f8.view(torch.uint8)[sids].numpy().tobytes()
    assert out8.view(torch.uint8)[dids].numpy().tobytes() == want
    assert out_u8[dids].numpy().tobytes() == want
    assert not out_u8[rest].numpy().any()


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["kv_pull.py", "kv_push.py"])
def test_connector_examples_run_and_check_every_byte(script: str) -> None:
    """The pull (NixlConnector-like, leases) and push (Mooncake-like, layer by layer)
    examples: two processes each, exit 0 only when every checked byte is right."""
    # A lease long enough for a request to be pulled under emulation; the abandoned
    # request's blocks are freed when it ends.
    extra = ["--lease", "8"] if script == "kv_pull.py" else []
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--requests", "3", "--layers", "3", *extra],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
