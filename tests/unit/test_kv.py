"""KV cache layout helpers: contiguous, padded, paged and token ranges.

Each layout is checked against numpy: the descriptor must stream exactly the bytes of the
matching numpy view, and a planned transfer applied with memoryview copies must move
exactly the selected values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from plan_oracle import apply_plan

from hixl.core.descriptors import NdStridedDesc, Segments, desc_from_view
from hixl.core.kv import ContiguousKVLayout, PagedKVLayout, padded_stride
from hixl.core.plan import DeviceLimits, Op, check_bounds, plan_transfer
from hixl.errors import AlignmentError, DescriptorError


def stream_of(buf: bytes, seg: Segments) -> bytes:
    view = memoryview(buf)
    return b"".join(bytes(view[o : o + n]) for o, n in seg.pairs())


def filled(shape: tuple[int, ...], seed: int) -> npt.NDArray[np.float16]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 30000, size=shape).astype(np.float16)


# --------------------------------------------------------------------------- padding


def test_padded_stride_examples() -> None:
    assert padded_stride(128, 2) == 256  # already 64-byte aligned
    assert padded_stride(128, 2, pow2=True) == 256
    assert padded_stride(96, 2) == 192  # 192 = 3 * 64 is a multiple of 64 already
    assert padded_stride(96, 2, pow2=True) == 256  # the power-of-two pad
    assert padded_stride(96, 2, 128) == 256
    assert padded_stride(80, 2) == 192
    assert padded_stride(8, 2, pow2=True) == 64  # never below the alignment
    with pytest.raises(DescriptorError, match="head_dim must be >= 1, got 0"):
        padded_stride(0, 2)


# --------------------------------------------------------------------------- contiguous


def test_contiguous_geometry() -> None:
    lay = ContiguousKVLayout(
        num_layers=2, num_heads=4, num_tokens=8, head_dim=96, token_stride=256, base_offset=4096
    )
    assert lay.vector_bytes == 192
    assert (lay.head_stride, lay.kv_stride, lay.layer_stride) == (2048, 8192, 16384)
    assert lay.nbytes == 32768
    assert lay.offset_of(1, 1, 2, 3) == 4096 + 16384 + 8192 + 2 * 2048 + 3 * 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_layers = 3  # type: ignore[misc]


def test_contiguous_whole_layer_is_one_range() -> None:
    lay = ContiguousKVLayout(num_layers=32, num_heads=8, num_tokens=1024, head_dim=128)
    desc = lay.descriptor(layers=range(5, 6))
    assert desc == NdStridedDesc(
        offset=5 * lay.layer_stride, shape=(), strides=(), size=lay.layer_stride
    )
    # K only, all layers: one element per layer.
    k = lay.descriptor(kv="k")
    assert k.shape == (32,) and k.size == lay.kv_stride


@pytest.mark.parametrize("token_stride", [None, 128])
@pytest.mark.parametrize("order", ["head", "token"])
def test_contiguous_descriptor_matches_numpy(token_stride: int | None, order: str) -> None:
    layers, heads, tokens, head_dim = 3, 4, 6, 32
    pad = (token_stride or head_dim * 2) // 2
    arr = filled((layers, 2, heads, tokens, pad), seed=1)
    lay = ContiguousKVLayout(
        num_layers=layers,
        num_heads=heads,
        num_tokens=tokens,
        head_dim=head_dim,
        token_stride=token_stride,
    )
    assert lay.nbytes == arr.nbytes
    sel = dict(layers=range(0, 3, 2), kv="v", heads=range(1, 4), tokens=range(2, 5))
    desc = lay.descriptor(order=order, alignment=None, **sel)  # type: ignore[arg-type]
    view = arr[0:3:2, 1:2, 1:4, 2:5, :head_dim]
    if order == "token":
        view = view.transpose(0, 1, 3, 2, 4)
    assert stream_of(arr.tobytes(), desc.to_segments()) == np.ascontiguousarray(view).tobytes()
    assert desc.nbytes == view.nbytes
    # Same bytes as the descriptor numpy derives from the view itself (head order).
    if order == "head":
        seg = desc_from_view(arr[0:3:2, 1:2, 1:4, 2:5, :head_dim], arr, alignment=None)
        assert seg.to_segments().merged() == desc.to_segments().merged()


def test_new_tokens_from_padded_prefill_to_packed_decode() -> None:
    # head_dim 96 fp16: prefill pads each token vector to 256 bytes, decode packs 192.
    layers, heads, tokens, head_dim = 2, 4, 16, 96
    pre = ContiguousKVLayout(
        num_layers=layers,
        num_heads=heads,
        num_tokens=tokens,
        head_dim=head_dim,
        token_stride=padded_stride(head_dim, 2, pow2=True),
    )
    dec = ContiguousKVLayout(
        num_layers=layers, num_heads=heads, num_tokens=tokens, head_dim=head_dim
    )
    src = filled((layers, 2, heads, tokens, 128), seed=2)
    dst = np.zeros((layers, 2, heads, tokens, head_dim), dtype=np.float16)
    new = range(10, 14)  # only the new tokens
    local = pre.descriptor(tokens=new)
    remote = dec.descriptor(tokens=new)
    check_bounds(local, src.nbytes, what="local")
    check_bounds(remote, dst.nbytes)
    plan = plan_transfer(local, remote, Op.WRITE, DeviceLimits(max_sge=4))
    assert plan.num_sges == layers * 2 * heads * len(new)  # padding is never sent
    apply_plan(plan, src, dst)
    assert np.array_equal(dst[:, :, :, 10:14], src[:, :, :, 10:14, :head_dim])
    assert not dst[:, :, :, :10].any() and not dst[:, :, :, 14:].any()


def test_unpadded_odd_rows_break_the_alignment_policy() -> None:
    # head_dim 80 fp16 = 160 bytes: token 3 starts at 480, not a multiple of 64.
    lay = ContiguousKVLayout(num_layers=1, num_heads=2, num_tokens=8, head_dim=80)
    with pytest.raises(AlignmentError, match="not a multiple of the alignment policy 64"):
        lay.descriptor(tokens=range(3, 5))
    padded = dataclasses.replace(lay, token_stride=padded_stride(80, 2))
    assert padded.descriptor(tokens=range(3, 5)).strides[-1] == 192
    assert lay.descriptor(tokens=range(3, 5), alignment=None).size == 2 * 160  # fused


def test_contiguous_rejects_bad_selections() -> None:
    lay = ContiguousKVLayout(num_layers=2, num_heads=4, num_tokens=8, head_dim=32)
    with pytest.raises(DescriptorError, match=r"tokens range\(6, 9\) reaches outside \[0, 8\)"):
        lay.descriptor(tokens=range(6, 9))
    with pytest.raises(DescriptorError, match=r"heads is empty \(range\(2, 2\)\)"):
        lay.descriptor(heads=range(2, 2))
    with pytest.raises(DescriptorError, match="layers must have a positive step"):
        lay.descriptor(layers=range(1, 0, -1))
    with pytest.raises(DescriptorError, match="layers must be a range, got slice"):
        lay.descriptor(layers=slice(0, 1))  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="kv must be 'k', 'v' or 'kv', got 'q'"):
        lay.descriptor(kv="q")  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="order must be 'head' or 'token'"):
        lay.descriptor(order="layer")  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="token_stride=100 is shorter than head_dim"):
        ContiguousKVLayout(num_layers=1, num_heads=1, num_tokens=1, head_dim=64, token_stride=100)
    with pytest.raises(DescriptorError, match="num_heads must be >= 1, got 0"):
        ContiguousKVLayout(num_layers=1, num_heads=0, num_tokens=1, head_dim=64)


# --------------------------------------------------------------------------- paged


PAGED = dict(num_layers=3, num_blocks=10, block_size=4, num_heads=2, head_dim=32)


def paged_array(seed: int) -> npt.NDArray[np.float16]:
    # [layers][K|V][num_blocks][block_size][heads][head_dim], packed.
    return filled((3, 2, 10, 4, 2, 32), seed)


def test_paged_geometry() -> None:
    lay = PagedKVLayout(**PAGED)
    assert (lay.token_bytes, lay.block_bytes) == (128, 512)
    assert (lay.kv_stride, lay.layer_stride, lay.nbytes) == (5120, 10240, 30720)
    assert lay.nbytes == paged_array(0).nbytes
    spread = PagedKVLayout(**PAGED, kv_stride=8192, layer_stride=65536)
    assert spread.nbytes == 2 * 65536 + 8192 + 5120
    with pytest.raises(DescriptorError, match="kv_stride=100 is shorter than one plane"):
        PagedKVLayout(**PAGED, kv_stride=100)
    with pytest.raises(DescriptorError, match="layer_stride=6000 is shorter than kv_stride"):
        PagedKVLayout(**PAGED, layer_stride=6000)


def test_paged_to_paged_with_block_lists() -> None:
    lay = PagedKVLayout(**PAGED)
    src_ids, dst_ids = [7, 2, 5, 0], [1, 3, 8, 9]
    src, dst = paged_array(3), np.zeros((3, 2, 10, 4, 2, 32), np.float16)
    local = lay.descriptor(src_ids)
    remote = lay.descriptor(dst_ids)
    assert local.count == 3 * 2 * 4  # one element per (layer, plane, block)
    plan = plan_transfer(local, remote, Op.WRITE)
    apply_plan(plan, src, dst)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert np.array_equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(10) if b not in dst_ids]
    assert not dst[:, :, untouched].any()


def test_paged_new_tokens_only_and_read() -> None:
    lay = PagedKVLayout(**PAGED)
    src_ids, dst_ids = [7, 2, 5, 0], [1, 3, 8, 9]
    remote_arr = paged_array(4)  # the decode side pulls from prefill with READ
    local_arr = np.zeros_like(remote_arr)
    new = range(6, 13)  # tokens 6..12: end of block 1, all of block 2, start of block 3
    plan = plan_transfer(
        lay.descriptor(dst_ids, tokens=new), lay.descriptor(src_ids, tokens=new), Op.READ
    )
    apply_plan(plan, local_arr, remote_arr)
    want = np.zeros_like(remote_arr)
    for t in new:
        b, slot = divmod(t, 4)
        want[:, :, dst_ids[b], slot] = remote_arr[:, :, src_ids[b], slot]
    assert np.array_equal(local_arr, want)


def test_paged_head_slice_and_v_only() -> None:
    lay = PagedKVLayout(**PAGED)
    ids = [4, 6]
    desc = lay.descriptor(ids, heads=range(1, 2), kv="v", layers=range(1, 3))
    arr = paged_array(5)
    view = arr[1:3, 1:2][:, :, ids][:, :, :, :, 1:2]
    assert stream_of(arr.tobytes(), desc.to_segments()) == np.ascontiguousarray(view).tobytes()
    assert desc.count == 2 * 1 * 8  # per token when heads are a slice


def test_contiguous_token_order_to_paged() -> None:
    # Prefill contiguous [layers][K|V][heads][tokens][head_dim] -> decode paged blocks.
    layers, heads, head_dim, tokens = 3, 2, 32, 16
    pre = ContiguousKVLayout(
        num_layers=layers, num_heads=heads, num_tokens=tokens, head_dim=head_dim
    )
    dec = PagedKVLayout(**PAGED)
    src = filled((layers, 2, heads, tokens, head_dim), seed=6)
    dst = np.zeros((3, 2, 10, 4, 2, 32), np.float16)
    ids = [9, 0, 4, 2]
    plan = plan_transfer(
        pre.descriptor(order="token", tokens=range(0, 14)),
        dec.descriptor(ids, tokens=range(0, 14)),
        Op.WRITE,
    )
    apply_plan(plan, src, dst)
    for t in range(16):
        b, slot = divmod(t, 4)
        got = dst[:, :, ids[b], slot]  # [layers][K|V][heads][head_dim]
        if t < 14:
            assert np.array_equal(got, src[:, :, :, t])
        else:
            assert not got.any()


def test_paged_rejects_bad_input() -> None:
    lay = PagedKVLayout(**PAGED)
    with pytest.raises(DescriptorError, match=r"block_ids\[1\]=10 is outside \[0, num_blocks=10\)"):
        lay.descriptor([0, 10])
    with pytest.raises(DescriptorError, match="non-empty 1-D integer array"):
        lay.descriptor([])
    with pytest.raises(DescriptorError, match="non-empty 1-D integer array"):
        lay.descriptor([0.5])
    with pytest.raises(DescriptorError, match=r"tokens range\(4, 9\) reaches outside \[0, 8\)"):
        lay.descriptor([0, 1], tokens=range(4, 9))
    with pytest.raises(DescriptorError, match="tokens must have step 1"):
        lay.descriptor([0, 1], tokens=range(0, 8, 2))
    with pytest.raises(DescriptorError, match="heads must have step 1"):
        lay.descriptor([0, 1], heads=range(0, 2, 2))
    # One head is 64 bytes: a slice starting at head 1 is 64-aligned, but with fp32 and
    # head_dim 8 (32 bytes) it is not.
    small = PagedKVLayout(
        num_layers=1, num_blocks=2, block_size=2, num_heads=2, head_dim=8, itemsize=4
    )
    with pytest.raises(AlignmentError, match="BlockListDesc element 0 starts at offset 32"):
        small.descriptor([0], heads=range(1, 2))
    # A repeated destination block is an overlap, caught by the planner.
    with pytest.raises(DescriptorError, match="overlaps itself"):
        plan_transfer(lay.descriptor([1, 2]), lay.descriptor([3, 3]), Op.WRITE)
