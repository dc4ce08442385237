"""KV caches in blocks over RDMA: register_kv, put_blocks/get_blocks, head ranges, torch.

Every test checks every byte of the destination against numpy slicing of the source,
untouched blocks included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hixl.engine import Engine
from hixl.errors import DescriptorError, RegistrationError, TransferTimeout

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


def test_mismatches_fail_before_posting(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    src = [filled((NB, BS, H, D), seed=1) for _ in range(2)]
    dst = np.zeros((NB, BS, H, D), np.float32)
    dst16 = [np.zeros((NB, BS, H, D), np.float16) for _ in range(2)]
    kv = prefill.register_kv("p", src, heads_axis=2)
    decode.register_kv("f32", [dst, dst], heads_axis=2)
    decode.register_kv("d", dst16, heads_axis=2)
    prefill.connect(decode.id, timeout=30)
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


def test_no_write_lands_after_a_transfer_timeout(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    nb, big = 64, (64, 16, 8, 128)  # 64 blocks of 32 KiB per tensor
    src = [np.ones(big, np.float16) for _ in range(16)]
    dst = [np.zeros(big, np.float16) for _ in range(16)]
    kv = prefill.register_kv("p", src)
    decode.register_kv("d", dst)
    prefill.connect(decode.id, timeout=30)
    ids = list(range(nb))
    with pytest.raises(TransferTimeout) as info:
        prefill.put_blocks(decode.id, kv, "d", ids, ids[::-1], timeout=0.001, notify="r9")
    err = info.value
    assert "request 'r9'" in str(err)
    assert err.remote_blocks == ids[::-1]  # type: ignore[attr-defined]
    snap = [d.copy() for d in dst]
    time.sleep(0.5)
    assert all(np.array_equal(a, b) for a, b in zip(snap, dst, strict=True))
